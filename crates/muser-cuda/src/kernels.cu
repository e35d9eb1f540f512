// Muser CUDA kernels, compiled at start-up by NVRTC for the device's architecture.
//
// Layouts (device side, see weights.rs):
//   Q4_K   ggml blocks as in the file (144 bytes / 256 values, 16-byte aligned).
//   Q6_K   ggml blocks padded to 224 bytes (ql 128 | qh 64 | scales 16 | d f16 | pad 14).
//   Q8_0   split: int8 quants [rows][cols], then f16 scales [rows][cols/32].
//   NVFP4  split: packed nibbles [rows][cols/2] (each 16-value group in value order: byte j
//          holds values 2j low and 2j+1 high), then UE4M3 scales [rows][cols/16].
//   F16 / BF16 / F32 plain row-major.
// Activations for the integer GEMV paths are quantized per 16 values:
//   xq int8 [B][n], xd f32 [B][n/16] (scale), xs f32 [B][n/16] (scale * sum of quants).

// The shared prelude (common.cuh: types, warp and block sums, programmatic-launch waits) is
// prepended by runtime.rs.

__device__ __forceinline__ float h2f(u16 bits) { return __half2float(__ushort_as_half(bits)); }


// Quantizes a group of 16 activations to int8 with one scale (max |v| / 127), writing 16 bytes,
// the scale and scale * sum, spread over 16 / N consecutive lanes with N values each (v): the
// group's maximum and integer sum are exact across lanes, so the bytes and scales do not depend
// on N. With N < 16 every lane of the warp must call it (shuffles); `act` false marks lanes with
// no group. The lane holding the group's first values (first) writes the scale and scale * sum.
template <int N>
__device__ __forceinline__ void quant_part(const float* v, bool act, bool first, i8* q, float* qd, float* qs) {
    static_assert(N == 4 || N == 8 || N == 16, "4, 8 or 16 values per lane");
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < N; i++) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 1; o < 16 / N; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, o));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    u32 w[N / 4];
#pragma unroll
    for (int k = 0; k < N / 4; k++) {
        u32 word = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int qi = __float2int_rn(v[4 * k + i] * id);
            sum += qi;
            word |= ((u32)(qi & 0xff)) << (8 * i);
        }
        w[k] = word;
    }
#pragma unroll
    for (int o = 1; o < 16 / N; o <<= 1) sum += __shfl_xor_sync(FULL, sum, o);
    if (!act) return;
    if constexpr (N == 4) {
        *(u32*)q = w[0];
    } else if constexpr (N == 8) {
        *(uint2*)q = make_uint2(w[0], w[1]);
    } else {
        *(uint4*)q = make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (first) {
        *qd = d;
        *qs = d * (float)sum;
    }
}

// One thread's whole group (callable from divergent code: no shuffles with N = 16).
__device__ __forceinline__ void quant16(const float* v, i8* q, float* qd, float* qs) {
    quant_part<16>(v, true, true, q, qd, qs);
}

// ---------------------------------------------------------------------------------------------
// Dequantization of 16 consecutive values (group g of a row) from the device layouts.

__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// UE4M3 scale, halved (fp4_lut8 decodes E2M1 to the doubled table). 0 and 0x7F decode to 0.
__device__ __forceinline__ float ue4m3_half(u32 x) {
    if (x == 0 || x == 0x7F) return 0.f;
    const int e = (x >> 3) & 15, m = x & 7;
    const float raw = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + (float)m / 8.f, e - 7);
    return raw * 0.5f;
}

// Two UE4M3 scales (bytes 0 and 1 of `two`) as ue4m3_half gives them, bit for bit: one
// hardware conversion of the pair to f16 (sign bits cleared: the scales are unsigned), exact
// for every finite E4M3 value, the NaN code 0x7F mapped to 0, then halved (exact). The GEMV's
// per-chunk scale decode, where ue4m3_half's branches and ldexpf made NVFP4 decode issue-bound.
__device__ __forceinline__ float2 ue4m3x2_half(u32 two) {
    const u32 v = two & 0x7f7fu;
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)v));
    const float2 f = __half22float2(*(const __half2*)&h);
    return make_float2((v & 0xffu) == 0x7fu ? 0.f : 0.5f * f.x, (v >> 8) == 0x7fu ? 0.f : 0.5f * f.y);
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// The eight E2M1 values of one packed word (nibble i, low first), as int8 of the doubled table
// (0, 1, 2, 3, 4, 6, 8, 12 and their negatives): nibbles 0-3 in lo, 4-7 in hi. Each half takes
// one byte permute over the positive table and one over the negative table, selected by the
// three magnitude bits of the four nibbles at once, and a third permute in sign-replicate mode
// that turns the four sign bits into byte masks (nibble 2k's sign is the top bit of byte k of
// w << 4, nibble 2k+1's that of byte k of w).
__device__ __forceinline__ void fp4_lut8(u32 w, int& lo, int& hi) {
    const u32 t0 = 0x03020100u, t1 = 0x0C080604u, t2 = 0xFDFEFF00u, t3 = 0xF4F8FAFCu;
    const u32 w4 = w << 4;
    const u32 s0 = w & 0x7777u, s1 = (w >> 16) & 0x7777u;
    const u32 m0 = prmt(w, w4, 0x9D8Cu), m1 = prmt(w, w4, 0xBFAEu);
    lo = (int)((prmt(t0, t1, s0) & ~m0) | (prmt(t2, t3, s0) & m0));
    hi = (int)((prmt(t0, t1, s1) & ~m1) | (prmt(t2, t3, s1) & m1));
}

// ty: 0 F32, 1 F16, 8 Q8_0, 12 Q4_K, 14 Q6_K, 30 BF16, 40 NVFP4 (ggml ids).
__device__ void dq16(int ty, const u8* W, const u8* S, long cols, long row, long g, float* o) {
    if (ty == 12) {
        const long s = g >> 4;
        const int e = (int)(g & 15) * 16, c = e >> 6, r = e & 63;
        const u8* blk = W + (row * (cols >> 8) + s) * 144;
        const float d = h2f(*(const u16*)blk), dmin = h2f(*(const u16*)(blk + 2));
        int sc, m;
        scale_min_k4(2 * c + (r >= 32), blk + 4, &sc, &m);
        const u8* qs = blk + 16 + 32 * c + (r & 31);
        const float a = d * (float)sc, b = dmin * (float)m;
#pragma unroll
        for (int t = 0; t < 16; t++) o[t] = a * (float)(r < 32 ? (qs[t] & 15) : (qs[t] >> 4)) - b;
    } else if (ty == 14) {
        const long s = g >> 4;
        const int e = (int)(g & 15) * 16, n = e >> 7, r = e & 127, quad = r >> 5, l0 = r & 31;
        const u8* blk = W + (row * (cols >> 8) + s) * 224;
        const u8* ql = blk + 64 * n + (quad & 1) * 32 + l0;
        const u8* qh = blk + 128 + 32 * n + l0;
        const float d = h2f(*(const u16*)(blk + 208));
        const float a = d * (float)((const i8*)(blk + 192))[8 * n + l0 / 16 + 2 * quad];
#pragma unroll
        for (int t = 0; t < 16; t++) {
            const int lo = quad < 2 ? (ql[t] & 15) : (ql[t] >> 4);
            const int q = (lo | (((qh[t] >> (2 * quad)) & 3) << 4)) - 32;
            o[t] = a * (float)q;
        }
    } else if (ty == 8) {
        const i8* qs = (const i8*)W + row * cols + 16 * g;
        const float d = h2f(((const u16*)S)[row * (cols / 32) + g / 2]);
#pragma unroll
        for (int t = 0; t < 16; t++) o[t] = d * (float)qs[t];
    } else if (ty == 40) {
        // One 8-byte load and the GEMV's permute decoding (a table lookup per value, each lane
        // at its own index, serializes on the constant cache): values 4k .. 4k+3 in q[k].
        const uint2 w = *(const uint2*)(W + row * (cols / 2) + 8 * g);
        const float d = ue4m3_half(S[row * (cols / 16) + g]);
        int q[4];
        fp4_lut8(w.x, q[0], q[1]);
        fp4_lut8(w.y, q[2], q[3]);
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int i = 0; i < 4; i++) o[4 * k + i] = d * (float)(i8)((q[k] >> (8 * i)) & 0xff);
    } else if (ty == 1) {
        const u16* p = (const u16*)W + row * cols + 16 * g;
#pragma unroll
        for (int t = 0; t < 16; t++) o[t] = h2f(p[t]);
    } else if (ty == 30) {
        const u16* p = (const u16*)W + row * cols + 16 * g;
#pragma unroll
        for (int t = 0; t < 16; t++) o[t] = __uint_as_float(((u32)p[t]) << 16);
    } else {
        const float* p = (const float*)W + row * cols + 16 * g;
#pragma unroll
        for (int t = 0; t < 16; t++) o[t] = p[t];
    }
}

// Whole matrix to bf16 [rows][cols] (prefill GEMM operand). One thread per 16 values.
extern "C" __global__ void dequant_bf16(int ty, const u8* W, const u8* S, long rows, long cols, bf16* out) {
    pdl_trigger();
    pdl_wait();
    const long ng = cols / 16;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * ng) return;
    const long row = i / ng, g = i % ng;
    float v[16];
    dq16(ty, W, S, cols, row, g, v);
    __align__(16) bf16 b[16];
#pragma unroll
    for (int t = 0; t < 16; t++) b[t] = __float2bfloat16(v[t]);
    uint4* dst = (uint4*)(out + row * cols + 16 * g);
    dst[0] = ((uint4*)b)[0];
    dst[1] = ((uint4*)b)[1];
}

// Embedding rows for T tokens into x f32 [T][cols]. grid (ceil(cols/16/128), T).
extern "C" __global__ void get_rows(int ty, const u8* W, const u8* S, long cols, const int* tokens, float* x) {
    pdl_trigger();
    pdl_wait();
    const long g = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (g >= cols / 16) return;
    float v[16];
    dq16(ty, W, S, cols, tokens[t], g, v);
#pragma unroll
    for (int k = 0; k < 16; k++) x[(long)t * cols + 16 * g + k] = v[k];
}

// ---------------------------------------------------------------------------------------------
// Decode GEMV: y[b][row] = W[row] . x[b]. One warp per row, 4 rows per 128-thread block.

__device__ __forceinline__ int dot16(uint4 w, int4 x, int acc) {
    acc = __dp4a((int)w.x, x.x, acc);
    acc = __dp4a((int)w.y, x.y, acc);
    acc = __dp4a((int)w.z, x.z, acc);
    acc = __dp4a((int)w.w, x.w, acc);
    return acc;
}

// The same over unsigned weight bytes (dp4a.u32.s32): a Q4_K word masked to its high
// nibbles in place is 16x their values, with no shift.
__device__ __forceinline__ int dot16u(uint4 w, int4 x, int acc) {
    asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(acc) : "r"(w.x), "r"(x.x));
    asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(acc) : "r"(w.y), "r"(x.y));
    asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(acc) : "r"(w.z), "r"(x.z));
    asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(acc) : "r"(w.w), "r"(x.w));
    return acc;
}

__device__ __forceinline__ uint4 and4(uint4 v, u32 m) { return make_uint4(v.x & m, v.y & m, v.z & m, v.w & m); }
__device__ __forceinline__ uint4 shr4(uint4 v, int s) { return make_uint4(v.x >> s, v.y >> s, v.z >> s, v.w >> s); }

struct Act {
    const i8* q;
    const float* d;
    const float* s;
    long n;
};

// Byte k (0..15) of a 16-byte vector, without indexing a local array.
__device__ __forceinline__ int byte_of(uint4 v, int k) {
    const u32 w = k < 4 ? v.x : k < 8 ? v.y : k < 12 ? v.z : v.w;
    return (int)((w >> (8 * (k & 3))) & 0xffu);
}

// Weight bytes are read once: keep them out of L1 so the activations stay there. L = 1 also
// asks L2 to fetch the whole 256-byte line pair on a miss (the neighbours are read next).
template <int L = 0>
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    if constexpr (L == 1) {
        asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
            : "l"(p));
    } else {
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
            : "l"(p));
    }
    return r;
}

// One lane's share of a Q4_K super-block (header hd, 16 bytes of quants qv of chunk c: the
// low nibbles are sub-block 2c, the high ones 2c + 1; sh = 16 (c & 1), clo = c < 2) against B
// activation rows: xa, xb their 16 int8 values under each half, d0/s0v and d2/s2v the two
// groups' scale and scale * sum, d2 already divided by 16 (the high nibbles are summed in place
// by dot16u, 16x too large; the power of two moves into the scale exactly, so the product and
// every sum after it are bit-identical to the shifted form).
//
// (float)v for v < 2^23, on the FMA pipe (the conversion unit has a sixteenth of its rate): v
// in the mantissa of 2^23, where one unit is 1.0; the same bits as the conversion.
__device__ __forceinline__ float u2f_small(u32 v) { return __int_as_float(0x4B000000u | v) - 8388608.f; }
// A lane's scales of a super-block: its header's d and dmin, and the 6-bit scales and mins of
// the two sub-blocks of its chunk.
struct Q4kScales {
    float d, dmin, m1, m2;
    int sc1, sc2;
};
__device__ __forceinline__ Q4kScales q4k_scales(uint4 hd, int sh, bool clo) {
    Q4kScales k;
    k.d = h2f(hd.x & 0xffff);
    k.dmin = h2f(hd.x >> 16);
    // Scales and mins of sub-blocks 2c and 2c+1 as byte pairs (get_scale_min_k4).
    const u32 Y = hd.y >> sh, Z = hd.z >> sh, Wd = hd.w >> sh;
    const u32 aux0 = clo ? (Y & 0x3f3fu) : ((Wd & 0x0f0fu) | ((Y & 0xc0c0u) >> 2));
    const u32 aux1 = clo ? (Z & 0x3f3fu) : (((Wd >> 4) & 0x0f0fu) | ((Z & 0xc0c0u) >> 2));
    k.sc1 = aux0 & 0xff;
    k.sc2 = (aux0 >> 8) & 0xff;
    k.m1 = u2f_small(aux1 & 0xff);
    k.m2 = u2f_small((aux1 >> 8) & 0xff);
    return k;
}

// One term of a lane for one activation row: fa and fb the integer sums of its two groups
// times their 6-bit scales, as floats (fb 16x too large, d2 16x too small: see above). Every
// Q4_K GEMV adds its terms with this one expression, so the float rounding (and the compiler's
// FMA contraction of it) is the same in each.
__device__ __forceinline__ void q4k_term(const Q4kScales& k, float fa, float fb, float d0, float d2, float s0v,
                                         float s2v, float& acc) {
    acc += k.d * (d0 * fa + d2 * fb) - k.dmin * (k.m1 * s0v + k.m2 * s2v);
}

// The lane's term for B activation rows, given its scales (q4k_scales) and quants.
template <int B>
__device__ __forceinline__ void q4k_terms(const Q4kScales& k, uint4 qv, const int4* xa, const int4* xb,
                                          const float* d0, const float* d2, const float* s0v, const float* s2v,
                                          float* acc) {
    const uint4 lo = and4(qv, 0x0F0F0F0Fu), hi = and4(qv, 0xF0F0F0F0u);
#pragma unroll
    for (int b = 0; b < B; b++) {
        const int sa = dot16(lo, xa[b], 0) * k.sc1, sb = dot16u(hi, xb[b], 0) * k.sc2;
        q4k_term(k, (float)sa, (float)sb, d0[b], d2[b], s0v[b], s2v[b], acc[b]);
    }
}

template <int B>
__device__ __forceinline__ void q4k_lane_term(uint4 hd, uint4 qv, const int4* xa, const int4* xb, const float* d0,
                                              const float* d2, const float* s0v, const float* s2v, int sh, bool clo,
                                              float* acc) {
    q4k_terms<B>(q4k_scales(hd, sh, clo), qv, xa, xb, d0, d2, s0v, s2v, acc);
}

// The end of every Q4_K GEMV: each lane's partial sums of RPW rows x NB sequences summed over
// its warp, then (WPR > 1) over the row's WPR warps in warp order, written to
// y[(b0 + b) * ldy + row + r] for b0 + b < nb. One statement of the reduction, so a batched
// step sums each sequence exactly as the one-sequence kernel does. Every thread of the block
// calls it (it holds the block's barriers when WPR > 1).
template <int WPR, int RPW, int NB>
__device__ __forceinline__ void q4k_store(const float (&acc)[RPW][NB], float (*red)[RPW * NB], int warp, int lane,
                                          bool valid, long row, long rows, int b0, int nb, float* __restrict__ y,
                                          long ldy) {
    if constexpr (WPR == 1) {
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int b = 0; b < NB; b++) {
                const float v = warp_sum(acc[r][b]);
                if (row + r < rows && b0 + b < nb && lane == 0) y[(b0 + b) * ldy + row + r] = v;
            }
    } else {
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int b = 0; b < NB; b++) {
                const float v = warp_sum(acc[r][b]);
                if (lane == 0) red[warp][r * NB + b] = v;
            }
        __syncthreads();
        if (valid && warp % WPR == 0 && lane < RPW * NB) {
            const int r = lane / NB, b = lane % NB;
            float v = 0.f;
#pragma unroll
            for (int k = 0; k < WPR; k++) v += red[warp + k][lane];
            if (row + r < rows && b0 + b < nb) y[(b0 + b) * ldy + row + r] = v;
        }
        __syncthreads();
    }
}

