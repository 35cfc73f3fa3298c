// Softmax, log-softmax and softmax cross-entropy for CUDA devices; one block per row.

extern "C" __global__ void log_softmax_rows_f32(const float* x, float* y, size_t rows, size_t cols) {
    size_t r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + r * cols;
    float m = __int_as_float(0xff800000) /* -inf */;
    for (size_t c = 0; c < cols; ++c) m = fmaxf(m, row[c]);
    float s = 0.0f;
    for (size_t c = 0; c < cols; ++c) s += expf(row[c] - m);
    float log_z = m + logf(s);
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) y[r * cols + c] = row[c] - log_z;
}

// loss[r] = -log_softmax(x)[r, label[r]] / normalizer; grad = (softmax - onehot) / normalizer.
extern "C" __global__ void cross_entropy_f32(const float* logits, const long long* labels, float normalizer,
                                            float* loss, float* grad, size_t rows, size_t cols) {
    size_t r = blockIdx.x;
    if (r >= rows) return;
    const float* row = logits + r * cols;
    float m = __int_as_float(0xff800000) /* -inf */;
    for (size_t c = 0; c < cols; ++c) m = fmaxf(m, row[c]);
    float s = 0.0f;
    for (size_t c = 0; c < cols; ++c) s += expf(row[c] - m);
    long long label = labels[r];
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) {
        float p = expf(row[c] - m) / s;
        grad[r * cols + c] = (p - (c == (size_t)label ? 1.0f : 0.0f)) / normalizer;
    }
    if (threadIdx.x == 0) loss[r] = (m + logf(s) - row[label]) / normalizer;
}
