// Log-softmax and softmax cross-entropy for CUDA devices: one block of 256 threads per row, the
// row maximum and the sum of exponentials reduced in shared memory (numerically stable, like
// engine/src/cpu/softmax.rs).

// Block-wide reduction of one value per thread (blockDim.x == 256); every thread gets the result.
__device__ float block_reduce(float value, bool take_max) {
    __shared__ float shared[256];
    shared[threadIdx.x] = value;
    __syncthreads();
    for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            float other = shared[threadIdx.x + stride];
            shared[threadIdx.x] = take_max ? fmaxf(shared[threadIdx.x], other) : shared[threadIdx.x] + other;
        }
        __syncthreads();
    }
    float result = shared[0];
    __syncthreads(); // shared is reused by the next call
    return result;
}

// The row's maximum m and log(sum exp(x - m)).
__device__ void row_max_and_log_sum_exp(const float* row, size_t cols, float* m_out, float* log_sum_out) {
    float m = __int_as_float(0xff800000) /* -inf */;
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, row[c]);
    m = block_reduce(m, true);
    float s = 0.0f;
    if (m != __int_as_float(0xff800000)) {
        for (size_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(row[c] - m);
    }
    s = block_reduce(s, false);
    *m_out = m;
    *log_sum_out = m == __int_as_float(0xff800000) ? 0.0f : logf(s);
}

// y[r, c] = x[r, c] - max_r - log(sum exp(x[r, :] - max_r)).
extern "C" __global__ void log_softmax_rows_f32(const float* x, float* y, size_t rows, size_t cols) {
    size_t r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + r * cols;
    float m, log_sum;
    row_max_and_log_sum_exp(row, cols, &m, &log_sum);
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) y[r * cols + c] = row[c] - m - log_sum;
}

// loss[r] = -log_softmax(x)[r, label[r]] / normalizer; grad = (softmax - onehot) / normalizer.
// A label outside [0, cols) yields NaN loss and gradient for its row (never an out-of-range read).
extern "C" __global__ void cross_entropy_f32(const float* logits, const long long* labels, float normalizer,
                                            float* loss, float* grad, size_t rows, size_t cols) {
    size_t r = blockIdx.x;
    if (r >= rows) return;
    const float* row = logits + r * cols;
    long long label = labels[r];
    if (label < 0 || label >= (long long)cols) {
        float nan = __int_as_float(0x7fc00000);
        for (size_t c = threadIdx.x; c < cols; c += blockDim.x) grad[r * cols + c] = nan;
        if (threadIdx.x == 0) loss[r] = nan;
        return;
    }
    float m, log_sum;
    row_max_and_log_sum_exp(row, cols, &m, &log_sum);
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) {
        float p = expf(row[c] - m - log_sum);
        grad[r * cols + c] = (p - (c == (size_t)label ? 1.0f : 0.0f)) / normalizer;
    }
    if (threadIdx.x == 0) loss[r] = (m + log_sum - row[label]) / normalizer;
}
