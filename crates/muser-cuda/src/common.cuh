// Shared prelude of Muser's CUDA modules (kernels.cu, ops.cu): runtime.rs prepends it to each
// source before NVRTC compiles it.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef __nv_bfloat16 bf16;

#define FULL 0xffffffffu
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Programmatic dependent launch (sm_90+): a kernel lets the next one start early
// (launch_dependents) and waits for the previous one before touching its results (wait).
// Both are no-ops when the launch did not ask for it.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). `sh` holds 33 floats.
__device__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float t = l < (int)(blockDim.x >> 5) ? sh[l] : 0.f;
        t = warp_sum(t);
        if (l == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}

