/* Sampled rows on the CPU: temperature, top-k and top-p draws without sorting the vocabulary.
 *
 * The draw is the one worker/sampling.py defines (and tests/unit/worker/test_sampling.py checks
 * against float64): tokens in order of likelihood, most likely first and ties by token id; top-k
 * keeps every token at least as likely as the k-th; top-p keeps tokens while the mass before them
 * is below top_p (after top-k, renormalised); a plain temperature draw (neither filter) walks the
 * 64 most likely tokens, then the others by id. The token is the first whose cumulative mass, in
 * that order, passes uniform * (the kept mass).
 *
 * Why not sort: a random-weight or high-temperature row is flat, its top-p set is most of a
 * 50,257-entry vocabulary, and torch's sort of a step's rows took 57 ms, twice a decode step.
 * Each row is weighed in one vectorised pass (w = exp((x - max) / T), in float32 as the torch path
 * does) that also lists its likely tokens (w >= 2^-10, within 6.9 nats of the top). In a trained
 * model's rows every token a draw can reach is among those few, which are sorted and walked
 * (`draw_listed`; up to 1,024 of them: sorting more costs more than bucketing). Where they may
 * not be (a flat row), every token is put in a bucket by the top 16 bits of its weight: w is in
 * [0, 1], so the bits order the buckets as the weights (a binade in 128 equal steps: 7 mantissa
 * bits). Walking the buckets from the top with their counts and masses finds the bucket where the
 * k-th token, the top-p boundary or the draw falls; only that bucket's tokens are sorted (by
 * logit, then id). A walk reads the row again to collect its bucket, so a flat row costs a few
 * passes.
 *
 * Masses are summed in float64 (the total in float32 within blocks of 64, then float64: a draw
 * with u within about 1e-7 of 1 can land on the fallback, the least likely token of any weight).
 * Per thread, the buckets and a list as long as the vocabulary are allocated once per call,
 * outside the rows' loop; a failed allocation returns -2.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector.h"

#define BUCKETS 16384 /* the top 16 bits of a float in [0, 1]: 1.0f is 0x3F80 */
#define PLAIN_FIRST 64 /* a plain draw walks this many most likely tokens before the rest by id */
#define LIKELY 0x1p-10f   /* a weight this large or larger (within 6.9 nats of the top) is listed first */
#define MAX_LISTED 1024   /* more than this many likely tokens: the row is flat, and is bucketed */
#define BLOCK 64          /* weights summed in float32 before float64 takes the sum */

typedef struct {
    double mass[BUCKETS];
    int32_t count[BUCKETS];
} Buckets;

typedef struct {
    float x;
    int32_t id;
} Token;

/* A row being drawn from, and the set its walks range over: tokens with x > floor, and those with
 * x == floor and id <= floor_id (everything, before a filter sets them). */
typedef struct {
    const float *x; /* the row's logits */
    float *w;       /* their weights */
    int64_t V;
    Buckets *b;  /* the set's count and mass by bucket */
    Token *list; /* room for the whole row */
    float floor;
    int64_t floor_id;
} Row;

static inline int bucket_of(float w) {
    union { float f; uint32_t u; } v = {.f = w};
    const uint32_t k = v.u >> 16;
    return k < BUCKETS ? (int)k : BUCKETS - 1; /* w <= 1 always; the clamp only guards memory */
}

static inline int in_set(const Row *r, int64_t i) {
    return r->x[i] > r->floor || (r->x[i] == r->floor && i <= r->floor_id);
}

static int by_likelihood(const void *a, const void *b) {
    const Token *s = a, *t = b;
    if (s->x != t->x) return s->x > t->x ? -1 : 1;
    return (s->id > t->id) - (s->id < t->id);
}

/* The set's tokens in bucket k, most likely first, into r->list: their number. */
static int64_t sorted_bucket(const Row *r, int k) {
    int64_t n = 0;
    for (int64_t i = 0; i < r->V; i++)
        if (bucket_of(r->w[i]) == k && in_set(r, i)) r->list[n++] = (Token){r->x[i], (int32_t)i};
    qsort(r->list, (size_t)n, sizeof(Token), by_likelihood);
    return n;
}

/* Narrows the set to its most likely tokens down to (floor, floor_id) and counts it again: its mass. */
static double restrict_to(Row *r, float floor, int64_t floor_id) {
    r->floor = floor, r->floor_id = floor_id;
    memset(r->b, 0, sizeof(Buckets));
    double mass = 0.0;
    for (int64_t i = 0; i < r->V; i++)
        if (in_set(r, i)) {
            const int k = bucket_of(r->w[i]);
            r->b->mass[k] += r->w[i];
            r->b->count[k] += 1;
            mass += r->w[i];
        }
    return mass;
}

/* The logit and id of the set's k-th most likely token (1 <= k <= the set's size). */
static float kth(const Row *r, int64_t k, int64_t *id) {
    int64_t above = 0;
    for (int b = BUCKETS - 1; b >= 0; b--) {
        if (above + r->b->count[b] >= k) {
            sorted_bucket(r, b);
            *id = r->list[k - above - 1].id;
            return r->list[k - above - 1].x;
        }
        above += r->b->count[b];
    }
    *id = r->V - 1;
    return -INFINITY; /* not reached */
}

