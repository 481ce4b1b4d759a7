/* A grammar's checks of a drafted tree and of the text it forces, each in one call.
 *
 * A grammar position is a llama.cpp grammar sampler (llama_sampler_init_grammar, cloned per
 * position). Checking a token means applying the sampler to a one-entry candidate array and
 * seeing whether its logit became -inf; advancing means accepting the token. From Python each
 * such call is several numpy and ctypes calls, which cost tens of microseconds on the caches a
 * forward pass has just flushed; a drafted tree's check makes dozens of them. These functions
 * make the same calls from C. llama.cpp's functions are passed in as pointers (nothing is
 * linked); the types follow the llama.h of the pinned llama-cpp-python (a token data array,
 * as _argmax.c has it). */

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

struct token_data {
    int32_t id;
    float logit, p;
};

struct token_data_array {
    struct token_data *data;
    size_t size;
    int64_t selected;
    bool sorted;
};

typedef void (*apply_fn)(void *smpl, struct token_data_array *cur);
typedef void (*accept_fn)(void *smpl, int32_t token);
typedef void *(*clone_fn)(const void *smpl);
typedef void (*free_fn)(void *smpl);

/* llama_sampler_apply, _accept, _clone, _free */
struct fns {
    apply_fn apply;
    accept_fn accept;
    clone_fn clone;
    free_fn release;
};

/* ok[i]: whether the grammar at `st` admits ids[i] next (buf: n entries of scratch). The
 * number admitted. */
static int32_t admits(const struct fns *f, void *st, const int32_t *ids, int32_t n,
                      uint8_t *ok, struct token_data *buf) {
    for (int32_t i = 0; i < n; ++i) {
        buf[i].id = ids[i];
        buf[i].logit = 0.0f;
        buf[i].p = 0.0f;
    }
    struct token_data_array arr = {buf, (size_t)n, -1, false};
    f->apply(st, &arr);
    int32_t some = 0;
    for (int32_t i = 0; i < n; ++i) {
        ok[i] = isfinite(buf[i].logit) ? 1 : 0;
        some += ok[i];
    }
    return some;
}

/* The grammar at `st` checked for `token` next and, where it admits it, advanced along it:
 * 1; else 0, the state unchanged. (A greedy step's draw: the row's argmax, most often
 * admitted, checked and taken in one call.) */
int32_t srsd_grammar_take(const struct fns *f, void *st, int32_t token) {
    struct token_data one;
    uint8_t ok;
    if (!admits(f, st, &token, 1, &ok, &one)) return 0;
    f->accept(st, token);
    return 1;
}

/* A drafted tree (tokens, parents; node 0 the root, already accepted at `root`; parents
 * before children) checked against the grammar: keep[i], whether node i is admitted along
 * its path (a node under a rejected one is not); states[i], for each admitted node that has
 * no children in the tree (the root aside), a new grammar state after it (the caller owns
 * it), else NULL. A node's state, not needed once its children are checked, becomes its last
 * admitted child's (a chain clones one state, not one per node); `root` is never advanced.
 * 0, or -1 when memory ran out (nothing is then kept). */
int32_t srsd_grammar_prune(const struct fns *f, void *root, int32_t n, const int32_t *tokens,
                           const int32_t *parents, uint8_t *keep, void **states) {
    for (int32_t i = 0; i < n; ++i) {
        keep[i] = 0;
        states[i] = NULL;
    }
    if (n <= 0) return 0;
    int32_t *first = malloc(sizeof(int32_t) * (size_t)n * 3);
    int32_t *kids_tok = malloc(sizeof(int32_t) * (size_t)n);
    uint8_t *ok = malloc((size_t)n);
    struct token_data *buf = malloc(sizeof(struct token_data) * (size_t)n);
    if (!first || !kids_tok || !ok || !buf) {
        free(first), free(kids_tok), free(ok), free(buf);
        return -1;
    }
    int32_t *next = first + n, *last_kid = first + 2 * n;
    for (int32_t i = 0; i < n; ++i) first[i] = next[i] = last_kid[i] = -1;
    for (int32_t i = 1; i < n; ++i) { /* children in index order */
        int32_t p = parents[i];
        if (p < 0 || p >= i) continue;
        if (last_kid[p] < 0) first[p] = i;
        else next[last_kid[p]] = i;
        last_kid[p] = i;
    }
    keep[0] = 1;
    states[0] = root;
    for (int32_t node = 0; node < n; ++node) {
        if (!keep[node] || first[node] < 0) continue;
        void *st = states[node];
        states[node] = NULL;
        int32_t m = 0;
        for (int32_t k = first[node]; k >= 0; k = next[k]) kids_tok[m++] = tokens[k];
        admits(f, st, kids_tok, m, ok, buf);
        int32_t last = -1, j = 0;
        if (node != 0)
            for (int32_t k = first[node]; k >= 0; k = next[k], ++j)
                if (ok[j]) last = k;
        j = 0;
        for (int32_t k = first[node]; k >= 0; k = next[k], ++j) {
            if (!ok[j]) continue;
            keep[k] = 1;
            void *child = k == last ? st : f->clone(st);
            f->accept(child, tokens[k]);
            states[k] = child;
        }
        if (node != 0 && last < 0) f->release(st); /* no child took it over */
    }
    for (int32_t i = 1; i < n; ++i) /* states left on nodes with children: none (popped) */
        if (states[i] && first[i] >= 0) {
            f->release(states[i]);
            states[i] = NULL;
        }
    states[0] = NULL;
    free(first), free(kids_tok), free(ok), free(buf);
    return 0;
}

