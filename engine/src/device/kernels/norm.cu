// Layer normalisation, embedding lookups and the sequence layers' token reductions for CUDA
// devices. Every sum is one thread's loop over its inputs in the CPU kernel's order (no atomics,
// no tree reductions), so results are deterministic and, compiled with --fmad=false, round as the
// CPU kernels of engine/src/cpu round them.

// One thread per row of `dim` elements (`cpu::layer_norm::layer_norm_forward`): the mean and the
// biased variance summed in f64, rstd = 1 / sqrt(var + eps), y = (x - mean) * rstd * w + b.
extern "C" __global__ void layer_norm_forward_f32(const float* x, const float* weight, const float* bias, float eps,
                                                  float* y, float* mean, float* rstd, size_t rows, size_t dim) {
    size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * dim;
    double sum = 0.0;
    for (size_t c = 0; c < dim; ++c) sum += (double)xr[c];
    double row_mean = sum / (double)dim;
    double squares = 0.0;
    for (size_t c = 0; c < dim; ++c) {
        double d = (double)xr[c] - row_mean;
        squares += d * d;
    }
    double var = squares / (double)dim;
    double row_rstd = 1.0 / sqrt(var + (double)eps);
    float m = (float)row_mean, s = (float)row_rstd;
    float* yr = y + r * dim;
    for (size_t c = 0; c < dim; ++c) yr[c] = (xr[c] - m) * s * weight[c] + bias[c];
    mean[r] = m;
    rstd[r] = s;
}

// One thread per row (`cpu::layer_norm::layer_norm_backward_input`): with g = dy * w and
// xhat = (x - mean) * rstd, dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), the means in f64.
extern "C" __global__ void layer_norm_backward_input_f32(const float* x, const float* dy, const float* weight,
                                                         const float* mean, const float* rstd, float* dx, size_t rows,
                                                         size_t dim) {
    size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * dim;
    const float* dyr = dy + r * dim;
    float m = mean[r], s = rstd[r];
    double sum_g = 0.0, sum_g_xhat = 0.0;
    for (size_t c = 0; c < dim; ++c) {
        double g = (double)(dyr[c] * weight[c]);
        sum_g += g;
        sum_g_xhat += g * (double)((xr[c] - m) * s);
    }
    float mean_g = (float)(sum_g / (double)dim);
    float mean_g_xhat = (float)(sum_g_xhat / (double)dim);
    float* dxr = dx + r * dim;
    for (size_t c = 0; c < dim; ++c) {
        float xhat = (xr[c] - m) * s;
        dxr[c] = s * (dyr[c] * weight[c] - mean_g - xhat * mean_g_xhat);
    }
}

// One thread per column (`cpu::layer_norm::layer_norm_backward_weight`, summed apart then added):
// weight_grad[c] += sum over rows of dy * (x - mean) * rstd, bias_grad[c] += sum over rows of dy.
extern "C" __global__ void layer_norm_backward_weight_f32(const float* x, const float* dy, const float* mean,
                                                          const float* rstd, float* weight_grad, float* bias_grad,
                                                          size_t rows, size_t dim) {
    size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (c >= dim) return;
    float weight_total = 0.0f, bias_total = 0.0f;
    for (size_t r = 0; r < rows; ++r) {
        float d = dy[r * dim + c];
        bias_total += d;
        weight_total += d * (x[r * dim + c] - mean[r]) * rstd[r];
    }
    weight_grad[c] += weight_total;
    bias_grad[c] += bias_total;
}

// out[p, c] = table[ids[p], c] for n_ids ids (integers held in floats, checked by the caller; an
// id out of range writes zeros rather than reading outside the table).
extern "C" __global__ void embedding_gather_f32(const float* ids, const float* table, float* out, size_t n_ids,
                                                size_t n_rows, size_t dim) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_ids * dim; i += (size_t)blockDim.x * gridDim.x) {
        float id = ids[i / dim];
        out[i] = (id >= 0.0f && id < (float)n_rows) ? table[(size_t)id * dim + i % dim] : 0.0f;
    }
}

// One thread per (distinct id, column): grad[ids[s], c] += sum of dy[p, c] over the positions p
// holding that id, in order (positions[offsets[s] .. offsets[s + 1]]), summed apart then added.
extern "C" __global__ void embedding_scatter_add_f32(const float* dy, const long long* ids, const long long* offsets,
                                                     const long long* positions, float* grad, size_t n_slots,
                                                     size_t dim) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n_slots * dim) return;
    size_t s = i / dim, c = i % dim;
    float total = 0.0f;
    for (long long k = offsets[s]; k < offsets[s + 1]; ++k) total += dy[(size_t)positions[k] * dim + c];
    grad[(size_t)ids[s] * dim + c] += total;
}

// y[i] = x[i] + table[i % len]: a [len] table (tokens x dim) added to every sample.
extern "C" __global__ void add_positions_f32(const float* x, const float* table, float* y, size_t n, size_t len) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        y[i] = x[i] + table[i % len];
    }
}

// One thread per table element c < len: grad[c] += sum over samples b of dy[b * len + c].
extern "C" __global__ void positions_grad_accumulate_f32(const float* dy, float* grad, size_t batch, size_t len) {
    size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (c >= len) return;
    float total = 0.0f;
    for (size_t b = 0; b < batch; ++b) total += dy[b * len + c];
    grad[c] += total;
}

// One thread per (sample, feature): y[b, f] = (sum over t of x[b, t, f]) * inv_tokens.
extern "C" __global__ void mean_over_tokens_f32(const float* x, float* y, size_t batch, size_t tokens,
                                                size_t features, float inv_tokens) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= batch * features) return;
    size_t b = i / features, f = i % features;
    const float* sample = x + b * tokens * features;
    float total = 0.0f;
    for (size_t t = 0; t < tokens; ++t) total += sample[t * features + f];
    y[i] = total * inv_tokens;
}

// dx[b, t, f] = dy[b, f] * inv_tokens.
extern "C" __global__ void mean_over_tokens_backward_f32(const float* dy, float* dx, size_t batch, size_t tokens,
                                                         size_t features, float inv_tokens) {
    size_t n = batch * tokens * features;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        size_t b = i / (tokens * features), f = i % features;
        dx[i] = dy[b * features + f] * inv_tokens;
    }
}