// Q4_K GEMV. A group of 8 lanes works on one super-block (lane j: 16 bytes of quants, chunk
// c = j/2, half h = j%2); a row is shared by WPR warps of the 4-warp block; each lane keeps
// Q4K_UNROLL super-blocks of loads in flight. Strides are compile-time constants so the loads
// use immediate offsets from a few running pointers.
#define Q4K_UNROLL 4
// Blocks loop over row blocks (stride gridDim.x), so the host may launch fewer blocks than row
// blocks (a persistent grid sized to the GPU); with one block per row block it runs once.
// RPW rows per warp (group of WPR warps) share each activation load: Q4_K weights are 4.5 bits
// and int8 activations 8, so with one row the activation reads outweigh the weight reads.
template <int B, int WPR, int U = Q4K_UNROLL, int L = 0, int RPW = 1>
__device__ void gemv_q4k(const u8* __restrict__ W, long rows, long cols, Act x, float* __restrict__ y, long ldy) {
    constexpr int STEP = 4 * WPR;
    constexpr int RPB = 4 / WPR * RPW;
    __shared__ float red[WPR > 1 ? 4 : 1][RPW * B];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nsb = (int)(cols >> 8);
    const long nblk = (rows + RPB - 1) / RPB;
    const int j = lane & 7, c = j >> 1, h = j & 1;
    const int s_first = (warp % WPR) * 4 + (lane >> 3);
    const int ga0 = s_first * 16 + 4 * c + h;
    const long xn = x.n, gn = x.n / 16;
    const int sh = 16 * (c & 1);
    const bool clo = c < 2;
    const long rstride = (long)nsb * 144;
    bool waited = false;
    for (long blk = blockIdx.x; blk < nblk; blk += gridDim.x) {
        const long row = blk * RPB + (warp / WPR) * RPW;
        const bool valid = row < rows;
        const u8* wh = W + ((valid ? row : 0) * nsb + s_first) * 144;
        const u8* wq = wh + 16 + 16 * j;
        const i8* xq = x.q + ga0 * 16;
        const float* xd = x.d + ga0;
        const float* xs = x.s + ga0;
        float acc[RPW][B];
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int b = 0; b < B; b++) acc[r][b] = 0.f;
        for (int s0 = s_first; valid && s0 < nsb; s0 += STEP * U) {
            uint4 hv[RPW][U], qv[RPW][U];
#pragma unroll
            for (int r = 0; r < RPW; r++) {
#pragma unroll
                for (int u = 0; u < U; u++) {
                    hv[r][u] = make_uint4(0, 0, 0, 0);
                    qv[r][u] = hv[r][u];
                    if (s0 + STEP * u < nsb && row + r < rows) {
                        hv[r][u] = ld_stream<L>(wh + r * rstride + STEP * u * 144);
                        qv[r][u] = ld_stream<L>(wq + r * rstride + STEP * u * 144);
                    }
                }
            }
            // Weights do not depend on the previous kernel: wait for it only after the first loads.
            if (!waited) {
                pdl_wait();
                waited = true;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (s0 + STEP * u < nsb) {
                    int4 xa[B], xb[B];
                    float d0[B], d2[B], s0v[B], s2v[B];
#pragma unroll
                    for (int b = 0; b < B; b++) {
                        const i8* xp = xq + b * xn + STEP * u * 256;
                        xa[b] = *(const int4*)xp;
                        xb[b] = *(const int4*)(xp + 32);
                        const long go = b * gn + STEP * u * 16;
                        d0[b] = xd[go];
                        d2[b] = xd[go + 2] * 0.0625f;  // q4k_lane_term's high-nibble scale
                        s0v[b] = xs[go];
                        s2v[b] = xs[go + 2];
                    }
#pragma unroll
                    for (int r = 0; r < RPW; r++) q4k_lane_term<B>(hv[r][u], qv[r][u], xa, xb, d0, d2, s0v, s2v, sh, clo, acc[r]);
                }
            }
            wh += STEP * U * 144;
            wq += STEP * U * 144;
            xq += STEP * U * 256;
            xd += STEP * U * 16;
            xs += STEP * U * 16;
        }
        q4k_store<WPR, RPW, B>(acc, red, warp, lane, valid, row, rows, 0, B, y, ldy);
    }
}

template <int B>
__device__ __forceinline__ void q6k_step(const u8* blk, long s, int j, Act x, float* acc) {
    const int n = j >> 2, a = (j >> 1) & 1, bb = j & 1;
    const uint4 ql = __ldg((const uint4*)(blk + 64 * n + 32 * a + 16 * bb));
    const uint4 qh = __ldg((const uint4*)(blk + 128 + 32 * n + 16 * bb));
    const uint4 scv = __ldg((const uint4*)(blk + 192));
    const float d = h2f(*(const u16*)(blk + 208));
    const int sl2 = 2 * a;
    const uint4 lo2 = make_uint4((ql.x & 0x0F0F0F0Fu) | (((qh.x >> sl2) & 0x03030303u) << 4),
                                 (ql.y & 0x0F0F0F0Fu) | (((qh.y >> sl2) & 0x03030303u) << 4),
                                 (ql.z & 0x0F0F0F0Fu) | (((qh.z >> sl2) & 0x03030303u) << 4),
                                 (ql.w & 0x0F0F0F0Fu) | (((qh.w >> sl2) & 0x03030303u) << 4));
    const uint4 hn = and4(shr4(ql, 4), 0x0F0F0F0Fu);
    const int sh = 2 * a + 4;
    const uint4 hi = make_uint4(hn.x | (((qh.x >> sh) & 0x03030303u) << 4), hn.y | (((qh.y >> sh) & 0x03030303u) << 4),
                                hn.z | (((qh.z >> sh) & 0x03030303u) << 4), hn.w | (((qh.w >> sh) & 0x03030303u) << 4));
    const int il = 8 * n + 2 * a + bb, ih = il + 4;
    const float scl = d * (float)(i8)byte_of(scv, il), sch = d * (float)(i8)byte_of(scv, ih);
    const long gl = s * 16 + il, gh = s * 16 + ih;
#pragma unroll
    for (int b = 0; b < B; b++) {
        const long go = b * (x.n / 16);
        const int4 xl = *(const int4*)(x.q + b * x.n + gl * 16);
        const int4 xh = *(const int4*)(x.q + b * x.n + gh * 16);
        const int sl = dot16(lo2, xl, 0), shh = dot16(hi, xh, 0);
        acc[b] += scl * (x.d[go + gl] * (float)sl - 32.f * x.s[go + gl]) +
                  sch * (x.d[go + gh] * (float)shh - 32.f * x.s[go + gh]);
    }
}

template <int B>
__device__ void gemv_q6k(const u8* __restrict__ W, long rows, long cols, Act x, float* __restrict__ y, long ldy) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const long nsb = cols >> 8;
    const u8* wr = W + row * nsb * 224;
    const int j = lane & 7;
    float acc[B];
#pragma unroll
    for (int b = 0; b < B; b++) acc[b] = 0.f;
    for (long s = lane >> 3; s < nsb; s += 4) q6k_step<B>(wr + s * 224, s, j, x, acc);
#pragma unroll
    for (int b = 0; b < B; b++) {
        const float v = warp_sum(acc[b]);
        if (lane == 0) y[b * ldy + row] = v;
    }
}

template <int B>
__device__ void gemv_q80(const u8* __restrict__ W, const u8* __restrict__ S, long rows, long cols, Act x,
                         float* __restrict__ y, long ldy) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const u8* wr = W + row * cols;
    const u16* sr = (const u16*)S + row * (cols / 32);
    float acc[B];
#pragma unroll
    for (int b = 0; b < B; b++) acc[b] = 0.f;
    for (long e = 16 * lane; e < cols; e += 512) {
        const uint4 w = __ldg((const uint4*)(wr + e));
        const float d = h2f(sr[e / 32]);
        const long g = e / 16;
#pragma unroll
        for (int b = 0; b < B; b++) {
            const int4 xv = *(const int4*)(x.q + b * x.n + e);
            acc[b] += d * x.d[b * (x.n / 16) + g] * (float)dot16(w, xv, 0);
        }
    }
#pragma unroll
    for (int b = 0; b < B; b++) {
        const float v = warp_sum(acc[b]);
        if (lane == 0) y[b * ldy + row] = v;
    }
}

// Sum over 16 values: packed words wa, wb (the device order: nibble i of the pair is value i)
// against the int8 activations xi[0..4) (values 0-3, 4-7, 8-11, 12-15).
__device__ __forceinline__ int fp4_dot16(u32 wa, u32 wb, const int* xi) {
    int a0, a1, b0, b1;
    fp4_lut8(wa, a0, a1);
    fp4_lut8(wb, b0, b1);
    int s = __dp4a(a0, xi[0], 0);
    s = __dp4a(a1, xi[1], s);
    s = __dp4a(b0, xi[2], s);
    return __dp4a(b1, xi[3], s);
}

// NVFP4 GEMV: RPW rows per warp, lane chunks of 32 values (16 bytes of nibbles and two scale
// bytes per row), U chunks of loads in flight per lane and row, issued before waiting for the
// previous kernel. The rows of a warp share each activation load and interleave. The integer
// sums are exact and each row sums its chunks in the same order for every shape, so the shapes
// give bit-identical results.
template <int B, int RPW, int U>
__device__ void gemv_nvfp4(const u8* __restrict__ W, const u8* __restrict__ S, long rows, long cols, Act x,
                           float* __restrict__ y, long ldy) {
    const int lane = threadIdx.x & 31;
    const long row0 = ((long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * RPW;
    if (row0 >= rows) return;
    const int nr = (int)min((long)RPW, rows - row0);
    float acc[RPW][B];
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[r][b] = 0.f;
    bool waited = false;
    for (long e0 = 32 * lane; e0 < cols; e0 += 1024 * U) {
        uint4 wv[RPW][U];
        u32 sc[RPW][U];
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const u8* wr = W + (row0 + r) * (cols / 2);
            const u8* sr = S + (row0 + r) * (cols / 16);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const long e = e0 + 1024 * u;
                wv[r][u] = make_uint4(0, 0, 0, 0);
                sc[r][u] = 0;
                if (e < cols && r < nr) {
                    wv[r][u] = ld_stream<1>(wr + e / 2);
                    sc[r][u] = *(const u16*)(sr + e / 16);
                }
            }
        }
        if (!waited) {
            pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const long e = e0 + 1024 * u;
            if (e >= cols) continue;
            const long g = e / 16;
#pragma unroll
            for (int b = 0; b < B; b++) {
                const int4 x0 = *(const int4*)(x.q + b * x.n + e);
                const int4 x1 = *(const int4*)(x.q + b * x.n + e + 16);
                const float xd0 = x.d[b * (x.n / 16) + g], xd1 = x.d[b * (x.n / 16) + g + 1];
                // The weights' nibbles are in value order (layout::repack): the activation
                // words as stored line up with the decoded bytes.
                const int xi[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int r = 0; r < RPW; r++) {
                    const uint4 w = wv[r][u];
                    const float2 dd = ue4m3x2_half(sc[r][u]);
                    const float d0 = dd.x, d1 = dd.y;
                    const int s0 = fp4_dot16(w.x, w.y, xi);
                    const int s1 = fp4_dot16(w.z, w.w, xi + 4);
                    acc[r][b] += d0 * xd0 * (float)s0 + d1 * xd1 * (float)s1;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; r++) {
#pragma unroll
        for (int b = 0; b < B; b++) {
            const float v = warp_sum(acc[r][b]);
            if (lane == 0 && r < nr) y[b * ldy + row0 + r] = v;
        }
    }
}

// Float weights (F16, BF16, F32) against f32 activations xf [B][cols].
template <int B>
__device__ void gemv_float(int ty, const u8* __restrict__ W, long rows, long cols, const float* __restrict__ xf,
                           float* __restrict__ y, long ldy) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    float acc[B];
#pragma unroll
    for (int b = 0; b < B; b++) acc[b] = 0.f;
    for (long e = 8 * lane; e < cols; e += 256) {
        float w[8];
        if (ty == 1) {
            const uint4 v = __ldg((const uint4*)((const u16*)W + row * cols + e));
            const u16* h = (const u16*)&v;
#pragma unroll
            for (int t = 0; t < 8; t++) w[t] = h2f(h[t]);
        } else if (ty == 30) {
            const uint4 v = __ldg((const uint4*)((const u16*)W + row * cols + e));
            const u16* h = (const u16*)&v;
#pragma unroll
            for (int t = 0; t < 8; t++) w[t] = __uint_as_float(((u32)h[t]) << 16);
        } else {
            const float4 v0 = __ldg((const float4*)((const float*)W + row * cols + e));
            const float4 v1 = __ldg((const float4*)((const float*)W + row * cols + e + 4));
            w[0] = v0.x; w[1] = v0.y; w[2] = v0.z; w[3] = v0.w;
            w[4] = v1.x; w[5] = v1.y; w[6] = v1.z; w[7] = v1.w;
        }
#pragma unroll
        for (int b = 0; b < B; b++) {
            const float4 x0 = *(const float4*)(xf + b * cols + e);
            const float4 x1 = *(const float4*)(xf + b * cols + e + 4);
            acc[b] += w[0] * x0.x + w[1] * x0.y + w[2] * x0.z + w[3] * x0.w + w[4] * x1.x + w[5] * x1.y +
                      w[6] * x1.z + w[7] * x1.w;
        }
    }
#pragma unroll
    for (int b = 0; b < B; b++) {
        const float v = warp_sum(acc[b]);
        if (lane == 0) y[b * ldy + row] = v;
    }
}

#define GEMV_ENTRIES(B)                                                                                       \
    extern "C" __global__ void gemv_q6k_b##B(const u8* W, const u8* S, long rows, long cols, const i8* xq,    \
                                             const float* xd, const float* xs, const float* xf, float* y, long ldy) {   \
        Act x = {xq, xd, xs, cols};                                                                           \
        pdl_trigger(); pdl_wait(); gemv_q6k<B>(W, rows, cols, x, y, ldy);                                                                     \
    }                                                                                                         \
    extern "C" __global__ void gemv_q80_b##B(const u8* W, const u8* S, long rows, long cols, const i8* xq,    \
                                             const float* xd, const float* xs, const float* xf, float* y, long ldy) {   \
        Act x = {xq, xd, xs, cols};                                                                           \
        pdl_trigger(); pdl_wait(); gemv_q80<B>(W, S, rows, cols, x, y, ldy);                                                                  \
    }                                                                                                         \
    extern "C" __global__ void gemv_nvfp4_b##B(const u8* W, const u8* S, long rows, long cols, const i8* xq,  \
                                               const float* xd, const float* xs, const float* xf, float* y, long ldy) { \
        Act x = {xq, xd, xs, cols};                                                                           \
        pdl_trigger(); gemv_nvfp4<B, 2, 2>(W, S, rows, cols, x, y, ldy);                                                                \
    }                                                                                                         \
    extern "C" __global__ void gemv_f16_b##B(const u8* W, const u8* S, long rows, long cols, const i8* xq,    \
                                             const float* xd, const float* xs, const float* xf, float* y, long ldy) {   \
        pdl_trigger(); pdl_wait(); gemv_float<B>(1, W, rows, cols, xf, y, ldy);                                                               \
    }                                                                                                         \
    extern "C" __global__ void gemv_bf16_b##B(const u8* W, const u8* S, long rows, long cols, const i8* xq,   \
                                              const float* xd, const float* xs, const float* xf, float* y, long ldy) {  \
        pdl_trigger(); pdl_wait(); gemv_float<B>(30, W, rows, cols, xf, y, ldy);                                                              \
    }                                                                                                         \
    extern "C" __global__ void gemv_f32_b##B(const u8* W, const u8* S, long rows, long cols, const i8* xq,    \
                                             const float* xd, const float* xs, const float* xf, float* y, long ldy) {   \
        pdl_trigger(); pdl_wait(); gemv_float<B>(0, W, rows, cols, xf, y, ldy);                                                               \
    }

GEMV_ENTRIES(1)
GEMV_ENTRIES(2)
GEMV_ENTRIES(3)
GEMV_ENTRIES(4)

