//! Pooling kernels over `n_planes` planes (batch x channels) of one size: max pooling with saved
//! argmax positions, average pooling (padding counted in the divisor, PyTorch's
//! `count_include_pad=True`), and global average pooling.
//!
//! Without padding every window lies inside the plane, so the window loops need no bounds
//! checks: those planes take a branch-free path (the running maximum and its position by
//! selects, no `Option`s), with the common 2×2 and 3×3 kernels unrolled. It visits the window
//! in the same order and applies the same rule as the general path, so the results are the
//! same bit for bit; padded windows take the general path.
use std::mem::MaybeUninit;

use super::uninit;
use super::window::{Window2d, check_len};
use crate::{Error, Result};

/// Largest plane for which max pooling records argmax positions exactly as f32 (2^24).
pub const MAX_POOL_PLANE_LIMIT: usize = 1 << 24;

/// Max pooling: `output[p, i, j]` is the largest input in the window, padding acting as -inf;
/// `argmax[p, i, j]` receives the winning position within the input plane (`row * in_width + col`)
/// as an f32 (exact below [`MAX_POOL_PLANE_LIMIT`]). The first maximum wins ties; NaN propagates,
/// the last NaN of a window winning (PyTorch's `val > max || isnan(val)`, so the gradient goes
/// where torch sends it).
pub fn max_pool2d_forward(
    input: &[f32],
    n_planes: usize,
    window: &Window2d,
    output: &mut [f32],
    argmax: &mut [f32],
) -> Result<()> {
    if window.in_plane_len() > MAX_POOL_PLANE_LIMIT {
        return Err(Error::invalid(
            "max pooling input",
            format!(
                "a {}x{} plane exceeds 2^24 positions, which f32 argmax indices cannot address",
                window.in_height, window.in_width
            ),
        ));
    }
    let (out_h, out_w) = (window.out_height(), window.out_width());
    check_len("max_pool2d", "input", n_planes * window.in_plane_len(), input.len())?;
    check_len("max_pool2d", "output", n_planes * out_h * out_w, output.len())?;
    check_len("max_pool2d", "argmax", n_planes * out_h * out_w, argmax.len())?;
    let planes = input.chunks_exact(window.in_plane_len().max(1));
    let outs = output.chunks_exact_mut(out_h * out_w).zip(argmax.chunks_exact_mut(out_h * out_w));
    if is_unpadded(window) {
        for (plane, (out, arg)) in planes.zip(outs) {
            match (window.kernel_height, window.kernel_width) {
                (2, 2) => max_pool_plane_unpadded(plane, window, 2, 2, out, arg),
                (3, 3) => max_pool_plane_unpadded(plane, window, 3, 3, out, arg),
                (kh, kw) => max_pool_plane_unpadded(plane, window, kh, kw, out, arg),
            }
        }
        return Ok(());
    }
    for (plane, (out, arg)) in planes.zip(outs) {
        for out_row in 0..out_h {
            for out_col in 0..out_w {
                let mut best = f32::NEG_INFINITY;
                let mut best_idx = usize::MAX;
                for kernel_row in 0..window.kernel_height {
                    let Some(r) = window.input_row(out_row, kernel_row) else { continue };
                    for kernel_col in 0..window.kernel_width {
                        let Some(c) = window.input_col(out_col, kernel_col) else { continue };
                        let idx = r * window.in_width + c;
                        let v = plane[idx];
                        if best_idx == usize::MAX || v > best || v.is_nan() {
                            best = v;
                            best_idx = idx;
                        }
                    }
                }
                // Window2d guarantees every window overlaps the input when padding <= kernel / 2;
                // a window entirely in padding yields -inf and routes no gradient.
                out[out_row * out_w + out_col] = best;
                arg[out_row * out_w + out_col] = if best_idx == usize::MAX { -1.0 } else { best_idx as f32 };
            }
        }
    }
    Ok(())
}

/// Whether every window lies inside the plane (no padding), for the unchecked paths.
fn is_unpadded(window: &Window2d) -> bool {
    window.pad_height == 0 && window.pad_width == 0
}

