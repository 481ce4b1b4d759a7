/* Greedy samplers for llama.cpp's graph that copy nothing out but the token.
 *
 * When a sequence has a sampler, llama.cpp pads the graph's logits with a row (a copy of
 * every row, element by element) and hands the sampler a view of the padded tensor per
 * output row. Its own greedy sampler adds ggml's argmax of that view and leaves the view as
 * the row's "sampled logits", so the pad is computed and every row is still copied out.
 * These samplers read the row in llama.cpp's logits tensor itself (a view of the tensor the
 * pad was made from: the pad is then not computed) and give back no logits. On a CPU
 * (srsd_argmax_iface(1)) the argmax is two custom ops per row, because ggml's takes one
 * thread and a scalar loop: every thread takes the maximum of its share of the row (the
 * first index holding it), then one thread picks the first part with the largest. Elsewhere
 * (a GPU's backend, srsd_argmax_iface(0)) it is ggml's argmax. The token is numpy's argmax
 * for rows without NaN. The "keep" kinds (srsd_argmax_iface(2 | threads)) copy the row out
 * as well, as the row's sampled logits (read where a grammar rejects the argmax).
 *
 * The types below follow the llama.h / ggml.h of the pinned llama-cpp-python (the sampler
 * interface and its data, a token data array, the leading fields of a ggml tensor);
 * srsd_argmax_setup checks the tensor fields against ggml's own functions on tensors it
 * makes, and the sampler is not offered (0 returned) when they disagree. */

#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

struct ggml_context;
struct ggml_cgraph;
struct llama_sampler;

struct tensor { /* the fields of struct ggml_tensor up to its data */
    int type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct tensor *src[10];
    struct tensor *view_src;
    size_t view_offs;
    void *data;
};

struct init_params {
    size_t mem_size;
    void *mem_buffer;
    bool no_alloc;
};

typedef void (*custom_op)(struct tensor *dst, int ith, int nth, void *userdata);
typedef struct tensor *(*custom_4d_fn)(struct ggml_context *ctx, int type, int64_t ne0,
                                       int64_t ne1, int64_t ne2, int64_t ne3,
                                       struct tensor **args, int n_args, custom_op fun,
                                       int n_tasks, void *userdata);
typedef struct tensor *(*view_1d_fn)(struct ggml_context *ctx, struct tensor *a, int64_t ne0,
                                     size_t offset);
typedef struct ggml_context *(*init_fn)(struct init_params params);
typedef void (*free_fn)(struct ggml_context *ctx);
typedef struct tensor *(*new_2d_fn)(struct ggml_context *ctx, int type, int64_t ne0,
                                    int64_t ne1);
typedef struct tensor *(*pad_fn)(struct ggml_context *ctx, struct tensor *a, int p0, int p1,
                                 int p2, int p3);
typedef struct tensor *(*argmax_fn)(struct ggml_context *ctx, struct tensor *a);
typedef void *(*get_data_fn)(const struct tensor *t);
typedef int64_t (*nelements_fn)(const struct tensor *t);

struct sampler_data {
    struct tensor *logits, *probs, *sampled, *candidates;
};

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

struct sampler_iface {
    const char *(*name)(const struct llama_sampler *s);
    void (*accept)(struct llama_sampler *s, int32_t token);
    void (*apply)(struct llama_sampler *s, struct token_data_array *cur);
    void (*reset)(struct llama_sampler *s);
    struct llama_sampler *(*clone)(const struct llama_sampler *s);
    void (*free)(struct llama_sampler *s);
    bool (*backend_init)(struct llama_sampler *s, void *buft, uint32_t n_outputs_max);
    void (*backend_accept)(struct llama_sampler *s, struct ggml_context *ctx,
                           struct ggml_cgraph *gf, struct tensor *token);
    void (*backend_apply)(struct llama_sampler *s, struct ggml_context *ctx,
                          struct ggml_cgraph *gf, struct sampler_data *data);
    void (*backend_set_input)(struct llama_sampler *s);
    void (*backend_reset)(struct llama_sampler *s);
    void (*copy_state)(const struct llama_sampler *src, struct llama_sampler *dst);
};

