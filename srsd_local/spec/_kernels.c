/* Compiled kernels for the sampler (see kernels.py): one pass over a logits row where numpy
 * makes several. Compiled on first use with the system's C compiler; Python falls back to
 * numpy without one. Plain C, no intrinsics: the loops are written in lanes so compilers
 * vectorise them without reassociating floating point (no -ffast-math), so a build gives the
 * same results however wide its vectors are. */
#include <math.h>
#include <stdint.h>

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

/* A token drawn with probability proportional to exp((x[i] - max x) / temperature), given
 * inv_t = 1 / temperature and u uniform in [0, 1): the first i whose cumulative weight
 * exceeds u times the total. One pass over the row from memory: each block's maximum, then
 * its weights relative to that maximum (the block is still in the first-level cache), then
 * the blocks' sums brought to the row's maximum in double (the blocks on `n_threads`
 * threads). `sums` holds 2 * (n / BLOCK + 1) doubles (scratch: the scaled sums, then the
 * blocks' maxima). */
int64_t srsd_sample_temperature(const float *x, int64_t n, float inv_t, double u,
                                double *sums, int n_threads) {
    if (n <= 0) return -1;
    const int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    double *maxes = sums + n_blocks;
    /* the blocks are independent: shared out among n_threads threads where the build has
     * OpenMP (the pool llama.cpp's CPU backend decodes with, idle between its passes); each
     * block's results are the same whoever computes them */
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        const float mb = row_max(x + lo, hi - lo);
        maxes[b] = mb;
        /* a block of -inf only weighs nothing (and -inf - -inf is not a number) */
        sums[b] = mb == -INFINITY ? 0.0 : block_sum(x, lo, hi, mb, inv_t);
    }
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
 *   matching tokens before, at most max_agree) to out_agree. Returns how many. */
int64_t srsd_retrieve(const float *stage, int64_t n_stage, const float *query, int64_t dim,
                      const float *center, uint16_t *rows, int64_t stored, float *qbuf,
                      const int32_t *tokens, int64_t n_tok, int32_t root,
                      const int32_t *row_of, int64_t k, float min_score, int64_t max_agree,
                      int64_t *out_pos, float *out_score, int64_t *out_agree) {
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
    }
    return got;
}
