// Optimizer updates for CUDA devices, with torch.optim's rules (see engine/src/optim for the
// formulas); hyperparameters arrive as f32 where torch hands them to an f32 kernel.

// SGD: g = grad + wd * p; buf = momentum * buf + (1 - dampening) * g (buf = g at step 1);
// g = nesterov ? g + momentum * buf : buf; p -= lr * g.
extern "C" __global__ void sgd_step_f32(float* p, const float* grad, float* buf, float lr, float momentum, float dampening,
                                        float weight_decay, int nesterov, int first_step, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float g = grad[i] + weight_decay * p[i];
        if (momentum != 0.0f) {
            float b = first_step ? g : momentum * buf[i] + (1.0f - dampening) * g;
            buf[i] = b;
            g = nesterov ? g + momentum * b : b;
        }
        p[i] -= lr * g;
    }
}

// Adam / AdamW: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= step_size * m / (sqrt(v) / sqrt(bias_correction2) + eps), with decoupled decay first for AdamW.
extern "C" __global__ void adam_step_f32(float* p, const float* grad, float* m, float* v, float lr, float beta1, float beta2,
                                         float eps, float weight_decay, int decoupled, float bias_correction1,
                                         float bias_correction2_sqrt, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float g = grad[i];
        if (decoupled) p[i] *= 1.0f - lr * weight_decay; else g += weight_decay * p[i];
        m[i] = beta1 * m[i] + (1.0f - beta1) * g;
        v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
        float denom = sqrtf(v[i]) / bias_correction2_sqrt + eps;
        p[i] -= (lr / bias_correction1) * m[i] / denom;
    }
}