enum { TYPE_F32 = 0, TYPE_I32 = 26, ALL_THREADS = -1, MAX_PARTS = 256, LANES = 16 };

static custom_4d_fn custom_4d;
static view_1d_fn view_1d;
static argmax_fn ggml_argmax;
static int pad_op = -1;     /* ggml's op code of a pad, learnt in setup */
static int64_t rows_taken;  /* rows whose argmax the ops took, for tests */
static int64_t rows_direct; /* of those, read from the tensor the pad was made from */

/* Checks the tensor fields above on tensors made with ggml's functions, learns the pad's
 * op code and keeps the functions the sampler uses. 1 when everything agreed, else 0 (the
 * sampler is then not to be used). */
int srsd_argmax_setup(void *init_addr, void *free_addr, void *new_2d_addr, void *pad_addr,
                      void *view_1d_addr, void *custom_4d_addr, void *argmax_addr,
                      void *get_data_addr, void *nelements_addr) {
    init_fn init = (init_fn)init_addr;
    free_fn release = (free_fn)free_addr;
    new_2d_fn new_2d = (new_2d_fn)new_2d_addr;
    pad_fn pad = (pad_fn)pad_addr;
    get_data_fn get_data = (get_data_fn)get_data_addr;
    nelements_fn nelements = (nelements_fn)nelements_addr;
    view_1d = (view_1d_fn)view_1d_addr;
    struct init_params params = {1 << 20, NULL, false};
    struct ggml_context *ctx = init(params);
    if (!ctx) return 0;
    struct tensor *t = new_2d(ctx, TYPE_F32, 40, 3);
    struct tensor *p = pad(ctx, t, 0, 1, 0, 0);
    struct tensor *v = view_1d(ctx, p, 40, 2 * p->nb[1]);
    bool ok = t->type == TYPE_F32 && t->ne[0] == 40 && t->ne[1] == 3 && t->nb[0] == 4 &&
              t->nb[1] == 160 && nelements(t) == 120 && t->data == get_data(t) &&
              t->data != NULL && p->src[0] == t && p->ne[1] == 4 && p->nb[1] == 160 &&
              v->view_src == p && v->view_offs == 320 && v->ne[0] == 40 &&
              v->op != p->op && t->op != p->op;
    if (ok) pad_op = p->op;
    release(ctx);
    if (!ok) return 0;
    custom_4d = (custom_4d_fn)custom_4d_addr;
    ggml_argmax = (argmax_fn)argmax_addr;
    return 1;
}

int64_t srsd_argmax_rows(int direct) { return direct ? rows_direct : rows_taken; }

/* The maximum of x[lo, hi) and the first index holding it (lo when every entry is NaN). */
static void span_max(const float *x, int64_t lo, int64_t hi, float *best, int64_t *at) {
    float lane[LANES];
    int64_t i = lo;
    float m = x[lo];
    for (int j = 0; j < LANES; ++j) lane[j] = x[lo];
    for (; i + LANES <= hi; i += LANES)
        for (int j = 0; j < LANES; ++j) lane[j] = lane[j] > x[i + j] ? lane[j] : x[i + j];
    for (int j = 0; j < LANES; ++j) m = m > lane[j] ? m : lane[j];
    for (; i < hi; ++i) m = m > x[i] ? m : x[i];
    int64_t k = lo;
    while (k < hi && x[k] != m) ++k;
    *best = m;
    *at = k < hi ? k : lo;
}

/* Thread ith of nth: the maximum of its share of the row (userdata: a contiguous float32
 * row) and where it is. dst (float32): [nth, (maximum, index bits) per part]. */
