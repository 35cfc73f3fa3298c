// im2col / col2im and pooling for CUDA devices, NCHW, the same layouts and padding rules as
// engine/src/cpu/conv.rs and engine/src/cpu/pool.rs (Window2d). Grid-stride loops over 64-bit
// indices; col2im and the average-pooling gradient gather (one thread per input element, no
// atomics, so they are deterministic).

// cols[n][(c*kh + i)*kw + j][oy*ow + ox] = x[n][c][oy*sh + i - ph][ox*sw + j - pw] (0 in the padding):
// `batch` samples, each with its own col matrix of (channels*kh*kw) x (oh*ow), one after another.
extern "C" __global__ void im2col_f32(const float* x, float* cols, int batch, int channels, int h, int w, int kh, int kw,
                                      int sh, int sw, int ph, int pw, int oh, int ow) {
    long long total = (long long)batch * channels * kh * kw * oh * ow;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        long long t = idx;
        int ox = t % ow; t /= ow;
        int oy = t % oh; t /= oh;
        int j = t % kw; t /= kw;
        int i = t % kh; t /= kh;
        long long plane = t; // n * channels + c
        int y = oy * sh + i - ph, xx = ox * sw + j - pw;
        cols[idx] = (y >= 0 && y < h && xx >= 0 && xx < w) ? x[(plane * h + y) * w + xx] : 0.0f;
    }
}

// The adjoint of im2col, accumulated: dx[n][c][y][x] += every column entry that read it.
extern "C" __global__ void col2im_f32(const float* cols, float* dx, int batch, int channels, int h, int w, int kh, int kw,
                                      int sh, int sw, int ph, int pw, int oh, int ow) {
    long long total = (long long)batch * channels * h * w;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int x = idx % w; long long t = idx / w;
        int y = t % h; long long plane = t / h; // n * channels + c
        const float* col = cols + plane * kh * kw * (long long)oh * ow;
        float sum = 0.0f;
        for (int i = 0; i < kh; ++i) {
            int ty = y + ph - i;
            if (ty < 0 || ty % sh != 0 || ty / sh >= oh) continue;
            int oy = ty / sh;
            for (int j = 0; j < kw; ++j) {
                int tx = x + pw - j;
                if (tx < 0 || tx % sw != 0 || tx / sw >= ow) continue;
                sum += col[((long long)(i * kw + j) * oh + oy) * ow + tx / sw];
            }
        }
        dx[idx] += sum;
    }
}

// Max pooling forward over `planes` planes: y, and the winning position within the input plane
// (y0 * w + x0; -1 when the window lies entirely in the padding) stored as a float, as
// cpu::pool::max_pool2d_forward stores it (exact: the launcher checks h * w <= 2^24). Padding acts
// as -inf, the first maximum wins ties and NaN propagates, the last NaN of a window winning, as on
// the CPU and in PyTorch (`val > max || isnan(val)`).
extern "C" __global__ void max_pool_forward_f32(const float* x, float* y, float* argmax, long long planes, int h, int w,
                                                int kh, int kw, int sh, int sw, int ph, int pw, int oh, int ow) {
    long long total = planes * oh * ow;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int ox = idx % ow; int oy = (idx / ow) % oh; long long p = idx / ((long long)oh * ow);
        const float* plane = x + p * h * (long long)w;
        float best = __int_as_float(0xff800000) /* -inf */; int best_at = -1;
        for (int i = 0; i < kh; ++i) {
            int y0 = oy * sh + i - ph;
            if (y0 < 0 || y0 >= h) continue;
            for (int j = 0; j < kw; ++j) {
                int x0 = ox * sw + j - pw;
                if (x0 < 0 || x0 >= w) continue;
                int at = y0 * w + x0;
                float v = plane[at];
                if (best_at < 0 || v > best || isnan(v)) { best = v; best_at = at; }
            }
        }
        y[idx] = best; argmax[idx] = (float)best_at;
    }
}

// Max pooling backward, accumulated: dx[p][argmax] += dy (atomic: overlapping windows may share a
// winner). The argmax is read as the forward stored it, a float position; -1 (a window entirely in
// the padding) and NaN fail the range test and route nothing, as on the CPU.
extern "C" __global__ void max_pool_backward_f32(const float* dy, const float* argmax, float* dx, long long planes,
                                                 long long in_plane, long long out_plane) {
    long long total = planes * out_plane;
    float limit = (float)in_plane;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        float at = argmax[idx];
        if (at >= 0.0f && at < limit) atomicAdd(&dx[(idx / out_plane) * in_plane + (long long)at], dy[idx]);
    }
}

// Average pooling forward: the window's sum over kh*kw (padding counted in the divisor, PyTorch's
// count_include_pad=True).
extern "C" __global__ void avg_pool_forward_f32(const float* x, float* y, long long planes, int h, int w,
                                                int kh, int kw, int sh, int sw, int ph, int pw, int oh, int ow) {
    long long total = planes * oh * ow;
    float scale = 1.0f / (float)(kh * kw);
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int ox = idx % ow; int oy = (idx / ow) % oh; long long p = idx / ((long long)oh * ow);
        const float* plane = x + p * h * (long long)w;
        float s = 0.0f;
        for (int i = 0; i < kh; ++i) {
            int y0 = oy * sh + i - ph;
            if (y0 < 0 || y0 >= h) continue;
            for (int j = 0; j < kw; ++j) {
                int x0 = ox * sw + j - pw;
                if (x0 >= 0 && x0 < w) s += plane[y0 * w + x0];
            }
        }
        y[idx] = s * scale;
    }
}

// Average pooling backward, accumulated: dx[p][y][x] += sum of dy / (kh*kw) over the windows that hold it.
extern "C" __global__ void avg_pool_backward_f32(const float* dy, float* dx, long long planes, int h, int w,
                                                 int kh, int kw, int sh, int sw, int ph, int pw, int oh, int ow) {
    long long total = planes * h * w;
    float scale = 1.0f / (float)(kh * kw);
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total; idx += (long long)blockDim.x * gridDim.x) {
        int x = idx % w; long long t = idx / w;
        int y = t % h; long long p = t / h;
        const float* g = dy + p * oh * (long long)ow;
        float sum = 0.0f;
        for (int i = 0; i < kh; ++i) {
            int ty = y + ph - i;
            if (ty < 0 || ty % sh != 0 || ty / sh >= oh) continue;
            for (int j = 0; j < kw; ++j) {
                int tx = x + pw - j;
                if (tx < 0 || tx % sw != 0 || tx / sw >= ow) continue;
                sum += g[(ty / sh) * ow + tx / sw] * scale;
            }
        }
        dx[idx] += sum;
    }
}