// Q4_K GEMV with an explicit shape: WPR warps per row, U super-blocks of loads in flight per
// lane group, load hint L2::256B, RPW rows per warp (the activations loaded once for all of
// them): 4 * RPW / WPR rows per 128-thread block. The plan (plan.rs) picks, per matrix, the
// shape that covers a row in one pass: two rows per warp for one sequence; four for batches
// 2-4, in the shape with as many warps per row (the same summation order), for the shapes
// whose loads still fit the registers.
#define Q4K_ENTRY(NAME, WPR, U, RPW, B)                                                                     \
    extern "C" __global__ void NAME(const u8* W, const u8* S, long rows, long cols, const i8* xq,          \
                                    const float* xd, const float* xs, const float* xf, float* y, long ldy) { \
        Act x = {xq, xd, xs, cols};                                                                         \
        pdl_trigger();                                                                                      \
        gemv_q4k<B, WPR, U, 1, RPW>(W, rows, cols, x, y, ldy);                                              \
    }
#define Q4K_R2(WPR, U) Q4K_ENTRY(gemv_q4k_w##WPR##u##U##l1r2_b1, WPR, U, 2, 1)
#define Q4K_R4(WPR, U)                                                                                      \
    Q4K_ENTRY(gemv_q4k_w##WPR##u##U##l1r4_b2, WPR, U, 4, 2)                                                 \
    Q4K_ENTRY(gemv_q4k_w##WPR##u##U##l1r4_b3, WPR, U, 4, 3)                                                 \
    Q4K_ENTRY(gemv_q4k_w##WPR##u##U##l1r4_b4, WPR, U, 4, 4)
Q4K_R2(1, 1)
Q4K_R2(1, 2)
Q4K_R2(1, 3)
Q4K_R2(1, 4)
Q4K_R2(1, 7)
Q4K_R2(2, 4)
Q4K_R2(4, 5)
Q4K_R4(1, 4)
Q4K_R4(2, 4)
Q4K_R4(4, 5)

// ---------------------------------------------------------------------------------------------
// Decode GEMVs for larger batches (5 up to the scratch's rows, MAX_GEMV_BATCH): nb sequences in
// chunks of SEQ_CHUNK, one kernel per weight type (and per Q4_K shape), the batch a run-time
// argument.
//
// Every sequence's result is bit-identical to its one-sequence GEMV's, by construction:
// - the integer dot products (dp4a over int8 activations) are exact in any order;
// - each (row, sequence) is summed in floats by the same lanes in the same order as the
//   one-sequence kernel of that matrix: lane group g of warp k of a row takes super-blocks
//   (k * 4 + g) + i * 4 * WPR for i = 0, 1, ... ascending (gemv_q4k's s_first and STEP, which
//   depend on WPR only, not on U, RPW or B), each term is q4k_terms's expression for one
//   sequence (q4k_lane_term is q4k_terms of q4k_scales), the warp's lanes are added by warp_sum and the WPR warps in ascending order
//   starting from 0.f, as in gemv_q4k. The host picks WPR as the one-sequence GEMV does
//   (plan.rs, `gemv`);
// - the other types loop over the sequences with their own kernels' device functions, whose
//   per-sequence sums do not depend on the batch template (one accumulator per sequence).
// The Q4_K kernel loads its row's first pass of super-blocks (U per lane group; one pass
// covers the row for the shapes the host picks up to 80 super-blocks) into registers once,
// the headers decoded (q4k_scales), and keeps them there while it loops over the chunks, so each weight byte is read from memory once
// per step for all sequences; passes beyond the first (longer rows) re-read theirs per chunk.
// A chunk past the last sequence reads the last sequence's activations and stores nothing.
#define SEQ_CHUNK 4

// One super-block step of a lane group for SEQ_CHUNK sequences from b0 (rows r of the warp:
// scales ks[r], quants qv[r]): xq, xd, xs point at the lane's activations of super-block s
// of sequence 0.
template <int RPW>
__device__ __forceinline__ void q4k_seq_terms(const Q4kScales* ks, const uint4* qv, const i8* xq, const float* xd,
                                              const float* xs, long xn, long gn, int b0, int nb,
                                              float (*acc)[SEQ_CHUNK]) {
    int4 xa[SEQ_CHUNK], xb[SEQ_CHUNK];
    float d0[SEQ_CHUNK], d2[SEQ_CHUNK], s0v[SEQ_CHUNK], s2v[SEQ_CHUNK];
#pragma unroll
    for (int b = 0; b < SEQ_CHUNK; b++) {
        const long sb = min(b0 + b, nb - 1);
        const i8* xp = xq + sb * xn;
        xa[b] = *(const int4*)xp;
        xb[b] = *(const int4*)(xp + 32);
        const long go = sb * gn;
        d0[b] = xd[go];
        d2[b] = xd[go + 2] * 0.0625f;  // q4k_lane_term's high-nibble scale
        s0v[b] = xs[go];
        s2v[b] = xs[go + 2];
    }
#pragma unroll
    for (int r = 0; r < RPW; r++) q4k_terms<SEQ_CHUNK>(ks[r], qv[r], xa, xb, d0, d2, s0v, s2v, acc[r]);
}

template <int WPR, int U, int RPW>
__device__ void gemv_q4k_seqs(const u8* __restrict__ W, long rows, long cols, Act x, int nb, float* __restrict__ y,
                              long ldy) {
    constexpr int STEP = 4 * WPR;
    constexpr int RPB = 4 / WPR * RPW;
    __shared__ float red[WPR > 1 ? 4 : 1][RPW * SEQ_CHUNK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nsb = (int)(cols >> 8);
    const long nblk = (rows + RPB - 1) / RPB;
    const int j = lane & 7, c = j >> 1, h = j & 1;
    const int s_first = (warp % WPR) * 4 + (lane >> 3);
    const long xn = x.n, gn = x.n / 16;
    const int sh = 16 * (c & 1);
    const bool clo = c < 2;
    const long rstride = (long)nsb * 144;
    // The lane's activations of super-block s (sequence 0).
    const i8* xq0 = x.q + (4 * c + h) * 16;
    const float* xd0 = x.d + 4 * c + h;
    const float* xs0 = x.s + 4 * c + h;
    bool waited = false;
    for (long blk = blockIdx.x; blk < nblk; blk += gridDim.x) {
        const long row = blk * RPB + (warp / WPR) * RPW;
        const bool valid = row < rows;
        const u8* wh = W + ((valid ? row : 0) * nsb + s_first) * 144;
        const u8* wq = wh + 16 + 16 * j;
        uint4 qv[U][RPW];
        Q4kScales ks[U][RPW];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                uint4 hv = make_uint4(0, 0, 0, 0);
                qv[u][r] = hv;
                if (valid && s_first + STEP * u < nsb && row + r < rows) {
                    hv = ld_stream<1>(wh + r * rstride + STEP * u * 144);
                    qv[u][r] = ld_stream<1>(wq + r * rstride + STEP * u * 144);
                }
                ks[u][r] = q4k_scales(hv, sh, clo);
            }
        // Weights do not depend on the previous kernel: wait for it only after the first loads.
        if (!waited) {
            pdl_wait();
            waited = true;
        }
        for (int b0 = 0; b0 < nb; b0 += SEQ_CHUNK) {
            float acc[RPW][SEQ_CHUNK];
#pragma unroll
            for (int r = 0; r < RPW; r++)
#pragma unroll
                for (int b = 0; b < SEQ_CHUNK; b++) acc[r][b] = 0.f;
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int s = s_first + STEP * u;
                if (valid && s < nsb)
                    q4k_seq_terms<RPW>(ks[u], qv[u], xq0 + s * 256, xd0 + s * 16, xs0 + s * 16, xn, gn, b0, nb, acc);
            }
            for (int s = s_first + STEP * U; valid && s < nsb; s += STEP) {
                uint4 q1[RPW];
                Q4kScales k1[RPW];
#pragma unroll
                for (int r = 0; r < RPW; r++) {
                    uint4 h1 = make_uint4(0, 0, 0, 0);
                    q1[r] = h1;
                    if (row + r < rows) {
                        h1 = ld_stream<1>(wh + r * rstride + (s - s_first) * 144);
                        q1[r] = ld_stream<1>(wq + r * rstride + (s - s_first) * 144);
                    }
                    k1[r] = q4k_scales(h1, sh, clo);
                }
                q4k_seq_terms<RPW>(k1, q1, xq0 + s * 256, xd0 + s * 16, xs0 + s * 16, xn, gn, b0, nb, acc);
            }
            q4k_store<WPR, RPW, SEQ_CHUNK>(acc, red, warp, lane, valid, row, rows, b0, nb, y, ldy);
        }
    }
}

// Rows per warp of the batched Q4_K GEMV (layout::Q4K_SEQ_ROWS_PER_WARP): two rows share each
// activation load; with U = 7 their first pass takes 112 registers.
#define Q4K_SEQ_RPW 2
#define Q4K_SEQS(WPR, U)                                                                                   \
    extern "C" __global__ void gemv_q4k_w##WPR##u##U##_bn(const u8* W, const u8* S, long rows, long cols,  \
                                                          const i8* xq, const float* xd, const float* xs,  \
                                                          const float* xf, float* y, long ldy, int nb) {   \
        Act x = {xq, xd, xs, cols};                                                                         \
        pdl_trigger();                                                                                      \
        gemv_q4k_seqs<WPR, U, Q4K_SEQ_RPW>(W, rows, cols, x, nb, y, ldy);                                   \
    }
Q4K_SEQS(1, 1)
Q4K_SEQS(1, 2)
Q4K_SEQS(1, 3)
Q4K_SEQS(1, 4)
Q4K_SEQS(1, 7)
Q4K_SEQS(2, 4)
Q4K_SEQS(4, 5)

// ---------------------------------------------------------------------------------------------
// The batched Q4_K GEMV on int8 tensor cores, for batches from Q4K_TILE_MIN_BATCH (layout.rs,
// q4k_tile). Same sums as gemv_q4k with the same WPR, bit for bit, by construction:
// - a block of 4 * WPR warps takes 16 * MT rows and the 8 sequences from 8 * blockIdx.x
//   (sequence blocks vary fastest, so the blocks of one row tile run together and its weights
//   come from HBM once per step). Warp w takes super-blocks w, w + 4 * WPR, ... ascending: in
//   gemv_q4k those are the super-blocks of lane group g = w % 4 of warp k = w / 4 of the row;
// - super-block s, lane chunk j (c = j / 2, h = j % 2: the lane's 16 quant bytes, low nibbles
//   against activation group 4c + h, high ones against group 4c + h + 2): two
//   mma.m16n8k16.s8 give the integer sums of 16 rows x 8 sequences, A the nibbles as int8
//   0..15 (the high ones shifted down: 16x smaller than dot16u's), B the group's 16 int8
//   activations. Integer sums are exact in any order, so each equals the lane's dp4a chain;
//   i2f_exact and i2f16_exact make of them times the 6-bit scales the floats (float)(int)
//   makes of dot16 * sc1 and dot16u * sc2, and q4k_term adds the term;
// - a thread's C fragment holds rows gid, gid + 8 and sequences 2t, 2t + 1 (gid = lane / 4,
//   t = lane % 4): per m-tile it keeps 8 lanes j x 4 (row, sequence) accumulators, each the
//   one-sequence lane's sum of its terms in ascending super-block order from 0.f;
// - q4k_tile_store adds them in warp_sum's tree (lane 8g + j: distance 16 and 8 pair the lane
//   groups, across warps through shared memory; 4, 2, 1 pair the lanes j, in registers), then
//   the WPR warps of the row in ascending order from 0.f, as q4k_store does.
// Rows past the matrix and sequences past nb read the last ones' data and store nothing. The
// activation scales are read four groups at a time (rows of cols / 16 floats: 16-byte aligned).
// Work per term (one per 32 weights per sequence): two IMADs and two FADDs for the exact
// conversions and seven float operations for the term; the tensor cores do the dot products.

// (float)v for |v| < 2^22, on the FMA pipe (the conversion unit has a sixteenth of its rate):
// v lands in the mantissa of 1.5 * 2^23, where one unit is 1.0. Integer sums of 16 nibbles
// times int8 activations times a 6-bit scale stay below 16 * 15 * 128 * 63 < 2^21.
__device__ __forceinline__ float i2f_exact(int v) { return __int_as_float(0x4B400000 + v) - 12582912.f; }
// (float)(16 * v) for |v| < 2^22: v in the mantissa of 1.5 * 2^27, where one unit is 16.0.
__device__ __forceinline__ float i2f16_exact(int v) { return __int_as_float(0x4D400000 + v) - 201326592.f; }

// c = A (16 x 16 int8, rows gid and gid + 8: bytes 4t..4t+3 in a0, a1) times B (16 x 8 int8,
// column gid: bytes 4t..4t+3 in b); c[e] is row gid + 8 (e / 2), column 2t + e % 2.
__device__ __forceinline__ void mma_s8_16x8x16(u32 a0, u32 a1, u32 b, int (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// The end of the tiled kernel: acc[m][j][e] of every warp summed as q4k_store sums the lanes
// and warps of a row, written to y[seq * ldy + row]. Every thread of the block calls it. red:
// 2 * WPR slots of 32 x 32 floats, one m-tile at a time.
template <int WPR, int MT>
__device__ __forceinline__ void q4k_tile_store(float (&acc)[MT][8][4], float (*red)[32][32], int w, int lane,
                                               long row0, long rows, int b0, int nb, float* __restrict__ y,
                                               long ldy) {
    const int k = w >> 2, g = w & 3, gid = lane >> 2, t = lane & 3;
#pragma unroll
    for (int m = 0; m < MT; m++) {
        // warp_sum at distance 16: lane groups g and g + 2.
        if (g >= 2)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) red[2 * k + g - 2][j * 4 + e][lane] = acc[m][j][e];
        __syncthreads();
        if (g < 2)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[m][j][e] += red[2 * k + g][j * 4 + e][lane];
        __syncthreads();
        // Distance 8: lane groups 0 and 1.
        if (g == 1)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) red[2 * k][j * 4 + e][lane] = acc[m][j][e];
        __syncthreads();
        float v[4];
        if (g == 0) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float a[8];
#pragma unroll
                for (int j = 0; j < 8; j++) a[j] = acc[m][j][e] + red[2 * k][j * 4 + e][lane];
                // Distances 4, 2, 1 over the lanes j, as lane 0 of warp_sum adds them.
                v[e] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
            }
        }
        if constexpr (WPR > 1) {
            __syncthreads();
            if (g == 0)
#pragma unroll
                for (int e = 0; e < 4; e++) red[k][e][lane] = v[e];
            __syncthreads();
            if (w == 0)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    v[e] = 0.f;
#pragma unroll
                    for (int kk = 0; kk < WPR; kk++) v[e] += red[kk][e][lane];
                }
        }
        if (w == 0)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const long row = row0 + 16 * m + gid + 8 * (e >> 1);
                const int seq = b0 + 2 * t + (e & 1);
                if (row < rows && seq < nb) y[seq * ldy + row] = v[e];
            }
        __syncthreads();
    }
}

// Asynchronous copies into shared memory (sm_80): cp_async16 copies 16 bytes, bypassing L1;
// cp_async_commit closes a group of them, cp_async_wait<N> waits until at most N groups of the
// thread are pending.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    const u32 a = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
// Four 8 x 8 b16 matrices from shared memory: lanes 8k .. 8k + 7 give the row addresses of
// matrix k (16 bytes each), and r[k] is, for lane (gid, t), bytes 4t .. 4t + 3 of its row gid:
// the A (rows gid, gid + 8) and B (column gid) words of mma.m16n8k16.s8.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The tiled kernel's staging (layout.rs Q4K_TILE_STAGES, Q4K_TILE_STAGE_BYTES). A warp's unit
// of work is half a super-block (chunks 2 hf and 2 hf + 1; unit u of warp w is super-block
// w + 4 WPR (u / 2), half u % 2), copied by cp.async into one of the warp's TILE_STAGES stages
// TILE_STAGES - 1 units before its mma and float terms read it. A stage holds:
//   the weights: 32 rows x (the 16-byte header, the half's 64 quant bytes), TILE_WROW apart;
//   the activations: 8 sequences x the half's 128 int8 (groups 8 hf .. 8 hf + 7), TILE_AROW apart;
//   their scales, then their scale * sums: 8 sequences x 8 floats each, TILE_SROW apart.
// Strides of 5, 9 and 3 16-byte slots put the 8 rows of an ldmatrix phase, the 8 headers of a
// load and the 4 sequences of a scale load in distinct banks.
#define Q4K_TILE_MT 2
#define TILE_STAGES 3
#define TILE_WROW 80
#define TILE_AROW 144
#define TILE_SROW 48
#define TILE_W_BYTES (16 * Q4K_TILE_MT * TILE_WROW)
#define TILE_A_BYTES (8 * TILE_AROW)
#define TILE_S_BYTES (8 * TILE_SROW)
#define TILE_STAGE_BYTES (TILE_W_BYTES + TILE_A_BYTES + 2 * TILE_S_BYTES)

// Weights of unit (s, hf) into stage st: 5 slots of 16 bytes per row, 5 MT / 2 per lane (rows
// past the matrix copy its last row).
__device__ __forceinline__ void q4k_tile_stage_w(u8* st, const u8* W, long row0, long rows, int nsb, int s, int hf,
                                                 int lane) {
#pragma unroll
    for (int i = 0; i < 5 * Q4K_TILE_MT / 2; i++) {
        const int k = lane + 32 * i, r = k / 5, p = k % 5;
        const u8* blk = W + (min(row0 + r, rows - 1) * nsb + s) * 144;
        cp_async16(st + r * TILE_WROW + 16 * p, blk + (p ? 64 * hf + 16 * p : 0));
    }
}