static void part_op(struct tensor *dst, int ith, int nth, void *userdata) {
    const struct tensor *row = userdata;
    const float *x = row->data;
    float *out = dst->data;
    int64_t n = row->ne[0];
    if (nth > MAX_PARTS) nth = MAX_PARTS;
    if (ith >= nth) return;
    int64_t share = ((n + nth - 1) / nth + LANES - 1) / LANES * LANES;
    int64_t lo = ith * share, hi = lo + share < n ? lo + share : n;
    float m = 0.0f;
    int64_t at = -1;
    if (lo < hi) span_max(x, lo, hi, &m, &at);
    int32_t idx = (int32_t)at;
    out[1 + 2 * ith] = m;
    memcpy(&out[2 + 2 * ith], &idx, sizeof idx);
    if (ith == 0) out[0] = (float)nth;
}

/* One thread: the first part holding the largest maximum, as the row's token (int32). */
static void pick_op(struct tensor *dst, int ith, int nth, void *userdata) {
    (void)nth;
    if (ith != 0) return;
    const float *parts = ((const struct tensor *)userdata)->data;
    int n = (int)parts[0];
    int32_t best = 0;
    float m = 0.0f;
    bool found = false;
    for (int p = 0; p < n; ++p) {
        int32_t idx;
        memcpy(&idx, &parts[2 + 2 * p], sizeof idx);
        if (idx < 0) continue;
        float v = parts[1 + 2 * p];
        if (!found || v > m) {
            m = v;
            best = idx;
            found = true;
        }
    }
    *(int32_t *)dst->data = best;
    __atomic_fetch_add(&rows_taken, 1, __ATOMIC_RELAXED); /* contexts may compute at once */
}

static void pick_direct_op(struct tensor *dst, int ith, int nth, void *userdata) {
    pick_op(dst, ith, nth, userdata);
    if (ith == 0) __atomic_fetch_add(&rows_direct, 1, __ATOMIC_RELAXED);
}

static const char *name(const struct llama_sampler *s) {
    (void)s;
    return "srsd-argmax";
}

/* Outside the graph (llama_sampler_apply): the first token of the largest logit. */
static void apply(struct llama_sampler *s, struct token_data_array *cur) {
    (void)s;
    int64_t best = 0;
    for (size_t i = 1; i < cur->size; ++i)
        if (cur->data[i].logit > cur->data[best].logit) best = (int64_t)i;
    cur->selected = cur->size ? best : -1;
}

static bool backend_init(struct llama_sampler *s, void *buft, uint32_t n_outputs_max) {
    (void)s, (void)buft, (void)n_outputs_max;
    return custom_4d != NULL;
}

/* The row of the tensor llama.cpp's pad copied, when `row` is a view of that pad (the pad
 * is then not computed), else `row` itself. */
static struct tensor *unpadded(struct ggml_context *ctx, struct tensor *row, bool *direct) {
    struct tensor *padded = row->view_src;
    *direct = false;
    if (!padded || padded->op != pad_op || !padded->src[0] || !padded->nb[1]) return row;
    struct tensor *logits = padded->src[0];
    if (logits->nb[1] != padded->nb[1] || logits->nb[0] != 4 || logits->ne[0] != row->ne[0] ||
        row->view_offs % padded->nb[1] != 0 ||
        (int64_t)(row->view_offs / padded->nb[1]) >= logits->ne[1])
        return row;
    *direct = true;
    return view_1d(ctx, logits, row->ne[0], row->view_offs);
}

/* CPU: the two custom ops; the row kept as the row's "sampled logits" (copied out) or not. */
static void argmax_threads(struct ggml_context *ctx, struct sampler_data *data, bool keep) {
    bool direct;
    struct tensor *row = unpadded(ctx, data->logits, &direct);
    struct tensor *parts = custom_4d(ctx, TYPE_F32, 1 + 2 * MAX_PARTS, 1, 1, 1, &row, 1,
                                     part_op, ALL_THREADS, row);
    data->sampled = custom_4d(ctx, TYPE_I32, 1, 1, 1, 1, &parts, 1,
                              direct ? pick_direct_op : pick_op, 1, parts);
    /* not kept, only the token comes back: left as it was, the padded row would be computed
     * and copied out; kept, the row of the logits tensor itself is */
    data->logits = keep ? row : NULL;
}

