/* The close's fused kernels: the outer step, and an int8 upload added to the exact sum
   (diloco/outer/kernels.py, which compiles and checks them). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define FLT_MAX_BITS 0x7f7fffffu /* |x| as bits above this: Inf or NaN */
#define MAX_THREADS 64

typedef struct {
    float *theta, *m, *r, *change, *scales;
    const float *g;
    int8_t *codes;
    int64_t n, block, first, last; /* this worker's blocks: [first, last) */
    float mu, neg_lr;
    int has_momentum, nesterov, finite;
} Job;

/* m <- mu*m + g (two roundings) or g; u <- fma(m, mu, g) or m; d <- fma(u, -lr, r), kept in
   r. Returns max |d| as bits: ordered as the floats, Inf and NaN above any finite value. */
static uint32_t first_pass(const Job *j, int64_t lo, int64_t hi) {
    float *restrict m = j->m, *restrict r = j->r;
    const float *restrict g = j->g;
    const float mu = j->mu, neg_lr = j->neg_lr;
    const int has_momentum = j->has_momentum, nesterov = j->nesterov;
    uint32_t top = 0;
    for (int64_t i = lo; i < hi; i++) {
        float mi = has_momentum ? mu * m[i] + g[i] : g[i];
        float u = nesterov ? fmaf(mi, mu, g[i]) : mi;
        float d = fmaf(u, neg_lr, r[i]);
        m[i] = mi;
        r[i] = d;
        uint32_t bits;
        memcpy(&bits, &d, 4);
        bits &= 0x7fffffffu; /* -0 counts as +0 */
        top = bits > top ? bits : top;
    }
    return top;
}

/* Int8Codec.encode of the block's d (in r); change = code * scale; theta += change;
   r <- d - change. */
static void second_pass(const Job *j, int64_t lo, int64_t hi, float scale) {
    float *restrict theta = j->theta, *restrict r = j->r, *restrict change = j->change;
    int8_t *restrict codes = j->codes;
    const float divisor = scale > 0.0f ? scale : 1.0f;
    for (int64_t i = lo; i < hi; i++) {
        float d = r[i];
        int32_t v = (int32_t)nearbyintf(d / divisor); /* |d / divisor| <= 254 */
        v = v < -127 ? -127 : v;
        v = v > 127 ? 127 : v;
        float c = (float)v * scale;
        codes[i] = (int8_t)v;
        change[i] = c;
        theta[i] = theta[i] + c;
        r[i] = d - c;
    }
}

static void *run(void *arg) {
    Job *j = (Job *)arg;
    for (int64_t b = j->first; b < j->last; b++) {
        int64_t lo = b * j->block, hi = lo + j->block < j->n ? lo + j->block : j->n;
        uint32_t top = first_pass(j, lo, hi);
        if (top > FLT_MAX_BITS) {
            j->finite = 0;
            return NULL;
        }
        float absmax;
        memcpy(&absmax, &top, 4);
        float scale = absmax / 127.0f;
        j->scales[b] = scale;
        second_pass(j, lo, hi, scale);
    }
    return NULL;
}

int diloco_step_int8(float *theta, float *m, float *r, const float *g, float *change,
                     int8_t *codes, float *scales, int64_t n, int64_t block, float mu,
                     float neg_lr, int has_momentum, int nesterov, int threads) {
    int64_t blocks = (n + block - 1) / block;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > blocks) threads = (int)blocks;
    if (threads < 1) threads = 1;
    int64_t per = (blocks + threads - 1) / threads;
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        int64_t first = t * per < blocks ? t * per : blocks;
        int64_t last = first + per < blocks ? first + per : blocks;
        Job job = {theta, m, r, change, scales, g, codes, n, block, first, last,
                   mu, neg_lr, has_momentum, nesterov, 1};
        jobs[t] = job;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, run, &jobs[t]) == 0;
    run(&jobs[0]);
    int finite = jobs[0].finite;
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run(&jobs[t]); /* no thread to be had: its blocks here */
        finite &= jobs[t].finite;
    }
    return finite;
}

/* An int8 upload's chunk into the round's exact sum (diloco/outer/exact.py): x <- code *
   scale (Int8Codec.decode_into: one fp32 rounding), acc += round(x * factor) in double
   (exact.add_term: the product rounded once, then to the nearest whole number, ties to
   even, as torch's round). q starts at a block boundary. */
void diloco_add_int8(const int8_t *q, const float *scales, int64_t n, int64_t block,
                     double factor, float *x, double *acc) {
    for (int64_t lo = 0; lo < n; lo += block) {
        int64_t hi = lo + block < n ? lo + block : n;
        const float scale = scales[lo / block];
        for (int64_t i = lo; i < hi; i++) {
            float xi = (float)q[i] * scale;
            x[i] = xi;
            acc[i] += nearbyint((double)xi * factor);
        }
    }
}