/* The set's first token, in order, of any weight whose cumulative mass passes `target` (reaches
 * it, with `reach`; exceeds it, without), and the mass up to and including it in *through. Where
 * rounding leaves the target unreached, the set's least likely token of any weight. */
static int64_t walk(const Row *r, double target, int reach, double *through) {
    double acc = 0.0;
    int lowest = -1;
    for (int k = BUCKETS - 1; k >= 0; k--) {
        if (!(r->b->mass[k] > 0)) continue; /* tokens of weight 0 are never drawn */
        const double after = acc + r->b->mass[k];
        if (reach ? after >= target : after > target) {
            const int64_t n = sorted_bucket(r, k);
            for (int64_t j = 0; j < n; j++) {
                const double w = r->w[r->list[j].id];
                acc += w;
                if (w > 0 && (reach ? acc >= target : acc > target)) {
                    *through = acc;
                    return r->list[j].id;
                }
            }
        }
        acc = after;
        lowest = k;
    }
    *through = acc;
    if (lowest < 0) return -1;
    const int64_t n = sorted_bucket(r, lowest);
    for (int64_t j = n - 1; j >= 0; j--)
        if (r->w[r->list[j].id] > 0) return r->list[j].id;
    return -1;
}

/* The first index of the row's largest logit, NaN aside (0 if all are NaN). */
static int64_t argmax_of(const float *x, int64_t V) {
    int64_t best = -1;
    for (int64_t i = 0; i < V; i++)
        if (x[i] == x[i] && (best < 0 || x[i] > x[best])) best = i;
    return best < 0 ? 0 : best;
}

/* Weighs the row: w = e^((x - max) * inv_t), in float32 and vectors, NaN (from a NaN or an
 * infinite logit) weighing 0; lists its likely tokens (weight >= LIKELY: up to MAX_LISTED of them
 * in r->list, their number and mass in *n_listed and *listed); returns the total weight. Sums run
 * in float32 over a block of BLOCK weights and in float64 across blocks: vector adds, and float64's
 * precision where the terms are many. */
static double weigh(Row *r, float inv_t, int64_t *n_listed, double *listed) {
    const float *x = r->x;
    float *w = r->w;
    const int64_t V = r->V;
    vf top = vf_set1(-INFINITY);
    int64_t i = 0;
    for (; i + LANES <= V; i += LANES) top = vf_max(vf_loadu(x + i), top); /* NaN: the old top kept */
    float m = vf_hmax(top);
    for (int64_t t = i; t < V; t++) m = x[t] > m ? x[t] : m;
    const vf shift = vf_set1(-m), scale = vf_set1(inv_t);
    double total = 0.0;
    *n_listed = 0, *listed = 0.0;
    for (int64_t start = 0; start < V; start += BLOCK) {
        const int64_t end = start + BLOCK < V ? start + BLOCK : V;
        vf sum = vf_zero(), most = vf_zero();
        int64_t j = start;
        for (; j + LANES <= end; j += LANES) {
            const vf e = vf_max(vf_exp(vf_mul(vf_add(vf_loadu(x + j), shift), scale)), vf_zero());
            vf_storeu(w + j, e);
            sum = vf_add(sum, e);
            most = vf_max(e, most);
        }
        float tail_sum = 0.f, tail_most = 0.f;
        for (; j < end; j++) {
            const float e = expf((x[j] - m) * inv_t);
            w[j] = e > 0 ? e : 0.f;
            tail_sum += w[j];
            tail_most = w[j] > tail_most ? w[j] : tail_most;
        }
        total += (double)vf_hsum(sum) + tail_sum;
        if (vf_hmax(most) >= LIKELY || tail_most >= LIKELY) {
            for (j = start; j < end; j++)
                if (w[j] >= LIKELY) {
                    if (*n_listed < MAX_LISTED) r->list[*n_listed] = (Token){x[j], (int32_t)j};
                    *n_listed += 1, *listed += w[j];
                }
        }
    }
    return total;
}

/* The plain draw's tokens past the first (those outside the set, which is the first), by id:
 * the one where the cumulative mass, starting from the first's, passes target; -1 if none does. */
static int64_t past_the_first(const Row *r, double first_mass, double target) {
    double acc = first_mass;
    int64_t last = -1;
    for (int64_t i = 0; i < r->V; i++) {
        if (in_set(r, i) || !(r->w[i] > 0)) continue;
        acc += r->w[i];
        if (acc > target) return i;
        last = i;
    }
    return last;
}

/* The first of list[0, n) (most likely first) whose cumulative mass exceeds target; the last of
 * any weight where rounding leaves it unreached. */
static int64_t walk_list(const Row *r, int64_t n, double target) {
    double acc = 0.0;
    int64_t last = r->list[0].id;
    for (int64_t j = 0; j < n; j++) {
        const double w = r->w[r->list[j].id];
        if (!(w > 0)) continue;
        acc += w;
        if (acc > target) return r->list[j].id;
        last = r->list[j].id;
    }
    return last;
}

