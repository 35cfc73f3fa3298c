// im2col / col2im and pooling for CUDA devices, NCHW, one sample per launch row of the grid.

// cols[(c*kh + i)*kw + j, oy*ow + ox] = x[c, oy*sh + i - ph, ox*sw + j - pw] (0 outside).
extern "C" __global__ void im2col_f32(const float* x, float* cols, int channels, int h, int w, int kh, int kw,
                                      int sh, int sw, int ph, int pw, int oh, int ow) {
    long long total = (long long)channels * kh * kw * oh * ow;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int ox = idx % ow; long long t = idx / ow;
        int oy = t % oh; t /= oh;
        int j = t % kw; t /= kw;
        int i = t % kh; int c = t / kh;
        int y = oy * sh + i - ph, xx = ox * sw + j - pw;
        cols[idx] = (y >= 0 && y < h && xx >= 0 && xx < w) ? x[((long long)c * h + y) * w + xx] : 0.0f;
    }
}

// The adjoint of im2col: dx[c, y, x] += every column entry that read it (atomic adds).
extern "C" __global__ void col2im_f32(const float* cols, float* dx, int channels, int h, int w, int kh, int kw,
                                      int sh, int sw, int ph, int pw, int oh, int ow) {
    long long total = (long long)channels * kh * kw * oh * ow;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int ox = idx % ow; long long t = idx / ow;
        int oy = t % oh; t /= oh;
        int j = t % kw; t /= kw;
        int i = t % kh; int c = t / kh;
        int y = oy * sh + i - ph, xx = ox * sw + j - pw;
        if (y >= 0 && y < h && xx >= 0 && xx < w) atomicAdd(&dx[((long long)c * h + y) * w + xx], cols[idx]);
    }
}

// Max pooling forward: y and the flat input index of each maximum (for the backward pass).
extern "C" __global__ void max_pool_forward_f32(const float* x, float* y, int* argmax, int planes, int h, int w,
                                                int kh, int kw, int sh, int sw, int oh, int ow) {
    long long total = (long long)planes * oh * ow;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int ox = idx % ow; int oy = (idx / ow) % oh; long long p = idx / ((long long)oh * ow);
        float best = __int_as_float(0xff800000) /* -inf */; int best_at = -1;
        for (int i = 0; i < kh; ++i) for (int j = 0; j < kw; ++j) {
            int y0 = oy * sh + i, x0 = ox * sw + j;
            if (y0 < h && x0 < w) {
                int at = (int)((p * h + y0) * w + x0);
                if (x[at] > best) { best = x[at]; best_at = at; }
            }
        }
        y[idx] = best; argmax[idx] = best_at;
    }
}

extern "C" __global__ void max_pool_backward_f32(const float* dy, const int* argmax, float* dx, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        if (argmax[i] >= 0) atomicAdd(&dx[argmax[i]], dy[i]);
    }
}

extern "C" __global__ void avg_pool_forward_f32(const float* x, float* y, int planes, int h, int w,
                                                int kh, int kw, int sh, int sw, int oh, int ow) {
    long long total = (long long)planes * oh * ow;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int ox = idx % ow; int oy = (idx / ow) % oh; long long p = idx / ((long long)oh * ow);
        float s = 0.0f;
        for (int i = 0; i < kh; ++i) for (int j = 0; j < kw; ++j) s += x[(p * h + oy * sh + i) * w + ox * sw + j];
        y[idx] = s / (float)(kh * kw);
    }
}
