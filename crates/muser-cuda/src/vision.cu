// Kernels of the image encoder's device-resident forward (muser-vision's `gpu.rs`), compiled
// by NVRTC as a module of their own after common.cuh; the encoder also loads ops.cu for the
// element-wise adds, the row gather and the activation rounding. Activations are row-major
// f32 [rows][cols]; every kernel is f32 math in the order encoder.rs computes on the CPU.

#define VIS_EACH(i, n) \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long)gridDim.x * blockDim.x)

// LayerNorm of one row per block: y = (x - mean) / sqrt(var + eps) * w (+ b), the mean and the
// variance of the centred values in f32 block sums. b may be null; x may equal y.
extern "C" __global__ void vis_layer_norm(const float* x, float* y, const float* w, const float* b, int cols,
                                          float eps) {
    pdl_wait();
    __shared__ float sh[33];
    const float* xr = x + (long)blockIdx.x * cols;
    float* yr = y + (long)blockIdx.x * cols;
    float s = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, sh) / (float)cols;
    float s2 = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float d = xr[i] - mean;
        s2 += d * d;
    }
    const float scale = 1.f / sqrtf(block_sum(s2, sh) / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = (xr[i] - mean) * scale * w[i];
        if (b) v += b[i];
        yr[i] = v;
    }
}

// ggml_gelu_erf in place.
extern "C" __global__ void vis_gelu_erf(float* x, long n) {
    pdl_wait();
    VIS_EACH(i, n) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    }
}

// 2D RoPE in place over rows of n_head heads of hd: pair p of every head (values 2p, 2p+1)
// turns by the row's table entry p, (cos, sin) as encoder.rs's `rope_table` computes them
// (x angles for the first half of the head, y angles for the second).
extern "C" __global__ void vis_rope_2d(float* x, const float2* table, long rows, int n_head, int hd) {
    pdl_wait();
    const int pairs = hd / 2;
    VIS_EACH(i, rows * n_head * pairs) {
        const int p = (int)(i % pairs);
        const long r = i / ((long)n_head * pairs);
        const float2 cs = table[r * pairs + p];
        float* v = x + i / pairs * hd + 2 * p;
        const float x0 = v[0], x1 = v[1];
        v[0] = fmaf(x0, cs.x, -(x1 * cs.y));
        v[1] = fmaf(x0, cs.y, x1 * cs.x);
    }
}

// Softmax of each row of `cols` scores in place, one row per block: exp(s - max) / sum.
extern "C" __global__ void vis_softmax(float* s, int cols) {
    pdl_wait();
    __shared__ float sh[33];
    float* r = s + (long)blockIdx.x * cols;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, r[i]);
    m = warp_max(m);
    __shared__ float wm[32];
    if ((threadIdx.x & 31) == 0) wm[threadIdx.x >> 5] = m;
    __syncthreads();
    m = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, wm[w]);
    float sum = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float e = expf(r[i] - m);
        r[i] = e;
        sum += e;
    }
    const float inv = 1.f / block_sum(sum, sh);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) r[i] *= inv;
}

// f32 to f16 (round to nearest even): a product's activations for an f16 weight, the values
// the CPU's F16 vec_dot rounds them to.
extern "C" __global__ void vis_to_f16(const float* x, __half* y, long n) {
    pdl_wait();
    VIS_EACH(i, n) y[i] = __float2half_rn(x[i]);
}

// Pixel shuffle of a gw-wide grid of e-wide rows by f: out[o][c·f² + s] = grid[t][c], with t
// the s-th token (row-major) of output cell o's f×f block (n = cells · e · f² values).
extern "C" __global__ void vis_pixel_shuffle(const float* grid, float* out, int gw, int e, int f, long n) {
    pdl_wait();
    const int ss = f * f, ow = gw / f;
    VIS_EACH(i, n) {
        const long o = i / ((long)e * ss);
        const int r = (int)(i - o * e * ss);
        const int c = r / ss, s = r - c * ss;
        const long oy = o / ow, ox = o - oy * ow;
        const long t = (oy * f + s / f) * gw + ox * f + s % f;
        out[i] = grid[t * e + c];
    }
}
