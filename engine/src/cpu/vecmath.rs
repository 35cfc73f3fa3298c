//! f32 vector math with the same bits on every instruction set: `exp`, the normal CDF `Φ` (erfc
//! form) and density `φ`, `tanh`, the GELUs built on them (in `vecmath/special.rs`), the lane
//! reductions softmax needs (a maximum, and a sum in one canonical order), and the run-time
//! dispatch that picks AVX-512, AVX2+FMA, NEON (aarch64) or scalar code.
//!
//! Every function is written once, generic over [`Lanes`]: a vector of 16 (`__m512`), 8
//! (`__m256`) or 4 (NEON's `float32x4_t`) floats, or one `f32`. The generic body is instantiated inside a
//! `#[target_feature]` function per ISA ([`dispatch`]); each lane runs the same sequence of
//! correctly rounded IEEE operations (add, mul, fused multiply-add, true division, round to
//! nearest even, exponent-bit scaling), and the scalar instance does its fused multiply-adds with
//! `f32::mul_add`, so all three give identical bits (tested below on every ISA the machine has).
//! That keeps a pipeline bit-equal to one device whatever CPU each worker runs on. No
//! approximate reciprocals: their bits differ between ISAs.
//!
//! Accuracy (the tests measure these bounds against f64 references):
//! - `exp`: Cody–Waite reduction by `ln 2`, Cephes' degree-7 polynomial; ≤ 1e-7 relative.
//! - `Φ(x) = erfc(-x/√2)/2`, `erfc(z) = erfcx(z)·e^{-z²}` with `erfcx(z) = t·R(t)`,
//!   `t = 1/(1+z/2)`, `R` a degree-8 polynomial fitted here (1.4e-7 relative in f32). `-x²/2` is
//!   carried as an exact double-float (`fma(x, x, -x·x)`) into the one `exp`, which `φ` shares, so
//!   the lower tail stays accurate relative to its own value (where `1 + erf` would cancel):
//!   ≤ 4e-7 relative on [-10, 10] (φ ≤ 2e-7). One true division (`t`) per element.
//! - `tanh`: Cephes' odd polynomial for `|x| < 0.625`, `1 - 2/(e^{2|x|} + 1)` above; ≤ 2e-7.
//!
//! Non-finite inputs: NaN propagates everywhere; `exp(-inf) = 0`, `exp(inf) = inf`,
//! `Φ(±inf) = 1, 0`, `tanh(±inf) = ±1`; the sign of zero is kept by `tanh`.
use std::mem::MaybeUninit;

