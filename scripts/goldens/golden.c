// Greedy-decoding goldens from llama.cpp's libllama (build 11434), for Muser's parity tests.
//
//   golden MODEL --tokens 1,2,3 [--n-predict 128] [--n-ctx 1024] [--threads 2] [--chunk N] [--full-logits]
//                [--flash-attn auto|on|off]
//   golden MODEL --tokenize "text"          (prints the token ids as a JSON array)
//
// Decodes the prompt (token ids, so models without a tokenizer work) in one llama_decode call
// (or in llama_decode calls of --chunk tokens),
// then greedily generates --n-predict tokens one llama_decode at a time, and prints JSON:
// the settings used, the prompt, the generated ids, the top-1 logit of every step and, with
// --full-logits, every logit of the first step. Context settings are llama.cpp's defaults
// (flash_attn auto, F16 K/V, n_batch 2048, n_ubatch 512) except n_ctx and threads, which are
// explicit so the run is reproducible; weights are not repacked (use_extra_bufts = false).
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_fa_enabled = -1;

static void log_cb(enum ggml_log_level level, const char * text, void * user) {
    (void) level;
    (void) user;
    if (strstr(text, "Flash Attention") || strstr(text, "flash_attn")) {
        if (strstr(text, "enabled")) g_fa_enabled = 1;
        if (strstr(text, "disabled") || strstr(text, "not supported")) g_fa_enabled = 0;
    }
    if (getenv("GOLDEN_VERBOSE")) fputs(text, stderr);
}

static int parse_tokens(const char * s, llama_token * out, int max) {
    int n = 0;
    while (*s && n < max) {
        char * end;
        long v = strtol(s, &end, 10);
        if (end == s) break;
        out[n++] = (llama_token) v;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL (--tokens IDS | --tokenize TEXT) [--n-predict N] [--n-ctx N] [--threads N] [--full-logits] [--flash-attn auto|on|off]\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    const char * tokens_arg = NULL;
    const char * text = NULL;
    int n_predict = 128, n_ctx = 1024, threads = 2, full = 0, chunk = 0;
    const char * fa = "auto";
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) tokens_arg = argv[++i];
        else if (!strcmp(argv[i], "--tokenize") && i + 1 < argc) text = argv[++i];
        else if (!strcmp(argv[i], "--n-predict") && i + 1 < argc) n_predict = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--n-ctx") && i + 1 < argc) n_ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc) chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--full-logits")) full = 1;
        else if (!strcmp(argv[i], "--flash-attn") && i + 1 < argc) fa = argv[++i];
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }

    llama_log_set(log_cb, NULL);
    llama_backend_init();

    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false;
    struct llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", model_path); return 1; }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);

    static llama_token prompt[65536];
    int n_prompt = 0;
    if (text) {
        n_prompt = llama_tokenize(vocab, text, (int) strlen(text), prompt, 65536, true, true);
        if (n_prompt < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
        printf("[");
        for (int i = 0; i < n_prompt; i++) printf(i ? ",%d" : "%d", prompt[i]);
        printf("]\n");
        return 0;
    }
    n_prompt = parse_tokens(tokens_arg ? tokens_arg : "", prompt, 65536);
    if (n_prompt <= 0) { fprintf(stderr, "no prompt tokens\n"); return 1; }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n_ctx;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    if (!strcmp(fa, "on")) cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    else if (!strcmp(fa, "off")) cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    else if (strcmp(fa, "auto")) { fprintf(stderr, "--flash-attn takes auto, on or off\n"); return 2; }
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create context\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(vocab);

    for (int p = 0; p < n_prompt;) {
        const int n = chunk > 0 && chunk < n_prompt - p ? chunk : n_prompt - p;
        if (llama_decode(ctx, llama_batch_get_one(prompt + p, n))) { fprintf(stderr, "prompt decode failed\n"); return 1; }
        p += n;
    }

    printf("{\"n_ctx\":%u,\"n_batch\":%u,\"n_ubatch\":%u,\"n_threads\":%d,", llama_n_ctx(ctx), llama_n_batch(ctx), llama_n_ubatch(ctx), threads);
    printf("\"flash_attn\":\"%s%s\",\"type_k\":\"f16\",\"type_v\":\"f16\",\"n_vocab\":%d,", fa, g_fa_enabled == 1 ? " (enabled)" : g_fa_enabled == 0 ? " (disabled)" : "", n_vocab);
    printf("\"chunk\":%d,\"prompt\":[", chunk);
    for (int i = 0; i < n_prompt; i++) printf(i ? ",%d" : "%d", prompt[i]);
    printf("],");

    llama_token out[8192];
    float top[8192];
    for (int step = 0; step < n_predict && step < 8192; step++) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int v = 1; v < n_vocab; v++) if (logits[v] > logits[best]) best = v;
        if (step == 0 && full) {
            printf("\"first_logits\":[");
            for (int v = 0; v < n_vocab; v++) printf(v ? ",%.9g" : "%.9g", logits[v]);
            printf("],");
        }
        out[step] = best;
        top[step] = logits[best];
        if (step + 1 < n_predict && llama_decode(ctx, llama_batch_get_one(&out[step], 1))) {
            fprintf(stderr, "decode failed at step %d\n", step);
            return 1;
        }
    }
    printf("\"tokens\":[");
    for (int i = 0; i < n_predict; i++) printf(i ? ",%d" : "%d", out[i]);
    printf("],\"top_logits\":[");
    for (int i = 0; i < n_predict; i++) printf(i ? ",%.9g" : "%.9g", top[i]);
    printf("]}\n");

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
