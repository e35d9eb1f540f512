// Standalone study: Q4_K decode GEMVs that stream their weights into shared memory with bulk
// copies (cp.async.bulk + mbarrier; one pipeline per warp, a persistent grid) against the
// register-load GEMV of crates/muser-cuda/src/kernels.cu, on the 30B's matrix shapes.
// Findings and numbers: docs/receipts/gpu-h200-gemv-bulk-copy-study.json and the session-12
// notes in docs/benchmarks.md. Needs nvcc (the GPU machine has it); not part of the build.
//   nvcc -O3 -arch=sm_90a -std=c++17 gemv_tma.cu -o gemv_tma
//   ./gemv_tma [LAYERS=52] [x: also the bulk-copy read ceiling] [x: checks only, for ncu]
//   bash prof.sh   (Nsight Compute stall reasons of the gate+up and down launches)
// Every variant is checked bit for bit against the register kernel before it is timed.
#include "../crates/muser-cuda/src/common.cuh"
#include "../crates/muser-cuda/src/kernels.cu"

#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

// ---- One warp's pipeline of ST shared-memory stages filled by bulk copies ----
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
struct WarpPipe {
    u8* buf;    // ST stages of TB bytes
    u64* bars;  // ST mbarriers
    int tb, st;
    __device__ void init() {
        if ((threadIdx.x & 31) == 0) {
            for (int s = 0; s < st; s++)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[s])) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
    }
    // Lane 0: stage t % st expects `bytes` in total (then copy() pieces of it in).
    __device__ u8* expect(int t, u32 bytes) {
        const int s = t % st;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bars[s])), "r"(bytes) : "memory");
        return buf + (long)s * tb;
    }
    __device__ void copy(int t, void* dst, const void* src, u32 bytes) {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         smem_u32(dst)),
                     "l"(src), "r"(bytes), "r"(smem_u32(&bars[t % st]))
                     : "memory");
    }
    // Every lane: waits until stage t has landed; returns it.
    __device__ const u8* wait(int t) {
        const u32 a = smem_u32(&bars[t % st]), parity = (u32)((t / st) & 1);
        u32 ok = 0;
        while (!ok)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(ok)
                         : "r"(a), "r"(parity)
                         : "memory");
        return buf + (long)(t % st) * tb;
    }
};

