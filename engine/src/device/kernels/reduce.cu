// Reductions for CUDA devices: column sums (Linear bias gradients), row sums (Conv2d bias
// gradients), row broadcast (bias add) and the sum of squares (gradient-norm clipping, accumulated
// in f64 like the CPU path). Kernels with a shared array are launched with exactly 256 threads.

// column_sums[c] += sum over rows of matrix[r, c]; one thread per column, rows in order.
extern "C" __global__ void column_sums_accumulate_f32(const float* matrix, float* column_sums, size_t rows, size_t cols) {
    size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float total = 0.0f;
    for (size_t r = 0; r < rows; ++r) total += matrix[r * cols + c];
    column_sums[c] += total;
}

// row_sums[r] += sum over columns of matrix[r, c]; one block of 256 threads per row.
extern "C" __global__ void row_sums_accumulate_f32(const float* matrix, float* row_sums, size_t rows, size_t cols) {
    __shared__ float shared[256];
    size_t r = blockIdx.x;
    if (r >= rows) return;
    float acc = 0.0f;
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) acc += matrix[r * cols + c];
    shared[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) row_sums[r] += shared[0];
}

// y[r, c] = row[c]; fills the output before a GEMM accumulates onto it.
extern "C" __global__ void broadcast_rows_f32(const float* row, float* y, size_t rows, size_t cols) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * cols; i += (size_t)blockDim.x * gridDim.x) {
        y[i] = row[i % cols];
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
