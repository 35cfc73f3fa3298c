//! Convolution as device ops: [`Tensor::conv2d`] (forward), [`Tensor::conv2d_input_grad`] and
//! [`Tensor::conv2d_weight_grad_accumulate`], dispatched as every op in [`super`]: the CPU kernels
//! the `Conv2d` layer ran before (unchanged, bit for bit) on a CPU device, a batched im2col and
//! cuBLAS strided-batched products (col2im for the input gradient) on a GPU.