/// One plane of [`max_pool2d_forward`] without padding: the window's first element, then each
/// later one taken where `v > best || v.is_nan()`, as selects. `kh`, `kw` are constants where
/// the caller passes literals (this function is inlined), so those windows unroll.
#[inline(always)]
fn max_pool_plane_unpadded(plane: &[f32], window: &Window2d, kh: usize, kw: usize, out: &mut [f32], arg: &mut [f32]) {
    let (out_w, in_w) = (window.out_width(), window.in_width);
    let (sh, sw) = (window.stride_height, window.stride_width);
    for (out_row, (out, arg)) in out.chunks_exact_mut(out_w).zip(arg.chunks_exact_mut(out_w)).enumerate() {
        let row_start = out_row * sh * in_w;
        for (out_col, (out, arg)) in out.iter_mut().zip(arg.iter_mut()).enumerate() {
            let start = row_start + out_col * sw;
            // Positions fit u32 (planes are below MAX_POOL_PLANE_LIMIT), whose conversion to f32
            // is one instruction where usize's is not.
            let mut best_idx = start as u32;
            let mut best = plane[start];
            for kernel_row in 0..kh {
                for kernel_col in 0..kw {
                    if kernel_row + kernel_col > 0 {
                        let idx = start + kernel_row * in_w + kernel_col;
                        let v = plane[idx];
                        // All-ones where v replaces the running maximum; blended as bits so the
                        // compiler emits no data-dependent branch (random data would mispredict).
                        let take = 0u32.wrapping_sub(u32::from(v > best || v.is_nan()));
                        best = f32::from_bits((v.to_bits() & take) | (best.to_bits() & !take));
                        best_idx = (idx as u32 & take) | (best_idx & !take);
                    }
                }
            }
            *out = best;
            *arg = best_idx as f32;
        }
    }
}

/// Max pooling's input gradient: adds each output gradient onto the input position recorded in
/// `argmax` (`input_grad += scatter(grad_output)`).
pub fn max_pool2d_backward(
    grad_output: &[f32],
    argmax: &[f32],
    n_planes: usize,
    window: &Window2d,
    input_grad: &mut [f32],
) -> Result<()> {
    let out_plane = window.out_plane_len();
    check_len("max_pool2d_backward", "grad_output", n_planes * out_plane, grad_output.len())?;
    check_len("max_pool2d_backward", "argmax", n_planes * out_plane, argmax.len())?;
    check_len("max_pool2d_backward", "input_grad", n_planes * window.in_plane_len(), input_grad.len())?;
    let in_plane = window.in_plane_len();
    for ((g, arg), dst) in grad_output
        .chunks_exact(out_plane)
        .zip(argmax.chunks_exact(out_plane))
        .zip(input_grad.chunks_exact_mut(in_plane.max(1)))
    {
        let limit = in_plane as f32;
        for (&gv, &a) in g.iter().zip(arg) {
            // `a` is -1 for a window entirely in padding (no gradient); NaN fails both tests.
            // Positions are exact below 2^24, so the f32 comparison decides the range.
            if a >= 0.0 && a < limit {
                // SAFETY: `a` is finite, in [0, in_plane), so it fits a u32.
                dst[unsafe { a.to_int_unchecked::<u32>() } as usize] += gv;
            }
        }
    }
    Ok(())
}

