/* Compiled kernels for the sampler (see kernels.py): one pass over a logits row where numpy
 * makes several. Compiled on first use with the system's C compiler; Python falls back to
 * numpy without one. Plain C, no intrinsics: the loops are written in lanes so compilers
 * vectorise them without reassociating floating point (no -ffast-math), so a build gives the
 * same results however wide its vectors are. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
#define BLOCK 512 /* weights summed per block (the second level of the pick) */

/* exp(x) for x <= 0 in float32: 2^k * p(r) with r = x - k ln2 (|r| <= ln2 / 2, ln2 split in
 * two parts) and p the degree-6 Taylor polynomial (relative error below 3e-7); 0 below -87
 * (where float32 underflows). Branch-free, so the loops that call it vectorise. */
typedef union { int32_t i; float f; } bits32;

static inline float exp_nonpos(float x) {
    /* below -87 (-inf included): clamped there, its weight zeroed; integer selects, as a
     * float compare-and-branch keeps some compilers from vectorising the loop */
    const int32_t lim = -1028784128; /* the bits of -87.0f as an int32 */
    bits32 v = {.f = x};
    const int32_t over = ((v.i >> 31) & 1) & (((lim - v.i) >> 31) & 1); /* x < -87 */
    const int32_t mask = -over;
    v.i = (v.i & ~mask) | (lim & mask);
    x = v.f;
    const float t = x * 1.44269504088896341f;
    const int32_t k = (int32_t)(t - 0.5f); /* round half away from zero, t <= 0 */
    const float kf = (float)k;
    const float r = (x - kf * 0.693359375f) + kf * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    bits32 scale = {.i = ((k + 127) << 23) & ~mask};
    return p * scale.f; /* a zero scale below -87 */
}

static float row_max(const float *x, int64_t n) {
    float lane[LANES];
    int64_t i = 0;
    for (int j = 0; j < LANES; ++j) lane[j] = x[0];
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) lane[j] = lane[j] > x[i + j] ? lane[j] : x[i + j];
    float m = lane[0];
    for (int j = 1; j < LANES; ++j) m = m > lane[j] ? m : lane[j];
    for (; i < n; ++i) m = m > x[i] ? m : x[i];
    return m;
}

/* The sum of the weights exp((x[i] - m) * inv_t) for i in [lo, hi) (hi - lo <= BLOCK),
 * in double: the weights into a buffer (a loop of independent iterations, which compilers
 * vectorise), then summed in lanes. */
static double block_sum(const float *x, int64_t lo, int64_t hi, float m, float inv_t) {
    float w[BLOCK];
    const int64_t len = hi - lo;
    const float *xs = x + lo;
    for (int64_t i = 0; i < len; ++i) w[i] = exp_nonpos((xs[i] - m) * inv_t);
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= len; i += LANES)
        for (int j = 0; j < LANES; ++j) lane[j] += w[i + j];
    double s = 0.0;
    for (int j = 0; j < LANES; ++j) s += lane[j];
    for (; i < len; ++i) s += w[i];
    return s;
}

/* The draw below in two parts, so that llama.cpp's graph can make it too (its blocks on the
 * decode's threads as custom ops, then the pick on one: see llama/_argmax.c), with these very
 * functions and so the very same numbers. `sums` holds 2 * (n / BLOCK + 1) doubles (scratch:
 * the scaled sums, then the blocks' maxima). */

/* Blocks [b0, b1) of the row: each block's maximum, then its weights relative to that
 * maximum summed (the block is still in the first-level cache). */
void srsd_temperature_blocks(const float *x, int64_t n, float inv_t, double *sums,
                             int64_t b0, int64_t b1) {
    const int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    double *maxes = sums + n_blocks;
    for (int64_t b = b0; b < b1 && b < n_blocks; ++b) {
        const int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        const float mb = row_max(x + lo, hi - lo);
        maxes[b] = mb;
        /* a block of -inf only weighs nothing (and -inf - -inf is not a number) */
        sums[b] = mb == -INFINITY ? 0.0 : block_sum(x, lo, hi, mb, inv_t);
    }
}