static void apply_threads(struct llama_sampler *s, struct ggml_context *ctx,
                          struct ggml_cgraph *gf, struct sampler_data *data) {
    (void)s, (void)gf;
    argmax_threads(ctx, data, false);
}

static void apply_threads_keep(struct llama_sampler *s, struct ggml_context *ctx,
                               struct ggml_cgraph *gf, struct sampler_data *data) {
    (void)s, (void)gf;
    argmax_threads(ctx, data, true);
}

/* Any backend (a GPU's): ggml's argmax of the unpadded row; the row kept or not. */
static void argmax_ggml(struct ggml_context *ctx, struct sampler_data *data, bool keep) {
    bool direct;
    struct tensor *row = unpadded(ctx, data->logits, &direct);
    data->sampled = ggml_argmax(ctx, row);
    data->logits = keep ? row : NULL;
}

static void apply_ggml(struct llama_sampler *s, struct ggml_context *ctx,
                       struct ggml_cgraph *gf, struct sampler_data *data) {
    (void)s, (void)gf;
    argmax_ggml(ctx, data, false);
}

static void apply_ggml_keep(struct llama_sampler *s, struct ggml_context *ctx,
                            struct ggml_cgraph *gf, struct sampler_data *data) {
    (void)s, (void)gf;
    argmax_ggml(ctx, data, true);
}

static struct sampler_iface ifaces[4] = {
    {.name = name, .apply = apply, .backend_init = backend_init, .backend_apply = apply_ggml},
    {.name = name, .apply = apply, .backend_init = backend_init,
     .backend_apply = apply_threads},
    {.name = name, .apply = apply, .backend_init = backend_init,
     .backend_apply = apply_ggml_keep},
    {.name = name, .apply = apply, .backend_init = backend_init,
     .backend_apply = apply_threads_keep},
};

/* The sampler interface: bit 0, the CPU's custom ops (else ggml's argmax); bit 1, the row
 * kept as the row's sampled logits (for a request that may need more than the argmax: a
 * grammar that rejects it). */
void *srsd_argmax_iface(int kind) { return &ifaces[kind & 3]; }

/* A sampled request's draw in the graph (CPU): the token drawn from softmax(row / T) with a
 * uniform u set before each pass, made by the very functions of spec/_kernels.c that draw
 * on the host (passed in by srsd_draw_setup), so that the token is the one the host would
 * draw from the same row and u: the row's blocks shared out among the decode's threads, then
 * the pick on one. Only the token comes back. The sampler's ctx is a struct draw_state the
 * caller owns. */
typedef void (*blocks_fn)(const float *x, int64_t n, float inv_t, double *sums, int64_t b0,
                          int64_t b1);
typedef int64_t (*pick_fn)(const float *x, int64_t n, float inv_t, double u, double *sums);
static blocks_fn draw_blocks;
static pick_fn draw_pick;

struct draw_state {
    double u;       /* the uniform draw for the next pass's row */
    float inv_t;    /* 1 / temperature */
    int32_t rows;   /* rows drawn in a graph, ever */
    double *sums;   /* scratch: n_sums doubles, 2 * (n / 512 + 1) for rows of n */
    int64_t n_sums;
};

struct llama_sampler_head { /* llama.h's struct llama_sampler */
    void *iface;
    void *ctx;
};

void srsd_draw_setup(void *blocks, void *pick) {
    draw_blocks = (blocks_fn)blocks;
    draw_pick = (pick_fn)pick;
}

static bool draw_fits(const struct draw_state *st, int64_t n) {
    return st->sums && st->n_sums >= 2 * (n / 512 + 1);
}

/* Thread ith of nth: its share of the row's blocks (dst->src[0]: the row). */
static void draw_blocks_op(struct tensor *dst, int ith, int nth, void *userdata) {
    struct draw_state *st = userdata;
    const struct tensor *row = dst->src[0];
    const int64_t n = row->ne[0], n_blocks = (n + 511) / 512;
    if (!draw_fits(st, n)) return;
    const int64_t share = (n_blocks + nth - 1) / nth, b0 = ith * share;
    if (b0 < n_blocks) draw_blocks(row->data, n, st->inv_t, st->sums, b0, b0 + share);
}