// Activations of unit (s, hf) into stage st: 64 slots of int8, 2 per lane, then one slot of
// scales (lanes 0-15) or scale * sums (16-31) per lane (sequences past nb copy the last one).
__device__ __forceinline__ void q4k_tile_stage_x(u8* st, const Act& x, int b0, int nb, int s, int hf, int lane) {
    u8* sa = st + TILE_W_BYTES;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int k = lane + 32 * i, q = k >> 3, p = k & 7;
        cp_async16(sa + q * TILE_AROW + 16 * p, x.q + (long)min(b0 + q, nb - 1) * x.n + 256 * s + 128 * hf + 16 * p);
    }
    const int q = (lane >> 1) & 7, p = lane & 1;
    const float* src = (lane < 16 ? x.d : x.s) + (long)min(b0 + q, nb - 1) * (x.n / 16) + 16 * s + 8 * hf + 4 * p;
    cp_async16(sa + TILE_A_BYTES + (lane >> 4) * TILE_S_BYTES + q * TILE_SROW + 16 * p, src);
}

// The mma and float terms of a warp's unit of half HF from stage st: chunks c = 2 HF + cc, lanes
// j = 2c + h, into acc[m][j][e] (rows 16m + gid + 8 (e / 2), sequences 2t + e % 2). HF is a
// template argument so that every index of acc is a constant (registers, not local memory).
template <int HF>
__device__ __forceinline__ void q4k_tile_unit(const u8* st, int lane, float (&acc)[Q4K_TILE_MT][8][4]) {
    constexpr int hf = HF;
    const int gid = lane >> 2, t = lane & 3;
    const u8* sa = st + TILE_W_BYTES;
    const float* sd = (const float*)(sa + TILE_A_BYTES);
    const float* ss = (const float*)(sa + TILE_A_BYTES + TILE_S_BYTES);
#pragma unroll
    for (int cc = 0; cc < 2; cc++) {
        const int c = 2 * hf + cc;
        Q4kScales ks[Q4K_TILE_MT][2];
#pragma unroll
        for (int m = 0; m < Q4K_TILE_MT; m++)
#pragma unroll
            for (int i = 0; i < 2; i++)
                ks[m][i] = q4k_scales(*(const uint4*)(st + (16 * m + gid + 8 * i) * TILE_WROW), 16 * cc, c < 2);
        // B: groups 4c .. 4c + 3 of the super-block (low nibbles of lanes h = 0, 1, then high).
        u32 bf[4];
        ldsm_x4(bf, sa + (lane & 7) * TILE_AROW + 16 * (4 * cc + (lane >> 3)));
        // Scales of those groups for sequences 2t + q.
        float4 dv[2], sv[2];
#pragma unroll
        for (int q = 0; q < 2; q++) {
            dv[q] = *(const float4*)(sd + (2 * t + q) * (TILE_SROW / 4) + 4 * cc);
            sv[q] = *(const float4*)(ss + (2 * t + q) * (TILE_SROW / 4) + 4 * cc);
        }
        // A: rows 16m + (0-7, 8-15) of lanes h = 0, then h = 1.
        u32 af[Q4K_TILE_MT][4];
#pragma unroll
        for (int m = 0; m < Q4K_TILE_MT; m++)
            ldsm_x4(af[m], st + (16 * m + (lane & 7) + 8 * ((lane >> 3) & 1)) * TILE_WROW + 16 + 32 * cc + 16 * (lane >> 4));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int j = 2 * c + h;
            float d0[2], d2[2], s0v[2], s2v[2];
#pragma unroll
            for (int q = 0; q < 2; q++) {
                d0[q] = h ? dv[q].y : dv[q].x;
                d2[q] = (h ? dv[q].w : dv[q].z) * 0.0625f;  // q4k_lane_term's high-nibble scale
                s0v[q] = h ? sv[q].y : sv[q].x;
                s2v[q] = h ? sv[q].w : sv[q].z;
            }
#pragma unroll
            for (int m = 0; m < Q4K_TILE_MT; m++) {
                const u32 q0 = af[m][2 * h], q1 = af[m][2 * h + 1];
                int lo[4], hi[4];
                mma_s8_16x8x16(q0 & 0x0F0F0F0Fu, q1 & 0x0F0F0F0Fu, bf[h], lo);
                mma_s8_16x8x16((q0 >> 4) & 0x0F0F0F0Fu, (q1 >> 4) & 0x0F0F0F0Fu, bf[2 + h], hi);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const Q4kScales& k = ks[m][e >> 1];
                    const int q = e & 1;
                    q4k_term(k, i2f_exact(lo[e] * k.sc1), i2f16_exact(hi[e] * k.sc2), d0[q], d2[q], s0v[q], s2v[q],
                             acc[m][j][e]);
                }
            }
        }
    }
}

template <int WPR>
__device__ void gemv_q4k_tile(const u8* __restrict__ W, long rows, long cols, Act x, int nb, float* __restrict__ y,
                              long ldy) {
    constexpr int NW = 4 * WPR;
    extern __shared__ __align__(16) u8 tile_smem[];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int nsb = (int)(cols >> 8);
    const long row0 = (long)blockIdx.y * 16 * Q4K_TILE_MT;
    const int b0 = 8 * blockIdx.x;
    u8* stages = tile_smem + w * TILE_STAGES * TILE_STAGE_BYTES;
    // Units of this warp: both halves of super-blocks w, w + NW, ... below nsb.
    const int nu = w < nsb ? 2 * ((nsb - 1 - w) / NW + 1) : 0;
    float acc[Q4K_TILE_MT][8][4];
#pragma unroll
    for (int m = 0; m < Q4K_TILE_MT; m++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][j][e] = 0.f;
    // The first units' weights do not depend on the previous kernel: copy them before waiting.
#pragma unroll
    for (int u = 0; u < TILE_STAGES - 1; u++)
        if (u < nu) q4k_tile_stage_w(stages + u * TILE_STAGE_BYTES, W, row0, rows, nsb, w + NW * (u >> 1), u & 1, lane);
    pdl_wait();
#pragma unroll
    for (int u = 0; u < TILE_STAGES - 1; u++) {
        if (u < nu) q4k_tile_stage_x(stages + u * TILE_STAGE_BYTES, x, b0, nb, w + NW * (u >> 1), u & 1, lane);
        cp_async_commit();
    }
    // Group g holds unit g; at unit u, groups up to u + TILE_STAGES - 1 are committed, so
    // waiting for all but TILE_STAGES - 1 of them completes unit u's. The stage unit u + STAGES
    // - 1 fills is the one unit u - 1 used (done: the warp synchronizes after each unit).
    // Units come in pairs (both halves of a super-block): u even, then u + 1.
    const auto step = [&](int u) -> const u8* {
        const int un = u + TILE_STAGES - 1;
        if (un < nu) {
            u8* st = stages + (un % TILE_STAGES) * TILE_STAGE_BYTES;
            q4k_tile_stage_w(st, W, row0, rows, nsb, w + NW * (un >> 1), un & 1, lane);
            q4k_tile_stage_x(st, x, b0, nb, w + NW * (un >> 1), un & 1, lane);
        }
        cp_async_commit();
        cp_async_wait<TILE_STAGES - 1>();
        __syncwarp();
        return stages + (u % TILE_STAGES) * TILE_STAGE_BYTES;
    };
    for (int u = 0; u < nu; u += 2) {
        q4k_tile_unit<0>(step(u), lane, acc);
        __syncwarp();
        q4k_tile_unit<1>(step(u + 1), lane, acc);
        __syncwarp();
    }
    cp_async_wait<0>();
    __syncthreads();
    q4k_tile_store<WPR, Q4K_TILE_MT>(acc, (float(*)[32][32])tile_smem, w, lane, row0, rows, b0, nb, y, ldy);
}

// gemv_q4k_tile_w<WPR>: blocks of 4 * WPR warps over 32 rows and 8 sequences (layout.rs
// q4k_tile; measured on the H200 against 16-row tiles and two or four sequence tiles per block),
// with 4 * WPR * TILE_STAGES * TILE_STAGE_BYTES bytes of dynamic shared memory (the stages, then
// the reduction's 2 * WPR slots of 32 x 32 floats). MINB: the blocks per SM its registers must
// allow (one-warp rows: 3, at 168 registers without spills; 512-thread blocks fit one at 128).
#define Q4K_TILE(WPR, MINB)                                                                                    \
    extern "C" __global__ void __launch_bounds__(128 * WPR, MINB) gemv_q4k_tile_w##WPR(                          \
        const u8* W, const u8* S, long rows, long cols, const i8* xq, const float* xd, const float* xs,    \
        const float* xf, float* y, long ldy, int nb) {                                                     \
        Act x = {xq, xd, xs, cols};                                                                        \
        pdl_trigger();                                                                                     \
        gemv_q4k_tile<WPR>(W, rows, cols, x, nb, y, ldy);                                                  \
    }
Q4K_TILE(1, 3)
Q4K_TILE(2, 1)
Q4K_TILE(4, 1)

// The other types: their batch kernels' device functions over chunks of SEQ_CHUNK sequences
// (the tail with a smaller batch), activations and outputs moved to the chunk's first row.
// Weights are read again per chunk (from L1 or L2: these are the small matrices).
#define SEQ_LOOP(CALL)                                                                                      \
    for (int b0 = 0; b0 < nb; b0 += SEQ_CHUNK) {                                                            \
        const Act xc = {x.q + b0 * x.n, x.d + b0 * (x.n / 16), x.s + b0 * (x.n / 16), x.n};                 \
        const float* xfc = xf + (long)b0 * cols;                                                            \
        float* yc = y + (long)b0 * ldy;                                                                     \
        switch (min(nb - b0, SEQ_CHUNK)) {                                                                  \
            case 1: CALL(1); break;                                                                         \
            case 2: CALL(2); break;                                                                         \
            case 3: CALL(3); break;                                                                         \
            default: CALL(4); break;                                                                        \
        }                                                                                                   \
    }
#define SEQ_ENTRY(NAME, CALL)                                                                               \
    extern "C" __global__ void NAME(const u8* W, const u8* S, long rows, long cols, const i8* xq,          \
                                    const float* xd, const float* xs, const float* xf, float* y, long ldy,  \
                                    int nb) {                                                               \
        const Act x = {xq, xd, xs, cols};                                                                   \
        pdl_trigger();                                                                                      \
        pdl_wait();                                                                                         \
        SEQ_LOOP(CALL)                                                                                      \
    }
#define CALL_Q6K(B) gemv_q6k<B>(W, rows, cols, xc, yc, ldy)
#define CALL_Q80(B) gemv_q80<B>(W, S, rows, cols, xc, yc, ldy)
#define CALL_NVFP4(B) gemv_nvfp4<B, 2, 2>(W, S, rows, cols, xc, yc, ldy)
#define CALL_F16(B) gemv_float<B>(1, W, rows, cols, xfc, yc, ldy)
#define CALL_BF16(B) gemv_float<B>(30, W, rows, cols, xfc, yc, ldy)
#define CALL_F32(B) gemv_float<B>(0, W, rows, cols, xfc, yc, ldy)
SEQ_ENTRY(gemv_q6k_bn, CALL_Q6K)
SEQ_ENTRY(gemv_q80_bn, CALL_Q80)
SEQ_ENTRY(gemv_nvfp4_bn, CALL_NVFP4)
SEQ_ENTRY(gemv_f16_bn, CALL_F16)
SEQ_ENTRY(gemv_bf16_bn, CALL_BF16)
SEQ_ENTRY(gemv_f32_bn, CALL_F32)

// Quantize f32 activations [B][n] (n a multiple of 16) for the integer GEMV paths.
extern "C" __global__ void quantize_act(const float* x, long n, long total_groups, i8* q, float* qd, float* qs) {
    pdl_trigger();
    pdl_wait();
    const long g = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= total_groups) return;
    float v[16];
#pragma unroll
    for (int t = 0; t < 16; t++) v[t] = x[16 * g + t];
    quant16(v, q + 16 * g, qd + g, qs + g);
}

// ---------------------------------------------------------------------------------------------
// Norms. One block per row, one thread per 16 values (blockDim.x >= n / 16, a multiple of 32).
//   if y:  x += RMSNorm(y, eps_post) * w_post          (post-norm and residual)
//   out = RMSNorm(x, eps) * w  (w may be null)  -> f32 out_f, bf16 out_b, quantized (q, qd, qs)
// Each output pointer may be null; out_f may alias x. The new x goes to x_out (null: x).
// grid (rows, slices): every block of a row computes both sums over the whole row and writes
// one slice of its outputs, so several SMs share the stores; with more than one slice x_out and
// out_f must not alias x (another block may still be reading it).
__device__ __forceinline__ void load16(const float* p, float* v) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float4 t = *(const float4*)(p + 4 * k);
        v[4 * k] = t.x; v[4 * k + 1] = t.y; v[4 * k + 2] = t.z; v[4 * k + 3] = t.w;
    }
}
__device__ __forceinline__ void store16(float* p, const float* v) {
#pragma unroll
    for (int k = 0; k < 4; k++) *(float4*)(p + 4 * k) = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}

extern "C" __global__ void norm_fused(float* x, const float* y, const float* w_post, float eps_post, const float* w,
                                      float eps, long n, float* out_f, bf16* out_b, i8* q, float* qd, float* qs,
                                      float* x_out) {
    pdl_trigger();
    __shared__ float sh[33];
    const long r = blockIdx.x;
    const long g = threadIdx.x;
    const bool act = g < n / 16;
    const long per = (n / 16 + gridDim.y - 1) / gridDim.y;
    const bool mine = act && g >= (long)blockIdx.y * per && g < (long)(blockIdx.y + 1) * per;
    float* xr = x + r * n + 16 * g;
    float* xo = (x_out ? x_out : x) + r * n + 16 * g;
    // Every input is loaded up front, so the two reductions are the only waits; the norm
    // weights (constant) before waiting for the previous kernel.
    float v[16], yv[16], wp[16], wv[16];
    if (act && y) load16(w_post + 16 * g, wp);
    if (mine && w) load16(w + 16 * g, wv);
    pdl_wait();
    if (act) {
        load16(xr, v);
        if (y) load16(y + r * n + 16 * g, yv);
    }
    if (y) {
        float ss = 0.f;
        if (act) {
#pragma unroll
            for (int t = 0; t < 16; t++) ss += yv[t] * yv[t];
        }
        ss = block_sum(ss, sh);
        const float sy = 1.0f / sqrtf(ss / (float)n + eps_post);
        if (act) {
#pragma unroll
            for (int t = 0; t < 16; t++) v[t] += yv[t] * sy * wp[t];
            if (mine) store16(xo, v);
        }
    }
    float ss = 0.f;
    if (act) {
#pragma unroll
        for (int t = 0; t < 16; t++) ss += v[t] * v[t];
    }
    ss = block_sum(ss, sh);
    if (!mine) return;
    const float sx = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int t = 0; t < 16; t++) v[t] = v[t] * sx * (w ? wv[t] : 1.f);
    if (out_f) store16(out_f + r * n + 16 * g, v);
    if (out_b) {
        __align__(16) bf16 b[16];
#pragma unroll
        for (int t = 0; t < 16; t++) b[t] = __float2bfloat16(v[t]);
        uint4* dst = (uint4*)(out_b + r * n + 16 * g);
        dst[0] = ((uint4*)b)[0];
        dst[1] = ((uint4*)b)[1];
    }
    if (q) quant16(v, q + r * n + 16 * g, qd + r * (n / 16) + g, qs + r * (n / 16) + g);
}

