/* Fused patch apply for token-major KV rows (float32, CPU): dst = R(cos, sin) · (src + U V^T).
 *
 * One read of each source row, one write of each destination row: the rank-m product is accumulated
 * into a row buffer that stays in L1, rotated, and streamed out (non-temporal stores, as a large memcpy
 * does). Four rows share each load of V^T.
 * Built at first use by kamera_engine.fused_apply (cc -O3 -march=native -fopenmp), called through ctypes.
 *
 * Layout: src/dst (L, T, F) contiguous with F = H * D; u (Lp, T, m); vt (Lp, m, F); patch_row (L,)
 * maps a layer to its row in u/vt (-1: not patched; the pointer may be NULL when nothing is);
 * cos/sin (T, r / 2) or NULL for no rotation. style 0: pairs (i, i + r/2); 1: pairs (2i, 2i + 1).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define BLOCK 4 /* rows per register block: measured best of 4 / 5 / 6 on AVX-512 */

typedef struct {
    const float *src;
    float *dst;
    const float *u;
    const float *vt;
    const int64_t *patch_row;
    const float *cos;
    const float *sin;
    int64_t L, T, H, D, r, m;
    int style;
    int64_t g0, g1; /* rows [g0, g1) of the L * T rows */
    int status;
} job_t;

static void rotate_row(const float *x, float *o, const float *c, const float *s, int64_t H, int64_t D,
                       int64_t r, int style) {
    const int64_t hr = r / 2;
    for (int64_t h = 0; h < H; h++) {
        const float *xh = x + h * D;
        float *oh = o + h * D;
        if (style == 0) {
            for (int64_t i = 0; i < hr; i++) {
                const float x1 = xh[i], x2 = xh[i + hr];
                oh[i] = x1 * c[i] - x2 * s[i];
                oh[i + hr] = x2 * c[i] + x1 * s[i];
            }
        } else {
            for (int64_t i = 0; i < hr; i++) {
                const float x1 = xh[2 * i], x2 = xh[2 * i + 1];
                oh[2 * i] = x1 * c[i] - x2 * s[i];
                oh[2 * i + 1] = x2 * c[i] + x1 * s[i];
            }
        }
        for (int64_t i = r; i < D; i++) oh[i] = xh[i];
    }
}

/* Write n floats to dst without pulling dst's lines into the cache first (as a large memcpy does). */
static void stream_out(float *restrict dst, const float *restrict src, int64_t n) {
#if defined(__AVX512F__)
    if (((uintptr_t)dst & 63) == 0 && (n & 15) == 0) {
        for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
        return;
    }
#elif defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0 && (n & 7) == 0) {
        for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
        return;
    }
#endif
    memcpy(dst, src, sizeof(float) * n);
}

typedef float v16 __attribute__((vector_size(64), aligned(4)));

static inline void put16(float *p, v16 x, int stream) {
#if defined(__AVX512F__)
    if (stream) {
        _mm512_stream_ps(p, (__m512)x);
        return;
    }
#endif
    (void)stream;
    *(v16 *)p = x;
}

/* out[b][f] = src[b][f] + u[b] . vt[:, f] for rows b < n, features f >= f0: the scalar path (a block's last
 * features, a layer's last rows). */
static void add_rows(float *restrict out, const float *restrict src, const float *restrict u,
                     const float *restrict vt, int64_t F, int64_t m, int64_t n, int64_t f0) {
    for (int64_t b = 0; b < n; b++) {
        float *restrict row = out + b * F;
        for (int64_t f = f0; f < F; f++) row[f] = src[b * F + f];
        for (int64_t k = 0; k < m; k++) { /* k outside, contiguous features inside: the loop vectorises */
            const float a = u[b * m + k];
            const float *restrict v = vt + k * F;
            for (int64_t f = f0; f < F; f++) row[f] += a * v[f];
        }
    }
}

/* out[BLOCK][F] = src[BLOCK][F] + u[BLOCK][m] @ vt[m][F]: 64 features x BLOCK rows of accumulators stay
 * in registers across k, and each load of vt serves BLOCK rows.
 * cs/sn (BLOCK rows of 32 cos / sin): rotate each 64-feature chunk in registers as one head of
 * head_dim 64, pairs (i, i + 32), before it leaves (the common layout; others rotate from a buffer).
 * stream: out is the destination, 64-byte aligned, written with non-temporal stores. */