/* After every block's part: the blocks' sums brought to the row's maximum in double, and
 * the first i whose cumulative weight exceeds u times the total. */
int64_t srsd_temperature_pick(const float *x, int64_t n, float inv_t, double u,
                              double *sums) {
    if (n <= 0) return -1;
    const int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    const double *maxes = sums + n_blocks;
    float m = -INFINITY;
    for (int64_t b = 0; b < n_blocks; ++b) m = m > (float)maxes[b] ? m : (float)maxes[b];
    if (m == -INFINITY) return n - 1; /* nothing to draw from */
    double total = 0.0;
    for (int64_t b = 0; b < n_blocks; ++b) {
        if (sums[b] > 0.0) sums[b] *= exp(((double)(float)maxes[b] - (double)m) * inv_t);
        total += sums[b];
    }
    const double target = u * total;
    double before = 0.0;
    int64_t b = 0;
    for (; b < n_blocks - 1 && before + sums[b] <= target; ++b) before += sums[b];
    const int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
    const float mb = (float)maxes[b];
    const double scale = exp(((double)mb - (double)m) * inv_t);
    for (int64_t i = lo; i < hi; ++i) {
        before += exp_nonpos((x[i] - mb) * inv_t) * scale;
        if (before > target) return i;
    }
    return hi - 1; /* rounding left the target at the block's very end */
}

/* A token drawn with probability proportional to exp((x[i] - max x) / temperature), given
 * inv_t = 1 / temperature and u uniform in [0, 1): the first i whose cumulative weight
 * exceeds u times the total. One pass over the row from memory (the two parts above, the
 * blocks on `n_threads` threads). */
int64_t srsd_sample_temperature(const float *x, int64_t n, float inv_t, double u,
                                double *sums, int n_threads) {
    if (n <= 0) return -1;
    const int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    /* the blocks are independent: shared out among n_threads threads where the build has
     * OpenMP (the pool llama.cpp's CPU backend decodes with, idle between its passes); each
     * block's results are the same whoever computes them */
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t b = 0; b < n_blocks; ++b) srsd_temperature_blocks(x, n, inv_t, sums, b, b + 1);
    return srsd_temperature_pick(x, n, inv_t, u, sums);
}

/* x rounded to the nearest float16 value (ties to even), as float32; |x| < 65504. Normal
 * float16 range: the mantissa rounded from 23 to 10 bits in the integer bits; below 2^-14
 * (float16 subnormals, steps of 2^-24): adding and subtracting 0.75, whose float32 step is
 * 2^-24 and whose step count is even, rounds to that step, ties to even. Branch-free. */
static inline float round_f16(float x) {
    bits32 v = {.f = x};
    const int32_t mag = v.i & 0x7fffffff;
    const int32_t tiny = -(((mag - 0x38800000) >> 31) & 1); /* |x| < 2^-14: all ones */
    bits32 r = {.i = (v.i + 0x0fff + ((v.i >> 13) & 1)) & ~0x1fff};
    bits32 s = {.f = (x + 0.75f) - 0.75f};
    r.i = (r.i & ~tiny) | (s.i & tiny);
    return r.f;
}

/* The index's stored form of n rows of length dim (row-major): each row minus `center`,
 * divided by its length (at least 1e-6), rounded through float16; written to `out`. */
void srsd_normalise_rows(const float *x, int64_t n, int64_t dim, const float *center,
                         float *out) {
    for (int64_t r = 0; r < n; ++r) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] - center[i];
        float lane[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int j = 0; j < LANES; ++j) lane[j] += o[i + j] * o[i + j];
        double s = 0.0;
        for (int j = 0; j < LANES; ++j) s += lane[j];
        for (; i < dim; ++i) s += o[i] * o[i];
        float norm = (float)sqrt(s);
        norm = norm > 1e-6f ? norm : 1e-6f;
        for (i = 0; i < dim; ++i) o[i] = round_f16(o[i] / norm);
    }
}

