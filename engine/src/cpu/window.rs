//! `Window2d`: the geometry of a 2-D sliding window (kernel, stride, zero padding) over a batch of
//! NCHW planes, shared by convolution (im2col/col2im) and pooling.
use crate::{Error, Result};

/// Geometry of a 2-D sliding window over `channels` planes of `in_height x in_width`.
///
/// Output size per axis is PyTorch's `floor((in + 2 * pad - kernel) / stride) + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window2d {
    /// Channels (planes) per sample.
    pub channels: usize,
    /// Input plane height.
    pub in_height: usize,
    /// Input plane width.
    pub in_width: usize,
    /// Kernel height.
    pub kernel_height: usize,
    /// Kernel width.
    pub kernel_width: usize,
    /// Vertical stride.
    pub stride_height: usize,
    /// Horizontal stride.
    pub stride_width: usize,
    /// Zero (or, for max pooling, -inf) rows added above and below.
    pub pad_height: usize,
    /// Zero (or, for max pooling, -inf) columns added left and right.
    pub pad_width: usize,
}

impl Window2d {
    /// Validates the geometry: kernel and stride must be positive and the padded input must hold
    /// at least one kernel.
    pub fn new(
        channels: usize,
        (in_height, in_width): (usize, usize),
        (kernel_height, kernel_width): (usize, usize),
        (stride_height, stride_width): (usize, usize),
        (pad_height, pad_width): (usize, usize),
    ) -> Result<Window2d> {
        if kernel_height == 0 || kernel_width == 0 {
            return Err(Error::invalid(
                "kernel size",
                format!("{kernel_height}x{kernel_width}: both sides must be at least 1"),
            ));
        }
        if stride_height == 0 || stride_width == 0 {
            return Err(Error::invalid(
                "stride",
                format!("{stride_height}x{stride_width}: both strides must be at least 1"),
            ));
        }
        if in_height + 2 * pad_height < kernel_height || in_width + 2 * pad_width < kernel_width {
            return Err(Error::shape(
                "Window2d",
                format!("a padded input of at least {kernel_height}x{kernel_width} (the kernel)"),
                format!("{in_height}x{in_width} with padding {pad_height}x{pad_width}"),
            ));
        }
        Ok(Window2d {
            channels,
            in_height,
            in_width,
            kernel_height,
            kernel_width,
            stride_height,
            stride_width,
            pad_height,
            pad_width,
        })
    }

    /// Output plane height.
    pub fn out_height(&self) -> usize {
        (self.in_height + 2 * self.pad_height - self.kernel_height) / self.stride_height + 1
    }

    /// Output plane width.
    pub fn out_width(&self) -> usize {
        (self.in_width + 2 * self.pad_width - self.kernel_width) / self.stride_width + 1
    }

    /// Elements of one input plane.
    pub fn in_plane_len(&self) -> usize {
        self.in_height * self.in_width
    }

    /// Elements of one output plane.
    pub fn out_plane_len(&self) -> usize {
        self.out_height() * self.out_width()
    }

    /// Elements of one sample's input (`channels` planes).
    pub fn input_len(&self) -> usize {
        self.channels * self.in_plane_len()
    }

    /// Rows of the im2col matrix: `channels * kernel_height * kernel_width`.
    pub fn col_rows(&self) -> usize {
        self.channels * self.kernel_height * self.kernel_width
    }

    /// True when im2col would copy the input unchanged (1x1 kernel, stride 1, no padding), so a
    /// convolution can multiply the input directly.
    pub fn is_pointwise(&self) -> bool {
        self.kernel_height == 1
            && self.kernel_width == 1
            && self.stride_height == 1
            && self.stride_width == 1
            && self.pad_height == 0
            && self.pad_width == 0
    }

    /// The window of the gather-form input gradient of a stride-1 convolution with `out_channels`
    /// filters over this window: `dx = conv(dy, flipped kernels)` with padding `k - 1 - pad`, which
    /// reads the output gradient (`out_channels x out_h x out_w`) and yields `in_h x in_w` planes.
    /// `None` for strides above 1 or padding above `k - 1` (those take col2im).
    pub fn input_grad_window(&self, out_channels: usize) -> Option<Window2d> {
        if self.stride_height != 1 || self.stride_width != 1 {
            return None;
        }
        let pad_height = (self.kernel_height - 1).checked_sub(self.pad_height)?;
        let pad_width = (self.kernel_width - 1).checked_sub(self.pad_width)?;
        Window2d::new(
            out_channels,
            (self.out_height(), self.out_width()),
            (self.kernel_height, self.kernel_width),
            (1, 1),
            (pad_height, pad_width),
        )
        .ok()
    }

    /// The input row for output row `out_row` and kernel row `kernel_row`, or `None` in the padding.
    #[inline]
    pub(crate) fn input_row(&self, out_row: usize, kernel_row: usize) -> Option<usize> {
        (out_row * self.stride_height + kernel_row).checked_sub(self.pad_height).filter(|&r| r < self.in_height)
    }

    /// The input column for output column `out_col` and kernel column `kernel_col`, or `None` in the padding.
    #[inline]
    pub(crate) fn input_col(&self, out_col: usize, kernel_col: usize) -> Option<usize> {
        (out_col * self.stride_width + kernel_col).checked_sub(self.pad_width).filter(|&c| c < self.in_width)
    }
}

/// Checks that a slice named `what` has `expected` elements.
pub(crate) fn check_len(op: &str, what: &str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::shape(op, format!("{what} of {expected} elements"), format!("{got} elements")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_size_follows_pytorch_floor_rule() {
        let window = Window2d::new(3, (7, 6), (3, 2), (2, 2), (1, 0)).unwrap();
        assert_eq!((window.out_height(), window.out_width()), (4, 3));
        assert_eq!(window.col_rows(), 18);
        assert!(Window2d::new(1, (2, 2), (3, 3), (1, 1), (0, 0)).is_err());
        assert!(Window2d::new(1, (4, 4), (3, 3), (0, 1), (0, 0)).is_err());
    }
}
