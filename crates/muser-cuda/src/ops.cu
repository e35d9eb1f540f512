// Kernels of the per-op CUDA backend (backend.rs): one kernel per `Backend` op, f32 math,
// written for correctness over speed (the fused fast path is glimmer/ with kernels.cu).
// Compiled by NVRTC as a module of its own; only the prelude (common.cuh) is shared with kernels.cu.
//
// Activations are row-major f32 [rows][cols]. The KV cache of a layer is f16
// [n_seq][cells][n_head_kv * head_dim], rows head-major, as muser-model's HostKv.

// Grid-stride loop over [0, n).
#define OPS_EACH(i, n) \
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long)gridDim.x * blockDim.x)

extern "C" __global__ void op_add(float* x, const float* y, long n) {
    pdl_wait();
    OPS_EACH(i, n) x[i] += y[i];
}

extern "C" __global__ void op_add_row(float* x, const float* b, long n, long cols) {
    pdl_wait();
    OPS_EACH(i, n) x[i] += b[i % cols];
}

extern "C" __global__ void op_mul_sigmoid(float* x, const float* g, long n) {
    pdl_wait();
    OPS_EACH(i, n) x[i] *= 1.f / (1.f + expf(-g[i]));
}

extern "C" __global__ void op_swiglu(float* g, const float* u, long n) {
    pdl_wait();
    OPS_EACH(i, n) {
        const float a = g[i];
        g[i] = a / (1.f + expf(-a)) * u[i];
    }
}

extern "C" __global__ void op_scale(float* x, float s, long n) {
    pdl_wait();
    OPS_EACH(i, n) x[i] *= s;
}

extern "C" __global__ void op_softcap(float* x, float cap, long n) {
    pdl_wait();
    const float inv = 1.f / cap;
    OPS_EACH(i, n) x[i] = tanhf(x[i] * inv) * cap;
}

extern "C" __global__ void op_to_bf16(const float* x, __nv_bfloat16* y, long n) {
    pdl_wait();
    OPS_EACH(i, n) y[i] = __float2bfloat16(x[i]);
}

// y[r] = x[rows[r]] for n = n_rows * cols values.
extern "C" __global__ void op_select_rows(const float* x, float* y, const int* rows, long cols, long n) {
    pdl_wait();
    OPS_EACH(i, n) {
        const long r = i / cols, c = i - r * cols;
        y[i] = x[(long)rows[r] * cols + c];
    }
}

// Rows of `xcols` widened to `ycols` with zeros (n = rows * ycols values).
extern "C" __global__ void op_pad_cols(const float* x, float* y, long xcols, long ycols, long n) {
    pdl_wait();
    OPS_EACH(i, n) {
        const long r = i / ycols, c = i - r * ycols;
        y[i] = c < xcols ? x[r * xcols + c] : 0.f;
    }
}

// One block per `group`-wide slice: y = x / sqrt(mean(x^2) + eps) (* w). x may equal y.
extern "C" __global__ void op_rms_norm(const float* x, float* y, const float* w, int group, float eps) {
    pdl_wait();
    __shared__ float sh[33];
    const long g = blockIdx.x;
    const float* xr = x + g * group;
    float* yr = y + g * group;
    float ss = 0.f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        const float v = xr[i];
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float sc = 1.f / sqrtf(ss / (float)group + eps);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        const float v = xr[i] * sc;
        yr[i] = w ? v * w[i] : v;
    }
}

// RoPE in place, one thread per rotated pair. Pair j of a head turns by
// pos * theta_scale^j (theta_scale = base^(-2/n_rot)); NORM mode rotates (2j, 2j+1), NEOX mode
// (j, j + n_rot/2). Values past n_rot are left alone.
extern "C" __global__ void op_rope(float* x, long rows, int cols, int head_dim, int n_rot, const int* pos,
                                   float theta_scale, int neox) {
    pdl_wait();
    const int n_head = cols / head_dim, half = n_rot / 2;
    const long total = rows * n_head * half;
    OPS_EACH(i, total) {
        const int j = (int)(i % half);
        const long rh = i / half;
        const int h = (int)(rh % n_head);
        const long r = rh / n_head;
        const float theta = (float)pos[r] * powf(theta_scale, (float)j);
        const float c = cosf(theta), s = sinf(theta);
        float* hp = x + r * cols + (long)h * head_dim;
        const int a = neox ? j : 2 * j, b = neox ? j + half : 2 * j + 1;
        const float x0 = hp[a], x1 = hp[b];
        hp[a] = x0 * c - x1 * s;
        hp[b] = x0 * s + x1 * c;
    }
}