// Rows [r0, r1) of a warp, as tiles (row pair, chunk of CH super-blocks), streamed by bulk
// copies; each lane copies its part of a tile to registers, the stage is refilled at once,
// then kernels.cu's q4k_lane_term does the arithmetic in the register kernel's order (CH a
// multiple of 4 * WPR). ACT: activations staged in shared memory once per block (else read
// through L1 as the register kernel does).
template <int NSB, int WPR, int CH, int ST, int NW, int ACT>
__global__ __launch_bounds__(32 * NW) void gemv_bulk(const u8* __restrict__ W, long rows, Act x, float* __restrict__ y) {
    pdl_trigger();
    constexpr int RPW = 2, ROWB = NSB * 144, TB = RPW * CH * 144, NCH = (NSB + CH - 1) / CH, UL = CH / 4;
    constexpr int ACTB = ACT ? NSB * 384 : 0;
    extern __shared__ __align__(128) u8 smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    WarpPipe pp = {smem + ACTB + (long)warp * ST * TB, (u64*)(smem + ACTB + (long)NW * ST * TB) + warp * ST, TB, ST};
    const long nw = (long)gridDim.x * NW, gw = (long)blockIdx.x * NW + warp;
    const long r0 = rows * gw / nw, r1 = rows * (gw + 1) / nw;
    const int ntile = (int)((r1 - r0 + 1) / 2) * NCH;
    pp.init();
    auto issue = [&](int t) {
        if (lane != 0 || t >= ntile) return;
        const long ra = r0 + 2L * (t / NCH);
        const int nr = (int)min(2L, r1 - ra), sb0 = (t % NCH) * CH;
        const u32 rb = (u32)(min(CH, NSB - sb0) * 144);
        u8* dst = pp.expect(t, rb * nr);
        for (int r = 0; r < nr; r++) pp.copy(t, dst + r * CH * 144, W + (ra + r) * ROWB + sb0 * 144, rb);
    };
    for (int s = 0; s < ST; s++) issue(s);
    pdl_wait();
    const i8* xq = x.q;
    const float *xd = x.d, *xs = x.s;
    if (ACT) {
        i8* sq = (i8*)smem;
        float* sd = (float*)(smem + NSB * 256);
        for (int i = threadIdx.x; i < NSB * 16; i += blockDim.x) {
            ((int4*)sq)[i] = ((const int4*)x.q)[i];
            sd[i] = x.d[i];
            sd[NSB * 16 + i] = x.s[i];
        }
        __syncthreads();
        xq = sq;
        xd = sd;
        xs = sd + NSB * 16;
    }
    const int j = lane & 7, c = j >> 1, hh = j & 1, g = lane >> 3, sh = 16 * (c & 1);
    const bool clo = c < 2;
    float acc[RPW][WPR];
    for (int t = 0; t < ntile; t++) {
        const int ci = t % NCH, sb0 = ci * CH, nsbc = min(CH, NSB - sb0);
        const long ra = r0 + 2L * (t / NCH);
        if (ci == 0)
#pragma unroll
            for (int r = 0; r < RPW; r++)
#pragma unroll
                for (int k = 0; k < WPR; k++) acc[r][k] = 0.f;
        const u8* tb = pp.wait(t);
        uint4 hv[RPW][UL], qv[RPW][UL];
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int u = 0; u < UL; u++) {
                const u8* p = tb + r * CH * 144 + (4 * u + g) * 144;
                const bool in = 4 * u + g < nsbc;
                hv[r][u] = in ? *(const uint4*)p : make_uint4(0, 0, 0, 0);
                qv[r][u] = in ? *(const uint4*)(p + 16 + 16 * j) : make_uint4(0, 0, 0, 0);
            }
        __syncwarp();
        issue(t + ST);
#pragma unroll
        for (int u = 0; u < UL; u++) {
            if (4 * u + g >= nsbc) continue;
            const int ga = (sb0 + 4 * u + g) * 16 + 4 * c + hh;
            const int4 xa = *(const int4*)(xq + ga * 16), xb = *(const int4*)(xq + ga * 16 + 32);
            const float d0 = xd[ga], d2 = xd[ga + 2] * 0.0625f, s0v = xs[ga], s2v = xs[ga + 2];
            // The accumulator of the register kernel's warp (u + sb0 / 4) % WPR: static in u.
#pragma unroll
            for (int r = 0; r < RPW; r++)
                q4k_lane_term<1>(hv[r][u], qv[r][u], &xa, &xb, &d0, &d2, &s0v, &s2v, sh, clo, &acc[r][u % WPR]);
        }
        if (ci == NCH - 1)
#pragma unroll
            for (int r = 0; r < RPW; r++) {
                // The register kernel's reduction: one warp's sum, or 0 plus its warps' in order.
                float v = 0.f;
                if constexpr (WPR == 1) {
                    v = warp_sum(acc[r][0]);
                } else {
#pragma unroll
                    for (int k = 0; k < WPR; k++) v += warp_sum(acc[r][k]);
                }
                if (lane == 0 && ra + r < r1) y[ra + r] = v;
            }
    }
}

// The pipeline alone (no arithmetic): what bulk copies can read.
template <int TB, int ST, int NW>
__global__ __launch_bounds__(32 * NW) void read_bulk(const u8* __restrict__ W, long bytes, u32* sink) {
    pdl_trigger();
    extern __shared__ __align__(128) u8 smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    WarpPipe pp = {smem + (long)warp * ST * TB, (u64*)(smem + (long)NW * ST * TB) + warp * ST, TB, ST};
    const long nw = (long)gridDim.x * NW, gw = (long)blockIdx.x * NW + warp, nt = bytes / TB;
    const long t0 = nt * gw / nw;
    const int ntile = (int)(nt * (gw + 1) / nw - t0);
    pp.init();
    auto issue = [&](int t) {
        if (lane == 0 && t < ntile) pp.copy(t, pp.expect(t, TB), W + (t0 + t) * TB, TB);
    };
    for (int s = 0; s < ST; s++) issue(s);
    pdl_wait();
    u32 h = 0;
    for (int t = 0; t < ntile; t++) {
        h ^= *(const u32*)(pp.wait(t) + 4 * lane);
        __syncwarp();
        issue(t + ST);
    }
    if (h == 0x12345678u) sink[0] = h;
}