/// Max pooling's input gradient into an uninitialised `input_grad`, every element written: the
/// same bits as zeros followed by [`max_pool2d_backward`], plane by plane, so each plane is zeroed
/// and receives its gradients while it is in L1 (one pass over the output instead of a zero-fill
/// of the whole tensor and then a scatter over it). Where windows cannot overlap (no padding,
/// strides at least the kernel: the usual 2×2 stride-2 pool) each position receives at most one
/// gradient, so it is stored (`0 + g`, the scatter's sum onto zero, -0 becoming +0) rather than
/// added.
pub fn max_pool2d_input_grad<'a>(
    grad_output: &[f32],
    argmax: &[f32],
    n_planes: usize,
    window: &Window2d,
    input_grad: &'a mut [MaybeUninit<f32>],
) -> Result<&'a mut [f32]> {
    let (in_plane, out_plane) = (window.in_plane_len(), window.out_plane_len());
    check_len("max_pool2d_input_grad", "grad_output", n_planes * out_plane, grad_output.len())?;
    check_len("max_pool2d_input_grad", "argmax", n_planes * out_plane, argmax.len())?;
    check_len("max_pool2d_input_grad", "input_grad", n_planes * in_plane, input_grad.len())?;
    if in_plane == 0 || out_plane == 0 {
        return Ok(uninit::fill(input_grad, 0.0));
    }
    let disjoint = is_unpadded(window)
        && window.stride_height >= window.kernel_height
        && window.stride_width >= window.kernel_width;
    let planes = grad_output.chunks_exact(out_plane).zip(argmax.chunks_exact(out_plane));
    for ((g, arg), dst) in planes.zip(input_grad.chunks_exact_mut(in_plane)) {
        let dst = uninit::fill(dst, 0.0);
        // Positions are exact below 2^24 (max_pool2d_forward's limit), so an f32 comparison
        // with the plane's length decides the range.
        let limit = in_plane as f32;
        for (&gv, &a) in g.iter().zip(arg) {
            // `a` is -1 for a window entirely in padding (no gradient); NaN fails both tests.
            if a >= 0.0 && a < limit {
                // SAFETY: `a` is finite, in [0, in_plane), so it fits a u32.
                let idx = unsafe { a.to_int_unchecked::<u32>() } as usize;
                if disjoint {
                    dst[idx] = 0.0 + gv;
                } else {
                    dst[idx] += gv;
                }
            }
        }
    }
    // SAFETY: every plane was filled above.
    Ok(unsafe { uninit::assume_init(input_grad) })
}

/// Average pooling: `output[p, i, j]` is the window's sum divided by `kernel_height * kernel_width`
/// (padding counts as zeros in the divisor, PyTorch's default).
pub fn avg_pool2d_forward(input: &[f32], n_planes: usize, window: &Window2d, output: &mut [f32]) -> Result<()> {
    let (out_h, out_w) = (window.out_height(), window.out_width());
    check_len("avg_pool2d", "input", n_planes * window.in_plane_len(), input.len())?;
    check_len("avg_pool2d", "output", n_planes * out_h * out_w, output.len())?;
    let scale = 1.0 / (window.kernel_height * window.kernel_width) as f32;
    let planes = input.chunks_exact(window.in_plane_len().max(1)).zip(output.chunks_exact_mut(out_h * out_w));
    if is_unpadded(window) {
        let (kh, kw, in_w) = (window.kernel_height, window.kernel_width, window.in_width);
        let (sh, sw) = (window.stride_height, window.stride_width);
        for (plane, out) in planes {
            for (out_row, out) in out.chunks_exact_mut(out_w).enumerate() {
                for (out_col, out) in out.iter_mut().enumerate() {
                    let start = out_row * sh * in_w + out_col * sw;
                    // The general path's order: rows, then columns, from +0.0.
                    let mut sum = 0.0;
                    for kernel_row in 0..kh {
                        for &x in &plane[start + kernel_row * in_w..][..kw] {
                            sum += x;
                        }
                    }
                    *out = sum * scale;
                }
            }
        }
        return Ok(());
    }
    for (plane, out) in planes {
        for out_row in 0..out_h {
            for out_col in 0..out_w {
                let mut sum = 0.0;
                for kernel_row in 0..window.kernel_height {
                    let Some(r) = window.input_row(out_row, kernel_row) else { continue };
                    for kernel_col in 0..window.kernel_width {
                        if let Some(c) = window.input_col(out_col, kernel_col) {
                            sum += plane[r * window.in_width + c];
                        }
                    }
                }
                out[out_row * out_w + out_col] = sum * scale;
            }
        }
    }
    Ok(())
}