// K and V of n_tok tokens (f32 [n_tok][row]) rounded to f16 into cache rows dst_row[t].
extern "C" __global__ void op_kv_store(const float* k, const float* v, __half* kc, __half* vc, const int* dst_row,
                                       int row, long n_tok) {
    pdl_wait();
    OPS_EACH(i, n_tok * row) {
        const long t = i / row, e = i - t * row;
        const long d = (long)dst_row[t] * row + e;
        kc[d] = __float2half_rn(k[i]);
        vc[d] = __float2half_rn(v[i]);
    }
}

#define OPS_ATT_WARPS 4
#define OPS_ATT_PER_LANE 16  // head_dim <= 512

// Attention of one (head, token) per block of OPS_ATT_WARPS warps, online softmax in f32.
// meta holds four int arrays of n_tok entries: kv_base (first cache row of the token's
// sequence), cp_off (offset of its cell positions in cpos), n_kv (cells to visit), qpos.
// Cell c is visible iff its position p satisfies 0 <= p <= qpos and, when n_swa > 0,
// qpos - p < n_swa. Warps take cells in turn and merge at the end. GQA: head h reads KV head
// h / (n_head / n_head_kv).
// Whether a cell at position p (-1: empty) is visible to a query at qpos: causal, and within
// the sliding window when n_swa > 0.
__device__ __forceinline__ bool att_visible(int p, int qpos, int n_swa) {
    return p >= 0 && p <= qpos && (n_swa == 0 || qpos - p < n_swa);
}

// q·k over the warp (lane holds dims lane + 32i of q in qr), unscaled.
__device__ __forceinline__ float att_score(const float* qr, const __half* kr, int hd, int lane) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < OPS_ATT_PER_LANE; i++) {
        const int d = lane + 32 * i;
        if (d < hd) s += qr[i] * __half2float(kr[d]);
    }
    return warp_sum(s);
}

// With `seq_rows` (exact precision) a token whose sequence has fewer than 64 query rows in the
// batch takes the CPU's one-chunk numerics instead: one warp visits the cells in index order,
// Q rounded to f16, the V accumulator kept in f16 (rounded after every scale and
// multiply-add), the result scaled by 1/sum, as ggml's CPU flash attention does for such rows.
extern "C" __global__ void op_attention(const float* q, const __half* kc, const __half* vc, float* out,
                                        const int* meta, const int* cpos, long n_tok, int n_head, int n_head_kv,
                                        int hd, float scale, int n_swa, const int* seq_rows) {
    pdl_wait();
    __shared__ float sm_m[OPS_ATT_WARPS], sm_l[OPS_ATT_WARPS];
    __shared__ float sm_acc[OPS_ATT_WARPS * 32 * OPS_ATT_PER_LANE];
    const long t = blockIdx.y;
    const int h = blockIdx.x;
    const int kv_base = meta[t], cp_off = meta[n_tok + t], n_kv = meta[2 * n_tok + t], qpos = meta[3 * n_tok + t];
    const int hkv = h / (n_head / n_head_kv);
    const long row = (long)n_head_kv * hd;
    const float* qh = q + (t * n_head + h) * (long)hd;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (seq_rows && seq_rows[t] < 64) {
        if (warp != 0) return;
        float qr[OPS_ATT_PER_LANE];
        __half acc[OPS_ATT_PER_LANE];
#pragma unroll
        for (int i = 0; i < OPS_ATT_PER_LANE; i++) {
            const int d = lane + 32 * i;
            qr[i] = d < hd ? __half2float(__float2half_rn(qh[d])) : 0.f;
            acc[i] = __float2half_rn(0.f);
        }
        float m = -INFINITY, l = 0.f;
        for (int c = 0; c < n_kv; c++) {
            if (!att_visible(cpos[cp_off + c], qpos, n_swa)) continue;
            const long off = ((long)kv_base + c) * row + (long)hkv * hd;
            const __half* vr = vc + off;
            const float s = att_score(qr, kc + off, hd, lane) * scale;
            float ms = 1.f, vs = 1.f;
            if (s > m) {
                ms = expf(m - s);
                m = s;
#pragma unroll
                for (int i = 0; i < OPS_ATT_PER_LANE; i++) acc[i] = __float2half_rn(__half2float(acc[i]) * ms);
            } else {
                vs = expf(s - m);
            }
#pragma unroll
            for (int i = 0; i < OPS_ATT_PER_LANE; i++) {
                const int d = lane + 32 * i;
                if (d < hd) acc[i] = __float2half_rn(__fmaf_rn(__half2float(vr[d]), vs, __half2float(acc[i])));
            }
            l = l * ms + vs;
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int i = 0; i < OPS_ATT_PER_LANE; i++) {
            const int d = lane + 32 * i;
            if (d < hd) out[(t * n_head + h) * (long)hd + d] = __half2float(acc[i]) * inv;
        }
        return;
    }

    float qr[OPS_ATT_PER_LANE], acc[OPS_ATT_PER_LANE];
#pragma unroll
    for (int i = 0; i < OPS_ATT_PER_LANE; i++) {
        const int d = lane + 32 * i;
        qr[i] = d < hd ? qh[d] : 0.f;
        acc[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int c = warp; c < n_kv; c += OPS_ATT_WARPS) {
        if (!att_visible(cpos[cp_off + c], qpos, n_swa)) continue;
        const long off = ((long)kv_base + c) * row + (long)hkv * hd;
        const __half* vr = vc + off;
        const float s = att_score(qr, kc + off, hd, lane) * scale;
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn);
        const float pw = expf(s - mn);
        l = l * corr + pw;
#pragma unroll
        for (int i = 0; i < OPS_ATT_PER_LANE; i++) {
            const int d = lane + 32 * i;
            if (d < hd) acc[i] = acc[i] * corr + pw * __half2float(vr[d]);
        }
        m = mn;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < OPS_ATT_PER_LANE; i++) {
        const int d = lane + 32 * i;
        if (d < hd) sm_acc[warp * hd + d] = acc[i];
    }
    __syncthreads();
    float big = -INFINITY;
    for (int w = 0; w < OPS_ATT_WARPS; w++)
        if (sm_l[w] > 0.f) big = fmaxf(big, sm_m[w]);
    float total = 0.f;
    for (int w = 0; w < OPS_ATT_WARPS; w++)
        if (sm_l[w] > 0.f) total += sm_l[w] * expf(sm_m[w] - big);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < OPS_ATT_WARPS; w++)
            if (sm_l[w] > 0.f) o += sm_acc[w * hd + d] * expf(sm_m[w] - big);
        out[(t * n_head + h) * (long)hd + d] = total > 0.f ? o / total : 0.f;
    }
}