/* A decode's rows on an accepted path into the index's pending rows (see index.py,
 * VectorIndex.add_path): rows path[0..k-1] of `hidden` (float32, dim values per row) copied
 * one after the other to `stage` from its row `staged`; pos[n + i] = start + i (int64) and
 * row_of[start + i] = n + i (int32). One call for what took numpy a dozen, each slow on the
 * caches a forward pass has just flushed. */
void srsd_index_stage(const float *hidden, const int32_t *path, int64_t k, int64_t dim,
                      float *stage, int64_t staged, int64_t *pos, int64_t n,
                      int32_t *row_of, int64_t start) {
    for (int64_t i = 0; i < k; ++i) {
        memcpy(stage + (staged + i) * dim, hidden + (int64_t)path[i] * dim,
               (size_t)dim * sizeof(float));
        pos[n + i] = start + i;
        row_of[start + i] = (int32_t)(n + i);
    }
}

/* The float16 bits of x, a value round_f16 gives (so exactly representable): normal values
 * re-biased from float32's exponent, subnormals (|x| < 2^-14) as their count of 2^-24. */
static inline uint16_t f16_bits(float x) {
    bits32 v = {.f = x};
    const uint32_t sign = ((uint32_t)v.i >> 16) & 0x8000u;
    const int32_t mag = v.i & 0x7fffffff;
    if (mag < 0x38800000) /* below 2^-14 (zero included): a multiple of 2^-24 */
        return (uint16_t)(sign | (uint32_t)((v.f < 0 ? -v.f : v.f) * 16777216.0f));
    return (uint16_t)(sign | (uint32_t)(((mag >> 23) - 112) << 10) | ((uint32_t)mag >> 13 & 0x3ffu));
}

/* The float32 value of float16 bits h (finite values: the index stores nothing else). */
static inline float f16_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    bits32 normal = {.i = (int32_t)(sign | ((e + 112u) << 23) | (m << 13))};
    bits32 sub = {.f = (float)m * 5.9604644775390625e-8f};
    sub.i |= (int32_t)sign;
    return e ? normal.f : sub.f;
}

static float dot_f16(const float *q, const uint16_t *row, int64_t dim) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= dim; i += LANES)
        for (int j = 0; j < LANES; ++j) lane[j] += q[i + j] * f16_value(row[i + j]);
    double s = 0.0;
    for (int j = 0; j < LANES; ++j) s += lane[j];
    for (; i < dim; ++i) s += q[i] * f16_value(row[i]);
    return (float)s;
}

/* Hidden-state retrieval in one call (see index.py, VectorIndex.search_next):
 * - the n_stage raw rows in `stage` are stored: normalised (as srsd_normalise_rows) and
 *   written as float16 bits to rows[stored .. stored + n_stage);
 * - the raw `query` is normalised the same way into `qbuf`;
 * - among the context positions j whose next token is `root` (tokens[j + 1] == root, with
 *   a token after that: j + 2 < n_tok) and that have a stored row (row_of[j] >= 0), the at
 *   most k most similar to the query with a similarity of at least min_score, best first
 *   (ties: the earlier position), are written to out_pos / out_score, with how many tokens
 *   up to the root the context before each one agrees with the context's end (1 + the
 *   matching tokens before, at most max_agree) to out_agree, and (depth > 0) the at most
 *   `depth` tokens after its root (tokens[j + 2 ..]) to out_tokens[h * depth ..]. Returns
 *   how many. */
