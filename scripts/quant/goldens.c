// Writes golden data for muser-quant from ggml itself (llama.cpp b11434):
//   input.f32 / act_input.f32      the random rows everything starts from
//   quant_<t>.bin                   ggml_quantize_chunk (the _ref quantizers) of input.f32
//   ref_q8_1.bin                    quantize_row_q8_1_ref of input.f32
//   deq_<t>.f32                     type_traits->to_float of quant_<t>.bin
//   rand_<t>.bin / rand_<t>.f32     random block bytes and their to_float
//   act_<t>.bin                     the CPU backend's from_float (activation quantizer)
//   dot_<t>.f32                     the CPU backend's vec_dot, rows of DOT_N (FLOAT_N for floats)
//   mm_<t>.f32                      ggml_mul_mat of MM_ROWS weight rows by MM_TOKENS tokens
//                                   (FLOAT_N values each), which runs llamafile's tinyBLAS
// Usage: goldens OUT_DIR
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "ggml.h"
#include "ggml-cpu.h"

void quantize_row_q8_1_ref(const float * x, void * y, int64_t k);

// The quantized dot kernels, from ggml-cpu/arch/x86/quants.c compiled into this program (see
// quant-goldens.sh: the comparator's libggml-cpu is built with -mavxvnni, which some AVX512
// hosts lack, so its copies of these kernels die with SIGILL there).
typedef void (*vec_dot_fn)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
#define DOT(name) void name(int, float *, size_t, const void *, size_t, const void *, size_t, int);
DOT(ggml_vec_dot_q4_0_q8_0) DOT(ggml_vec_dot_q4_1_q8_1) DOT(ggml_vec_dot_q5_0_q8_0) DOT(ggml_vec_dot_q5_1_q8_1)
DOT(ggml_vec_dot_q8_0_q8_0) DOT(ggml_vec_dot_q2_K_q8_K) DOT(ggml_vec_dot_q3_K_q8_K) DOT(ggml_vec_dot_q4_K_q8_K)
DOT(ggml_vec_dot_q5_K_q8_K) DOT(ggml_vec_dot_q6_K_q8_K) DOT(ggml_vec_dot_mxfp4_q8_0) DOT(ggml_vec_dot_nvfp4_q8_0)

static vec_dot_fn quant_dot(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q4_0: return ggml_vec_dot_q4_0_q8_0;
        case GGML_TYPE_Q4_1: return ggml_vec_dot_q4_1_q8_1;
        case GGML_TYPE_Q5_0: return ggml_vec_dot_q5_0_q8_0;
        case GGML_TYPE_Q5_1: return ggml_vec_dot_q5_1_q8_1;
        case GGML_TYPE_Q8_0: return ggml_vec_dot_q8_0_q8_0;
        case GGML_TYPE_Q2_K: return ggml_vec_dot_q2_K_q8_K;
        case GGML_TYPE_Q3_K: return ggml_vec_dot_q3_K_q8_K;
        case GGML_TYPE_Q4_K: return ggml_vec_dot_q4_K_q8_K;
        case GGML_TYPE_Q5_K: return ggml_vec_dot_q5_K_q8_K;
        case GGML_TYPE_Q6_K: return ggml_vec_dot_q6_K_q8_K;
        case GGML_TYPE_MXFP4: return ggml_vec_dot_mxfp4_q8_0;
        case GGML_TYPE_NVFP4: return ggml_vec_dot_nvfp4_q8_0;
        default: return NULL;
    }
}