// norm_fused with 8 values per thread (blockDim.x >= n / 8, a multiple of 32, so n up to 8192)
// and one barrier per sum: half the serial work per thread of the 16-value kernel. The sums
// add in another order (warp sums of 8-value sums, then the warps' sums as a warp sum), so
// results differ from norm_fused by rounding.
__device__ __forceinline__ float block_sum1(float v, float* sh) {
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) sh[w] = v;
    __syncthreads();
    return warp_sum(l < (int)(blockDim.x >> 5) ? sh[l] : 0.f);
}
extern "C" __global__ void norm_fused8(float* x, const float* y, const float* w_post, float eps_post, const float* w,
                                       float eps, long n, float* out_f, bf16* out_b, i8* q, float* qd, float* qs,
                                       float* x_out) {
    pdl_trigger();
    __shared__ float sh[2][32];
    const long r = blockIdx.x;
    const long g = threadIdx.x;  // values 8 g .. 8 g + 7
    const bool act = g < n / 8;
    const long per = (n / 8 + gridDim.y - 1) / gridDim.y;
    // Slices hold whole quantization groups (pairs of threads).
    const long per2 = (per + 1) & ~1L;
    const bool mine = act && g >= (long)blockIdx.y * per2 && g < (long)(blockIdx.y + 1) * per2;
    float* xr = x + r * n + 8 * g;
    float* xo = (x_out ? x_out : x) + r * n + 8 * g;
    float v[8], yv[8], wp[8], wv[8];
    auto ld8 = [](const float* p, float* o) {
        const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    };
    auto st8 = [](float* p, const float* o) {
        *(float4*)p = make_float4(o[0], o[1], o[2], o[3]);
        *(float4*)(p + 4) = make_float4(o[4], o[5], o[6], o[7]);
    };
    if (act && y) ld8(w_post + 8 * g, wp);
    if (act && w) ld8(w + 8 * g, wv);
    pdl_wait();
#pragma unroll
    for (int t = 0; t < 8; t++) v[t] = yv[t] = 0.f;
    if (act) {
        ld8(xr, v);
        if (y) ld8(y + r * n + 8 * g, yv);
    }
    if (y) {
        float ss = 0.f;
#pragma unroll
        for (int t = 0; t < 8; t++) ss += yv[t] * yv[t];
        ss = block_sum1(ss, sh[0]);
        const float sy = 1.0f / sqrtf(ss / (float)n + eps_post);
        if (act) {
#pragma unroll
            for (int t = 0; t < 8; t++) v[t] += yv[t] * sy * wp[t];
            if (mine) st8(xo, v);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int t = 0; t < 8; t++) ss += v[t] * v[t];
    ss = block_sum1(ss, sh[1]);
    const float sx = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
    for (int t = 0; t < 8; t++) v[t] = v[t] * sx * (w ? wv[t] : 1.f);
    if (mine && out_f) st8(out_f + r * n + 8 * g, v);
    if (mine && out_b) {
        __align__(16) bf16 b[8];
#pragma unroll
        for (int t = 0; t < 8; t++) b[t] = __float2bfloat16(v[t]);
        *(uint4*)(out_b + r * n + 8 * g) = *(uint4*)b;
    }
    // (Warp-uniform: both lanes of a group are in or out of the slice.)
    if (q) quant_part<8>(v, mine, (g & 1) == 0, q + r * n + 8 * g, qd + r * (n / 16) + g / 2, qs + r * (n / 16) + g / 2);
}

// One 128-wide head held by a warp (lane: dims 4·lane .. 4·lane+3): RMSNorm times `nw`, then
// NORM RoPE (adjacent pairs) at position p when `rope`.
__device__ __forceinline__ void head_norm_rope(float* v, const float* nw, float eps, int rope, int p,
                                               float theta_scale, int lane) {
    const float ss = warp_sum(v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3]);
    const float s = 1.0f / sqrtf(ss / 128.f + eps);
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = v[i] * s * nw[4 * lane + i];
    if (!rope) return;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int i = 2 * lane + k;  // pair index
        const float theta = (float)p * powf(theta_scale, (float)i);
        float sn, cs;
        sincosf(theta, &sn, &cs);
        const float a = v[2 * k], b = v[2 * k + 1];
        v[2 * k] = a * cs - b * sn;
        v[2 * k + 1] = a * sn + b * cs;
    }
}

// Per-head RMSNorm of q and k, NORM RoPE (adjacent pairs) when `rope`, K/V into the cache.
// qkv rows [T][ld]: q heads at 0, k heads at nq*128, v heads at (nq+nkv)*128. head_dim 128.
// grid (T, nq + 2 nkv), block 32. q goes to q_f [T][nq][128] f32 and/or q_h [nq][T][128] f16.
// The caches hold one sequence per `slot_stride` halves: token t goes to sequence `slot`, or
// to sequence slots[t] when slot < 0 (a decode step over several sequences). With ring > 0
// (sliding layers) position p lives in row p % ring.
extern "C" __global__ void qk_norm_rope_store(const float* qkv, long ld, int nq, int nkv, const float* qn_w,
                                              const float* kn_w, float eps, const int* pos, int rope,
                                              float theta_scale, float* q_f, __half* q_h, int T, __half* kc,
                                              __half* vc, long slot_stride, const int* slots, int slot,
                                              int ring) {
    pdl_trigger();
    pdl_wait();
    const int t = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
    const int p = pos[t];
    const long soff = (long)(slot < 0 ? slots[t] : slot) * slot_stride;
    const float4 v4 = *(const float4*)(qkv + (long)t * ld + (long)head * 128 + 4 * lane);
    float v[4] = {v4.x, v4.y, v4.z, v4.w};
    const bool is_q = head < nq, is_k = !is_q && head < nq + nkv;
    if (is_q || is_k) head_norm_rope(v, is_q ? qn_w : kn_w, eps, rope, p, theta_scale, lane);
    if (is_q) {
        if (q_f) *(float4*)(q_f + ((long)t * nq + head) * 128 + 4 * lane) = make_float4(v[0], v[1], v[2], v[3]);
        if (q_h) {
            __half* d = q_h + ((long)head * T + t) * 128 + 4 * lane;
            d[0] = __float2half(v[0]); d[1] = __float2half(v[1]);
            d[2] = __float2half(v[2]); d[3] = __float2half(v[3]);
        }
    } else {
        const int kh = is_k ? head - nq : head - nq - nkv;
        const long prow = ring > 0 ? p % ring : p;
        __half* d = (is_k ? kc : vc) + soff + prow * nkv * 128 + kh * 128 + 4 * lane;
        d[0] = __float2half(v[0]); d[1] = __float2half(v[1]);
        d[2] = __float2half(v[2]); d[3] = __float2half(v[3]);
    }
}

// ---------------------------------------------------------------------------------------------
// Merges the four warps of a 128-thread flash-decoding block, each with its running max `m`,
// sum `l` and four dimensions per lane in `acc`: thread d gets dimension d's combined max M,
// sum L and accumulator A. Every thread of the block must call it.
__device__ void merge_warps(float m, float l, const float* acc, float& M, float& L, float& A) {
    __shared__ float sm[4], sl[4], sa[4][128];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, d = threadIdx.x;
    if (lane == 0) { sm[w] = m; sl[w] = l; }
#pragma unroll
    for (int i = 0; i < 4; i++) sa[w][4 * lane + i] = acc[i];
    __syncthreads();
    M = fmaxf(fmaxf(sm[0], sm[1]), fmaxf(sm[2], sm[3]));
    L = 0.f;
    A = 0.f;
    if (M != -INFINITY) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (sm[i] != -INFINITY) {
                const float f = __expf(sm[i] - M);
                L += sl[i] * f;
                A += sa[i][d] * f;
            }
        }
    }
}

// A decode query at position p attends to keys [attn_lo, p] (lo = p - window + 1 on sliding
// layers). The keys go to at most S flash-decoding splits of at least kmin keys each
// (attn_splits_used, the same count in the attention kernels and the merge), and split sp takes
// keys [k0, k1) of an even division, the last split possibly short (split_keys).
__device__ __forceinline__ int attn_lo(int p, int window) { return window > 0 ? max(0, p - window + 1) : 0; }
__device__ __forceinline__ int attn_splits_used(int p, int window, int S, int kmin) {
    const int nk = p - attn_lo(p, window) + 1;
    return min(S, (nk + kmin - 1) / kmin);
}
__device__ __forceinline__ void split_keys(int p, int window, int used, int sp, int& k0, int& k1) {
    const int lo = attn_lo(p, window), nk = p - lo + 1, chunk = (nk + used - 1) / used;
    k0 = lo + sp * chunk;
    k1 = min(p + 1, k0 + chunk);
}

// One value of a head's attention output (thread d of a 128-thread block holds dimension d):
// to f32 and/or quantized in 16-value groups (int8, scale, scale·Σq) for the next GEMV.
__device__ __forceinline__ void store_head_out(float v, long idx, float* out_f, i8* q, float* qd, float* qs) {
    if (out_f) out_f[idx] = v;
    if (!q) return;
    float amax = fabsf(v);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, o, 16));
    const float dd = amax / 127.f;
    const int qi = dd > 0.f ? __float2int_rn(v / dd) : 0;
    int sum = qi;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL, sum, o, 16);
    q[idx] = (i8)qi;
    if ((idx & 15) == 0) {
        qd[idx / 16] = dd;
        qs[idx / 16] = dd * (float)sum;
    }
}

// Split blocks that finish a reduction together: after __syncthreads (which orders the block's
// partial stores before this thread's), one thread increments the counter with a GPU-scope
// acquire-release atomic and gets the previous count. The release publishes the block's
// partials to whichever block arrives last; that block's acquire, shared through the next
// __syncthreads, makes every other block's partials visible to its L2 (ld.cg) loads. Cheaper
// than two sequentially consistent fences (__threadfence: membar.gl, which also empties L1).
__device__ __forceinline__ unsigned arrive_acq_rel(unsigned* cnt) {
    unsigned prev;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(cnt) : "memory");
    return prev;
}

// Merges `used` flash-decoding splits of one (sequence, head) at `base` ([split][130]: acc[128],
// max, sum), for a 128-thread block, thread d owning dimension d: thread d reads the max and
// sum of splits d, d + 128, ... (used <= MAXS) while every thread reads its dimension of the
// first R splits, all in one round trip; the block reduces the maxima and sums, and each thread
// sums its dimension in split order (R loads in flight at a time). The result does not depend
// on MAXS or R. Every thread of the block must call it.
template <int MAXS, int R>
__device__ void merge_splits(const float* base, int used, int d, float& M, float& L, float& A) {
    constexpr int PER = MAXS / 128;
    __shared__ float fw[MAXS], red[4];
    const int w = d >> 5, lane = d & 31;
    float ms[PER], ls[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const int sp = d + 128 * k;
        ms[k] = sp < used ? __ldcg(base + sp * 130 + 128) : -INFINITY;
        ls[k] = sp < used ? __ldcg(base + sp * 130 + 129) : 0.f;
    }
    float av[R];
#pragma unroll
    for (int u = 0; u < R; u++) av[u] = u < used ? __ldcg(base + u * 130 + d) : 0.f;
    float mt = ms[0];
#pragma unroll
    for (int k = 1; k < PER; k++) mt = fmaxf(mt, ms[k]);
    const float mw = warp_max(mt);
    if (lane == 0) red[w] = mw;
    __syncthreads();
    M = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    float lt = 0.f;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const float f = (ms[k] == -INFINITY || M == -INFINITY) ? 0.f : __expf(ms[k] - M);
        fw[d + 128 * k] = f;
        lt = k == 0 ? ls[k] * f : lt + ls[k] * f;
    }
    const float lw = warp_sum(lt);
    __syncthreads();
    if (lane == 0) red[w] = lw;
    __syncthreads();
    L = red[0] + red[1] + red[2] + red[3];
    A = 0.f;
#pragma unroll
    for (int u = 0; u < R; u++)
        if (u < used) A += av[u] * fw[u];
    for (int s0 = R; s0 < used; s0 += R) {
#pragma unroll
        for (int u = 0; u < R; u++) av[u] = s0 + u < used ? __ldcg(base + (s0 + u) * 130 + d) : 0.f;
#pragma unroll
        for (int u = 0; u < R; u++)
            if (s0 + u < used) A += av[u] * fw[s0 + u];
    }
}

// Merge the splits (at most MAX_SPLITS), apply the sigmoid gate, write f32 (out_f [B][nq*128])
// and/or quantized. grid (nq, B), block 128. gate rows [B][ldg].
#define MAX_SPLITS 256
extern "C" __global__ void attn_combine_gate(const float* part, int nq, int S, int kmin, const int* pos,
                                             int window, const float* gate, long ldg, float* out_f, i8* q,
                                             float* qd, float* qs) {
    pdl_trigger();
    const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
    const float* pp = part + ((long)b * nq + h) * S * 130;
    const int used = attn_splits_used(pos[b], window, S, kmin);  // what the attention kernel used
    pdl_wait();
    const float gt = gate[(long)b * ldg + h * 128 + d];
    float M, L, A;
    merge_splits<MAX_SPLITS, 64>(pp, used, d, M, L, A);
    const float v = (L > 0.f ? A / L : 0.f) * (1.f / (1.f + __expf(-gt)));
    store_head_out(v, (long)b * nq * 128 + h * 128 + d, out_f, q, qd, qs);
}

// Stores a new key (four values per lane, already normalized and rotated) and its value at
// cache offset o (lane's dims 4 lane .. 4 lane + 3) as F16.
__device__ __forceinline__ void store_new_kv(__half* kc, __half* vc, long o, const float* kv, float4 v4) {
    __half2* kd = (__half2*)(kc + o);
    __half2* vd = (__half2*)(vc + o);
    kd[0] = __floats2half2_rn(kv[0], kv[1]);
    kd[1] = __floats2half2_rn(kv[2], kv[3]);
    vd[0] = __floats2half2_rn(v4.x, v4.y);
    vd[1] = __floats2half2_rn(v4.z, v4.w);
}

// Decode attention in one kernel: per-head Q/K RMSNorm and RoPE of the new token (recomputed
// by each block from the projection rows, so no separate kernel), K/V of the new token into
// the cache, flash-decoding over the cached keys [lo, pos) plus the new key from registers,
// and the split merge + sigmoid gate + quantization done by the last split block to finish
// (per-(b, h) counters in `cnt`, reset by that block for the next launch).
// qkv rows [B][ld] (q | k | v | gate), caches [B][n_ctx][nkv*128] (slot_stride halves apart).
// grid (nq, B, S), block 128. part [B][nq][S][130].
// Sums K per-lane values over the warp at once (K = 1, 2, 4, 8, 16; a reduce-scatter butterfly:
// at each of the first log2 K levels lanes swap halves of the set, so each level halves the
// values a lane carries) and gives every lane all K sums: for four values 10 shuffles and 6
// adds where four warp_sums take 20 and 20. Each sum is the same tree of additions as
// warp_sum's (pairs at lane distance 16, then 8, 4, 2, 1), so the results are bit-identical.
template <int K>
__device__ __forceinline__ void warp_sum_k(const float* p, float* out) {
    const int lane = threadIdx.x & 31;
    float v[K];
#pragma unroll
    for (int i = 0; i < K; i++) v[i] = p[i];
    int mask = 16;
#pragma unroll
    for (int n = K; n > 1; n >>= 1, mask >>= 1) {
        const bool hi = lane & mask;  // this lane keeps the upper half of the n values
#pragma unroll
        for (int i = 0; i < n / 2; i++) {
            const float other = __shfl_xor_sync(FULL, hi ? v[i] : v[i + n / 2], mask);
            v[i] = (hi ? v[i + n / 2] : v[i]) + other;
        }
    }
#pragma unroll
    for (; mask > 0; mask >>= 1) v[0] += __shfl_xor_sync(FULL, v[0], mask);
    // Lane l now holds value l / (32 / K).
#pragma unroll
    for (int u = 0; u < K; u++) out[u] = __shfl_sync(FULL, v[0], u * (32 / K));
}

