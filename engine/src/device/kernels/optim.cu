// Optimizer updates for CUDA devices, with torch.optim's rules operation by operation, as
// engine/src/optim/{sgd,adam}.rs write them: the scalars arrive precomputed by the host in f64 and
// rounded to f32 exactly where the CPU path rounds them, and every elementwise operation is one f32
// operation in the CPU's order (the module is compiled with --fmad=false, so none is contracted).

// SGD: g = grad + wd * p (when wd != 0); without momentum p += neg_lr * g; with momentum
// buf = g at the first step, else buf * momentum + (1 - dampening) * g;
// p += neg_lr * (nesterov ? g + momentum * buf : buf).
extern "C" __global__ void sgd_step_f32(float* p, const float* grad, float* buf, float neg_lr, float momentum,
                                        float one_minus_dampening, float weight_decay, int apply_weight_decay,
                                        int use_momentum, int nesterov, int first_step, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float g = apply_weight_decay ? grad[i] + weight_decay * p[i] : grad[i];
        if (use_momentum) {
            float b = first_step ? g : buf[i] * momentum + one_minus_dampening * g;
            buf[i] = b;
            g = nesterov ? g + momentum * b : b;
        }
        p[i] += neg_lr * g;
    }
}

// torch.lerp(start, end, weight) as ATen computes it for f32.
__device__ float torch_lerp(float start, float end, float weight) {
    return fabsf(weight) < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

// Adam / AdamW. weight_decay_mode: 0 none, 1 L2 (Adam: g = grad + wd * p), 2 decoupled (AdamW:
// p *= decay_factor first). m = lerp(m, g, 1 - beta1); v = v * beta2 + (1 - beta2) * g * g;
// p += neg_step_size * m / (sqrt(v) / sqrt(bias_correction2) + eps).
extern "C" __global__ void adam_step_f32(float* p, const float* grad, float* m, float* v, float lerp_weight, float beta2,
                                         float one_minus_beta2, float eps, float weight_decay, float decay_factor,
                                         int weight_decay_mode, float neg_step_size, float bias_correction2_sqrt,
                                         size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float g = grad[i];
        if (weight_decay_mode == 2) p[i] *= decay_factor;
        else if (weight_decay_mode == 1) g = grad[i] + weight_decay * p[i];
        float mi = torch_lerp(m[i], g, lerp_weight);
        float vi = v[i] * beta2 + one_minus_beta2 * g * g;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bias_correction2_sqrt + eps;
        p[i] += neg_step_size * mi / denom;
    }
}