// A stand-in for the small kernels between GEMVs (norm, attention): 8 blocks, a row's sum of
// squares, a scaled copy. K only makes two functions, so each can have its own carveout.
template <int K>
__global__ void between(const float* xin, float* out, int n) {
    pdl_trigger();
    pdl_wait();
    __shared__ float sh[33];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xin[i] * xin[i];
    const float t = block_sum(s, sh);
    const int per = (n + gridDim.x - 1) / gridDim.x;
    for (int i = blockIdx.x * per + threadIdx.x; i < min(n, (int)(blockIdx.x + 1) * per); i += blockDim.x)
        out[i] = xin[i] * rsqrtf(t / n + 1e-6f);
}

__global__ void fill_random(u8* p, long n, u64 seed) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n / 8; i += (long)gridDim.x * blockDim.x) {
        u64 z = (u64)i * 0x9E3779B97F4A7C15ull + seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        ((u64*)p)[i] = z ^ (z >> 31);
    }
}
// d and dmin of each super-block: small positive halves.
__global__ void fix_q4k(u8* p, long nblocks) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < nblocks; i += (long)gridDim.x * blockDim.x) {
        u16* h = (u16*)(p + i * 144);
        const u32 r = h[0] ^ (h[1] << 3);
        h[0] = __half_as_ushort(__float2half(1e-3f + (float)(r & 1023) * 1e-5f));
        h[1] = __half_as_ushort(__float2half(1e-4f + (float)((r >> 10) & 1023) * 1e-6f));
    }
}
__global__ void fill_act(i8* q, float* d, float* s, long n, u64 seed) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        u32 z = (u32)(i * 2654435761u + seed);
        z ^= z >> 13;
        z *= 0x5bd1e995;
        z ^= z >> 15;
        q[i] = (i8)((int)(z & 255) - 128 + (z & 255) / 255);
        if (i % 16 == 0) {
            d[i / 16] = 0.01f + (float)(z % 97) * 1e-4f;
            s[i / 16] = d[i / 16] * (float)((int)(z % 200) - 100);
        }
    }
}