// The fused decode attention of one (query head, sequence, split), K cached keys per warp per
// step. Sharing each key load among 2 or 4 heads of a KV group (16x fewer L2 bytes at most) was
// measured on the H200 and dropped (commit 84642e3 has it): 1-2% slower at depth 0 and, with
// K = 8, at depth 8192 too; the loop is bound by load latency more than by L2 bytes, which is
// what K addresses.
template <int K>
__device__ __forceinline__ void attn_fused_body(const float* qkv, long ld, int nq, int nkv, const float* qn_w,
                                                const float* kn_w, float eps, const int* pos, int rope,
                                                float theta_scale, __half* kc, __half* vc, long slot_stride,
                                                const int* slots, int window, float scale, float* part, int S,
                                                int kmin, unsigned* cnt, float* out_f, i8* q, float* qd, float* qs,
                                                int ring) {
    pdl_trigger();
    const int h = blockIdx.x, b = blockIdx.y, sp = blockIdx.z;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Positions are written only at the end of the previous step (or by the host), so the
    // splits this step needs are known before waiting: the others leave at once instead of
    // holding a slot while the projection finishes.
    const int p = pos[b];
    const int lo = attn_lo(p, window);
    const int used = attn_splits_used(p, window, S, kmin);  // counting the new key
    if (sp >= used) return;
    const int ncache = p - lo;                 // cached keys [lo, p)
    const int chunk = (ncache + used - 1) / used;
    const int k0 = lo + sp * chunk, k1 = min(p, k0 + chunk);
    const int grp = nq / nkv, g = h / grp;
    kc += (long)slots[b] * slot_stride;
    vc += (long)slots[b] * slot_stride;
    const long stride = (long)nkv * 128;
    // K keys per warp per step (keys j + 4u), their loads issued together, and the next
    // step's loads issued before this step's arithmetic (the loop is latency-bound).
    uint2 kr[K], vr[K];
    auto load_keys = [&](int j, uint2* kd, uint2* vd) {
#pragma unroll
        for (int u = 0; u < K; u++) {
            const int jj = min(j + 4 * u, k1 - 1);
            const long jr = ring > 0 ? jj % ring : jj;
            kd[u] = *(const uint2*)(kc + jr * stride + g * 128 + 4 * lane);
            vd[u] = *(const uint2*)(vc + jr * stride + g * 128 + 4 * lane);
        }
    };
    // The first keys are cached rows below p, written by earlier steps (a graph replay or
    // a stream-ordered prefill ago), never by the kernel this one waits on: load them before
    // waiting, so their latency overlaps the projection's tail.
    if (k0 + w < k1) load_keys(k0 + w, kr, vr);
    pdl_wait();
    const float* row = qkv + (long)b * ld;
    // q (and, for the new key, k) normalized and rotated: lane holds dims 4*lane .. 4*lane+3.
    auto norm_rope = [&](const float* src, const float* nw, float* v) {
        const float4 v4 = *(const float4*)(src + 4 * lane);
        v[0] = v4.x; v[1] = v4.y; v[2] = v4.z; v[3] = v4.w;
        head_norm_rope(v, nw, eps, rope, p, theta_scale, lane);
    };
    // The gate value of this thread's output dimension, needed last, requested first.
    const float gt = row[(long)(nq + 2 * nkv) * 128 + h * 128 + threadIdx.x];
    float qv[4];
    norm_rope(row + (long)h * 128, qn_w, qv);
#pragma unroll
    for (int i = 0; i < 4; i++) qv[i] *= scale;
    float m = -INFINITY, l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    const bool owner = sp == 0 && w == 0;  // this warp also takes the new key
    if (owner) {
        float kv[4];
        norm_rope(row + (long)(nq + g) * 128, kn_w, kv);
        float4 v4 = *(const float4*)(row + (long)(nq + nkv + g) * 128 + 4 * lane);
        // The new key and value as the F16 cache holds them (what later steps and the
        // three-kernel path read).
#pragma unroll
        for (int i = 0; i < 4; i++) kv[i] = __half2float(__float2half(kv[i]));
        v4 = make_float4(__half2float(__float2half(v4.x)), __half2float(__float2half(v4.y)),
                         __half2float(__float2half(v4.z)), __half2float(__float2half(v4.w)));
        m = warp_sum(qv[0] * kv[0] + qv[1] * kv[1] + qv[2] * kv[2] + qv[3] * kv[3]);
        l = 1.f;
        acc[0] = v4.x; acc[1] = v4.y; acc[2] = v4.z; acc[3] = v4.w;
        if (h % grp == 0) {
            // The group's first head stores the new K/V for later steps (this launch reads
            // cached keys below p only).
            const long o = (long)(ring > 0 ? p % ring : p) * nkv * 128 + g * 128 + 4 * lane;
            store_new_kv(kc, vc, o, kv, v4);
        }
    }
    for (int j = k0 + w; j < k1; j += 4 * K) {
        uint2 kn[K], vn[K];
        if (j + 4 * K < k1) load_keys(j + 4 * K, kn, vn);
        float2 ka[K], kb[K], va[K], vb[K];
#pragma unroll
        for (int u = 0; u < K; u++) {
            ka[u] = __half22float2(*(const __half2*)&kr[u].x);
            kb[u] = __half22float2(*(const __half2*)&kr[u].y);
            va[u] = __half22float2(*(const __half2*)&vr[u].x);
            vb[u] = __half22float2(*(const __half2*)&vr[u].y);
        }
        float sv[K];
        float mx = m;
        float pd[K];
#pragma unroll
        for (int u = 0; u < K; u++)
            pd[u] = qv[0] * ka[u].x + qv[1] * ka[u].y + qv[2] * kb[u].x + qv[3] * kb[u].y;
        warp_sum_k<K>(pd, sv);
#pragma unroll
        for (int u = 0; u < K; u++) {
            if (j + 4 * u >= k1) sv[u] = -INFINITY;
            mx = fmaxf(mx, sv[u]);
        }
        const float corr = __expf(m - mx);
        l *= corr;
#pragma unroll
        for (int i = 0; i < 4; i++) acc[i] *= corr;
#pragma unroll
        for (int u = 0; u < K; u++) {
            const float pe = j + 4 * u < k1 ? __expf(sv[u] - mx) : 0.f;
            l += pe;
            acc[0] += pe * va[u].x;
            acc[1] += pe * va[u].y;
            acc[2] += pe * vb[u].x;
            acc[3] += pe * vb[u].y;
        }
        m = mx;
#pragma unroll
        for (int u = 0; u < K; u++) {
            kr[u] = kn[u];
            vr[u] = vn[u];
        }
    }
    __shared__ unsigned last;
    const int d = threadIdx.x;
    float M, L, A;
    merge_warps(m, l, acc, M, L, A);
    if (used > 1) {
        float* o = part + (((long)b * nq + h) * S + sp) * 130;
        o[d] = A;
        if (d == 0) { o[128] = M; o[129] = L; }
        __syncthreads();
        if (d == 0) {
            const unsigned prev = arrive_acq_rel(cnt + (long)b * nq + h);
            last = prev == (unsigned)(used - 1);
            if (last) cnt[(long)b * nq + h] = 0;
        }
        __syncthreads();
        if (!last) return;
        merge_splits<128, 32>(part + ((long)b * nq + h) * S * 130, used, d, M, L, A);
    }
    const float v = (L > 0.f ? A / L : 0.f) * (1.f / (1.f + __expf(-gt)));
    store_head_out(v, (long)b * nq * 128 + h * 128 + d, out_f, q, qd, qs);
}

#define ATTN_FUSED_ENTRY(NAME, K)                                                                               \
    extern "C" __global__ void NAME(const float* qkv, long ld, int nq, int nkv, const float* qn_w,              \
                                    const float* kn_w, float eps, const int* pos, int rope, float theta_scale,  \
                                    __half* kc, __half* vc, long slot_stride, const int* slots, int window,     \
                                    float scale, float* part, int S, int kmin, unsigned* cnt, float* out_f,     \
                                    i8* q, float* qd, float* qs, int ring) {                                    \
        attn_fused_body<K>(qkv, ld, nq, nkv, qn_w, kn_w, eps, pos, rope, theta_scale, kc, vc, slot_stride,      \
                           slots, window, scale, part, S, kmin, cnt, out_f, q, qd, qs, ring);                   \
    }
ATTN_FUSED_ENTRY(attn_decode_fused_k8, 8)

// ---------------------------------------------------------------------------------------------
// Tensor-core pieces of the grouped attention kernels (the decode kernels below and the flash
// prefill): the `grp` query heads that share KV head g (at most 16) form the 16 rows of
// mma.m16n8k16 operands, so each cached key and value is read once per group instead of once
// per head. S = Q K^T with Q (16 heads x 128 dims, f16) as the A operand; the dot product's
// dimension order is free, so lane quad c of a key reads dims 32s + 8c .. +8 as one 16-byte
// chunk and Q's fragments use the same order. O += P V: P (f16) reuses the score accumulators
// as the A operand. Online softmax per row in f32.
__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm_x4_trans(u32* r, const void* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ u32 pack_half2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *(const u32*)&h;
}
// Online-softmax steps shared by the grouped decode kernels, for score tiles of mma.m16n8k16
// (each lane: rows r (elements 0, 1) and r + 8 (2, 3)). rescale_rows: the rows' new maxima
// over the lane quad (mx0, mx1 hold the lane's candidates, and come back reduced), the factors
// c0, c1 that bring the old sums to them, and the output accumulators rescaled. tile_probs:
// the probabilities of a 16-key tile (two 8-key halves) and, packed to f16, P's A fragment.
__device__ __forceinline__ void rescale_rows(float& mx0, float& mx1, float& m0, float& m1, float& c0, float& c1,
                                             float (*o)[4]) {
#pragma unroll
    for (int o2 = 1; o2 < 4; o2 <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL, mx0, o2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL, mx1, o2));
    }
    c0 = __expf(m0 - mx0);
    c1 = __expf(m1 - mx1);
    m0 = mx0;
    m1 = mx1;
#pragma unroll
    for (int nt = 0; nt < 16; nt++) {
        o[nt][0] *= c0; o[nt][1] *= c0;
        o[nt][2] *= c1; o[nt][3] *= c1;
    }
}
__device__ __forceinline__ void tile_probs(const float (*sc)[4], float mx0, float mx1, float (*pe)[4], u32* pa) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        pe[h][0] = __expf(sc[h][0] - mx0);
        pe[h][1] = __expf(sc[h][1] - mx0);
        pe[h][2] = __expf(sc[h][2] - mx1);
        pe[h][3] = __expf(sc[h][3] - mx1);
    }
    pa[0] = pack_half2(pe[0][0], pe[0][1]);
    pa[1] = pack_half2(pe[0][2], pe[0][3]);
    pa[2] = pack_half2(pe[1][0], pe[1][1]);
    pa[3] = pack_half2(pe[1][2], pe[1][3]);
}

// Offset in halves of 16-byte chunk `ch` (0..15) of staged row `row`.
__device__ __forceinline__ int gqa_swz(int row, int ch) { return row * 128 + 8 * (ch ^ (row & 7)); }

// Q's A fragments for k-steps 2s and 2s+1 from the lane's 16-byte chunks of rows r (h0) and
// r + 8 (h1), dims 32s + 8c .. +8: k-step 2s+t covers dims 32s + 8c + 4t + {0,1} (k 2c..) and
// + {2,3} (k 8+2c..), the order of the 16-byte K chunks gqa_tile reads.
__device__ __forceinline__ void gqa_q_frags(u32 (*qa)[4], uint4 h0, uint4 h1) {
    qa[0][0] = h0.x; qa[0][1] = h1.x; qa[0][2] = h0.y; qa[0][3] = h1.y;
    qa[1][0] = h0.z; qa[1][1] = h1.z; qa[1][2] = h0.w; qa[1][3] = h1.w;
}

// One 16-key tile t of a grouped attention pass over staged rows (attn_prefill_flash): S = Q K^T for pass keys 16 t .. 16 t + 15, each score v of pass key i
// replaced by score(i, v) (the kernel's mask, and its scale where Q is not scaled), then the
// online-softmax update of the rows' maxima and sums and O += P V (V read transposed with
// ldmatrix). qa: Q's A fragments in the permuted dimension order of the K chunks.
template <typename Score>
__device__ __forceinline__ void gqa_tile(const __half* sK, const __half* sV, int t, const u32 (*qa)[4], Score score,
                                         float (*o)[4], float& m0, float& m1, float& l0, float& l1) {
    const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    float sc[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
        sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
        const int kr = 16 * t + 8 * nt + r;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const uint4 kv = *(const uint4*)(sK + gqa_swz(kr, 4 * s + c));
            mma_16816(sc[nt], qa[2 * s], kv.x, kv.y);
            mma_16816(sc[nt], qa[2 * s + 1], kv.z, kv.w);
        }
    }
    // Each thread holds columns 2c, 2c+1 of both 8-key halves, for rows r (elements 0, 1) and
    // r + 8 (2, 3).
    const int jl = 16 * t + 2 * c;
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int e = 0; e < 4; e++) sc[nt][e] = score(jl + 8 * nt + (e & 1), sc[nt][e]);
        mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
    }
    float c0, c1, pe[2][4];
    u32 pa[4];
    rescale_rows(mx0, mx1, m0, m1, c0, c1, o);
    tile_probs(sc, mx0, mx1, pe, pa);
    l0 = l0 * c0 + pe[0][0] + pe[0][1] + pe[1][0] + pe[1][1];
    l1 = l1 * c1 + pe[0][2] + pe[0][3] + pe[1][2] + pe[1][3];
    // Lane i addresses row (i & 7) of matrix i >> 3: keys 8 (m & 1) + (i & 7), dims
    // 16 u + 8 (m >> 1).
    const int mi = lane >> 3, key = 16 * t + 8 * (mi & 1) + (lane & 7);
#pragma unroll
    for (int u = 0; u < 8; u++) {
        u32 bv[4];
        ldsm_x4_trans(bv, sV + gqa_swz(key, 2 * u + (mi >> 1)));
        mma_16816(o[2 * u], pa, bv[0], bv[1]);
        mma_16816(o[2 * u + 1], pa, bv[2], bv[3]);
    }
}

// ---------------------------------------------------------------------------------------------
// Grouped decode attention without shared memory (attn_decode_gqr; its warp is also the unit
// of the cluster kernels below): one warp per (KV group, sequence, split), every operand in
// registers, so the kernel starts on any SM beside the GEMV before it.
// The grp <= 16 query heads of KV head g are the 16 rows of mma.m16n8k16 operands, so each
// cached key and value is read once per group, not once per head.
//   Lane (r, c) (r = lane / 4, c = lane % 4) loads, per 16-key tile, rows jb + r and jb + 8 + r
//   of K and V as four 16-byte chunks each: dims 32 s + 8 c .. + 8, s = 0..3. Those are B
//   fragments of S = Q K^T as they come (the dot product's dimension order is free: Q's A
//   fragments use the same order). For O += P V the value chunks are transposed in registers
//   with movmatrix: register i of chunk s of rows jb .. jb + 7 becomes the B fragment of keys
//   0..7 and output dims 32 s + 8 (n / 2) + 2 i + n % 2 for column n, so lane (r, c) ends with
//   dims 32 s + 8 c .. + 8 of heads r and r + 8, the layout it loaded Q in.
//   Q (and the new key) are normalized over the lane quad that holds a head and rotated with
//   a table the warp computes before the programmatic-launch wait, while the first tile, all
//   rows written by earlier steps, is also loaded then. The new key (position p, last of its
//   split) is normalized, stored into the cache by lanes 0..3, and patched into that tile.
// Keys [lo, p] split as the per-head kernel's (split_keys); each split writes part [B][nq][S][130] and
// attn_combine_gate merges them (also when one split was used). NT 16-key tiles are loaded
// together per step. grid (nkv, B, S), block 32.
__device__ __forceinline__ u32 movm_trans(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}
__device__ __forceinline__ u32 u4_at(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Eight f32 at p (32-byte aligned) into v.
__device__ __forceinline__ void load8(const float* p, float* v) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// One head in lane-quad layout (lane (r, c): dims 32 s + 8 c + e in v[8 s + e]): RMSNorm with
// weights nw (same layout), NORM RoPE of pair 16 s + 4 c + k by (cs[4 s + k], sn[4 s + k])
// when `rope`, times `scale`; packed to f16 as chunk s = uint4 h[s].
__device__ __forceinline__ void quad_head(float* v, const float* nw, float eps, bool rope, const float* cs,
                                          const float* sn, float scale, uint4* h) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 32; i++) ss += v[i] * v[i];
    ss += __shfl_xor_sync(FULL, ss, 1);
    ss += __shfl_xor_sync(FULL, ss, 2);
    const float s = 1.0f / sqrtf(ss / 128.f + eps);
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] = v[i] * s * nw[i];
    if (rope) {
#pragma unroll
        for (int k = 0; k < 16; k++) {
            const float a = v[2 * k], b = v[2 * k + 1];
            v[2 * k] = a * cs[k] - b * sn[k];
            v[2 * k + 1] = a * sn[k] + b * cs[k];
        }
    }
#pragma unroll
    for (int i = 0; i < 32; i++) v[i] *= scale;
#pragma unroll
    for (int q = 0; q < 4; q++)
        h[q] = make_uint4(pack_half2(v[8 * q], v[8 * q + 1]), pack_half2(v[8 * q + 2], v[8 * q + 3]),
                          pack_half2(v[8 * q + 4], v[8 * q + 5]), pack_half2(v[8 * q + 6], v[8 * q + 7]));
}

// One warp's pass of the grouped register attention over keys [k0, k1) (k0 < k1, within
// [lo, p]) of KV group g for sequence b: the 16 rows of its outputs are the group's query heads
// (lane (r, c): o[4 s + i] holds dims 32 s + 8 c + 2 i + {0, 1} of heads r (0, 1) and r + 8
// (2, 3)), with their running maxima m0, m1 and sums l0, l1 (summed over the lane quad). Waits
// for the previous kernel (pdl_wait) after requesting its first tiles. The warp whose range
// holds p also normalizes and stores the new key and value. soff: the sequence's cache offset.
template <int NT>
__device__ __forceinline__ void gqr_warp(const float* qkv, long ld, int nq, int nkv, const float* qn_w,
                                         const float* kn_w, float eps, int rope, float theta_scale, __half* kc,
                                         __half* vc, long soff, int ring, float scale, int g, int b, int p, int k0,
                                         int k1, float (*o)[4], float& m0, float& m1, float& l0, float& l1) {
    const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    const int grp = nq / nkv;
    const long stride = (long)nkv * 128;
    const __half* kl = kc + soff + g * 128 + 8 * c;
    const __half* vl = vc + soff + g * 128 + 8 * c;
    // Rows jb + 8 h + r of NT tiles (keys past the range's end repeat its last row, whose
    // values are finite, and are masked): keys and values loaded apart, so that the next
    // tiles' keys are requested once the scores are computed and their values once the
    // values are used, with no registers beyond one set of tiles.
    uint4 kt[NT][2][4], vt[NT][2][4];
    auto load_half = [&](int jb, bool values) {
#pragma unroll
        for (int u = 0; u < NT; u++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int j = min(jb + 16 * u + 8 * h + r, k1 - 1);
                const long off = (long)(ring > 0 ? j % ring : j) * stride;
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    if (values)
                        vt[u][h][s] = *(const uint4*)(vl + off + 32 * s);
                    else
                        kt[u][h][s] = *(const uint4*)(kl + off + 32 * s);
                }
            }
        }
    };
    // Before the wait: the first tiles (rows below p are final; row p is patched below) and
    // the rotation of the lane's pairs 16 s + 4 c + k (lane i computes pairs 2 i, 2 i + 1).
    load_half(k0, false);
    load_half(k0, true);
    float cs[16] = {}, sn[16] = {};
    if (rope) {
        float tc[2], ts[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const float theta = (float)p * powf(theta_scale, (float)(2 * lane + k));
            sincosf(theta, &ts[k], &tc[k]);
        }
#pragma unroll
        for (int s = 0; s < 4; s++) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int src = 8 * s + 2 * c + (k >> 1);
                cs[4 * s + k] = __shfl_sync(FULL, tc[k & 1], src);
                sn[4 * s + k] = __shfl_sync(FULL, ts[k & 1], src);
            }
        }
    }
    float nw[32];
