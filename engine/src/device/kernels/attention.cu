// Scaled dot-product attention for CUDA devices, the layouts of engine/src/cpu/attention.rs:
// qkv head-major [3][heads][batch][tokens][head_dim] (q, then k, then v), the context
// [batch][tokens][heads * head_dim] and the row logsumexp [heads][batch][tokens]. One thread per
// output element, looping over the keys (forward, dQ) or the queries (dK, dV) in order: no
// atomics, deterministic, no [tokens, tokens] matrix kept. The causal mask hides key j > i from
// query i. Grid-stride loops over 64-bit indices.

// s_ij = scale * q_i . k_j
__device__ float attention_score(const float* q, const float* k, int head_dim, float scale) {
    float dot = 0.0f;
    for (int d = 0; d < head_dim; ++d) dot += q[d] * k[d];
    return dot * scale;
}

// ctx[b][i][h*dh + d] = sum_j exp(s_ij - lse_i) v_j[d]; lse[h][b][i] = log sum_j exp(s_ij).
extern "C" __global__ void attention_forward_f32(const float* qkv, float* ctx, float* lse, int batch, int tokens,
                                                 int heads, int head_dim, int causal, float scale) {
    long long total = (long long)heads * batch * tokens * head_dim;
    long long block = (long long)batch * tokens * head_dim; // one (which, h) block of qkv
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int d = idx % head_dim; long long t = idx / head_dim;
        int i = t % tokens; t /= tokens;
        int b = t % batch; int h = t / batch;
        long long sample = ((long long)h * batch + b) * tokens * head_dim;
        const float* q = qkv + sample;
        const float* k = qkv + (long long)heads * block + sample;
        const float* v = qkv + 2LL * heads * block + sample;
        const float* qi = q + (long long)i * head_dim;
        int keys = causal ? i + 1 : tokens;
        float m = __int_as_float(0xff800000); // -inf
        for (int j = 0; j < keys; ++j) m = fmaxf(m, attention_score(qi, k + (long long)j * head_dim, head_dim, scale));
        float sum = 0.0f, out = 0.0f;
        for (int j = 0; j < keys; ++j) {
            float p = expf(attention_score(qi, k + (long long)j * head_dim, head_dim, scale) - m);
            sum += p;
            out += p * v[(long long)j * head_dim + d];
        }
        ctx[((long long)b * tokens + i) * heads * head_dim + (long long)h * head_dim + d] = out / sum;
        if (d == 0) lse[((long long)h * batch + b) * tokens + i] = m + logf(sum);
    }
}

// dq_i[d] = scale * sum_j dS_ij k_j[d], dS_ij = P_ij (dO_i . v_j - dO_i . O_i), P_ij = exp(s_ij - lse_i).
extern "C" __global__ void attention_backward_q_f32(const float* qkv, const float* ctx, const float* lse,
                                                    const float* grad_ctx, float* grad_qkv, int batch, int tokens,
                                                    int heads, int head_dim, int causal, float scale) {
    long long total = (long long)heads * batch * tokens * head_dim;
    long long block = (long long)batch * tokens * head_dim;
    long long width = (long long)heads * head_dim;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int d = idx % head_dim; long long t = idx / head_dim;
        int i = t % tokens; t /= tokens;
        int b = t % batch; int h = t / batch;
        long long sample = ((long long)h * batch + b) * tokens * head_dim;
        const float* qi = qkv + sample + (long long)i * head_dim;
        const float* k = qkv + (long long)heads * block + sample;
        const float* v = qkv + 2LL * heads * block + sample;
        long long row = ((long long)b * tokens + i) * width + (long long)h * head_dim;
        const float* dOi = grad_ctx + row;
        const float* Oi = ctx + row;
        float l = lse[((long long)h * batch + b) * tokens + i];
        float delta = 0.0f;
        for (int e = 0; e < head_dim; ++e) delta += dOi[e] * Oi[e];
        int keys = causal ? i + 1 : tokens;
        float acc = 0.0f;
        for (int j = 0; j < keys; ++j) {
            const float* kj = k + (long long)j * head_dim;
            float p = expf(attention_score(qi, kj, head_dim, scale) - l);
            float dp = 0.0f;
            for (int e = 0; e < head_dim; ++e) dp += dOi[e] * v[(long long)j * head_dim + e];
            acc += p * (dp - delta) * kj[d];
        }
        grad_qkv[sample + (long long)i * head_dim + d] = acc * scale;
    }
}

// dk_j[d] = scale * sum_i dS_ij q_i[d]; dv_j[d] = sum_i P_ij dO_i[d] (over the queries i that see key j).
extern "C" __global__ void attention_backward_kv_f32(const float* qkv, const float* ctx, const float* lse,
                                                     const float* grad_ctx, float* grad_qkv, int batch, int tokens,
                                                     int heads, int head_dim, int causal, float scale) {
    long long total = (long long)heads * batch * tokens * head_dim;
    long long block = (long long)batch * tokens * head_dim;
    long long width = (long long)heads * head_dim;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int d = idx % head_dim; long long t = idx / head_dim;
        int j = t % tokens; t /= tokens;
        int b = t % batch; int h = t / batch;
        long long sample = ((long long)h * batch + b) * tokens * head_dim;
        const float* q = qkv + sample;
        const float* kj = qkv + (long long)heads * block + sample + (long long)j * head_dim;
        const float* vj = qkv + 2LL * heads * block + sample + (long long)j * head_dim;
        float dk = 0.0f, dv = 0.0f;
        for (int i = causal ? j : 0; i < tokens; ++i) {
            const float* qi = q + (long long)i * head_dim;
            long long row = ((long long)b * tokens + i) * width + (long long)h * head_dim;
            const float* dOi = grad_ctx + row;
            const float* Oi = ctx + row;
            float p = expf(attention_score(qi, kj, head_dim, scale) - lse[((long long)h * batch + b) * tokens + i]);
            float dp = 0.0f, delta = 0.0f;
            for (int e = 0; e < head_dim; ++e) {
                dp += dOi[e] * vj[e];
                delta += dOi[e] * Oi[e];
            }
            dk += p * (dp - delta) * qi[d];
            dv += p * dOi[d];
        }
        grad_qkv[(long long)heads * block + sample + (long long)j * head_dim + d] = dk * scale;
        grad_qkv[2LL * heads * block + sample + (long long)j * head_dim + d] = dv;
    }
}