template <typename K, typename... Args>
static void launch(K kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t st, bool pdl, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

static int NSM = 132;
typedef void (*RunFn)(const u8*, long, long, Act, float*, cudaStream_t, bool);
typedef void (*GemvEntry)(const u8*, const u8*, long, long, const i8*, const float*, const float*, const float*, float*, long);

// kernels.cu's register GEMV (two rows per warp, shape WPR x U), as the decode graph launches it.
template <int WPR, int U>
static void run_regs(const u8* W, long rows, long cols, Act x, float* y, cudaStream_t st, bool pdl) {
    const GemvEntry k = WPR == 1 && U == 7   ? gemv_q4k_w1u7l1r2_b1
                        : WPR == 1 && U == 4 ? gemv_q4k_w1u4l1r2_b1
                                             : gemv_q4k_w4u5l1r2_b1;
    const long nblk = (rows + 8 / WPR - 1) / (8 / WPR);
    launch(k, dim3((unsigned)nblk), dim3(128), 0, st, pdl, W, (const u8*)nullptr, rows, cols, x.q, x.d, x.s,
           (const float*)nullptr, y, rows);
}
template <int NSB, int WPR, int CH, int ST, int NW, int ACT>
static void run_bulk(const u8* W, long rows, long cols, Act x, float* y, cudaStream_t st, bool pdl) {
    const size_t smem = (size_t)(ACT ? NSB * 384 : 0) + (size_t)NW * ST * 2 * CH * 144 + NW * ST * 8;
    static bool set = false;
    if (!set) {
        CK(cudaFuncSetAttribute(gemv_bulk<NSB, WPR, CH, ST, NW, ACT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CK(cudaFuncSetAttribute(gemv_bulk<NSB, WPR, CH, ST, NW, ACT>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
        set = true;
    }
    launch(gemv_bulk<NSB, WPR, CH, ST, NW, ACT>, dim3(NSM), dim3(32 * NW), smem, st, pdl, W, rows, x, y);
}

struct Mat { const char* name; long rows, cols; };

int main(int argc, char** argv) {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    NSM = prop.multiProcessorCount;
    printf("device %s, %d SMs, L2 %d MB, smem/SM %zu\n", prop.name, NSM, prop.l2CacheSize >> 20, prop.sharedMemPerMultiprocessor);
    const int LAYERS = argc > 1 ? atoi(argv[1]) : 52;
    Mat mats[4] = {{"qkvg", 8704, 6656}, {"wo", 6656, 4096}, {"gate_up", 39936, 6656}, {"down", 6656, 19968}};
    std::vector<u8*> W(4 * LAYERS);
    for (int m = 0; m < 4; m++)
        for (int l = 0; l < LAYERS; l++) {
            const long bytes = mats[m].rows * (mats[m].cols / 256) * 144;
            CK(cudaMalloc(&W[m * LAYERS + l], bytes));
            fill_random<<<1024, 256>>>(W[m * LAYERS + l], bytes, 1234 + m * 1000 + l);
            fix_q4k<<<1024, 256>>>(W[m * LAYERS + l], bytes / 144);
        }
    i8* xq;
    float *xd, *xs, *y, *y2, *tmp;
    u32* sink;
    CK(cudaMalloc(&xq, 19968 * 4));
    CK(cudaMalloc(&xd, 19968));
    CK(cudaMalloc(&xs, 19968));
    CK(cudaMalloc(&y, 40000 * 16));
    CK(cudaMalloc(&y2, 40000 * 16));
    CK(cudaMalloc(&tmp, 40000 * 4));
    CK(cudaMalloc(&sink, 64));
    fill_act<<<64, 256>>>(xq, xd, xs, 19968, 99);
    CK(cudaMemset(tmp, 0, 40000 * 4));
    CK(cudaDeviceSynchronize());
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    auto timed = [&](int reps, auto body) {
        float best = 1e30f;
        for (int rep = 0; rep < reps; rep++) {
            CK(cudaEventRecord(e0, st));
            body();
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (rep) best = std::min(best, ms);
        }
        return best;
    };

    // [variant][matrix]: qkvg, wo, gate_up, down.
    struct V { const char* name; RunFn f[4]; };
    std::vector<V> vs = {
        {"regs (kernels.cu)", {run_regs<1, 7>, run_regs<1, 4>, run_regs<1, 7>, run_regs<4, 5>}},
        {"C ch28 s2 w8", {run_bulk<26, 1, 28, 2, 8, 0>, run_bulk<16, 1, 16, 2, 12, 0>, run_bulk<26, 1, 28, 2, 8, 0>, run_bulk<78, 4, 16, 2, 12, 0>}},
        {"C ch16 s3 w16", {run_bulk<26, 1, 16, 3, 16, 0>, run_bulk<16, 1, 16, 3, 16, 0>, run_bulk<26, 1, 16, 3, 16, 0>, run_bulk<78, 4, 16, 3, 16, 0>}},
        {"D ch16 s2 w12", {run_bulk<26, 1, 16, 2, 12, 1>, run_bulk<16, 1, 16, 2, 12, 1>, run_bulk<26, 1, 16, 2, 12, 1>, run_bulk<78, 4, 16, 2, 12, 1>}},
        {"D ch28 s2 w8", {run_bulk<26, 1, 28, 2, 8, 1>, run_bulk<16, 1, 16, 2, 12, 1>, run_bulk<26, 1, 28, 2, 8, 1>, run_bulk<78, 4, 16, 2, 12, 1>}},
        {"D ch16 s1 w16", {run_bulk<26, 1, 16, 1, 16, 1>, run_bulk<16, 1, 16, 1, 16, 1>, run_bulk<26, 1, 16, 1, 16, 1>, run_bulk<78, 4, 16, 1, 16, 1>}},
    };
    // Every variant against the register kernel, bit for bit.
    bool all_equal = true;
    for (int m = 0; m < 4; m++) {
        Act x = {xq, xd, xs, mats[m].cols};
        std::vector<float> ha(mats[m].rows), hb(mats[m].rows);
        vs[0].f[m](W[m * LAYERS], mats[m].rows, mats[m].cols, x, y, st, false);
        CK(cudaMemcpyAsync(ha.data(), y, mats[m].rows * 4, cudaMemcpyDeviceToHost, st));
        CK(cudaStreamSynchronize(st));
        for (size_t v = 1; v < vs.size(); v++) {
            CK(cudaMemsetAsync(y2, 0xff, mats[m].rows * 4, st));
            vs[v].f[m](W[m * LAYERS], mats[m].rows, mats[m].cols, x, y2, st, false);
            CK(cudaMemcpyAsync(hb.data(), y2, mats[m].rows * 4, cudaMemcpyDeviceToHost, st));
            CK(cudaStreamSynchronize(st));
            long diff = 0;
            for (long i = 0; i < mats[m].rows; i++) diff += memcmp(&ha[i], &hb[i], 4) != 0;
            all_equal &= diff == 0;
            if (diff) printf("check %-14s %-8s: %ld of %ld rows differ\n", vs[v].name, mats[m].name, diff, mats[m].rows);
        }
    }
    printf("every variant bit-identical to the register kernel on every shape: %s\n", all_equal ? "yes" : "NO");
    if (argc > 3) return all_equal ? 0 : 1;

    printf("\nisolated (us per GEMV, TB/s), %d copies back to back, PDL\n", LAYERS);
    for (auto& v : vs) {
        printf("%-18s", v.name);
        for (int m = 0; m < 4; m++) {
            Act x = {xq, xd, xs, mats[m].cols};
            const long bytes = mats[m].rows * (mats[m].cols / 256) * 144;
            const float ms = timed(6, [&] {
                for (int l = 0; l < LAYERS; l++) v.f[m](W[m * LAYERS + l], mats[m].rows, mats[m].cols, x, y, st, true);
            });
            const float us = ms * 1000.f / LAYERS;
            printf("  %s %6.2f us %4.2f", mats[m].name, us, bytes / (us * 1e-6) / 1e12);
        }
        printf("\n");
    }
    printf("\nlayer sequence, a stand-in kernel after each GEMV (us per layer)\n");
    CK(cudaFuncSetAttribute(between<1>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    for (auto& v : vs)
        for (int bk = 0; bk < 2; bk++) {
            const float ms = timed(6, [&] {
                for (int l = 0; l < LAYERS; l++)
                    for (int m = 0; m < 4; m++) {
                        Act x = {xq, xd, xs, mats[m].cols};
                        v.f[m](W[m * LAYERS + l], mats[m].rows, mats[m].cols, x, y, st, true);
                        launch(bk ? between<1> : between<0>, dim3(8), dim3(256), 0, st, true, (const float*)tmp, tmp + 20000, 6656);
                    }
            });
            printf("%-18s %s %7.2f us per layer\n", v.name, bk ? "stand-in with the shared-memory carveout" : "stand-in with the default carveout      ",
                   ms * 1000.f / LAYERS);
        }
    if (argc > 2) {
        printf("\nbulk-copy read of the gate_up matrices\n");
        const long bytes = 39936L * 26 * 144;
        auto rb = [&](auto kern, int tb, int stg, int nw) {
            const size_t smem = (size_t)nw * stg * tb + nw * stg * 8;
            CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            const float ms = timed(4, [&] {
                for (int l = 0; l < LAYERS; l++)
                    launch(kern, dim3(NSM), dim3(32 * nw), smem, st, true, (const u8*)W[2 * LAYERS + l], bytes, sink);
            });
            const float us = ms * 1000.f / LAYERS;
            printf("  tile %5d stages %d warps %2d: %6.2f us %4.2f TB/s\n", tb, stg, nw, us, bytes / (us * 1e-6) / 1e12);
        };
        rb(read_bulk<4096, 1, 8>, 4096, 1, 8);
        rb(read_bulk<4096, 2, 8>, 4096, 2, 8);
        rb(read_bulk<4096, 4, 8>, 4096, 4, 8);
        rb(read_bulk<16384, 3, 4>, 16384, 3, 4);
    }
    return all_equal ? 0 : 1;
}