#pragma unroll
    for (int s = 0; s < 4; s++) load8(qn_w + 32 * s + 8 * c, nw + 8 * s);
    pdl_wait();
    const float* row = qkv + (long)b * ld;
    // Q as A fragments: k-step 2 s + t covers dims 32 s + 8 c + 4 t + {0, 1} (k 2c ..) and
    // + {2, 3} (k 2c + 8 ..), matching the key chunks.
    u32 qa[8][4];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int hl = r + 8 * hh;
        float v[32];
        uint4 hq[4];
        if (hl < grp) {
#pragma unroll
            for (int s = 0; s < 4; s++) load8(row + (long)(g * grp + hl) * 128 + 32 * s + 8 * c, v + 8 * s);
        } else {
#pragma unroll
            for (int i = 0; i < 32; i++) v[i] = 0.f;
        }
        quad_head(v, nw, eps, rope, cs, sn, scale, hq);
#pragma unroll
        for (int s = 0; s < 4; s++) {
            qa[2 * s][hh] = hq[s].x;
            qa[2 * s][2 + hh] = hq[s].y;
            qa[2 * s + 1][hh] = hq[s].z;
            qa[2 * s + 1][2 + hh] = hq[s].w;
        }
    }
    // The range holding the new key: every lane normalizes and rotates its chunks of it,
    // lanes 0..3 store it and its value into the cache (later tiles load them from there),
    // and the first tiles' rows at or past p take them.
    if (k0 <= p && p < k1) {
        float v[32];
        uint4 nkh[4], nvh[4];
#pragma unroll
        for (int s = 0; s < 4; s++) load8(kn_w + 32 * s + 8 * c, nw + 8 * s);
#pragma unroll
        for (int s = 0; s < 4; s++) load8(row + (long)(nq + g) * 128 + 32 * s + 8 * c, v + 8 * s);
        quad_head(v, nw, eps, rope, cs, sn, 1.f, nkh);
#pragma unroll
        for (int s = 0; s < 4; s++) load8(row + (long)(nq + nkv + g) * 128 + 32 * s + 8 * c, v + 8 * s);
#pragma unroll
        for (int s = 0; s < 4; s++)
            nvh[s] = make_uint4(pack_half2(v[8 * s], v[8 * s + 1]), pack_half2(v[8 * s + 2], v[8 * s + 3]),
                                pack_half2(v[8 * s + 4], v[8 * s + 5]), pack_half2(v[8 * s + 6], v[8 * s + 7]));
        if (r == 0) {
            const long off = (long)(ring > 0 ? p % ring : p) * stride;
#pragma unroll
            for (int s = 0; s < 4; s++) {
                *(uint4*)(kc + soff + g * 128 + 8 * c + off + 32 * s) = nkh[s];
                *(uint4*)(vc + soff + g * 128 + 8 * c + off + 32 * s) = nvh[s];
            }
        }
#pragma unroll
        for (int u = 0; u < NT; u++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (k0 + 16 * u + 8 * h + r >= p) {
#pragma unroll
                    for (int s = 0; s < 4; s++) {
                        kt[u][h][s] = nkh[s];
                        vt[u][h][s] = nvh[s];
                    }
                }
            }
        }
        __syncwarp();  // orders the stores before this warp's later loads of row p
    }
#pragma unroll
    for (int nt = 0; nt < 16; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows r and r + 8
    for (int jb = k0; jb < k1; jb += 16 * NT) {
        const int jn = jb + 16 * NT;  // the next step's first key
        // Scores: two accumulation chains per 8-key half (dims 0..63, 64..127), then summed.
        float sc[NT][2][4];
#pragma unroll
        for (int u = 0; u < NT; u++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float s2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int e = 0; e < 4; e++) sc[u][h][e] = 0.f;
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    float* acc = s < 2 ? sc[u][h] : s2;
                    mma_16816(acc, qa[2 * s], kt[u][h][s].x, kt[u][h][s].y);
                    mma_16816(acc, qa[2 * s + 1], kt[u][h][s].z, kt[u][h][s].w);
                }
#pragma unroll
                for (int e = 0; e < 4; e++) sc[u][h][e] += s2[e];
            }
        }
        if (jn < k1) load_half(jn, false);
        // Column 2c + e of half h of tile u is key jb + 16 u + 8 h + 2 c + e.
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int u = 0; u < NT; u++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    if (jb + 16 * u + 8 * h + 2 * c + (e & 1) >= k1) sc[u][h][e] = -INFINITY;
                }
                mx0 = fmaxf(mx0, fmaxf(sc[u][h][0], sc[u][h][1]));
                mx1 = fmaxf(mx1, fmaxf(sc[u][h][2], sc[u][h][3]));
            }
        }
        float c0, c1;
        rescale_rows(mx0, mx1, m0, m1, c0, c1, o);
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int u = 0; u < NT; u++) {
            if (jb + 16 * u >= k1) break;
            float pe[2][4];
            u32 pa[4];
            tile_probs(sc[u], mx0, mx1, pe, pa);
            l0 += pe[0][0] + pe[0][1] + pe[1][0] + pe[1][1];
            l1 += pe[0][2] + pe[0][3] + pe[1][2] + pe[1][3];
#pragma unroll
            for (int s = 0; s < 4; s++) {
#pragma unroll
                for (int i = 0; i < 4; i++)
                    mma_16816(o[4 * s + i], pa, movm_trans(u4_at(vt[u][0][s], i)),
                              movm_trans(u4_at(vt[u][1][s], i)));
            }
        }
        if (jn < k1) load_half(jn, true);
    }
    l0 += __shfl_xor_sync(FULL, l0, 1);
    l0 += __shfl_xor_sync(FULL, l0, 2);
    l1 += __shfl_xor_sync(FULL, l1, 1);
    l1 += __shfl_xor_sync(FULL, l1, 2);
}

template <int NT>
__device__ __forceinline__ void attn_gqr_body(const float* qkv, long ld, int nq, int nkv, const float* qn_w,
                                              const float* kn_w, float eps, const int* pos, int rope,
                                              float theta_scale, __half* kc, __half* vc, long slot_stride,
                                              const int* slots, int window, float scale, float* part, int S,
                                              int kmin, int ring) {
    pdl_trigger();
    const int g = blockIdx.x, b = blockIdx.y, sp = blockIdx.z;
    const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    const int grp = nq / nkv;
    // Positions are written only at the end of the previous step (or by the host).
    const int p = pos[b];
    const int used = attn_splits_used(p, window, S, kmin);
    if (sp >= used) return;
    int k0, k1;  // keys [k0, k1)
    split_keys(p, window, used, sp, k0, k1);
    float o[16][4], m0, m1, l0, l1;
    gqr_warp<NT>(qkv, ld, nq, nkv, qn_w, kn_w, eps, rope, theta_scale, kc, vc, (long)slots[b] * slot_stride, ring,
                 scale, g, b, p, k0, k1, o, m0, m1, l0, l1);
    // Output tile (s, i) holds dims 32 s + 8 c + 2 i + {0, 1} of heads r (0, 1) and r + 8 (2, 3).
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int hl = r + 8 * hh;
        if (hl >= grp) continue;
        float* po = part + (((long)b * nq + g * grp + hl) * S + sp) * 130;
#pragma unroll
        for (int s = 0; s < 4; s++) {
#pragma unroll
            for (int i = 0; i < 4; i++)
                *(float2*)(po + 32 * s + 8 * c + 2 * i) = make_float2(o[4 * s + i][2 * hh], o[4 * s + i][2 * hh + 1]);
        }
        if (c == 0) {
            po[128] = hh ? m1 : m0;
            po[129] = hh ? l1 : l0;
        }
    }
}

#define ATTN_GQR_ENTRY(NAME, NT)                                                                               \
    extern "C" __global__ __launch_bounds__(32) void NAME(                                                     \
        const float* qkv, long ld, int nq, int nkv, const float* qn_w, const float* kn_w, float eps,           \
        const int* pos, int rope, float theta_scale, __half* kc, __half* vc, long slot_stride,                 \
        const int* slots, int window, float scale, float* part, int S, int kmin, int ring) {                   \
        attn_gqr_body<NT>(qkv, ld, nq, nkv, qn_w, kn_w, eps, pos, rope, theta_scale, kc, vc, slot_stride,      \
                          slots, window, scale, part, S, kmin, ring);                                          \
    }
ATTN_GQR_ENTRY(attn_decode_gqr, 1)

// ---------------------------------------------------------------------------------------------
// Grouped decode attention in one launch, its splits merged behind a thread-block cluster
// barrier (attn_decode_gqc*; sm_90). grid (nkv, B, CL) with cluster (1, 1, CL): the CL blocks
// of a (KV group, sequence) are one cluster, and each of their GQC_WARPS warps takes one of
// CL * GQC_WARPS key ranges ("virtual splits", as attn_splits_used and split_keys divide
// [lo, p]) with gqr_warp and writes its record to `part` as it holds it (fragment layout,
// GQC_REC floats: element e of lane l at 128 (e / 4) + 4 l + e % 4, then m0, m1, l0, l1 of
// lane l at 2048 + 4 l). After the cluster barrier (release / acquire at cluster scope) block
// k finishes heads k, k + CL, ... of the group: thread d reads dimension d of that head from
// every record that has keys (L2 loads, all in flight), merges in record order, applies the
// sigmoid gate and stores the output (f32 and/or quantized). No shared memory (a decode kernel
// that asks for some cannot start beside the GEMV before it: docs/benchmarks.md), no arrival
// counters, no combine kernel. part: [B][nkv][CL * GQC_WARPS][GQC_REC] floats.
#define GQC_WARPS 4
#define GQC_REC 2176
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The merge factors of a head's records, record lane + 32 k with maximum mj[k] (-inf: none)
// and sum lj[k]: fj[k] = exp(mj[k] - M) against the maximum M over the warp (0 for none); returns
// the merged sum over the warp, sum of lj fj.
template <int NK>
__device__ __forceinline__ float gqc_factors(const float* mj, const float* lj, float* fj) {
    float mt = mj[0];
#pragma unroll
    for (int k = 1; k < NK; k++) mt = fmaxf(mt, mj[k]);
    const float M = warp_max(mt);
    float lt = 0.f;
#pragma unroll
    for (int k = 0; k < NK; k++) {
        fj[k] = mj[k] == -INFINITY ? 0.f : __expf(mj[k] - M);
        lt += lj[k] * fj[k];
    }
    return warp_sum(lt);
}

template <int NT, int CL, int W = GQC_WARPS>
__device__ __forceinline__ void attn_gqc_body(const float* qkv, long ld, int nq, int nkv, const float* qn_w,
                                              const float* kn_w, float eps, const int* pos, int rope,
                                              float theta_scale, __half* kc, __half* vc, long slot_stride,
                                              const int* slots, int window, float scale, float* part, int kmin,
                                              float* out_f, i8* q, float* qd, float* qs, int ring) {
    constexpr int NR = CL * W;  // records per (group, sequence), at most 128
    static_assert(CL * (W / 4) >= 16, "every head of a group has 128 threads");
    pdl_trigger();
    const int g = blockIdx.x, b = blockIdx.y, rank = blockIdx.z;  // gridDim.z == CL
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = nq / nkv;
    const int p = pos[b];
    const int used = attn_splits_used(p, window, NR, kmin);
    const int vs = rank * W + w;
    float* base = part + ((long)b * nkv + g) * NR * GQC_REC;
    if (vs < used) {
        float o[16][4], m0, m1, l0, l1;
        int k0, k1;
        split_keys(p, window, used, vs, k0, k1);
        gqr_warp<NT>(qkv, ld, nq, nkv, qn_w, kn_w, eps, rope, theta_scale, kc, vc,
                         (long)slots[b] * slot_stride, ring, scale, g, b, p, k0, k1, o, m0, m1, l0, l1);
        float* rec = base + (long)vs * GQC_REC;
#pragma unroll
        for (int t = 0; t < 16; t++)
            *(float4*)(rec + 128 * t + 4 * lane) = make_float4(o[t][0], o[t][1], o[t][2], o[t][3]);
        *(float4*)(rec + 2048 + 4 * lane) = make_float4(m0, m1, l0, l1);
    } else {
        pdl_wait();
    }
    // 128 threads per head (at most one each: CL * W / 4 >= 16); with W = 8 the block's
    // second half takes head + CL. The gate is read between arriving and waiting.
    const int d = threadIdx.x & 127;
    const int hl = rank + CL * (threadIdx.x >> 7);
    const bool has_head = hl < grp && hl < 16;
    cluster_arrive();
    const float gt = has_head ? qkv[(long)b * ld + (long)(nq + 2 * nkv) * 128 + (g * grp + hl) * 128 + d] : 0.f;
    cluster_wait();
    if (has_head) {
        const int h = g * grp + hl;
        // Head hl is row rr of the fragments, in elements 2 hh + {0, 1}; dimension d is
        // 32 s + 8 cc + 2 i + e2 of tile 4 s + i in lane 4 rr + cc.
        const int rr = hl & 7, hh = hl >> 3;
        const int e = (4 * (d >> 5) + ((d >> 1) & 3)) * 4 + 2 * hh + (d & 1);
        const int off = 128 * (e >> 2) + 4 * (4 * rr + ((d >> 3) & 3)) + (e & 3);
        constexpr int NA = NR < 64 ? NR : 64;  // record values in flight
        float av[NA];
#pragma unroll
        for (int j = 0; j < NA; j++) av[j] = j < used ? __ldcg(base + (long)j * GQC_REC + off) : 0.f;
        // Records lane + 32 k: maxima, then factors and sums.
        constexpr int NK = (NR + 31) / 32;
        float mj[NK], lj[NK], fj[NK];
#pragma unroll
        for (int k = 0; k < NK; k++) {
            const int j = lane + 32 * k;
            const bool has = j < NR && j < used;
            mj[k] = has ? __ldcg(base + (long)j * GQC_REC + 2048 + 16 * rr + hh) : -INFINITY;
            lj[k] = has ? __ldcg(base + (long)j * GQC_REC + 2048 + 16 * rr + 2 + hh) : 0.f;
        }
        const float L = gqc_factors<NK>(mj, lj, fj);
        float A = 0.f;
#pragma unroll
        for (int j0 = 0; j0 < NR; j0 += NA) {
            if (j0 > 0) {
#pragma unroll
                for (int j = 0; j < NA; j++)
                    av[j] = j0 + j < used ? __ldcg(base + (long)(j0 + j) * GQC_REC + off) : 0.f;
            }
#pragma unroll
            for (int j = 0; j < NA; j++) A += av[j] * __shfl_sync(FULL, fj[(j0 + j) >> 5], (j0 + j) & 31);
        }
        const float v = (L > 0.f ? A / L : 0.f) * (1.f / (1.f + __expf(-gt)));
        store_head_out(v, (long)b * nq * 128 + h * 128 + d, out_f, q, qd, qs);
    }
}

#define ATTN_GQC_ENTRY(NAME, NT, CL, W)                                                                           \
    extern "C" __global__ __launch_bounds__(32 * W) void NAME(                                                    \
        const float* qkv, long ld, int nq, int nkv, const float* qn_w, const float* kn_w, float eps,              \
        const int* pos, int rope, float theta_scale, __half* kc, __half* vc, long slot_stride,                    \
        const int* slots, int window, float scale, float* part, int S, int kmin, float* out_f, i8* q, float* qd,  \
        float* qs, int ring) {                                                                                    \
        attn_gqc_body<NT, CL, W>(qkv, ld, nq, nkv, qn_w, kn_w, eps, pos, rope, theta_scale, kc, vc, slot_stride,  \
                              slots, window, scale, part, kmin, out_f, q, qd, qs, ring);                          \
    }