/// Average pooling's input gradient: `input_grad += grad_output / (kh * kw)` spread over each window.
pub fn avg_pool2d_backward(
    grad_output: &[f32],
    n_planes: usize,
    window: &Window2d,
    input_grad: &mut [f32],
) -> Result<()> {
    let (out_h, out_w) = (window.out_height(), window.out_width());
    check_len("avg_pool2d_backward", "grad_output", n_planes * out_h * out_w, grad_output.len())?;
    check_len("avg_pool2d_backward", "input_grad", n_planes * window.in_plane_len(), input_grad.len())?;
    let scale = 1.0 / (window.kernel_height * window.kernel_width) as f32;
    let planes = grad_output.chunks_exact(out_h * out_w).zip(input_grad.chunks_exact_mut(window.in_plane_len().max(1)));
    if is_unpadded(window) {
        let (kh, kw, in_w) = (window.kernel_height, window.kernel_width, window.in_width);
        let (sh, sw) = (window.stride_height, window.stride_width);
        for (g, plane) in planes {
            for (out_row, g) in g.chunks_exact(out_w).enumerate() {
                for (out_col, &g) in g.iter().enumerate() {
                    let share = g * scale;
                    let start = out_row * sh * in_w + out_col * sw;
                    // The general path's order, so overlapping windows add in the same order.
                    for kernel_row in 0..kh {
                        plane[start + kernel_row * in_w..][..kw].iter_mut().for_each(|x| *x += share);
                    }
                }
            }
        }
        return Ok(());
    }
    for (g, plane) in planes {
        for out_row in 0..out_h {
            for out_col in 0..out_w {
                let share = g[out_row * out_w + out_col] * scale;
                for kernel_row in 0..window.kernel_height {
                    let Some(r) = window.input_row(out_row, kernel_row) else { continue };
                    for kernel_col in 0..window.kernel_width {
                        if let Some(c) = window.input_col(out_col, kernel_col) {
                            plane[r * window.in_width + c] += share;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Global average pooling: `output[p] = mean(input[p, :])` over planes of `plane_len` elements.
/// The sum starts at +0.0 (as torch's `mean`), so a plane of -0.0 averages to +0.0.
pub fn global_avg_pool_forward(input: &[f32], plane_len: usize, output: &mut [f32]) -> Result<()> {
    check_len("global_avg_pool", "input", output.len() * plane_len, input.len())?;
    if plane_len == 0 {
        return Err(Error::invalid(
            "global average pooling input",
            "planes are empty (height or width 0); nothing to average",
        ));
    }
    let scale = 1.0 / plane_len as f32;
    for (plane, out) in input.chunks_exact(plane_len).zip(output.iter_mut()) {
        *out = plane.iter().fold(0.0f32, |sum, &x| sum + x) * scale;
    }
    Ok(())
}

/// Global average pooling's input gradient: `input_grad[p, :] += grad_output[p] / plane_len`.
pub fn global_avg_pool_backward(grad_output: &[f32], plane_len: usize, input_grad: &mut [f32]) -> Result<()> {
    check_len("global_avg_pool_backward", "input_grad", grad_output.len() * plane_len, input_grad.len())?;
    if plane_len == 0 {
        return Ok(());
    }
    let scale = 1.0 / plane_len as f32;
    for (g, plane) in grad_output.iter().zip(input_grad.chunks_exact_mut(plane_len)) {
        let share = g * scale;
        plane.iter_mut().for_each(|x| *x += share);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_pool_picks_window_maxima_and_routes_gradient() {
        // One 4x4 plane, 2x2 windows, stride 2.
        let input: Vec<f32> = vec![1., 5., 2., 0., 3., 4., 8., 7., 0., 0., 1., 1., 9., 0., 1., 2.];
        let w = Window2d::new(1, (4, 4), (2, 2), (2, 2), (0, 0)).unwrap();
        let (mut out, mut arg) = (vec![0.0; 4], vec![0.0; 4]);
        max_pool2d_forward(&input, 1, &w, &mut out, &mut arg).unwrap();
        assert_eq!(out, vec![5., 8., 9., 2.]);
        assert_eq!(arg, vec![1., 6., 12., 15.]);
        let mut grad = vec![0.0; 16];
        max_pool2d_backward(&[1., 2., 3., 4.], &arg, 1, &w, &mut grad).unwrap();
        assert_eq!((grad[1], grad[6], grad[12], grad[15]), (1., 2., 3., 4.));
        assert_eq!(grad.iter().sum::<f32>(), 10.0);
    }

    #[test]
    fn max_pool_propagates_nan_and_routes_the_gradient_to_the_last_nan_like_torch() {
        // torch.nn.functional.max_pool2d on [[nan, 1], [nan, 2]] gives nan with index 2.
        let w = Window2d::new(1, (2, 2), (2, 2), (2, 2), (0, 0)).unwrap();
        let (mut out, mut arg) = (vec![0.0; 1], vec![0.0; 1]);
        max_pool2d_forward(&[f32::NAN, 1.0, f32::NAN, 2.0], 1, &w, &mut out, &mut arg).unwrap();
        assert!(out[0].is_nan());
        assert_eq!(arg, vec![2.0]);
    }

    /// Seeded values with many ties (a few distinct levels) and some NaNs.
    fn tied_values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                match state % 23 {
                    0 => f32::NAN,
                    r => (r % 5) as f32 - 2.0 + ((state >> 32) % 3) as f32 * 0.25,
                }
            })
            .collect()
    }

    /// The general (bounds-checked) loops, written out: what the unpadded paths must equal bit
    /// for bit.
    fn reference(input: &[f32], planes: usize, w: &Window2d, grad: &[f32]) -> [Vec<f32>; 5] {
        let (out_h, out_w) = (w.out_height(), w.out_width());
        let (mut out, mut arg, mut avg) = (vec![], vec![], vec![]);
        let mut max_grad = vec![0.0; input.len()];
        let mut avg_grad = vec![0.0; input.len()];
        let scale = 1.0 / (w.kernel_height * w.kernel_width) as f32;
        for p in 0..planes {
            let plane = &input[p * w.in_plane_len()..][..w.in_plane_len()];
            for i in 0..out_h * out_w {
                let (mut best, mut best_idx, mut sum) = (f32::NEG_INFINITY, usize::MAX, 0.0f32);
                for kr in 0..w.kernel_height {
                    let Some(r) = w.input_row(i / out_w, kr) else { continue };
                    for kc in 0..w.kernel_width {
                        let Some(c) = w.input_col(i % out_w, kc) else { continue };
                        let v = plane[r * w.in_width + c];
                        sum += v;
                        if best_idx == usize::MAX || v > best || v.is_nan() {
                            (best, best_idx) = (v, r * w.in_width + c);
                        }
                        avg_grad[p * w.in_plane_len() + r * w.in_width + c] += grad[p * out_h * out_w + i] * scale;
                    }
                }
                out.push(best);
                arg.push(best_idx as f32);
                avg.push(sum * scale);
                max_grad[p * w.in_plane_len() + best_idx] += grad[p * out_h * out_w + i];
            }
        }
        [out, arg, avg, max_grad, avg_grad]
    }

    #[test]
    fn unpadded_paths_equal_the_general_loops_bit_for_bit() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (kh, kw) in [(1, 1), (2, 2), (3, 3), (2, 3), (4, 1)] {
            for (sh, sw) in [(1, 1), (2, 2), (3, 1)] {
                let (planes, height, width) = (3, 7, 9);
                let w = Window2d::new(1, (height, width), (kh, kw), (sh, sw), (0, 0)).unwrap();
                let input = tied_values(planes * height * width, (kh * 10 + sh) as u64);
                let n_out = planes * w.out_plane_len();
                let grad = tied_values(n_out, 99).iter().map(|g| if g.is_nan() { 0.5 } else { *g }).collect::<Vec<_>>();
                let [out, arg, avg, max_grad, avg_grad] = reference(&input, planes, &w, &grad);
                let (mut got, mut got_arg, mut got_avg) = (vec![0.0; n_out], vec![0.0; n_out], vec![0.0; n_out]);
                max_pool2d_forward(&input, planes, &w, &mut got, &mut got_arg).unwrap();
                avg_pool2d_forward(&input, planes, &w, &mut got_avg).unwrap();
                let mut got_max_grad = vec![0.0; input.len()];
                max_pool2d_backward(&grad, &got_arg, planes, &w, &mut got_max_grad).unwrap();
                let mut gathered = vec![MaybeUninit::uninit(); input.len()];
                let gathered = max_pool2d_input_grad(&grad, &got_arg, planes, &w, &mut gathered).unwrap();
                assert_eq!(
                    bits(gathered),
                    bits(&max_grad),
                    "kernel {kh}x{kw} stride {sh}x{sw}: max grad written in full"
                );
                let mut got_avg_grad = vec![0.0; input.len()];
                avg_pool2d_backward(&grad, planes, &w, &mut got_avg_grad).unwrap();
                let what = format!("kernel {kh}x{kw} stride {sh}x{sw}");
                assert_eq!(bits(&got), bits(&out), "{what} max");
                assert_eq!(bits(&got_arg), bits(&arg), "{what} argmax");
                assert_eq!(bits(&got_avg), bits(&avg), "{what} avg");
                assert_eq!(bits(&got_max_grad), bits(&max_grad), "{what} max grad");
                assert_eq!(bits(&got_avg_grad), bits(&avg_grad), "{what} avg grad");
            }
        }
    }

    /// The plane-by-plane input gradient (disjoint windows stored: gaps between windows, rows
    /// and columns past the last window, odd sizes; overlapping and padded ones added) equals
    /// zeros plus the scatter bit for bit, -0 and NaN gradients included.
    #[test]
    fn max_pool_input_grad_written_in_full_equals_zeros_plus_the_scatter() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let cases =
            [((2, 2), (2, 2), (0, 0)), ((3, 3), (3, 3), (0, 0)), ((2, 3), (3, 4), (0, 0)), ((2, 2), (2, 2), (1, 1))];
        for (seed, (kernel, stride, pad)) in cases.into_iter().enumerate() {
            for (height, width) in [(8, 8), (7, 9), (5, 11)] {
                let planes = 3;
                let w = Window2d::new(1, (height, width), kernel, stride, pad).unwrap();
                let input = tied_values(planes * height * width, seed as u64 + 40);
                let n_out = planes * w.out_plane_len();
                let grad: Vec<f32> = tied_values(n_out, seed as u64 + 70)
                    .iter()
                    .enumerate()
                    .map(|(i, g)| if i % 7 == 3 { -0.0 } else { *g })
                    .collect();
                let (mut out, mut arg) = (vec![0.0; n_out], vec![0.0; n_out]);
                max_pool2d_forward(&input, planes, &w, &mut out, &mut arg).unwrap();
                let mut expected = vec![0.0; input.len()];
                max_pool2d_backward(&grad, &arg, planes, &w, &mut expected).unwrap();
                let mut got = vec![MaybeUninit::uninit(); input.len()];
                let got = max_pool2d_input_grad(&grad, &arg, planes, &w, &mut got).unwrap();
                assert_eq!(
                    bits(got),
                    bits(&expected),
                    "kernel {kernel:?} stride {stride:?} pad {pad:?} {height}x{width}"
                );
            }
        }
        let w = Window2d::new(1, (4, 4), (2, 2), (2, 2), (0, 0)).unwrap();
        let mut short = vec![MaybeUninit::uninit(); 15];
        assert!(max_pool2d_input_grad(&[0.0; 4], &[0.0; 4], 1, &w, &mut short).is_err());
    }

    #[test]
    fn avg_pool_counts_padding_in_divisor() {
        let w = Window2d::new(1, (2, 2), (2, 2), (2, 2), (1, 1)).unwrap();
        let mut out = vec![0.0; 4];
        avg_pool2d_forward(&[4., 8., 12., 16.], 1, &w, &mut out).unwrap();
        assert_eq!(out, vec![1., 2., 3., 4.]);
    }

    #[test]
    fn global_average_is_the_plane_mean() {
        let mut out = vec![0.0; 2];
        global_avg_pool_forward(&[1., 2., 3., 4., 5., 6.], 3, &mut out).unwrap();
        assert_eq!(out, vec![2., 5.]);
        let mut grad = vec![0.0; 6];
        global_avg_pool_backward(&[3., 6.], 3, &mut grad).unwrap();
        assert_eq!(grad, vec![1., 1., 1., 2., 2., 2.]);
    }
}