int64_t srsd_retrieve(const float *stage, int64_t n_stage, const float *query, int64_t dim,
                      const float *center, uint16_t *rows, int64_t stored, float *qbuf,
                      const int32_t *tokens, int64_t n_tok, int32_t root,
                      const int32_t *row_of, int64_t k, float min_score, int64_t max_agree,
                      int64_t *out_pos, float *out_score, int64_t *out_agree,
                      int64_t depth, int32_t *out_tokens) {
    for (int64_t r = 0; r < n_stage; ++r) {
        srsd_normalise_rows(stage + r * dim, 1, dim, center, qbuf);
        uint16_t *o = rows + (stored + r) * dim;
        for (int64_t i = 0; i < dim; ++i) o[i] = f16_bits(qbuf[i]);
    }
    srsd_normalise_rows(query, 1, dim, center, qbuf);
    const int64_t n_rows = stored + n_stage;
    int64_t got = 0;
    for (int64_t j = 0; j + 2 < n_tok; ++j) {
        if (tokens[j + 1] != root) continue;
        const int32_t r = row_of[j];
        if (r < 0 || r >= n_rows) continue;
        const float s = dot_f16(qbuf, rows + (int64_t)r * dim, dim);
        if (!(s >= min_score)) continue;
        /* insert by score (positions come in increasing order: a tie stays behind) */
        int64_t at = got < k ? got : k;
        while (at > 0 && out_score[at - 1] < s) --at;
        if (at >= k) continue;
        const int64_t last = got < k ? got : k - 1;
        for (int64_t m = last; m > at; --m) {
            out_pos[m] = out_pos[m - 1];
            out_score[m] = out_score[m - 1];
        }
        out_pos[at] = j;
        out_score[at] = s;
        if (got < k) ++got;
    }
    for (int64_t h = 0; h < got; ++h) {
        const int64_t j = out_pos[h];
        int64_t agree = 1; /* the root itself; then the tokens before it */
        while (agree < max_agree && j - agree + 1 >= 0 &&
               tokens[j - agree + 1] == tokens[n_tok - agree])
            ++agree;
        out_agree[h] = agree;
        int64_t len = n_tok - j - 2 < depth ? n_tok - j - 2 : depth;
        if (len > 0) memcpy(out_tokens + h * depth, tokens + j + 2, (size_t)len * sizeof(int32_t));
    }
    return got;
}

/* ---- the controller's plan (planner.py: choose, with acceptance.py's q_all) ------------
 * The same arithmetic as the Python, in the same order (no contraction, no reassociation),
 * so both choose the same nodes with the same probabilities. */

#define KEY_DEPTHS 13 /* depths 0..MAX_KEY_DEPTH */
#define KEY_RECENT 5  /* buckets of RECENT_EDGES */
#define KEY_FINE 80   /* share (4) x strength (5) x agree (4) buckets */

static int32_t bucket(double v, const double *edges, int32_t n) {
    int32_t b = 0; /* bisect_right: the edges <= v */
    while (b < n && edges[b] <= v) ++b;
    return b;
}

static const double RECENT_EDGES[4] = {0.25, 0.5, 0.75, 0.9};
static const double SHARE_EDGES[3] = {0.34, 0.67, 0.999};
static const double STRENGTH_EDGES[4] = {0.4, 0.6, 0.8, 0.9};
static const double AGREE_EDGES[3] = {2, 3, 5};

/* Per node i >= 1 of a tree (ints: parents, depths, counts, agree, origin, n each; weights:
 * n doubles): q (explore) and q_mean (the posterior mean), from the acceptance counts
 * mirrored in tables: coarse[2 * c] = (accepted, tried) for coarse index
 * c = ((src * 2 + greedy) * KEY_DEPTHS + min(depth, 12)) * KEY_RECENT + recent bucket;
 * fine_row[c] its row in `fine` (-1: none), where fine[2 * (row * KEY_FINE + f)] holds the
 * fine key f = (share * 5 + strength) * 4 + agree (buckets). src: src_of_bits[origin], or
 * src0 for a node of no source; prior[src] its prior. Then choose()'s: q and q_mean
 * normalised within each group of siblings that sums past 1, p = P(parent) * q, never more
 * than the parent's (p with the depth scale, p_rep: q_mean with it, p_raw: q_mean without
 * it), the nodes taken best-first (-p, depth, index) under max_branches and the cost
 * table's size (n_cost entries, cost[k] for k tokens), and the count of them that
 * maximises (1 + gain + sum p) / cost[k + 1]. Returns that count; kept_out: the nodes in
 * the order taken (at least that many), p_rep_out / p_raw_out per node, key_out: per node
 * its coarse index and fine key (2 n int32, srsd_learn's). work: 6 n doubles, iwork: 3 n
 * int32. */