// The CPU engine's activation rounding before a matmul, in place (exact mode): each row of
// x [rows][cols] becomes the values the CPU's quantized activations stand for, so that a
// float product with the exactly dequantized weights gives the CPU's sums up to their order.
// kind: 1 F16, 2 BF16 (round to nearest even), 3 Q8_0 and 4 Q8_1 (ggml's AVX quantizer:
// d = amax/127 kept as f16, q = round-half-even(x·127/amax)), 5 Q8_K (the reference quantizer:
// iscale = -127/max of the first largest magnitude, q = nearest_int(iscale·x) ≤ 127, d =
// 1/iscale as f32). One thread per block of 32 (256 for Q8_K) values; cols a multiple of it.
// With `sums` (kind 4), each block's stored sum f16(d·Σq) goes to sums [rows][cols / 32]: the
// Q4_1/Q5_1 dot product multiplies it by the weight block's min.
extern "C" __global__ void op_fakequant(float* x, long rows, long cols, int kind, float* sums) {
    pdl_wait();
    if (kind == 1 || kind == 2) {
        OPS_EACH(i, rows * cols) {
            x[i] = kind == 1 ? __half2float(__float2half_rn(x[i])) : __bfloat162float(__float2bfloat16_rn(x[i]));
        }
        return;
    }
    const long qk = kind == 5 ? 256 : 32;
    OPS_EACH(blk, rows * (cols / qk)) {
        float* v = x + blk * qk;
        float amax = 0.f, maxv = 0.f;
        for (int l = 0; l < qk; l++) {
            const float a = fabsf(v[l]);
            if (a > amax) {
                amax = a;
                maxv = v[l];
            }
        }
        if (kind == 5) {
            if (amax == 0.f) {
                for (int l = 0; l < qk; l++) v[l] = 0.f;
                continue;
            }
            const float iscale = -127.f / maxv;
            const float d = 1.f / iscale;
            for (int l = 0; l < qk; l++) v[l] = d * (float)min(__float2int_rn(iscale * v[l]), 127);
        } else {
            const float d32 = amax / 127.f;
            const float d = __half2float(__float2half_rn(d32));
            const float id = amax != 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int l = 0; l < qk; l++) {
                const int q = max(-128, min(127, __float2int_rn(v[l] * id)));
                sum += q;
                v[l] = d * (float)q;
            }
            if (sums) sums[blk] = __half2float(__float2half_rn(d32 * (float)sum));
        }
    }
}