static void gemm_block(float *restrict out, const float *restrict src, const float *restrict u,
                       const float *restrict vt, int64_t F, int64_t m, const float *cs, const float *sn, int stream) {
    int64_t f = 0;
    for (; f + 64 <= F; f += 64) {
        v16 c[BLOCK][4];
        for (int b = 0; b < BLOCK; b++)
            for (int q = 0; q < 4; q++) c[b][q] = *(const v16 *)(src + b * F + f + 16 * q);
        for (int64_t k = 0; k < m; k++) {
            const float *v = vt + k * F + f;
            const v16 w0 = *(const v16 *)v, w1 = *(const v16 *)(v + 16), w2 = *(const v16 *)(v + 32),
                      w3 = *(const v16 *)(v + 48);
            for (int b = 0; b < BLOCK; b++) {
                const float a = u[b * m + k];
                c[b][0] += a * w0;
                c[b][1] += a * w1;
                c[b][2] += a * w2;
                c[b][3] += a * w3;
            }
        }
        if (cs != NULL)
            for (int b = 0; b < BLOCK; b++) {
                const v16 c0 = *(const v16 *)(cs + 32 * b), c1 = *(const v16 *)(cs + 32 * b + 16);
                const v16 s0 = *(const v16 *)(sn + 32 * b), s1 = *(const v16 *)(sn + 32 * b + 16);
                const v16 x1a = c[b][0], x1b = c[b][1], x2a = c[b][2], x2b = c[b][3];
                c[b][0] = x1a * c0 - x2a * s0;
                c[b][1] = x1b * c1 - x2b * s1;
                c[b][2] = x2a * c0 + x1a * s0;
                c[b][3] = x2b * c1 + x1b * s1;
            }
        for (int b = 0; b < BLOCK; b++)
            for (int q = 0; q < 4; q++) put16(out + b * F + f + 16 * q, c[b][q], stream);
    }
    for (; f + 16 <= F; f += 16) {
        v16 c[BLOCK];
        for (int b = 0; b < BLOCK; b++) c[b] = *(const v16 *)(src + b * F + f);
        for (int64_t k = 0; k < m; k++) {
            const v16 w = *(const v16 *)(vt + k * F + f);
            for (int b = 0; b < BLOCK; b++) c[b] += u[b * m + k] * w;
        }
        for (int b = 0; b < BLOCK; b++) put16(out + b * F + f, c[b], stream);
    }
    add_rows(out, src, u, vt, F, m, BLOCK, f);
}

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t F = j->H * j->D, T = j->T, m = j->m, hr = j->r / 2;
    float *buf = (float *)malloc(sizeof(float) * 2 * BLOCK * F);
    if (buf == NULL) {
        j->status = 1;
        return NULL;
    }
    float *out = buf + BLOCK * F;
    /* rows start 64-byte aligned: stream whole rows; head_dim 64 rotating in full, pairs (i, i + 32):
     * rotate in registers */
    const int direct = ((uintptr_t)j->dst & 63) == 0 && (F & 15) == 0;
    const int rot64 = j->style == 0 && j->D == 64 && j->r == 64;
    int64_t g = j->g0;
    while (g < j->g1) {
        const int64_t l = g / T, t = g % T;
        int64_t n = j->g1 - g;
        if (n > T - t) n = T - t; /* a block never crosses a layer */
        if (n > BLOCK) n = BLOCK;
        const float *src = j->src + g * F;
        float *dst = j->dst + g * F;
        const int64_t p = j->patch_row ? j->patch_row[l] : -1;
        const int rotate = j->cos != NULL;
        if (p >= 0) {
            const float *u = j->u + (p * T + t) * m;
            const float *vt = j->vt + p * m * F;
            if (n == BLOCK && direct && (!rotate || rot64)) { /* straight from registers to dst */
                gemm_block(dst, src, u, vt, F, m, rotate ? j->cos + t * hr : NULL, rotate ? j->sin + t * hr : NULL, 1);
                g += n;
                continue;
            }
            if (n == BLOCK)
                gemm_block(buf, src, u, vt, F, m, NULL, NULL, 0);
            else
                add_rows(buf, src, u, vt, F, m, n, 0);
            if (rotate)
                for (int64_t b = 0; b < n; b++)
                    rotate_row(buf + b * F, out + b * F, j->cos + (t + b) * hr, j->sin + (t + b) * hr, j->H, j->D,
                               j->r, j->style);
            stream_out(dst, rotate ? out : buf, n * F);
        } else if (rotate) {
            for (int64_t b = 0; b < n; b++)
                rotate_row(src + b * F, out + b * F, j->cos + (t + b) * hr, j->sin + (t + b) * hr, j->H, j->D, j->r,
                           j->style);
            stream_out(dst, out, n * F);
        } else if (dst != src) {
            stream_out(dst, src, n * F);
        }
        g += n;
    }
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
    free(buf);
    return NULL;
}

/* Returns 0 on success, 1 when a worker could not allocate its row buffer, 2 on bad arguments. */
int kamera_apply_f32(const float *src, float *dst, const float *u, const float *vt, const int64_t *patch_row,
                     const float *cos, const float *sin, int64_t L, int64_t T, int64_t H, int64_t D, int64_t r,
                     int64_t m, int style, int threads) {
    if (L < 0 || T < 0 || H <= 0 || D <= 0 || r < 0 || r > D || (r & 1) || m < 0 || (style != 0 && style != 1))
        return 2;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    const int64_t rows = L * T;
    if (rows == 0) return 0;
    if ((int64_t)threads > rows / BLOCK) threads = rows / BLOCK > 0 ? (int)(rows / BLOCK) : 1;
    job_t jobs[64];
    const int64_t per = (rows + threads - 1) / threads;
    for (int i = 0; i < threads; i++) {
        job_t jb = {src, dst, u, vt, patch_row, cos, sin, L, T, H, D, r, m, style, 0, 0, 0};
        jb.g0 = i * per < rows ? i * per : rows;
        jb.g1 = (i + 1) * per < rows ? (i + 1) * per : rows;
        jobs[i] = jb;
    }
    /* torch's own OpenMP pool (the library links the libgomp torch has loaded): no second set of
     * threads competing with torch's for the cores. */
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int i = 0; i < threads; i++) run_job(&jobs[i]);
    for (int i = 0; i < threads; i++)
        if (jobs[i].status) return jobs[i].status;
    return 0;
}
