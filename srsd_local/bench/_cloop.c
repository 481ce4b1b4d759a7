/* A minimal decode loop in C (see cloop.py): one llama_decode per token, the next token
 * taken from the logits row without going back to Python, until max_tokens or an
 * end-of-generation token. The baseline the engine's own per-token overhead is measured
 * against. Compiled on first use with the system's C compiler; llama.cpp's functions are
 * passed in as pointers, so nothing is linked. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* llama.h's struct llama_batch, field by field (cloop.py checks the size and offsets
 * against llama-cpp-python's definition before using the loop) */
struct batch {
    int32_t n_tokens;
    int32_t *token;
    float *embd;
    int32_t *pos;
    int32_t *n_seq_id;
    int32_t **seq_id;
    int8_t *logits;
};

typedef int32_t (*decode_fn)(void *ctx, struct batch b);
typedef float *(*logits_ith_fn)(void *ctx, int32_t i);
typedef bool (*is_eog_fn)(const void *vocab, int32_t token);
/* the sampler's compiled temperature draw (spec/_kernels.c) */
typedef int64_t (*temperature_fn)(const float *x, int64_t n, float inv_t, double u,
                                  double *sums, int n_threads);

void srsd_loop_batch_layout(size_t *out) {
    out[0] = sizeof(struct batch);
    out[1] = offsetof(struct batch, token);
    out[2] = offsetof(struct batch, embd);
    out[3] = offsetof(struct batch, pos);
    out[4] = offsetof(struct batch, n_seq_id);
    out[5] = offsetof(struct batch, seq_id);
    out[6] = offsetof(struct batch, logits);
}

#define LANES 16
typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef int32_t vint __attribute__((vector_size(LANES * 4)));

/* numpy's argmax (the first largest value) of a row without NaNs, in one pass: per lane
 * its largest value and where it was first seen (GCC/Clang vector types: the compiler
 * maps them on the machine's vectors) */
int64_t srsd_loop_argmax(const float *x, int64_t n) {
    if (n < 2 * LANES) {
        int64_t best = 0;
        for (int64_t i = 1; i < n; ++i)
            if (x[i] > x[best]) best = i;
        return best;
    }
    vfloat m;
    vint at, cur, step;
    memcpy(&m, x, sizeof m);
    for (int j = 0; j < LANES; ++j) {
        at[j] = cur[j] = j;
        step[j] = LANES;
    }
    int64_t i = LANES;
    for (; i + LANES <= n; i += LANES) {
        vfloat v;
        memcpy(&v, x + i, sizeof v);
        cur += step;
        const vint gt = v > m; /* all ones where this block's value is larger */
        m = (vfloat)(((vint)v & gt) | ((vint)m & ~gt));
        at = (cur & gt) | (at & ~gt);
    }
    float best = m[0];
    int64_t best_at = at[0];
    for (int j = 1; j < LANES; ++j)
        if (m[j] > best || (m[j] == best && at[j] < best_at)) {
            best = m[j];
            best_at = at[j];
        }
    for (; i < n; ++i)
        if (x[i] > best) {
            best = x[i];
            best_at = i;
        }
    return best_at;
}

/* Generate after a prompt whose logits llama.cpp holds: `token` is the first token (drawn
 * by the caller from the prompt's row), written to out[0]; then decode the last token on
 * sequence 0 (positions follow the cache) and take the next one, until max_tokens tokens are
 * in `out` or an end-of-generation token comes (not written). Greedy without `u`; else token
 * k is drawn with `sample` at 1 / inv_t with the uniform number u[k]. Returns the tokens
 * written; *rc is llama_decode's code when it failed (0 otherwise, -1: no logits row). */
int32_t srsd_loop(void *decode_addr, void *logits_ith_addr, void *is_eog_addr,
                  void *sample_addr, void *ctx, const void *vocab, int32_t token,
                  int32_t n_vocab, int32_t max_tokens, const double *u, float inv_t,
                  int32_t n_threads, double *sums, int32_t *out, int32_t *rc) {
    decode_fn decode = (decode_fn)decode_addr;
    logits_ith_fn logits_ith = (logits_ith_fn)logits_ith_addr;
    is_eog_fn is_eog = (is_eog_fn)is_eog_addr;
    temperature_fn sample = (temperature_fn)sample_addr;
    *rc = 0;
    if (max_tokens <= 0) return 0;
    int32_t n = 0;
    out[n++] = token;
    while (n < max_tokens) {
        struct batch b = {1, &token, NULL, NULL, NULL, NULL, NULL};
        const int32_t code = decode(ctx, b);
        if (code != 0) {
            *rc = code;
            return n;
        }
        const float *row = logits_ith(ctx, -1);
        if (!row) {
            *rc = -1;
            return n;
        }
        token = (int32_t)(u ? sample(row, n_vocab, inv_t, u[n], sums, n_threads)
                            : srsd_loop_argmax(row, n_vocab));
        if (is_eog(vocab, token)) break;
        out[n++] = token;
    }
    return n;
}