/* One thread, after every share: the token (int32; -1 where the scratch is too small). */
static void draw_pick_op(struct tensor *dst, int ith, int nth, void *userdata) {
    (void)nth;
    if (ith != 0) return;
    struct draw_state *st = userdata;
    const struct tensor *row = dst->src[0];
    const int64_t n = row->ne[0];
    int32_t tok = -1;
    if (draw_fits(st, n)) tok = (int32_t)draw_pick(row->data, n, st->inv_t, st->u, st->sums);
    *(int32_t *)dst->data = tok;
    __atomic_fetch_add(&st->rows, 1, __ATOMIC_RELAXED);
}

static const char *draw_name(const struct llama_sampler *s) {
    (void)s;
    return "srsd-draw";
}

static void apply_draw(struct llama_sampler *s, struct ggml_context *ctx,
                       struct ggml_cgraph *gf, struct sampler_data *data) {
    (void)gf;
    struct draw_state *st = ((struct llama_sampler_head *)s)->ctx;
    bool direct;
    struct tensor *row = unpadded(ctx, data->logits, &direct);
    struct tensor *parts = custom_4d(ctx, TYPE_F32, 1, 1, 1, 1, &row, 1, draw_blocks_op,
                                     ALL_THREADS, st);
    struct tensor *args[2] = {row, parts};
    data->sampled = custom_4d(ctx, TYPE_I32, 1, 1, 1, 1, args, 2, draw_pick_op, 1, st);
    data->logits = NULL;
}

static bool draw_init(struct llama_sampler *s, void *buft, uint32_t n_outputs_max) {
    (void)s, (void)buft, (void)n_outputs_max;
    return custom_4d != NULL && draw_blocks != NULL && draw_pick != NULL;
}

static struct sampler_iface draw_iface = {
    .name = draw_name, .apply = apply, .backend_init = draw_init, .backend_apply = apply_draw};

/* The draw sampler's interface (CPU only: its ops run on the decode's threads). */
void *srsd_draw_iface(void) { return &draw_iface; }

/* After a llama_decode call: into out[k], the in-graph sampled token of batch row rows[k]
 * (-1 where rows[k] is -1), read with llama_get_sampled_token_ith (`get`); returns how many
 * were read. One call for a tree's rows instead of one call into llama.cpp per row. */
typedef int32_t (*sampled_token_fn)(void *ctx, int32_t i);

int64_t srsd_read_sampled(void *get, void *ctx, const int32_t *rows, int64_t n,
                          int32_t *out) {
    sampled_token_fn f = (sampled_token_fn)get;
    int64_t some = 0;
    for (int64_t k = 0; k < n; ++k) {
        if (rows[k] >= 0) {
            out[k] = f(ctx, rows[k]);
            ++some;
        } else {
            out[k] = -1;
        }
    }
    return some;
}

/* The leading fields of llama.h's struct llama_batch. */
struct batch {
    int32_t n_tokens;
    int32_t *token;
    float *embd;
    int32_t *pos;
    int32_t *n_seq_id;
    int32_t **seq_id;
    int8_t *logits;
};

/* Rows 0..m-1 of a batch in one call (numpy's calls and ctypes' item writes each cost more
 * on the caches a forward pass has just flushed than this loop does): tokens, positions,
 * output flags (NULL: every row) and each row's nseq[i] sequence ids, read one after the
 * other from seq. Sets n_tokens; returns the number of output rows. */
int32_t srsd_fill_batch(struct batch *b, int32_t m, const int32_t *tok, const int32_t *pos,
                        const int8_t *flags, const int32_t *nseq, const int32_t *seq) {
    int32_t n_out = 0;
    b->n_tokens = m;
    for (int32_t i = 0; i < m; ++i) {
        b->token[i] = tok[i];
        b->pos[i] = pos[i];
        int8_t f = flags ? flags[i] : 1;
        b->logits[i] = f;
        n_out += f != 0;
        b->n_seq_id[i] = nseq[i];
        for (int32_t j = 0; j < nseq[i]; ++j) b->seq_id[i][j] = *seq++;
    }
    return n_out;
}