int64_t srsd_plan(int64_t n, const int32_t *ints, const double *weights,
                  const double *coarse, const int32_t *fine_row, const double *fine,
                  const double *prior, const int32_t *src_of_bits, int32_t src0,
                  int32_t greedy, double recent, double strength, double bonus,
                  const double *scale, int64_t n_scale, const double *cost, int64_t n_cost,
                  int64_t max_branches, double gain, double *work, int32_t *iwork,
                  int32_t *kept_out, double *p_rep_out, double *p_raw_out,
                  int32_t *key_out) {
    const int32_t *parents = ints, *depths = ints + n, *counts = ints + 2 * n;
    const int32_t *agree = ints + 3 * n, *origin = ints + 4 * n;
    double *q = work, *qm = work + n, *tot = work + 2 * n, *totm = work + 3 * n;
    double *raw = work + 4 * n, *raw_rep = work + 5 * n;
    double *p = p_rep_out; /* (p lives there until p_rep is copied in at the end) */
    int32_t *nkids = iwork, *order = iwork + n, *flags = iwork + 2 * n;
    const int32_t root_count = counts[0] > 1 ? counts[0] : 1;
    const int32_t rb = bucket(recent, RECENT_EDGES, 4);
    for (int64_t i = 0; i < n; ++i) { tot[i] = 0.0; totm[i] = 0.0; nkids[i] = 0; }
    q[0] = qm[0] = 1.0;
    for (int64_t i = 1; i < n; ++i) {
        const int32_t c = counts[i], o = origin[i];
        const int32_t src = o ? src_of_bits[o & 255] : src0;
        const double share = (double)c / (double)root_count;
        const double str = weights[i] / (double)(c > 1 ? c : 1);
        const int32_t d = depths[i] < KEY_DEPTHS - 1 ? depths[i] : KEY_DEPTHS - 1;
        const int64_t ci = ((int64_t)(src * 2 + greedy) * KEY_DEPTHS + d) * KEY_RECENT + rb;
        const double a_c = coarse[2 * ci], n_c = coarse[2 * ci + 1];
        const double qc = (a_c + strength * prior[src]) / (n_c + strength);
        const double bc = bonus / pow(1.0 + n_c, 0.5);
        const int32_t f = (bucket(share, SHARE_EDGES, 3) * 5 +
                           bucket(str, STRENGTH_EDGES, 4)) * 4 +
                          bucket((double)agree[i], AGREE_EDGES, 3);
        key_out[2 * i] = (int32_t)ci;
        key_out[2 * i + 1] = f;
        const int32_t row = fine_row[ci];
        const double a_f = row >= 0 ? fine[2 * ((int64_t)row * KEY_FINE + f)] : 0.0;
        const double n_f = row >= 0 ? fine[2 * ((int64_t)row * KEY_FINE + f) + 1] : 0.0;
        const double mean = (a_f + strength * qc) / (n_f + strength);
        const double ex = mean + bc;
        qm[i] = mean;
        q[i] = ex < 1.0 ? ex : 1.0;
    }
    const int chain = depths[n - 1] == n - 1;
    if (!chain) { /* siblings exclude each other */
        for (int64_t i = 1; i < n; ++i) {
            tot[parents[i]] += q[i];
            totm[parents[i]] += qm[i];
            nkids[parents[i]] += 1;
        }
        for (int64_t i = 1; i < n; ++i) {
            const int32_t par = parents[i];
            if (nkids[par] > 1) {
                if (tot[par] > 1.0) q[i] /= tot[par];
                if (totm[par] > 1.0) qm[i] /= totm[par];
            }
        }
    }
    double *p_rep = tot, *p_raw = totm; /* (the sums are spent) */
    raw[0] = raw_rep[0] = 1.0;
    p[0] = p_rep[0] = p_raw[0] = 1.0;
    const int64_t last = n_scale - 1;
    for (int64_t i = 1; i < n; ++i) {
        const int32_t par = parents[i], d = depths[i];
        const double s = n_scale ? scale[d < last ? d : last] : 1.0;
        double r = raw[par] * q[i];
        raw[i] = r;
        r *= s;
        p[i] = (r < p[par] && r < 1.0) ? r : (1.0 < p[par] ? 1.0 : p[par]);
        r = raw_rep[par] * qm[i];
        raw_rep[i] = r;
        p_raw[i] = (r < p_raw[par] && r < 1.0) ? r : (1.0 < p_raw[par] ? 1.0 : p_raw[par]);
        r *= s;
        p_rep[i] = (r < p_rep[par] && r < 1.0) ? r : (1.0 < p_rep[par] ? 1.0 : p_rep[par]);
    }
    int64_t n_kept = 0;
    if (chain) {
        const int64_t top = n < n_cost - 1 ? n : n_cost - 1;
        for (int64_t i = 1; i < top; ++i) kept_out[n_kept++] = (int32_t)i;
    } else {
        int64_t m = 0; /* order: -p, then depth, then index (insertion sort: a few dozen) */
        for (int64_t i = 1; i < n; ++i) {
            int64_t j = m++;
            while (j > 0) {
                const int32_t o = order[j - 1];
                const int before = p[i] > p[o] || (p[i] == p[o] &&
                                   (depths[i] < depths[o] || (depths[i] == depths[o] && i < o)));
                if (!before) break;
                order[j] = o;
                --j;
            }
            order[j] = (int32_t)i;
        }
        for (int64_t i = 0; i < n; ++i) flags[i] = 0; /* 1: taken, 2: has a child */
        flags[0] = 1;
        int64_t leaves = 1;
        for (int64_t k = 0; k < m; ++k) {
            if (n_kept >= n_cost - 2) break;
            const int32_t node = order[k], par = parents[node];
            if (!(flags[par] & 1)) continue;
            const int opens = (flags[par] & 2) != 0;
            if (opens && leaves >= max_branches) continue;
            leaves += opens;
            flags[par] |= 2;
            flags[node] |= 1;
            kept_out[n_kept++] = node;
        }
    }
    int64_t best_k = 0;
    double best_rate = (gain + 1.0) / cost[1], cum = gain;
    for (int64_t k = 1; k <= n_kept; ++k) {
        cum += p[kept_out[k - 1]];
        const double rate = (1.0 + cum) / cost[k + 1];
        if (rate > best_rate * (1.0 + 1e-9)) { best_k = k; best_rate = rate; }
    }
    for (int64_t i = 0; i < n; ++i) { p_raw_out[i] = p_raw[i]; p_rep_out[i] = p_rep[i]; }
    return best_k;
}

