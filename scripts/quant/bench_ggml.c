// Times ggml's own CPU dot kernels on the layout muser-quant's `kernels` bench uses: one
// activation row of N values against ROWS weight rows. Prints JSON: type name -> best
// nanoseconds per pass over the ROWS rows (the fastest of TRIALS timed batches of thread CPU
// time, which is robust on a busy machine; the Rust bench uses the same clock). Usage: bench_ggml > out.json
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"

#define N 4096
#define ROWS 64
#define TRIALS 30

typedef void (*vec_dot_fn)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
#define DOT(name) void name(int, float *, size_t, const void *, size_t, const void *, size_t, int);
DOT(ggml_vec_dot_q4_0_q8_0) DOT(ggml_vec_dot_q4_1_q8_1) DOT(ggml_vec_dot_q5_0_q8_0) DOT(ggml_vec_dot_q5_1_q8_1)
DOT(ggml_vec_dot_q8_0_q8_0) DOT(ggml_vec_dot_q2_K_q8_K) DOT(ggml_vec_dot_q3_K_q8_K) DOT(ggml_vec_dot_q4_K_q8_K)
DOT(ggml_vec_dot_q5_K_q8_K) DOT(ggml_vec_dot_q6_K_q8_K) DOT(ggml_vec_dot_mxfp4_q8_0) DOT(ggml_vec_dot_nvfp4_q8_0)

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(void) {
    ggml_cpu_init();
    static float x[N * ROWS], act[N];
    uint64_t s = 7;
    for (int i = 0; i < N * ROWS; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; x[i] = (float)((s >> 40) / 16777216.0 * 2 - 1); }
    for (int i = 0; i < N; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; act[i] = (float)((s >> 40) / 16777216.0 * 2 - 1); }
    const struct { enum ggml_type t; vec_dot_fn f; } kinds[] = {
        { GGML_TYPE_F32, NULL }, { GGML_TYPE_F16, NULL }, { GGML_TYPE_BF16, NULL },
        { GGML_TYPE_Q4_0, ggml_vec_dot_q4_0_q8_0 }, { GGML_TYPE_Q4_1, ggml_vec_dot_q4_1_q8_1 },
        { GGML_TYPE_Q5_0, ggml_vec_dot_q5_0_q8_0 }, { GGML_TYPE_Q5_1, ggml_vec_dot_q5_1_q8_1 },
        { GGML_TYPE_Q8_0, ggml_vec_dot_q8_0_q8_0 }, { GGML_TYPE_Q2_K, ggml_vec_dot_q2_K_q8_K },
        { GGML_TYPE_Q3_K, ggml_vec_dot_q3_K_q8_K }, { GGML_TYPE_Q4_K, ggml_vec_dot_q4_K_q8_K },
        { GGML_TYPE_Q5_K, ggml_vec_dot_q5_K_q8_K }, { GGML_TYPE_Q6_K, ggml_vec_dot_q6_K_q8_K },
        { GGML_TYPE_MXFP4, ggml_vec_dot_mxfp4_q8_0 }, { GGML_TYPE_NVFP4, ggml_vec_dot_nvfp4_q8_0 },
    };
    const int nk = sizeof kinds / sizeof kinds[0];
    static uint8_t w[N * ROWS * 4], a[N * 4];
    printf("{");
    for (int k = 0; k < nk; k++) {
        const enum ggml_type t = kinds[k].t;
        const struct ggml_type_traits_cpu * cpu = ggml_get_type_traits_cpu(t);
        const vec_dot_fn dot = kinds[k].f ? kinds[k].f : (vec_dot_fn)cpu->vec_dot;
        const size_t rb = ggml_row_size(t, N);
        ggml_quantize_chunk(t, x, w, 0, ROWS, N, NULL);
        if (cpu->vec_dot_type == GGML_TYPE_F32) memcpy(a, act, sizeof act);
        else ggml_get_type_traits_cpu(cpu->vec_dot_type)->from_float(act, a, N);
        // batches of `reps` passes, sized to about 2 ms
        int reps = 1;
        for (;;) {
            double t0 = now_ns();
            float sink = 0, r;
            for (int i = 0; i < reps; i++) for (int j = 0; j < ROWS; j++) { dot(N, &r, 0, w + j * rb, 0, a, 0, 1); sink += r; }
            if (now_ns() - t0 > 2e6 || reps > (1 << 20)) break;
            reps *= 2;
            if (sink == 12345.f) printf(" ");
        }
        double best = 1e30;
        for (int trial = 0; trial < TRIALS; trial++) {
            float sink = 0, r;
            double t0 = now_ns();
            for (int i = 0; i < reps; i++) for (int j = 0; j < ROWS; j++) { dot(N, &r, 0, w + j * rb, 0, a, 0, 1); sink += r; }
            double dt = (now_ns() - t0) / reps;
            if (dt < best) best = dt;
            if (sink == 12345.f) printf(" ");
        }
        printf("%s\"%s\": %.1f", k ? ", " : "", ggml_type_name(t), best);
    }
    printf("}\n");
    return 0;
}