/* The characters the grammar at `st` admits next while it admits one non-space character
 * (optional whitespace written as space_after[previous character] says; `prev_space` for
 * the character before the first), stopping at a real choice, where the output may end, or
 * after max_chars. ids/chars: the n single-character probe tokens and their (ASCII)
 * characters; eog: end-of-generation ids; sentinels: probes of which two admitted mean free
 * text (nothing forced). Written to out (max_chars bytes); returns how many, or -1 when
 * memory ran out. `st` is not advanced. */
int32_t srsd_grammar_forced(const struct fns *f, void *st0, int32_t max_chars,
                            const int32_t *ids, const uint8_t *chars, int32_t n,
                            const int32_t *eog, int32_t n_eog, const int32_t *sentinels,
                            int32_t n_sent, const uint8_t *space_after, int32_t prev_space,
                            char *out) {
    if (n <= 0 || max_chars <= 0) return 0;
    int32_t total = n + n_eog > n_sent ? n + n_eog : n_sent;
    int32_t *cand = malloc(sizeof(int32_t) * (size_t)(n + n_eog));
    uint8_t *ok = malloc((size_t)total);
    struct token_data *buf = malloc(sizeof(struct token_data) * (size_t)total);
    if (!cand || !ok || !buf) {
        free(cand), free(ok), free(buf);
        return -1;
    }
    int32_t got = 0;
    if (n_sent > 0 && admits(f, st0, sentinels, n_sent, ok, buf) >= 2)
        goto done; /* free text */
    for (int32_t i = 0; i < n; ++i) cand[i] = ids[i];
    for (int32_t i = 0; i < n_eog; ++i) cand[n + i] = eog[i];
    void *st = f->clone(st0);
    int space_next = prev_space;
    while (got < max_chars) {
        admits(f, st, cand, n + n_eog, ok, buf);
        int32_t n_allowed = 0, n_solid = 0, solid = -1, space = -1, any = -1;
        for (int32_t i = 0; i < n; ++i) {
            if (!ok[i]) continue;
            ++n_allowed;
            any = i;
            uint8_t c = chars[i];
            bool white = c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' ||
                         c == '\f';
            if (!white) {
                if (solid < 0) solid = i;
                ++n_solid;
            } else if (c == ' ') {
                space = i;
            }
        }
        if (n_solid > 1 || n_allowed == 0) break;
        bool may_end = false;
        for (int32_t i = 0; i < n_eog; ++i) may_end = may_end || ok[n + i];
        if (may_end) break; /* the output may end here */
        int32_t pick;
        if (n_solid == 1 && n_allowed == 1) pick = solid;
        else if (n_solid == 1) pick = space >= 0 && space_next ? space : solid;
        else if (n_allowed == 1) pick = any;
        else break;
        f->accept(st, ids[pick]);
        out[got++] = (char)chars[pick];
        space_next = space_after[chars[pick]];
    }
    f->release(st);
done:
    free(cand), free(ok), free(buf);
    return got;
}

/* A run of plain steps' check of each token it takes (see _argmax.c's srsd_step_run): the
 * grammar at `st` takes the token where it admits it. With `stop_forced`, a taken token
 * after which the grammar forces a character (what a drafting request drafts) ends the run.
 * The probe arrays are srsd_grammar_forced's. */
struct run_check {
    const struct fns *f;
    void *st;
    int32_t stop_forced;
    const int32_t *ids;
    const uint8_t *chars;
    int32_t n;
    const int32_t *eog;
    int32_t n_eog;
    const int32_t *sentinels;
    int32_t n_sent;
};

/* 1: taken, the run goes on; 2: taken, the grammar forces what comes next (stop_forced);
 * 0: rejected, the state unchanged. */
int32_t srsd_grammar_run_check(void *data, int32_t token) {
    const struct run_check *c = data;
    if (!srsd_grammar_take(c->f, c->st, token)) return 0;
    if (c->stop_forced) {
        static const uint8_t no_space[256];
        char one;
        if (srsd_grammar_forced(c->f, c->st, 1, c->ids, c->chars, c->n, c->eog, c->n_eog,
                                c->sentinels, c->n_sent, no_space, 0, &one) != 0)
            return 2; /* forced, or out of memory: back to the caller either way */
    }
    return 1;
}