/* One outcome per node (accepted[j] for nodes[j], whose coarse index and fine key srsd_plan
 * wrote to keys) counted in the tables of srsd_plan under both keys, each pair halved once
 * it has counted more than `horizon` (AcceptanceModel.update). The ids of the keys counted
 * go to touched (2 per node: c * (KEY_FINE + 1) for the coarse key, + 1 + f for the fine
 * one). Stops at a node whose coarse key has no fine row yet: returns the nodes counted. */
int64_t srsd_learn(int64_t m, const int32_t *keys, const int32_t *nodes,
                   const int32_t *accepted, double *coarse, const int32_t *fine_row,
                   double *fine, double horizon, int32_t *touched) {
    for (int64_t j = 0; j < m; ++j) {
        const int32_t c = keys[2 * nodes[j]], f = keys[2 * nodes[j] + 1];
        const int32_t row = fine_row[c];
        if (row < 0) return j;
        double *pairs[2] = {coarse + 2 * (int64_t)c, fine + 2 * ((int64_t)row * KEY_FINE + f)};
        for (int k = 0; k < 2; ++k) {
            double *v = pairs[k];
            v[0] += accepted[j] ? 1.0 : 0.0;
            v[1] += 1.0;
            if (v[1] > horizon) { v[0] = v[0] / 2; v[1] = v[1] / 2; }
        }
        touched[2 * j] = c * (KEY_FINE + 1);
        touched[2 * j + 1] = c * (KEY_FINE + 1) + 1 + f;
    }
    return m;
}