#[cfg(target_arch = "aarch64")]
use std::arch::aarch64::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Operations of one SIMD register of f32 lanes (or of one `f32`), each rounding exactly as IEEE
/// single precision does, so every implementation gives the same bits per lane.
pub(crate) trait Lanes: Copy {
    /// Lanes per register.
    const N: usize;
    /// The result of a lane-wise comparison.
    type Mask: Copy;
    /// Reads `N` floats.
    ///
    /// # Safety
    /// `ptr` must be valid for reading `N` floats.
    unsafe fn load(ptr: *const f32) -> Self;
    /// Writes `N` floats.
    ///
    /// # Safety
    /// `ptr` must be valid for writing `N` floats.
    unsafe fn store(self, ptr: *mut f32);
    fn splat(value: f32) -> Self;
    fn add(self, rhs: Self) -> Self;
    fn sub(self, rhs: Self) -> Self;
    fn mul(self, rhs: Self) -> Self;
    fn div(self, rhs: Self) -> Self;
    /// `self · b + c`, rounded once.
    fn fma(self, b: Self, c: Self) -> Self;
    /// `c - self · b`, rounded once.
    fn fnma(self, b: Self, c: Self) -> Self;
    /// `self > rhs ? self : rhs` (x86's `maxps` operand order: `rhs` where either is NaN).
    fn max(self, rhs: Self) -> Self;
    /// `self < rhs ? self : rhs` (`minps`: `rhs` where either is NaN).
    fn min(self, rhs: Self) -> Self;
    /// Round to the nearest integer, ties to even.
    fn round(self) -> Self;
    /// `|self|` (the sign bit cleared).
    fn abs(self) -> Self;
    /// `|self|` with the sign bit of `sign`.
    fn copysign(self, sign: Self) -> Self;
    /// `2^self` for integral `self` in `[-126, 127]`, by building the exponent bits.
    fn pow2i(self) -> Self;
    /// `self · 2^n` rounded once, for `self` in [0.5, 2] (or 0, ±inf, NaN) and integral `n` in
    /// `[-250, 254]`: two exact power-of-two factors by default (the first product stays normal,
    /// only the second rounds), one `vscalefps` on AVX-512, which rounds the same product once.
    #[inline(always)]
    fn scale2(self, n: Self) -> Self {
        let n_half = n.mul(Self::splat(0.5)).round();
        self.mul(n_half.pow2i()).mul(n.sub(n_half).pow2i())
    }
    /// `self < rhs`, false where either is NaN.
    fn lt(self, rhs: Self) -> Self::Mask;
    /// Lanes that are NaN.
    fn is_nan(self) -> Self::Mask;
    /// `mask ? if_true : if_false` per lane.
    fn select(mask: Self::Mask, if_true: Self, if_false: Self) -> Self;
    /// `mask ? lhs - rhs : if_false` per lane (one masked subtraction on AVX-512).
    #[inline(always)]
    fn select_sub(mask: Self::Mask, lhs: Self, rhs: Self, if_false: Self) -> Self {
        Self::select(mask, lhs.sub(rhs), if_false)
    }
    /// The largest lane, for lanes that are not NaN (then every order gives the same value).
    #[inline(always)]
    fn reduce_max(self) -> f32 {
        lanes_of(self)[..Self::N].iter().fold(f32::NEG_INFINITY, |m, &v| v.max(m))
    }
    /// The lanes' sum in the canonical order: the upper half added to the lower, lane by lane,
    /// halving until one lane is left (so every ISA's sum has the same bits).
    #[inline(always)]
    fn sum_halves(self) -> f32 {
        sum_halves_in_place(&mut lanes_of(self)[..Self::N])
    }
}

/// The sum of `lanes` (a power of two of them) in the canonical order of [`Lanes::sum_halves`]:
/// the upper half added to the lower, lane by lane, halving until one is left (`lanes` is used as
/// scratch).
#[inline(always)]
pub(crate) fn sum_halves_in_place(lanes: &mut [f32]) -> f32 {
    let mut width = lanes.len() / 2;
    while width > 0 {
        for k in 0..width {
            lanes[k] += lanes[k + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// The lanes of `v` (at most 16) in an array.
#[inline(always)]
fn lanes_of<V: Lanes>(v: V) -> [f32; 16] {
    const { assert!(V::N <= 16) };
    let mut lanes = [0.0f32; 16];
    // SAFETY: `lanes` holds 16 >= N floats.
    unsafe { v.store(lanes.as_mut_ptr()) };
    lanes
}

/// [`Lanes::sum_halves`] of 8 lanes.
///
/// # Safety
/// AVX is enabled (AVX2 and AVX-512F imply it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sum_halves_256(v: __m256) -> f32 {
    unsafe {
        let four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)))
    }
}

/// The largest of 8 lanes that are not NaN.
///
/// # Safety
/// AVX is enabled.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce_max_256(v: __m256) -> f32 {
    unsafe {
        let four = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let two = _mm_max_ps(four, _mm_movehl_ps(four, four));
        _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps::<1>(two, two)))
    }
}

impl Lanes for f32 {
    const N: usize = 1;
    type Mask = bool;

    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> f32 {
        // SAFETY: the caller guarantees one readable float.
        unsafe { ptr.read() }
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        // SAFETY: the caller guarantees one writable float.
        unsafe { ptr.write(self) }
    }
    #[inline(always)]
    fn splat(value: f32) -> f32 {
        value
    }
    #[inline(always)]
    fn add(self, rhs: f32) -> f32 {
        self + rhs
    }
    #[inline(always)]
    fn sub(self, rhs: f32) -> f32 {
        self - rhs
    }
    #[inline(always)]
    fn mul(self, rhs: f32) -> f32 {
        self * rhs
    }
    #[inline(always)]
    fn div(self, rhs: f32) -> f32 {
        self / rhs
    }
    #[inline(always)]
    fn fma(self, b: f32, c: f32) -> f32 {
        self.mul_add(b, c)
    }
    #[inline(always)]
    fn fnma(self, b: f32, c: f32) -> f32 {
        (-self).mul_add(b, c)
    }
    #[inline(always)]
    fn max(self, rhs: f32) -> f32 {
        if self > rhs { self } else { rhs }
    }
    #[inline(always)]
    fn min(self, rhs: f32) -> f32 {
        if self < rhs { self } else { rhs }
    }
    #[inline(always)]
    fn round(self) -> f32 {
        self.round_ties_even()
    }
    #[inline(always)]
    fn abs(self) -> f32 {
        f32::abs(self)
    }
    #[inline(always)]
    fn copysign(self, sign: f32) -> f32 {
        f32::copysign(self, sign)
    }
    #[inline(always)]
    fn pow2i(self) -> f32 {
        f32::from_bits(((self as i32 + 127) as u32) << 23)
    }
    #[inline(always)]
    fn lt(self, rhs: f32) -> bool {
        self < rhs
    }
    #[inline(always)]
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    #[inline(always)]
    fn select(mask: bool, if_true: f32, if_false: f32) -> f32 {
        if mask { if_true } else { if_false }
    }
}

