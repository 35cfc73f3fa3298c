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

// Dropout with a precomputed 0/1 mask, scaled by 1 / (1 - p) like PyTorch.
extern "C" __global__ void dropout_apply_f32(const float* x, const float* mask, float scale, float* y, size_t n) {
    GRID_STRIDE(i, n) { y[i] = x[i] * mask[i] * scale; }
}