/* Drafts merged into one token trie and pruned (TokenTree.insert for each draft, then
 * TokenTree.prune when the trie is over a budget), in the same order and arithmetic.
 * Draft j is toks[offs[j] .. offs[j + 1]) (non-empty, already cut to the depth limit),
 * with weight w[j], context agreement agree[j] and source bit origin[j]. The trie is built
 * in `trie` (6 cap int32: tokens, parents, depths, counts, agree, origin; cap >= 1 + the
 * drafts' tokens) with weights in `tw` (cap doubles) and child links in `links` (2 cap
 * int32: first child, next sibling). When it has more than max_nodes drafted nodes, a node
 * deeper than max_depth or more than max_branches leaves, it is pruned into `out` (same
 * layout, weights in `ow`): nodes taken best-first by (-weight, depth, trie index), a node
 * that would open a leaf past max_branches dropped with what is under it, until max_nodes
 * are taken; the root keeps its weight and count (not its agreement and origin). `heap`:
 * cap int32 of scratch (the frontier). Returns the node count, negated when the result is
 * the unpruned trie (left in `trie` / `tw`). */
int64_t srsd_merge(int32_t root, int64_t m, const int32_t *toks, const int32_t *offs,
                   const double *w, const int32_t *agree, const int32_t *origin,
                   int64_t cap, int64_t max_nodes, int64_t max_depth, int64_t max_branches,
                   int32_t *trie, double *tw, int32_t *links, int32_t *out, double *ow,
                   int32_t *heap) {
    int32_t *tok = trie, *par = trie + cap, *dep = trie + 2 * cap, *cnt = trie + 3 * cap;
    int32_t *agr = trie + 4 * cap, *org = trie + 5 * cap;
    int32_t *first = links, *next = links + cap;
    int64_t n = 1;
    tok[0] = root; par[0] = -1; dep[0] = 0; cnt[0] = 0; agr[0] = 0; org[0] = 0; tw[0] = 0.0;
    first[0] = -1; next[0] = -1;
    for (int64_t j = 0; j < m; ++j) {
        const double wj = w[j];
        const int32_t aj = agree[j], oj = origin[j];
        tw[0] += wj;
        cnt[0] += 1;
        org[0] |= oj;
        int32_t node = 0;
        for (int32_t k = offs[j]; k < offs[j + 1]; ++k) {
            const int32_t t = toks[k];
            int32_t c = first[node], last = -1;
            while (c >= 0 && tok[c] != t) { last = c; c = next[c]; }
            if (c < 0) {
                if (n >= cap) return 0; /* (the caller sizes cap: cannot happen) */
                c = (int32_t)n++;
                tok[c] = t; par[c] = node; dep[c] = dep[node] + 1; cnt[c] = 0; agr[c] = 0;
                org[c] = 0; tw[c] = 0.0; first[c] = -1; next[c] = -1;
                if (last >= 0) next[last] = c; else first[node] = c;
            }
            tw[c] += wj;
            cnt[c] += 1;
            if (agr[c] < aj) agr[c] = aj;
            org[c] |= oj;
            node = c;
        }
    }
    int64_t leaves = 0, deepest = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (first[i] < 0) ++leaves;
        if (dep[i] > deepest) deepest = dep[i];
    }
    if (n - 1 <= max_nodes && deepest <= max_depth && leaves <= max_branches) return -n;
    /* prune: the frontier (heap) holds trie nodes whose parent is taken; a node's sibling
     * link is read once, when its parent's children are pushed, and then holds the new
     * index of that parent (newp) */
    int32_t *otok = out, *opar = out + cap, *odep = out + 2 * cap, *ocnt = out + 3 * cap;
    int32_t *oagr = out + 4 * cap, *oorg = out + 5 * cap;
    int32_t *newp = next;
    int64_t h = 0, k = 1, oleaves = 1;
    otok[0] = tok[0]; opar[0] = -1; odep[0] = 0; ocnt[0] = cnt[0]; oagr[0] = 0; oorg[0] = 0;
    ow[0] = tw[0];
    for (int32_t c = first[0]; c >= 0;) {
        const int32_t nx = next[c];
        if (dep[c] <= max_depth) { heap[h++] = c; newp[c] = 0; }
        c = nx;
    }
    while (h > 0 && k - 1 < max_nodes) {
        int64_t b = 0;
        for (int64_t e = 1; e < h; ++e) {
            const int32_t x = heap[e], y = heap[b];
            if (tw[x] > tw[y] || (tw[x] == tw[y] && (dep[x] < dep[y] ||
                                                     (dep[x] == dep[y] && x < y)))) b = e;
        }
        const int32_t old = heap[b];
        heap[b] = heap[--h];
        const int32_t np = newp[old];
        /* the new parent has children already: this one opens a leaf */
        int opens = 0;
        for (int64_t i = 1; i < k; ++i) if (opar[i] == np) { opens = 1; break; }
        if (opens && oleaves >= max_branches) continue;
        oleaves += opens;
        const int64_t nw = k++;
        otok[nw] = tok[old]; opar[nw] = np; odep[nw] = dep[old]; ocnt[nw] = cnt[old];
        oagr[nw] = agr[old]; oorg[nw] = org[old]; ow[nw] = tw[old];
        for (int32_t c = first[old]; c >= 0;) {
            const int32_t nx = next[c];
            if (dep[c] <= max_depth) { heap[h++] = c; newp[c] = (int32_t)nw; }
            c = nx;
        }
    }
    return k;
}

