// Reductions for CUDA devices: column sums (bias gradients), row broadcast (bias add) and the
// sum of squares (gradient-norm clipping), accumulated in f64 like the CPU path.

// bias[c] += sum over rows of grad[r, c]; one thread per column.
extern "C" __global__ void column_sums_accumulate_f32(const float* grad, float* bias, size_t rows, size_t cols) {
    size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float total = 0.0f;
    for (size_t r = 0; r < rows; ++r) total += grad[r * cols + c];
    bias[c] += total;
}

// y[r, c] = bias[c]; fills the output before a GEMM accumulates onto it.
extern "C" __global__ void broadcast_rows_f32(const float* bias, float* y, size_t rows, size_t cols) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * cols; i += (size_t)blockDim.x * gridDim.x) {
        y[i] = bias[i % cols];
    }
}

// partial[block] = sum of x^2 over the block's grid-stride share (256 threads per block).
extern "C" __global__ void sum_of_squares_f32(const float* x, double* partial, size_t n) {
    __shared__ double shared[256];
    double acc = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        acc += (double)x[i] * (double)x[i];
    }
    shared[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = shared[0];
}
