// Elementwise kernels for CUDA devices: add, multiply, scale, activations and their gradients, dropout.
// One thread per element; grid-stride loops so any launch size covers any length.
#define GRID_STRIDE(i, n) for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)blockDim.x * gridDim.x)

extern "C" __global__ void add_f32(const float* a, const float* b, float* out, size_t n) {
    GRID_STRIDE(i, n) { out[i] = a[i] + b[i]; }
}

extern "C" __global__ void mul_f32(const float* a, const float* b, float* out, size_t n) {
    GRID_STRIDE(i, n) { out[i] = a[i] * b[i]; }
}

extern "C" __global__ void add_assign_f32(float* dst, const float* src, size_t n) {
    GRID_STRIDE(i, n) { dst[i] += src[i]; }
}

extern "C" __global__ void scale_f32(float* x, float factor, size_t n) {
    GRID_STRIDE(i, n) { x[i] *= factor; }
}

// relu(x) = x < 0 ? 0 : x, as on the CPU and in PyTorch: NaN propagates, -0.0 stays -0.0.
extern "C" __global__ void relu_forward_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = x[i] < 0.0f ? 0.0f : x[i]; }
}

// `x` may be the forward input or output: x <= 0 exactly where relu(x) <= 0. The gradient passes
// where x is NaN (PyTorch's threshold_backward); a NaN dy is zeroed where x <= 0 (a select).
extern "C" __global__ void relu_backward_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) { dx[i] = x[i] <= 0.0f ? 0.0f : dy[i]; }
}

// GELU, exact form (PyTorch's approximate='none'): x * Phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2,
// which stays accurate in the lower tail where 1 + erf(x / sqrt 2) would cancel.
extern "C" __global__ void gelu_forward_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = 0.5f * x[i] * erfcf(-x[i] * 0.70710678118654752f); }
}

extern "C" __global__ void gelu_backward_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) {
        float cdf = 0.5f * erfcf(-x[i] * 0.70710678118654752f);
        float pdf = 0.39894228040143268f * expf(-0.5f * x[i] * x[i]);
        dx[i] = dy[i] * (cdf + x[i] * pdf);
    }
}

// GELU, PyTorch's approximate='tanh': x / (1 + exp(-2u)) = x/2 (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3),
// the form that does not cancel for negative x (as cpu::vecmath::gelu_tanh).
extern "C" __global__ void gelu_tanh_forward_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) {
        float twice_inner = 1.5957691216057308f * (x[i] + 0.044715f * x[i] * x[i] * x[i]);
        y[i] = x[i] / (1.0f + expf(-twice_inner));
    }
}

extern "C" __global__ void gelu_tanh_backward_f32(const float* x, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) {
        float twice_inner = 1.5957691216057308f * (x[i] + 0.044715f * x[i] * x[i] * x[i]);
        twice_inner = fminf(fmaxf(twice_inner, -80.0f), 80.0f);
        float e = expf(-twice_inner);
        float sigma = 1.0f / (1.0f + e);
        float slope = 1.5957691216057308f * (1.0f + 3.0f * 0.044715f * x[i] * x[i]);
        dx[i] = dy[i] * (sigma + x[i] * sigma * (e * sigma) * slope);
    }
}

extern "C" __global__ void tanh_forward_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = tanhf(x[i]); }
}

extern "C" __global__ void tanh_backward_f32(const float* y, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) { dx[i] = dy[i] * (1.0f - y[i] * y[i]); }
}

// Conversions between f32 and the half types, bit for bit those of the `half` crate the CPU uses
// (its portable fallbacks): round to nearest, ties to even; NaNs stay NaN with the quiet bit set.

// An IEEE half's bits as a float (exact: every half is a float).
__device__ float half_bits_to_float(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exponent = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int mantissa = (unsigned int)h & 0x3ffu;
    if (exponent == 31u) {
        unsigned int quiet = mantissa == 0u ? 0u : 0x00400000u;
        return __uint_as_float(sign | 0x7f800000u | quiet | (mantissa << 13));
    }
    if (exponent == 0u) {
        // Zero and subnormals: mantissa * 2^-24, a power-of-two scaling (exact).
        return __uint_as_float(sign | __float_as_uint((float)mantissa * 5.9604644775390625e-8f));
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// A float rounded to an IEEE half, as bits (`half::f16::from_f32`).
__device__ unsigned short float_to_half_bits(float value) {
    unsigned int x = __float_as_uint(value);
    unsigned int sign = x & 0x80000000u;
    unsigned int exponent = x & 0x7f800000u;
    unsigned int mantissa = x & 0x007fffffu;
    if (exponent == 0x7f800000u) {
        unsigned int nan_bit = mantissa == 0u ? 0u : 0x0200u;
        return (unsigned short)((sign >> 16) | 0x7c00u | nan_bit | (mantissa >> 13));
    }
    unsigned int half_sign = sign >> 16;
    int half_exponent = (int)(exponent >> 23) - 127 + 15;
    if (half_exponent >= 0x1f) {
        return (unsigned short)(half_sign | 0x7c00u);
    }
    if (half_exponent <= 0) {
        if (14 - half_exponent > 24) {
            return (unsigned short)half_sign;
        }
        unsigned int full = mantissa | 0x00800000u;
        unsigned int half_mantissa = full >> (14 - half_exponent);
        unsigned int round_bit = 1u << (13 - half_exponent);
        if ((full & round_bit) != 0u && (full & (3u * round_bit - 1u)) != 0u) {
            half_mantissa += 1u;
        }
        return (unsigned short)(half_sign | half_mantissa);
    }
    unsigned int bits = half_sign | ((unsigned int)half_exponent << 10) | (mantissa >> 13);
    unsigned int round_bit = 0x00001000u;
    if ((mantissa & round_bit) != 0u && (mantissa & (3u * round_bit - 1u)) != 0u) {
        bits += 1u;
    }
    return (unsigned short)bits;
}

// A bfloat16's bits as a float (exact).
__device__ float bf16_bits_to_float(unsigned short h) {
    unsigned int bits = (unsigned int)h;
    if ((bits & 0x7fffu) > 0x7f80u) {
        bits |= 0x0040u;
    }
    return __uint_as_float(bits << 16);
}

// A float rounded to bfloat16, as bits (`half::bf16::from_f32`).
__device__ unsigned short float_to_bf16_bits(float value) {
    unsigned int x = __float_as_uint(value);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((x >> 16) | 0x0040u);
    }
    unsigned int round_bit = 0x00008000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) {
        return (unsigned short)((x >> 16) + 1u);
    }
    return (unsigned short)(x >> 16);
}

extern "C" __global__ void f32_to_f16(const float* x, unsigned short* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = float_to_half_bits(x[i]); }
}

extern "C" __global__ void f32_to_bf16(const float* x, unsigned short* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = float_to_bf16_bits(x[i]); }
}

extern "C" __global__ void f16_to_f32(const unsigned short* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = half_bits_to_float(x[i]); }
}

extern "C" __global__ void bf16_to_f32(const unsigned short* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = bf16_bits_to_float(x[i]); }
}

// Dropout with a precomputed 0/1 mask (saved as f16, as on the CPU), scaled by 1 / (1 - p)
// like PyTorch.
extern "C" __global__ void dropout_apply_f32(const float* x, const unsigned short* mask, float scale, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = x[i] * half_bits_to_float(mask[i]) * scale; }
}