#define N_VALUES 16384
#define DOT_N 2048
#define FLOAT_N 1000
#define N_RAND_BLOCKS 96
#define MM_ROWS 8
#define MM_TOKENS 3

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint64_t next_u64(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float uniform(void) { return (float)((next_u64() >> 40) * (1.0 / 16777216.0)); }
static float gauss(void) {
    float u = uniform() + 1e-7f, v = uniform();
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

// Random f16 scale fields become finite halves between about 2^-14 and 2^2 (either sign), so
// the goldens hold numbers rather than NaN/inf patterns.
static void sane_scales(enum ggml_type t, uint8_t * b, int nb, size_t ts) {
    int off[2] = { -1, -1 };
    switch (t) {
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0: off[0] = 0; break;
        case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: off[0] = 0; off[1] = 2; break;
        case GGML_TYPE_Q2_K: off[0] = 80; off[1] = 82; break;
        case GGML_TYPE_Q3_K: off[0] = 108; break;
        case GGML_TYPE_Q6_K: off[0] = 208; break;
        default: return;
    }
    for (int i = 0; i < nb; i++) {
        for (int k = 0; k < 2; k++) {
            if (off[k] < 0) continue;
            uint16_t h = (uint16_t)next_u64();
            uint16_t e = (uint16_t)(1 + ((h >> 10) & 15)); // exponent 1..16: 2^-14 .. 2^1
            h = (uint16_t)((h & 0x83FF) | (e << 10));
            memcpy(b + i * ts + off[k], &h, 2);
        }
    }
}

static const char * out_dir;
static void write_file(const char * name, const void * data, size_t size) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", out_dir, name);
    FILE * f = fopen(path, "wb");
    if (!f || fwrite(data, 1, size, f) != size) { perror(path); exit(1); }
    fclose(f);
}

// Rows with varied magnitudes, some all-zero blocks, some outliers, some constant blocks.
static void fill_input(float * x, int n) {
    for (int i = 0; i < n; i++) {
        int block = i / 256;
        float scale = powf(2.0f, (float)(block % 9) - 4.0f);
        x[i] = gauss() * scale;
        if (block % 13 == 5) x[i] = 0.0f;
        if (block % 17 == 3) x[i] = 0.75f * scale;
        if (next_u64() % 251 == 0) x[i] *= 40.0f;
    }
}

int main(int argc, char ** argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]); return 2; }
    out_dir = argv[1];
    ggml_cpu_init();

    static float input[N_VALUES], act_input[N_VALUES], deq[N_VALUES];
    static uint8_t buf[N_VALUES * 4], act[N_VALUES * 4];
    fill_input(input, N_VALUES);
    fill_input(act_input, N_VALUES);
    write_file("input.f32", input, sizeof input);
    write_file("act_input.f32", act_input, sizeof act_input);

    const enum ggml_type weights[] = {
        GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
        GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K,
        GGML_TYPE_Q6_K, GGML_TYPE_MXFP4, GGML_TYPE_NVFP4,
    };
    char name[128];
    for (size_t t = 0; t < sizeof weights / sizeof weights[0]; t++) {
        const enum ggml_type type = weights[t];
        const struct ggml_type_traits * tr = ggml_get_type_traits(type);
        const size_t bytes = ggml_row_size(type, N_VALUES);
        memset(buf, 0, sizeof buf);
        ggml_quantize_chunk(type, input, buf, 0, 1, N_VALUES, NULL);
        snprintf(name, sizeof name, "quant_%s.bin", tr->type_name);
        write_file(name, buf, bytes);
        if (tr->to_float) {
            tr->to_float(buf, deq, N_VALUES);
        } else {
            memcpy(deq, buf, sizeof deq); // F32
        }
        snprintf(name, sizeof name, "deq_%s.f32", tr->type_name);
        write_file(name, deq, sizeof deq);

        // random block bytes: every bit pattern of scales and quants
        if (ggml_is_quantized(type)) {
            const int nrb = N_RAND_BLOCKS * tr->blck_size <= N_VALUES ? N_RAND_BLOCKS : N_VALUES / (int)tr->blck_size;
            const size_t rb = (size_t)nrb * tr->type_size;
            for (size_t i = 0; i < rb; i++) buf[i] = (uint8_t)next_u64();
            sane_scales(type, buf, nrb, tr->type_size);
            const int64_t rn = (int64_t)nrb * tr->blck_size;
            tr->to_float(buf, deq, rn);
            snprintf(name, sizeof name, "rand_%s.bin", tr->type_name);
            write_file(name, buf, rb);
            snprintf(name, sizeof name, "rand_%s.f32", tr->type_name);
            write_file(name, deq, rn * sizeof(float));
        }

        // dot products: quantized weights (from input) against activations (from act_input)
        const struct ggml_type_traits_cpu * cpu = ggml_get_type_traits_cpu(type);
        const enum ggml_type vt = cpu->vec_dot_type;
        const int n = ggml_is_quantized(type) ? DOT_N : FLOAT_N;
        const int rows = N_VALUES / n;
        ggml_quantize_chunk(type, input, buf, 0, rows, n, NULL);
        memset(act, 0, sizeof act);
        if (vt == GGML_TYPE_F32) {
            memcpy(act, act_input, sizeof act_input);
        } else {
            for (int r = 0; r < rows; r++) {
                ggml_get_type_traits_cpu(vt)->from_float(act_input + r * n, act + r * ggml_row_size(vt, n), n);
            }
        }
        float dots[N_VALUES / FLOAT_N];
        for (int r = 0; r < rows; r++) {
            vec_dot_fn dot = quant_dot(type) ? quant_dot(type) : (vec_dot_fn)cpu->vec_dot;
            dot(n, &dots[r], 0, buf + r * ggml_row_size(type, n), 0, act + r * ggml_row_size(vt, n), 0, 1);
        }
        snprintf(name, sizeof name, "dot_%s.f32", tr->type_name);
        write_file(name, dots, rows * sizeof(float));
    }

    // prompt-processing matmuls (MM_ROWS weight rows x MM_TOKENS tokens): the CPU backend sends
    // these through llamafile's tinyBLAS instead of vec_dot
    const enum ggml_type gemm_types[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16 };
    for (size_t t = 0; t < sizeof gemm_types / sizeof gemm_types[0]; t++) {
        struct ggml_init_params ip = { 16 * 1024 * 1024, NULL, false };
        struct ggml_context * ctx = ggml_init(ip);
        struct ggml_tensor * w = ggml_new_tensor_2d(ctx, gemm_types[t], FLOAT_N, MM_ROWS);
        struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, FLOAT_N, MM_TOKENS);
        ggml_quantize_chunk(gemm_types[t], input, w->data, 0, MM_ROWS, FLOAT_N, NULL);
        memcpy(x->data, act_input, sizeof(float) * FLOAT_N * MM_TOKENS);
        struct ggml_tensor * y = ggml_mul_mat(ctx, w, x);
        struct ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, y);
        ggml_graph_compute_with_ctx(ctx, gf, 1);
        snprintf(name, sizeof name, "mm_%s.f32", ggml_type_name(gemm_types[t]));
        write_file(name, y->data, sizeof(float) * MM_ROWS * MM_TOKENS);
        ggml_free(ctx);
    }

    // activation quantizers of the CPU backend, one row of N_VALUES
    const enum ggml_type acts[] = { GGML_TYPE_Q8_0, GGML_TYPE_Q8_1, GGML_TYPE_Q8_K, GGML_TYPE_F16, GGML_TYPE_BF16 };
    for (size_t t = 0; t < sizeof acts / sizeof acts[0]; t++) {
        memset(act, 0, sizeof act);
        ggml_get_type_traits_cpu(acts[t])->from_float(act_input, act, N_VALUES);
        snprintf(name, sizeof name, "act_%s.bin", ggml_type_name(acts[t]));
        write_file(name, act, ggml_row_size(acts[t], N_VALUES));
    }
    memset(act, 0, sizeof act);
    quantize_row_q8_1_ref(input, act, N_VALUES);
    write_file("ref_q8_1.bin", act, ggml_row_size(GGML_TYPE_Q8_1, N_VALUES));
    return 0;
}