/* A plain step in one call: one token of sequence `seq` at `pos` (its logits row wanted)
 * written into the batch, the hidden-state capture switched on or off and emptied, then
 * llama_decode, llama_synchronize (both timed with CLOCK_MONOTONIC, the clock of Python's
 * perf_counter) and, asked for, the token llama.cpp's graph sampled for the row. From Python
 * a plain step is then one call into C instead of a dozen ctypes writes, three calls into
 * llama.cpp and two clock reads, each slow on the caches the last forward pass flushed.
 * With `stage` (not NULL), a captured row of n_embd float32 values is copied there too (the
 * index's next pending row: no numpy call to copy it out).
 * llama.cpp's functions are passed in as pointers (nothing is linked). */
typedef int32_t (*decode_fn)(void *ctx, struct batch b);
typedef void (*sync_fn)(void *ctx);

struct step {
    void *ctx;
    struct batch *batch;
    decode_fn decode;
    sync_fn sync;
    sampled_token_fn sampled;
    int32_t *cap_enabled; /* the compiled capture's state fields (NULL: no capture) */
    size_t *cap_used;
    int64_t *cap_rows;
    int32_t *cap_overflow;
    int32_t *cap_type;
    int64_t *cap_ne0;
    char **cap_buf;
    int64_t n_embd;
    double seconds; /* out: llama_decode and llama_synchronize */
    int32_t token;  /* out: the row's in-graph sampled token (want_sampled), else -1;
                     * srsd_step_rows: how many rows' tokens were read */
    int32_t staged; /* out: whether the captured row was copied to `stage` */
    double read_seconds; /* out (srsd_step_rows): reading the sampled tokens */
    int32_t verdict; /* out (srsd_step_run with a check): the last step's token's verdict */
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One token of sequence `seq` at `pos`, its logits row wanted, written into the batch; the
 * capture (if any) switched on or off and emptied; llama_decode and llama_synchronize, timed
 * into *seconds. llama_decode's return code comes back. */
static int32_t pass_one(struct step *s, int32_t token, int32_t pos, int32_t seq,
                        int32_t capture, double *seconds) {
    struct batch *b = s->batch;
    b->n_tokens = 1;
    b->token[0] = token;
    b->pos[0] = pos;
    b->logits[0] = 1;
    b->n_seq_id[0] = 1;
    b->seq_id[0][0] = seq;
    if (s->cap_enabled) {
        *s->cap_enabled = capture;
        *s->cap_used = 0;
        *s->cap_rows = 0;
        *s->cap_overflow = 0;
    }
    const double t0 = now();
    const int32_t rc = s->decode(s->ctx, *b);
    if (rc == 0) s->sync(s->ctx);
    *seconds = now() - t0;
    return rc;
}

/* Whether the last pass's captured row is one float32 row of n_embd values (a copy of it can
 * be staged). */
static bool row_stageable(const struct step *s) {
    return *s->cap_rows == 1 && !*s->cap_overflow && *s->cap_type == 0 /* GGML_TYPE_F32 */ &&
           *s->cap_ne0 == s->n_embd;
}

int32_t srsd_step_one(struct step *s, int32_t token, int32_t pos, int32_t seq,
                      int32_t capture, int32_t want_sampled, float *stage) {
    const int32_t rc = pass_one(s, token, pos, seq, capture, &s->seconds);
    s->token = (rc == 0 && want_sampled) ? s->sampled(s->ctx, 0) : -1;
    s->staged = 0;
    if (rc == 0 && stage && s->cap_enabled && capture && row_stageable(s)) {
        memcpy(stage, *s->cap_buf, (size_t)s->n_embd * sizeof(float));
        s->staged = 1;
    }
    return rc;
}

/* A check of each token a run's steps take (an output constraint's): 1, taken, the run goes
 * on; 2, taken, the run stops after it; 0, rejected (not taken), the run stops. */
typedef int32_t (*check_fn)(void *data, int32_t token);

/* Up to n plain steps of one sequence in one call, each decoding the token the step before
 * it sampled in the graph: `token` at `pos`, then its sampled token at pos + 1, and so on
 * (each step as srsd_step_one with want_sampled; the sequence must have an in-graph
 * sampler). With `draw_u` (a draw sampler's uniform draw, not NULL), step i's draw is set
 * to u[i] before its pass. With `check` (not NULL), each step's token is checked
 * (check(check_data, token)); the run stops after a step whose verdict is not 1, and
 * s->verdict holds the last verdict (1 without a check): 0 means the last step's token was
 * rejected, its row is the last pass's. Steps from `capture_from` on have their hidden row
 * captured (with `capture`; the others with the capture off). out[i] gets step i's sampled
 * token. The run stops early after a step whose token is an end of generation
 * (is_eog(vocab, token)), after a step whose captured row could not be staged, or at a
 * failed llama_decode (its return code comes back; out holds the steps before it).
 * s->token: the steps done; s->staged: how many of their captured rows were copied to
 * stage + k * n_embd (k = 0, 1, ... from step capture_from on, when `stage`); s->seconds:
 * llama_decode and llama_synchronize over all steps. From Python, n plain steps are then
 * one call, without the return into the interpreter after each forward pass. */
typedef bool (*is_eog_fn)(const void *vocab, int32_t token);

int32_t srsd_step_run(struct step *s, int32_t token, int32_t pos, int32_t seq,
                      int32_t capture, int32_t capture_from, int32_t n, float *stage,
                      int32_t *out, is_eog_fn is_eog, const void *vocab, double *draw_u,
                      const double *u, check_fn check, void *check_data) {
    double seconds = 0.0, one;
    int32_t done = 0, staged = 0, rc = 0;
    s->verdict = 1;
    while (done < n) {
        const bool cap_now = capture && done >= capture_from;
        if (draw_u) *draw_u = u[done];
        rc = pass_one(s, token, pos + done, seq, cap_now, &one);
        seconds += one;
        if (rc != 0) break;
        token = s->sampled(s->ctx, 0);
        out[done++] = token;
        if (stage && s->cap_enabled && cap_now) {
            if (!row_stageable(s)) break; /* this step's row stays in the capture's buffer */
            memcpy(stage + (size_t)staged * (size_t)s->n_embd, *s->cap_buf,
                   (size_t)s->n_embd * sizeof(float));
            ++staged;
        }
        if (token < 0) break;
        if (check) {
            s->verdict = check(check_data, token);
            if (s->verdict != 1) break;
        }
        if (is_eog(vocab, token)) break;
    }
    s->seconds = seconds;
    s->token = done;
    s->staged = staged;
    return rc;
}

/* A batch's pass in one call, its rows filled already (srsd_fill_batch): the compiled
 * capture emptied (its on/off switch is left as set), llama_decode and llama_synchronize
 * (timed: s->seconds), then into out[k] the in-graph sampled token of batch row rows[k] (-1
 * where rows[k] is -1; s->token: how many were read; s->read_seconds: the time that took).
 * For a tree's pass what took three calls into llama.cpp through ctypes, two clock reads
 * and the capture's fields written one by one, each slow on the caches the pass flushed. */
int32_t srsd_step_rows(struct step *s, const int32_t *rows, int64_t n_rows, int32_t *out) {
    if (s->cap_enabled) {
        *s->cap_used = 0;
        *s->cap_rows = 0;
        *s->cap_overflow = 0;
    }
    const double t0 = now();
    const int32_t rc = s->decode(s->ctx, *s->batch);
    if (rc == 0) s->sync(s->ctx);
    const double t1 = now();
    s->seconds = t1 - t0;
    s->token = 0;
    s->read_seconds = 0.0;
    if (rc != 0) return rc;
    for (int64_t k = 0; k < n_rows; ++k) {
        if (rows[k] >= 0) {
            out[k] = s->sampled(s->ctx, rows[k]);
            ++s->token;
        } else {
            out[k] = -1;
        }
    }
    s->read_seconds = now() - t1;
    return rc;
}
