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

extern "C" __global__ void tanh_forward_f32(const float* x, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = tanhf(x[i]); }
}

extern "C" __global__ void tanh_backward_f32(const float* y, const float* dy, float* dx, size_t n) {
    GRID_STRIDE(i, n) { dx[i] = dy[i] * (1.0f - y[i] * y[i]); }
}

// Dropout with a precomputed 0/1 mask, scaled by 1 / (1 - p) like PyTorch.
extern "C" __global__ void dropout_apply_f32(const float* x, const float* mask, float scale, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = x[i] * mask[i] * scale; }
}