/* The draw from the row's likely tokens alone: the n_listed of weight >= LIKELY (at most
 * MAX_LISTED, in r->list, holding mass `listed`), where the tokens a draw can reach all lie among
 * them, as they do in a trained model's rows: a top-k within them, a top-p set that they cover,
 * a plain draw that falls among them. -1 where they may not (a flat row): the caller buckets. */
static int64_t draw_listed(Row *r, int64_t n_listed, double listed, double total, int64_t top_k, double top_p,
                           double u) {
    if (n_listed > MAX_LISTED) return -1;
    qsort(r->list, (size_t)n_listed, sizeof(Token), by_likelihood);
    const float *w = r->w;
    if (top_k <= 0 && top_p >= 1) { /* plain */
        const int64_t first = r->V < PLAIN_FIRST ? r->V : PLAIN_FIRST;
        const double target = u * total;
        if (n_listed < first) return target < listed ? walk_list(r, n_listed, target) : -1;
        double first_mass = 0.0;
        for (int64_t j = 0; j < first; j++) first_mass += w[r->list[j].id];
        if (target < first_mass) return walk_list(r, first, target);
        r->floor = r->list[first - 1].x, r->floor_id = r->list[first - 1].id; /* the set: the first */
        const int64_t id = past_the_first(r, first_mass, target);
        return id >= 0 ? id : walk_list(r, first, INFINITY); /* else the least likely of the first */
    }
    int64_t end = n_listed;
    double norm = total;
    if (top_k > 0 && top_k < r->V) {
        if (n_listed < top_k) return -1;
        const float kth_x = r->list[top_k - 1].x;
        for (end = top_k; end < n_listed && r->list[end].x == kth_x; end++) continue; /* its ties */
        norm = 0.0;
        for (int64_t j = 0; j < end; j++) norm += w[r->list[j].id];
    } else if (listed < top_p * total) {
        return -1; /* the top-p set reaches past the listed tokens */
    }
    double held = norm;
    if (top_p < 1) { /* kept while the mass before a token is below top_p */
        double before = 0.0;
        int64_t j = 0;
        for (; j < end && before < top_p * norm; j++) before += w[r->list[j].id];
        end = j, held = before;
    }
    return walk_list(r, end, u * held);
}

static int64_t draw_row(Row *r, float inv_t, int64_t top_k, double top_p, double u) {
    const float *x = r->x;
    const int64_t V = r->V;
    int64_t n_listed;
    double listed;
    const double total = weigh(r, inv_t, &n_listed, &listed);
    if (!(total > 0) || !isfinite(total)) return argmax_of(x, V); /* nothing to draw from: as greedy */
    r->floor = -INFINITY, r->floor_id = INT64_MAX;
    const int64_t fast = draw_listed(r, n_listed, listed, total, top_k, top_p, u);
    if (fast >= 0) return fast;
    restrict_to(r, -INFINITY, INT64_MAX);
    double through;
    if (top_k <= 0 && top_p >= 1) { /* plain: the PLAIN_FIRST most likely in order, then the rest by id */
        int64_t edge_id;
        const float edge = kth(r, V < PLAIN_FIRST ? V : PLAIN_FIRST, &edge_id);
        const double first = restrict_to(r, edge, edge_id), target = u * total;
        if (target < first) return walk(r, target, 0, &through);
        const int64_t id = past_the_first(r, first, target);
        return id >= 0 ? id : walk(r, INFINITY, 0, &through); /* else the least likely of the first */
    }
    double norm = total;
    if (top_k > 0 && top_k < V) {
        int64_t kth_id;
        norm = restrict_to(r, kth(r, top_k, &kth_id), INT64_MAX); /* ties with the k-th included */
    }
    double held = norm;
    if (top_p < 1) walk(r, top_p * norm, 1, &held); /* the kept set ends where top_p is reached */
    const int64_t id = walk(r, u * held, 0, &through);
    return id >= 0 ? id : argmax_of(x, V);
}

int draw_float32(const float *x, int64_t n, int64_t V, int64_t row_stride, const float *inv_t, const int64_t *top_k,
                 const double *top_p, const double *uniform, float *scratch, int64_t *out, int nthreads) {
    if (V < 1 || V > INT32_MAX) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        Buckets *b = malloc(sizeof(Buckets));
        Token *list = malloc(sizeof(Token) * (size_t)V);
        if (b == NULL || list == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int seen;
#pragma omp atomic read
        seen = failed;
        if (!seen) { /* every thread sees the same answer after the barrier, so all or none share the loop */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n; i++) {
                Row r = {.x = x + i * row_stride, .w = scratch + i * V, .V = V, .b = b, .list = list};
                out[i] = draw_row(&r, inv_t[i], top_k[i], top_p[i], uniform[i]);
            }
        }
        free(b);
        free(list);
    }
    return failed ? -2 : 0;
}