/// 16 lanes of AVX-512F. Only instantiated inside `#[target_feature(enable = "avx512f")]`
/// functions ([`dispatch`] checks the CPU first), which is what makes its intrinsics sound.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx512(__m512);

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx512 {
    const N: usize = 16;
    type Mask = __mmask16;

    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        // SAFETY: the caller guarantees 16 readable floats; AVX-512F is enabled (see the type).
        Avx512(unsafe { _mm512_loadu_ps(ptr) })
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        // SAFETY: the caller guarantees 16 writable floats; AVX-512F is enabled (see the type).
        unsafe { _mm512_storeu_ps(ptr, self.0) }
    }
    #[inline(always)]
    fn splat(value: f32) -> Self {
        // SAFETY (this and every method below): AVX-512F is enabled where this type is used.
        Avx512(unsafe { _mm512_set1_ps(value) })
    }
    #[inline(always)]
    fn add(self, rhs: Self) -> Self {
        Avx512(unsafe { _mm512_add_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn sub(self, rhs: Self) -> Self {
        Avx512(unsafe { _mm512_sub_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn mul(self, rhs: Self) -> Self {
        Avx512(unsafe { _mm512_mul_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn div(self, rhs: Self) -> Self {
        Avx512(unsafe { _mm512_div_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn fma(self, b: Self, c: Self) -> Self {
        Avx512(unsafe { _mm512_fmadd_ps(self.0, b.0, c.0) })
    }
    #[inline(always)]
    fn fnma(self, b: Self, c: Self) -> Self {
        Avx512(unsafe { _mm512_fnmadd_ps(self.0, b.0, c.0) })
    }
    #[inline(always)]
    fn max(self, rhs: Self) -> Self {
        Avx512(unsafe { _mm512_max_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn min(self, rhs: Self) -> Self {
        Avx512(unsafe { _mm512_min_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn round(self) -> Self {
        Avx512(unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self.0) })
    }
    #[inline(always)]
    fn abs(self) -> Self {
        Avx512(unsafe { _mm512_abs_ps(self.0) })
    }
    #[inline(always)]
    fn copysign(self, sign: Self) -> Self {
        unsafe {
            let sign_bit = _mm512_and_si512(_mm512_castps_si512(sign.0), _mm512_set1_epi32(i32::MIN));
            let magnitude = _mm512_castps_si512(_mm512_abs_ps(self.0));
            Avx512(_mm512_castsi512_ps(_mm512_or_si512(magnitude, sign_bit)))
        }
    }
    #[inline(always)]
    fn pow2i(self) -> Self {
        unsafe {
            let biased = _mm512_add_epi32(_mm512_cvtps_epi32(self.0), _mm512_set1_epi32(127));
            Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
        }
    }
    #[inline(always)]
    fn scale2(self, n: Self) -> Self {
        // self · 2^floor(n), rounded once as the two-factor default does.
        Avx512(unsafe { _mm512_scalef_ps(self.0, n.0) })
    }
    #[inline(always)]
    fn lt(self, rhs: Self) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, rhs.0) }
    }
    #[inline(always)]
    fn is_nan(self) -> __mmask16 {
        unsafe { _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(self.0, self.0) }
    }
    #[inline(always)]
    fn select(mask: __mmask16, if_true: Self, if_false: Self) -> Self {
        Avx512(unsafe { _mm512_mask_blend_ps(mask, if_false.0, if_true.0) })
    }
    #[inline(always)]
    fn select_sub(mask: __mmask16, lhs: Self, rhs: Self, if_false: Self) -> Self {
        Avx512(unsafe { _mm512_mask_sub_ps(if_false.0, mask, lhs.0, rhs.0) })
    }
    #[inline(always)]
    fn reduce_max(self) -> f32 {
        unsafe {
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
            reduce_max_256(_mm256_max_ps(_mm512_castps512_ps256(self.0), high))
        }
    }
    #[inline(always)]
    fn sum_halves(self) -> f32 {
        unsafe {
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
            sum_halves_256(_mm256_add_ps(_mm512_castps512_ps256(self.0), high))
        }
    }
}

/// 8 lanes of AVX2 with FMA. Only instantiated inside `#[target_feature(enable = "avx2,fma")]`
/// functions ([`dispatch`] checks the CPU first), which is what makes its intrinsics sound.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2(__m256);

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    const N: usize = 8;
    type Mask = __m256;

    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable floats; AVX2 is enabled (see the type).
        Avx2(unsafe { _mm256_loadu_ps(ptr) })
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        // SAFETY: the caller guarantees 8 writable floats; AVX2 is enabled (see the type).
        unsafe { _mm256_storeu_ps(ptr, self.0) }
    }
    #[inline(always)]
    fn splat(value: f32) -> Self {
        // SAFETY (this and every method below): AVX2 and FMA are enabled where this type is used.
        Avx2(unsafe { _mm256_set1_ps(value) })
    }
    #[inline(always)]
    fn add(self, rhs: Self) -> Self {
        Avx2(unsafe { _mm256_add_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn sub(self, rhs: Self) -> Self {
        Avx2(unsafe { _mm256_sub_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn mul(self, rhs: Self) -> Self {
        Avx2(unsafe { _mm256_mul_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn div(self, rhs: Self) -> Self {
        Avx2(unsafe { _mm256_div_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn fma(self, b: Self, c: Self) -> Self {
        Avx2(unsafe { _mm256_fmadd_ps(self.0, b.0, c.0) })
    }
    #[inline(always)]
    fn fnma(self, b: Self, c: Self) -> Self {
        Avx2(unsafe { _mm256_fnmadd_ps(self.0, b.0, c.0) })
    }
    #[inline(always)]
    fn max(self, rhs: Self) -> Self {
        Avx2(unsafe { _mm256_max_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn min(self, rhs: Self) -> Self {
        Avx2(unsafe { _mm256_min_ps(self.0, rhs.0) })
    }
    #[inline(always)]
    fn round(self) -> Self {
        Avx2(unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self.0) })
    }
    #[inline(always)]
    fn abs(self) -> Self {
        Avx2(unsafe { _mm256_and_ps(self.0, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX))) })
    }
    #[inline(always)]
    fn copysign(self, sign: Self) -> Self {
        unsafe {
            let sign_bit = _mm256_and_ps(sign.0, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN)));
            Avx2(_mm256_or_ps(self.abs().0, sign_bit))
        }
    }
    #[inline(always)]
    fn pow2i(self) -> Self {
        unsafe {
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(self.0), _mm256_set1_epi32(127));
            Avx2(_mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased)))
        }
    }
    #[inline(always)]
    fn lt(self, rhs: Self) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_LT_OQ>(self.0, rhs.0) }
    }
    #[inline(always)]
    fn is_nan(self) -> __m256 {
        unsafe { _mm256_cmp_ps::<_CMP_UNORD_Q>(self.0, self.0) }
    }
    #[inline(always)]
    fn select(mask: __m256, if_true: Self, if_false: Self) -> Self {
        Avx2(unsafe { _mm256_blendv_ps(if_false.0, if_true.0, mask) })
    }
    #[inline(always)]
    fn reduce_max(self) -> f32 {
        unsafe { reduce_max_256(self.0) }
    }
    #[inline(always)]
    fn sum_halves(self) -> f32 {
        unsafe { sum_halves_256(self.0) }
    }
}

/// 4 lanes of NEON (AdvSIMD). The aarch64 targets enable NEON for all code, so its intrinsics
/// need no run-time check. Each operation rounds as IEEE single precision does (`vfmaq_f32` is a
/// fused multiply-add, `vdivq_f32` a true division, `vrndnq_f32` rounds ties to even), and max
/// and min are built from comparisons with x86's operand order, so NEON gives the bits of the
/// other ISAs.
#[cfg(target_arch = "aarch64")]
#[derive(Clone, Copy)]
pub(crate) struct Neon(float32x4_t);

#[cfg(target_arch = "aarch64")]
#[allow(unused_unsafe)] // NEON intrinsics are safe to call where the target enables NEON
impl Lanes for Neon {
    const N: usize = 4;
    type Mask = uint32x4_t;

    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        // SAFETY: the caller guarantees four readable floats.
        Neon(unsafe { vld1q_f32(ptr) })
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        // SAFETY: the caller guarantees four writable floats.
        unsafe { vst1q_f32(ptr, self.0) }
    }
    #[inline(always)]
    fn splat(value: f32) -> Self {
        Neon(unsafe { vdupq_n_f32(value) })
    }
    #[inline(always)]
    fn add(self, rhs: Self) -> Self {
        Neon(unsafe { vaddq_f32(self.0, rhs.0) })
    }
    #[inline(always)]
    fn sub(self, rhs: Self) -> Self {
        Neon(unsafe { vsubq_f32(self.0, rhs.0) })
    }
    #[inline(always)]
    fn mul(self, rhs: Self) -> Self {
        Neon(unsafe { vmulq_f32(self.0, rhs.0) })
    }
    #[inline(always)]
    fn div(self, rhs: Self) -> Self {
        Neon(unsafe { vdivq_f32(self.0, rhs.0) })
    }
    #[inline(always)]
    fn fma(self, b: Self, c: Self) -> Self {
        // vfmaq_f32(a, b, c) = a + b·c, rounded once.
        Neon(unsafe { vfmaq_f32(c.0, self.0, b.0) })
    }
    #[inline(always)]
    fn fnma(self, b: Self, c: Self) -> Self {
        // vfmsq_f32(a, b, c) = a - b·c, rounded once.
        Neon(unsafe { vfmsq_f32(c.0, self.0, b.0) })
    }
    #[inline(always)]
    fn max(self, rhs: Self) -> Self {
        Neon(unsafe { vbslq_f32(vcgtq_f32(self.0, rhs.0), self.0, rhs.0) })
    }
    #[inline(always)]
    fn min(self, rhs: Self) -> Self {
        Neon(unsafe { vbslq_f32(vcltq_f32(self.0, rhs.0), self.0, rhs.0) })
    }
    #[inline(always)]
    fn round(self) -> Self {
        Neon(unsafe { vrndnq_f32(self.0) })
    }
    #[inline(always)]
    fn abs(self) -> Self {
        Neon(unsafe { vabsq_f32(self.0) })
    }
    #[inline(always)]
    fn copysign(self, sign: Self) -> Self {
        Neon(unsafe { vbslq_f32(vdupq_n_u32(0x8000_0000), sign.0, self.0) })
    }
    #[inline(always)]
    fn pow2i(self) -> Self {
        Neon(unsafe { vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(self.0), vdupq_n_s32(127)))) })
    }
    #[inline(always)]
    fn lt(self, rhs: Self) -> uint32x4_t {
        unsafe { vcltq_f32(self.0, rhs.0) }
    }
    #[inline(always)]
    fn is_nan(self) -> uint32x4_t {
        unsafe { vmvnq_u32(vceqq_f32(self.0, self.0)) }
    }
    #[inline(always)]
    fn select(mask: uint32x4_t, if_true: Self, if_false: Self) -> Self {
        Neon(unsafe { vbslq_f32(mask, if_true.0, if_false.0) })
    }
}

/// The instruction sets [`dispatch`] chooses between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// 16 lanes (x86-64 with AVX-512F).
    Avx512,
    /// 8 lanes (x86-64 with AVX2 and FMA).
    Avx2,
    /// 4 lanes (aarch64's NEON, which every aarch64 CPU has).
    Neon,
    /// One lane, `f32::mul_add` for the fused multiply-adds (every target).
    Scalar,
}

impl Isa {
    /// Every instruction set, widest first (those of other architectures are never
    /// [`Isa::available`]).
    pub(crate) const ALL: [Isa; 4] = [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Scalar];

    /// The widest ISA this CPU has (`is_x86_feature_detected!` caches its answer).
    #[inline]
    pub(crate) fn detect() -> Isa {
        Isa::ALL.into_iter().find(|isa| isa.available()).unwrap_or(Isa::Scalar)
    }

    /// f32 lanes of one vector.
    pub(crate) fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 => 8,
            Isa::Neon => 4,
            Isa::Scalar => 1,
        }
    }

    /// Whether this CPU can run `self`.
    pub(crate) fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            // NEON is part of the aarch64 baseline (the target enables it for all code).
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// A piece of work written once over [`Lanes`]; [`dispatch`] runs it on the widest ISA present.
/// Implementations mark `run` `#[inline(always)]` so it is compiled with that ISA's features.
pub(crate) trait Job {
    type Output;
    fn run<V: Lanes>(self) -> Self::Output;
}

/// Runs `job` on the widest ISA this CPU has.
#[inline]
pub(crate) fn dispatch<J: Job>(job: J) -> J::Output {
    dispatch_on(Isa::detect(), job)
}

/// Runs `job` on `isa`, which must be [`Isa::available`] (else the scalar path runs).
#[inline]
pub(crate) fn dispatch_on<J: Job>(isa: Isa, job: J) -> J::Output {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (checked).
        Isa::Avx512 if isa.available() => unsafe { run_avx512(job) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (checked).
        Isa::Avx2 if isa.available() => unsafe { run_avx2(job) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => job.run::<Neon>(),
        _ => run_scalar(job),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn run_avx512<J: Job>(job: J) -> J::Output {
    job.run::<Avx512>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<J: Job>(job: J) -> J::Output {
    job.run::<Avx2>()
}

/// The scalar path, compiled with FMA instructions where the CPU has them (same bits either way:
/// `f32::mul_add` is a fused multiply-add in software too).
fn run_scalar<J: Job>(job: J) -> J::Output {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked).
        return unsafe { run_scalar_fma(job) };
    }
    job.run::<f32>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn run_scalar_fma<J: Job>(job: J) -> J::Output {
    job.run::<f32>()
}

// ---------------------------------------------------------------------------------------------
// The functions, generic over the lanes (`vecmath/special.rs`).

mod special;
pub(crate) use special::{exp, exp2parts, gelu, gelu_grad, gelu_tanh, gelu_tanh_grad, normal_cdf, normal_pdf, tanh};
// ---------------------------------------------------------------------------------------------
// Slice drivers.

/// An elementwise function of one input.
pub(crate) trait Unary: Copy {
    fn apply<V: Lanes>(self, x: V) -> V;
}

/// An elementwise function of two inputs.
pub(crate) trait Binary: Copy {
    fn apply<V: Lanes>(self, a: V, b: V) -> V;
}

struct MapUnary<F> {
    f: F,
    src: *const f32,
    dst: *mut f32,
    len: usize,
}

impl<F: Unary> Job for MapUnary<F> {
    type Output = ();
    #[inline(always)]
    fn run<V: Lanes>(self) {
        let mut i = 0;
        // SAFETY: `src` and `dst` are valid for `len` floats (see `map_unary`); whole vectors
        // are read and written below `len`, the remainder one float at a time.
        unsafe {
            while i + V::N <= self.len {
                self.f.apply(V::load(self.src.add(i))).store(self.dst.add(i));
                i += V::N;
            }
            while i < self.len {
                self.dst.add(i).write(self.f.apply(self.src.add(i).read()));
                i += 1;
            }
        }
    }
}

struct MapBinary<F> {
    f: F,
    lhs: *const f32,
    rhs: *const f32,
    dst: *mut f32,
    len: usize,
}

impl<F: Binary> Job for MapBinary<F> {
    type Output = ();
    #[inline(always)]
    fn run<V: Lanes>(self) {
        let mut i = 0;
        // SAFETY: as in `MapUnary::run`, for three arrays of `len` floats.
        unsafe {
            while i + V::N <= self.len {
                let (a, b) = (V::load(self.lhs.add(i)), V::load(self.rhs.add(i)));
                self.f.apply(a, b).store(self.dst.add(i));
                i += V::N;
            }
            while i < self.len {
                self.dst.add(i).write(self.f.apply(self.lhs.add(i).read(), self.rhs.add(i).read()));
                i += 1;
            }
        }
    }
}

/// `dst[i] = f(src[i])` on `isa`; returns `dst` initialised. Panics unless the lengths agree
/// (callers check them first and return an `Error`).
pub(crate) fn map_unary_on<'a, F: Unary>(
    isa: Isa,
    f: F,
    src: &[f32],
    dst: &'a mut [MaybeUninit<f32>],
) -> &'a mut [f32] {
    assert_eq!(src.len(), dst.len(), "map_unary: lengths checked by the caller");
    let job = MapUnary { f, src: src.as_ptr(), dst: dst.as_mut_ptr().cast::<f32>(), len: src.len() };
    dispatch_on(isa, job);
    // SAFETY: the job wrote all `len` elements.
    unsafe { super::uninit::assume_init(dst) }
}

/// `dst[i] = f(lhs[i], rhs[i])` on `isa`; returns `dst` initialised. Panics unless the lengths
/// agree (callers check them first and return an `Error`).
pub(crate) fn map_binary_on<'a, F: Binary>(
    isa: Isa,
    f: F,
    lhs: &[f32],
    rhs: &[f32],
    dst: &'a mut [MaybeUninit<f32>],
) -> &'a mut [f32] {
    assert!(lhs.len() == rhs.len() && lhs.len() == dst.len(), "map_binary: lengths checked by the caller");
    let job =
        MapBinary { f, lhs: lhs.as_ptr(), rhs: rhs.as_ptr(), dst: dst.as_mut_ptr().cast::<f32>(), len: lhs.len() };
    dispatch_on(isa, job);
    // SAFETY: the job wrote all `len` elements.
    unsafe { super::uninit::assume_init(dst) }
}

/// `dst` viewed as possibly uninitialised memory (for the drivers above, which only write it).
pub(crate) fn as_uninit(dst: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`; writing initialised floats through it
    // keeps `dst` initialised.
    unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<MaybeUninit<f32>>(), dst.len()) }
}

/// One element through `f` on the scalar path (with FMA instructions where the CPU has them).
#[inline]
pub(crate) fn scalar_unary<F: Unary>(f: F, x: f32) -> f32 {
    struct One<F>(F, f32);
    impl<F: Unary> Job for One<F> {
        type Output = f32;
        #[inline(always)]
        fn run<V: Lanes>(self) -> f32 {
            self.0.apply(self.1)
        }
    }
    run_scalar(One(f, x))
}

/// Two elements through `f` on the scalar path.
#[inline]
pub(crate) fn scalar_binary<F: Binary>(f: F, a: f32, b: f32) -> f32 {
    struct Two<F>(F, f32, f32);
    impl<F: Binary> Job for Two<F> {
        type Output = f32;
        #[inline(always)]
        fn run<V: Lanes>(self) -> f32 {
            self.0.apply(self.1, self.2)
        }
    }
    run_scalar(Two(f, a, b))
}

// ---------------------------------------------------------------------------------------------
// The functions as elementwise ops for the drivers.

macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident => $f:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub(crate) struct $name;
        impl Unary for $name {
            #[inline(always)]
            fn apply<V: Lanes>(self, x: V) -> V {
                $f(x)
            }
        }
    )*};
}

macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident => $f:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug)]
        pub(crate) struct $name;
        impl Binary for $name {
            #[inline(always)]
            fn apply<V: Lanes>(self, a: V, b: V) -> V {
                $f(a, b)
            }
        }
    )*};
}

unary_ops! {
    /// [`exp`] (tests only: the kernels call it inside their own loops).
    #[cfg_attr(not(test), allow(dead_code))]
    ExpKernel => exp;
    /// [`normal_cdf`].
    NormalCdfKernel => normal_cdf;
    /// [`normal_pdf`].
    NormalPdfKernel => normal_pdf;
    /// [`gelu`].
    GeluKernel => gelu;
    /// [`gelu_tanh`].
    GeluTanhKernel => gelu_tanh;
    /// [`tanh`].
    TanhKernel => tanh;
}

binary_ops! {
    /// [`gelu_grad`] of (input, output gradient).
    GeluGradKernel => gelu_grad;
    /// [`gelu_tanh_grad`] of (input, output gradient).
    GeluTanhGradKernel => gelu_tanh_grad;
}

#[cfg(test)]
#[path = "vecmath_tests.rs"]
mod tests;