/* The data pointer of a numpy array, read from its object: numpy's `.ctypes.data` builds a
 * helper object in Python code, which costs tens of microseconds on the caches a forward
 * pass has just flushed. The pointer follows the object header (numpy's PyArrayObject
 * layout); kernels.py sets its offset and checks this against `.ctypes.data` on arrays and
 * views before using it. */
static long array_data_offset = -1;

void srsd_set_array_data_offset(long offset) { array_data_offset = offset; }

void *srsd_array_data(void *obj) {
    return array_data_offset < 0 ? (void *)0 : *(void **)((char *)obj + array_data_offset);
}

/* ---- text lookup's longest repeat (textlookup.py: longest_repeat) ----------------------
 * The largest k in lo..hi (hi at most n - 1, lo at least 1) such that the last k bytes of
 * `text` also occur ending before its last byte, and where the most recent such occurrence
 * starts; returned as k << 32 | start, or 0 when no k >= lo does. One pass from the end: at
 * each earlier byte equal to the last, the length of the suffix both end with (the first,
 * rightmost, place reaching the longest length is its most recent occurrence). */
int64_t srsd_longest_repeat(const unsigned char *text, int64_t n, int64_t lo, int64_t hi) {
    if (hi > n - 1) hi = n - 1;
    if (lo < 1) lo = 1;
    if (lo > hi) return 0;
    const unsigned char last = text[n - 1];
    int64_t best = 0, at = -1;
    for (int64_t j = n - 2; j >= 0; --j) {
        if (text[j] != last) continue;
        int64_t len = 1;
        while (len < hi && len <= j && text[j - len] == text[n - 1 - len]) ++len;
        if (len > best) {
            best = len;
            at = j - len + 1;
            if (best == hi) break;
        }
    }
    return best >= lo ? (best << 32) | at : 0;
}