// Measured on the H200 and dropped in session 14 (commit dd5bd30 has them): two tiles per
// step (spills), 8-block clusters, L2 prefetch of each warp's later rows, at most 170
// registers (3 blocks per SM). Eight warps per block (gqc16w8) was within noise.
ATTN_GQC_ENTRY(attn_decode_gqc16n1, 1, 16, 4)
ATTN_GQC_ENTRY(attn_decode_gqc16w8, 1, 16, 8)

// Prefill attention in one pass (flash attention: no score matrix in memory). One warp per
// (token, KV group): the group's query heads (at most 16) are the 16 rows of mma.m16n8k16, so
// the rows share the token's position and mask. A block of FA_WARPS
// consecutive tokens of one KV group stages the keys and values they attend to in passes of
// FA_KEYS rows (16-byte chunks swizzled as gqa_swz, double-buffered with cp.async), and each
// warp visits only the 16-key tiles that hold one of its keys [lo(p), p]; within a tile the
// other keys are masked. The chunk's own keys are already in the cache (qk_norm_rope_store
// runs first). q_h [nq][T][128] f16 (normalized and rotated, not scaled), caches one sequence's
// rows (row of position j: j % ring with a ring), o [nq][T][128] f32, normalized.
// grid (ceil(T / FA_WARPS), nkv), block 32 FA_WARPS, FA_SMEM bytes of dynamic shared memory.
#define FA_WARPS 8
#define FA_KEYS 64
#define FA_SMEM (2 * 2 * FA_KEYS * 128 * 2)
extern "C" __global__ __launch_bounds__(32 * FA_WARPS) void attn_prefill_flash(
    const __half* q_h, int T, int nq, int nkv, const __half* kc, const __half* vc, int p0, int window, float scale,
    int ring, float* o_out) {
    pdl_trigger();
    const int g = blockIdx.y, w = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    const int grp = nq / nkv;
    const int tb = blockIdx.x * FA_WARPS, te = min(T, tb + FA_WARPS);
    const int tok = tb + w;
    const bool active = tok < te;
    const int p = p0 + (active ? tok : te - 1);
    const int lo = attn_lo(p, window);
    // The block's keys: from the first token's lowest to the last token's position.
    const int kb0 = attn_lo(p0 + tb, window), kb1 = p0 + te;
    extern __shared__ __align__(16) unsigned char fa_dyn[];
    __half* sbuf = (__half*)fa_dyn;  // [2 buffers][K | V][FA_KEYS][128], swizzled
    const long stride = (long)nkv * 128;
    auto stage = [&](int buf, int j0, int n) {
        __half* sK = sbuf + (long)buf * 2 * FA_KEYS * 128;
        __half* sV = sK + FA_KEYS * 128;
        const int rows = (n + 15) & ~15;
        for (int i = threadIdx.x; i < rows * 16; i += 32 * FA_WARPS) {
            const int row = i >> 4, ch = i & 15, j = j0 + row;
            const int so = gqa_swz(row, ch);
            if (row < n) {
                const long go = (long)(ring > 0 ? j % ring : j) * stride + g * 128 + 8 * ch;
                cp_async16(sK + so, kc + go);
                cp_async16(sV + so, vc + go);
            } else {
                *(uint4*)(sK + so) = make_uint4(0, 0, 0, 0);
                *(uint4*)(sV + so) = make_uint4(0, 0, 0, 0);
            }
        }
        cp_async_commit();
    };
    pdl_wait();
    stage(0, kb0, min(kb1 - kb0, FA_KEYS));
    // Q as A fragments (the permuted dimension order of the K chunks): rows r and r + 8 are
    // query heads g grp + r and g grp + r + 8 of this token (zero past grp).
    u32 qa[8][4];
    {
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const __half* q0 = q_h + ((long)(g * grp + r) * T + (active ? tok : 0)) * 128;
        const __half* q1 = q_h + ((long)(g * grp + r + 8) * T + (active ? tok : 0)) * 128;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const uint4 h0 = r < grp ? *(const uint4*)(q0 + 32 * s + 8 * c) : zero;
            const uint4 h1 = r + 8 < grp ? *(const uint4*)(q1 + 32 * s + 8 * c) : zero;
            gqa_q_frags(qa + 2 * s, h0, h1);
        }
    }
    float o[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows r and r + 8
    int buf = 0;
    for (int jb = kb0; jb < kb1; jb += FA_KEYS, buf ^= 1) {
        const int n = min(kb1 - jb, FA_KEYS);
        const bool next = jb + FA_KEYS < kb1;
        if (next) stage(buf ^ 1, jb + FA_KEYS, min(kb1 - jb - FA_KEYS, FA_KEYS));
        if (next)
            cp_async_wait<1>();
        else
            cp_async_wait<0>();
        __syncthreads();
        const __half* sK = sbuf + (long)buf * 2 * FA_KEYS * 128;
        const __half* sV = sK + FA_KEYS * 128;
        const int ntiles = (n + 15) >> 4;
        for (int t = 0; active && t < ntiles; t++) {
            const int k0 = jb + 16 * t;  // keys k0 .. k0 + 15 of this tile
            if (k0 > p || k0 + 15 < lo) continue;
            gqa_tile(
                sK, sV, t, qa,
                [&](int i, float v) {
                    const int key = jb + i;
                    return key > p || key < lo || i >= n ? -INFINITY : v * scale;
                },
                o, m0, m1, l0, l1);
        }
        __syncthreads();  // every warp is done with this buffer before it is staged again
    }
    if (!active) return;
    l0 += __shfl_xor_sync(FULL, l0, 1);
    l0 += __shfl_xor_sync(FULL, l0, 2);
    l1 += __shfl_xor_sync(FULL, l1, 1);
    l1 += __shfl_xor_sync(FULL, l1, 2);
    const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
    float* d0 = o_out + ((long)(g * grp + r) * T + tok) * 128;
    float* d1 = o_out + ((long)(g * grp + r + 8) * T + tok) * 128;
#pragma unroll
    for (int nt = 0; nt < 16; nt++) {
        if (r < grp) *(float2*)(d0 + 8 * nt + 2 * c) = make_float2(o[nt][0] * i0, o[nt][1] * i0);
        if (r + 8 < grp) *(float2*)(d1 + 8 * nt + 2 * c) = make_float2(o[nt][2] * i1, o[nt][3] * i1);
    }
}

// a[t][h*128+d] = O[h][t][d] * sigmoid(gate[t][h*128+d]) as bf16. One thread per element.
extern "C" __global__ void gate_heads_bf16(const float* O, const float* gate, long ldg, int n, int nq, bf16* out) {
    pdl_trigger();
    pdl_wait();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long total = (long)n * nq * 128;
    if (i >= total) return;
    const int t = (int)(i / (nq * 128));
    const int c = (int)(i % (nq * 128));
    const int h = c / 128, d = c % 128;
    const float gt = gate[(long)t * ldg + c];
    out[i] = __float2bfloat16(O[((long)h * n + t) * 128 + d] * (1.f / (1.f + __expf(-gt))));
}

// SwiGLU over rows [T][2F] (gate | up, or with `il` interleaved in groups of 16: 16 gate values,
// then their 16 up values): a = silu(gate) * up -> f32, bf16 and/or quantized [T][F]. Four
// values per thread, four lanes per quantization group (quant_part): with sixteen per thread
// the decode step's 19,968 values were a chain of ~1000 dependent instructions on 1,248
// threads, 2.3 us per layer on the H200 (docs/benchmarks.md, session 15). grid: T F / 4 threads.
extern "C" __global__ void swiglu(const float* gu, long F, long T, float* out_f, bf16* out_b, i8* q, float* qd,
                                   float* qs, int il) {
    pdl_trigger();
    pdl_wait();
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long nk = F / 4;
    const bool act = i < T * nk;  // whole groups: T * nk is a multiple of 4
    const long t = act ? i / nk : 0, k = act ? i % nk : 0, g = k / 4;
    const int sub = (int)(k & 3);
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (act) {
        const float* gp = il ? gu + t * 2 * F + 32 * g + 4 * sub : gu + t * 2 * F + 4 * k;
        const float* up = il ? gp + 16 : gp + F;
        const float4 a = *(const float4*)gp, u = *(const float4*)up;
        const float av[4] = {a.x, a.y, a.z, a.w}, uv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 4; e++) v[e] = av[e] / (1.f + __expf(-av[e])) * uv[e];
        if (out_f) *(float4*)(out_f + t * F + 4 * k) = make_float4(v[0], v[1], v[2], v[3]);
        if (out_b) {
            __align__(8) bf16 b[4];
#pragma unroll
            for (int e = 0; e < 4; e++) b[e] = __float2bfloat16(v[e]);
            *(uint2*)(out_b + t * F + 4 * k) = *(uint2*)b;
        }
    }
    if (q) quant_part<4>(v, act, sub == 0, q + t * F + 4 * k, qd + t * (F / 16) + g, qs + t * (F / 16) + g);
}

// Argmax of (value, index) pairs over a warp, then over the block (lowest index among equal
// values); every thread of the block gets the result. sv, si: 32 entries of shared memory.
__device__ __forceinline__ void warp_argmax(float& best, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL, best, o);
        const int oi = __shfl_xor_sync(FULL, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
}
__device__ void block_argmax(float& best, int& bi, float* sv, int* si) {
    warp_argmax(best, bi);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (int)(blockDim.x >> 5);
    if (l == 0) { sv[w] = best; si[w] = bi; }
    __syncthreads();
    best = l < nw ? sv[l] : -INFINITY;
    bi = l < nw ? si[l] : 0x7fffffff;
    warp_argmax(best, bi);
}

// Sampling parameters of one sequence (glimmer/ writes them; 16 bytes).
struct SampleParams {
    float temp;
    int top_k;
    unsigned long long seed;
};

// Order-preserving key of a float: larger floats give larger unsigned keys.
__device__ __forceinline__ u32 order_key(float v) {
    const u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A uniform draw in [0, 1) (24 bits) from a counter-based hash of (seed, position): splitmix64,
// the same function as layout.rs's `sample_uniform`, so a draw can be checked on the host.
__device__ __forceinline__ float sample_uniform(unsigned long long seed, int pos) {
    unsigned long long z = seed ^ ((unsigned long long)(u32)pos * 0x9E3779B97F4A7C15ull);
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

// Logit scale and softcap in place, then a sampled token per row: temperature, top-k (0: the
// whole vocabulary; values tied with the k-th largest are all kept), and a draw from
// sample_uniform(seed, pos). temp <= 0 or top_k == 1 is greedy (lowest index wins ties, as in
// logits_argmax). grid B, block 1024 (at most 1024). Thread t owns the contiguous indices
// [t·C, t·C + C), so sums in index order are the threads' sums in thread order: one thread scans
// them, which makes the draw reproducible. The k-th largest value is found by a radix select
// on order_key (four passes of 8 bits). Token, history and position as in logits_argmax.
extern "C" __global__ void logits_sample(float* logits, long V, float scale, float cap, const SampleParams* sp,
                                         int* tokens, int* pos, int* history, int hist_len, int advance) {
    pdl_trigger();
    pdl_wait();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ u32 hist[256];
    __shared__ float csum[1024];
    __shared__ u32 s_prefix, s_need;
    __shared__ int s_owner, s_tok;
    __shared__ float s_base, s_target, s_max;
    const int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    float* lr = logits + (long)b * V;
    const SampleParams P = sp[b];
    const int p = pos[b];
    const long C = (V + nt - 1) / nt;
    const long j0 = (long)tid * C, j1 = min(V, j0 + C);
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (long j = j0; j < j1; j++) {
        float v = lr[j] * scale;
        if (cap > 0.f) v = cap * tanhf(v / cap);
        lr[j] = v;
        if (v > best) { best = v; bi = (int)j; }
    }
    block_argmax(best, bi, sv, si);
    if (tid == 0) { s_tok = bi; s_max = best; }
    __syncthreads();
    if (P.temp > 0.f && P.top_k != 1) {
        // The key of the k-th largest value (0: keep every value).
        u32 thr = 0;
        if (P.top_k > 0 && P.top_k < V) {
            u32 prefix = 0, need = (u32)P.top_k;
            for (int shift = 24; shift >= 0; shift -= 8) {
                for (int i = tid; i < 256; i += nt) hist[i] = 0;
                __syncthreads();
                const u32 hmask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
                for (long j = j0; j < j1; j++) {
                    const u32 key = order_key(lr[j]);
                    if ((key & hmask) == (prefix & hmask)) atomicAdd(&hist[(key >> shift) & 255], 1u);
                }
                __syncthreads();
                if (tid == 0) {
                    u32 acc = 0;
                    int d = 255;
                    for (; d > 0; d--) {
                        if (acc + hist[d] >= need) break;
                        acc += hist[d];
                    }
                    s_prefix = prefix | ((u32)d << shift);
                    s_need = need - acc;
                }
                __syncthreads();
                prefix = s_prefix;
                need = s_need;
            }
            thr = prefix;
        }
        const float M = s_max, it = 1.f / P.temp;
        float acc = 0.f;
        for (long j = j0; j < j1; j++) {
            const float v = lr[j];
            if (order_key(v) >= thr) acc += expf((v - M) * it);
        }
        csum[tid] = acc;
        __syncthreads();
        if (tid == 0) {
            float tot = 0.f;
            for (int t = 0; t < nt; t++) {
                const float c = csum[t];
                csum[t] = tot;  // exclusive prefix
                tot += c;
            }
            const float target = sample_uniform(P.seed, p) * tot;
            // The first thread whose range carries the target; rounding past the total falls
            // to the last thread with any weight.
            int owner = -1, last = 0;
            for (int t = 0; t < nt; t++) {
                const float hi = t + 1 < nt ? csum[t + 1] : tot;
                if (hi > csum[t]) last = t;
                if (owner < 0 && hi > target && hi > csum[t]) owner = t;
            }
            s_owner = owner < 0 ? last : owner;
            s_base = csum[s_owner];
            s_target = target;
        }
        __syncthreads();
        if (tid == s_owner) {
            float run = s_base;
            int tok = -1;
            for (long j = j0; j < j1; j++) {
                const float v = lr[j];
                if (order_key(v) < thr) continue;
                tok = (int)j;
                run += expf((v - M) * it);
                if (run > s_target) break;
            }
            if (tok >= 0) s_tok = tok;
        }
        __syncthreads();
    }
    if (tid == 0) {
        const int t = s_tok;
        tokens[b] = t;
        if (advance) {
            const int np = p + 1;
            if (np < hist_len) history[(long)b * hist_len + np] = t;
            pos[b] = np;
        }
    }
}

// Logit scale and softcap in place, then greedy argmax per row (lowest index wins ties), spread
// over the row: grid (nblk, B), block 256 (1024 when nblk is 1). Block k takes the k-th of nblk
// contiguous chunks of row b and leaves its (value, index) in pv/pi [B][nblk]; the last block
// of the row to arrive (cnt[b]: zero between launches, put back by that block) merges them with
// the same rule, so the token is the one a single block finds. It goes to tokens[b];
// history[b * hist_len + pos[b] + 1] = token; pos[b] += 1 when advance != 0 (decode loops
// replayed from a CUDA graph). One block per row was a chain of ~200 softcaps per thread over
// Muse Glimmer's 202,048 logits (docs/benchmarks.md, session 15).
extern "C" __global__ void logits_argmax(float* logits, long V, float scale, float cap, int* tokens, int* pos,
                                         int* history, int hist_len, int advance, float* pv, int* pi,
                                         unsigned* cnt) {
    pdl_trigger();
    pdl_wait();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ unsigned last;
    const int b = blockIdx.y, k = blockIdx.x, nblk = gridDim.x;
    const long chunk = (V + nblk - 1) / nblk;
    const long j0 = (long)k * chunk, j1 = min(V, j0 + chunk);
    float* lr = logits + (long)b * V;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (long j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        float v = lr[j] * scale;
        if (cap > 0.f) v = cap * tanhf(v / cap);
        lr[j] = v;
        if (v > best) { best = v; bi = (int)j; }
    }
    block_argmax(best, bi, sv, si);
    if (nblk > 1) {
        if (threadIdx.x == 0) {
            pv[(long)b * nblk + k] = best;
            pi[(long)b * nblk + k] = bi;
            const unsigned prev = arrive_acq_rel(cnt + b);
            last = prev == (unsigned)(nblk - 1);
            if (last) cnt[b] = 0;
        }
        __syncthreads();
        if (!last) return;
        best = -INFINITY;
        bi = 0x7fffffff;
        for (int t = threadIdx.x; t < nblk; t += blockDim.x) {
            const float v = __ldcg(pv + (long)b * nblk + t);
            const int i = __ldcg(pi + (long)b * nblk + t);
            if (v > best || (v == best && i < bi)) { best = v; bi = i; }
        }
        block_argmax(best, bi, sv, si);
    }
    if (threadIdx.x == 0) {
        tokens[b] = bi;
        if (advance) {
            const int p = pos[b] + 1;
            if (p < hist_len) history[(long)b * hist_len + p] = bi;
            pos[b] = p;
        }
    }
}
