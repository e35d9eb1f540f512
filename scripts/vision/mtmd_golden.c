// Image goldens from llama.cpp's libmtmd (build 11434), for muser-vision's parity tests.
//
//   mtmd_golden MODEL MMPROJ IMAGE OUT.f32 [--threads N] [--flash-attn on|off] [--n-predict N]
//               [--prompt TEXT] [--repeat N] [--vocab-only 1 --width N] [--gpu 1]
//
// Tokenizes PROMPT (default "Look: <__media__>\nIt is") with the image, encodes the image chunk
// with mtmd_encode_chunk and writes its embeddings (f32, little-endian, token-major) to
// OUT.f32; then evaluates every chunk (mtmd_helper_eval_chunks), greedily generates N tokens
// (default 16) and prints one JSON object: the settings, each chunk (text ids, or the image's
// token grid) and the generated ids. Warm-up off; the CPU unless --gpu 1 (the projector on the
// GPU of a CUDA build; the text model stays on the CPU). --flash-attn sets the image
// encoder's attention (off by default: exact f32); --n-predict 0 skips the text model's
// evaluation, --vocab-only 1 loads only MODEL's vocabulary (a vocabulary-only file will do;
// --width then gives the projector's output width for OUT.f32), and --repeat N
// encodes the image N times, reporting each encode's milliseconds (`encode_ms`); the text model keeps llama.cpp's defaults
// (flash attention auto, F16 K/V, n_batch 2048, n_ubatch 512) with n_ctx 1024.
#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"
#include "ggml.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level >= GGML_LOG_LEVEL_ERROR || getenv("GOLDEN_VERBOSE")) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL MMPROJ IMAGE OUT.f32 [--threads N] [--flash-attn on|off] [--n-predict N] [--prompt TEXT]\n", argv[0]);
        return 2;
    }
    int threads = 2, n_predict = 16, repeat = 1, timed = 0, width = 0, vocab_only = 0, gpu = 0;
    enum llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    const char * prompt = "Look: <__media__>\nIt is";
    for (int i = 5; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--n-predict")) n_predict = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--prompt")) prompt = argv[i + 1];
        else if (!strcmp(argv[i], "--repeat")) { repeat = atoi(argv[i + 1]); timed = 1; }
        else if (!strcmp(argv[i], "--width")) width = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--vocab-only")) { vocab_only = atoi(argv[i + 1]); }
        else if (!strcmp(argv[i], "--gpu")) gpu = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--flash-attn"))
            fa = !strcmp(argv[i + 1], "on") ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    llama_log_set(quiet, NULL);
    mtmd_helper_log_set(quiet, NULL);
    llama_backend_init();

    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = false;
    mp.vocab_only = vocab_only;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024;
    cp.n_threads = cp.n_threads_batch = threads;
    struct llama_context * lctx = vocab_only ? NULL : llama_init_from_model(model, cp);

    struct mtmd_context_params mparams = mtmd_context_params_default();
    mparams.use_gpu = gpu != 0;
    mparams.print_timings = false;
    mparams.n_threads = threads;
    mparams.flash_attn_type = fa;
    mparams.warmup = false;
    mtmd_context * mctx = mtmd_init_from_file(argv[2], model, mparams);
    if (!mctx) { fprintf(stderr, "cannot load projector %s\n", argv[2]); return 1; }

    struct mtmd_helper_bitmap_wrapper bw = mtmd_helper_bitmap_init_from_file(mctx, argv[3], false, mtmd_helper_init_opt_default());
    if (!bw.bitmap) { fprintf(stderr, "cannot read image %s\n", argv[3]); return 1; }
    mtmd_input_chunks * chunks = mtmd_input_chunks_init();
    struct mtmd_input_text text = { prompt, strlen(prompt), true, true };
    const mtmd_bitmap * bitmaps[1] = { bw.bitmap };
    if (mtmd_tokenize(mctx, chunks, &text, bitmaps, 1) != 0) { fprintf(stderr, "tokenize failed\n"); return 1; }

    printf("{\"threads\":%d,\"clip_flash_attn\":%s,\"image_nx\":%u,\"image_ny\":%u,\"chunks\":[",
           threads, fa == LLAMA_FLASH_ATTN_TYPE_ENABLED ? "true" : "false",
           mtmd_bitmap_get_nx(bw.bitmap), mtmd_bitmap_get_ny(bw.bitmap));
    // a vocabulary-only model has no width: --width gives the projector's
    const int n_embd = width > 0 ? width : llama_model_n_embd_inp(model);
    for (size_t i = 0; i < mtmd_input_chunks_size(chunks); i++) {
        const mtmd_input_chunk * c = mtmd_input_chunks_get(chunks, i);
        if (i) printf(",");
        if (mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_TEXT) {
            size_t n;
            const llama_token * t = mtmd_input_chunk_get_tokens_text(c, &n);
            printf("{\"text\":[");
            for (size_t j = 0; j < n; j++) printf(j ? ",%d" : "%d", t[j]);
            printf("]}");
        } else {
            size_t n = mtmd_input_chunk_get_n_tokens(c);
            double ms[64];
            if (repeat < 1 || repeat > 64) { fprintf(stderr, "--repeat takes 1..64\n"); return 2; }
            for (int r = 0; r < repeat; r++) {
                const int64_t t0 = ggml_time_us();
                if (mtmd_encode_chunk(mctx, c) != 0) { fprintf(stderr, "encode failed\n"); return 1; }
                ms[r] = (ggml_time_us() - t0) / 1e3;
            }
            FILE * f = fopen(argv[4], "wb");
            if (!f) { fprintf(stderr, "cannot write %s\n", argv[4]); return 1; }
            fwrite(mtmd_get_output_embd(mctx), sizeof(float), n * n_embd, f);
            fclose(f);
            printf("{\"image\":{\"n_tokens\":%zu,\"width\":%d", n, n_embd);
            if (timed) {
                printf(",\"encode_ms\":[");
                for (int r = 0; r < repeat; r++) printf(r ? ",%.3f" : "%.3f", ms[r]);
                printf("]");
            }
            printf("}}");
        }
    }
    if (n_predict == 0 || !lctx) {
        printf("]}\n");
        return 0;
    }
    llama_pos n_past = 0;
    if (mtmd_helper_eval_chunks(mctx, lctx, chunks, 0, 0, cp.n_batch, true, &n_past) != 0) {
        fprintf(stderr, "eval failed\n");
        return 1;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    printf("],\"n_past\":%d,\"tokens\":[", n_past);
    for (int s = 0; s < n_predict; s++) {
        const float * lg = llama_get_logits_ith(lctx, -1);
        int best = 0;
        for (int v = 1; v < n_vocab; v++) if (lg[v] > lg[best]) best = v;
        printf(s ? ",%d" : "%d", best);
        llama_token t = best;
        struct llama_batch b = llama_batch_get_one(&t, 1);
        if (llama_decode(lctx, b) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
    }
    printf("]}\n");
    mtmd_input_chunks_free(chunks);
    mtmd_bitmap_free(bw.bitmap);
    mtmd_free(mctx);
    llama_free(lctx);
    llama_model_free(model);
    return 0;
}
