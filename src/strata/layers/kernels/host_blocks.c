/* Experts kept in host memory, run by the CPU in their GGUF blocks (as llama.cpp's -ncmoe runs them): each
 * weight row is decoded into a float buffer of one row, as gguf.quants.dequantize decodes it (same operations,
 * same order: compiled without contraction into fused multiply-adds), and dotted with every input row that
 * needs it. Only the blocks are read from memory; the decoded row lives in the L1 cache.
 * Built by host_blocks.py with the system's C compiler; no Python or torch headers. */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q8_0 = 8, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ3_XXS = 18, IQ4_XS = 23 };

static float half(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One block (32 weights for Q4_0/Q8_0, else a 256-weight superblock) into y; returns the weights written. */
static int block(int t, const uint8_t *b, const uint8_t *table, float *y) {
    switch (t) {
    case Q4_0: {
        float d = half(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[2 + j] & 0xf) - 8);
            y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
        return 32;
    }
    case Q8_0: {
        float d = half(b);
        for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
        return 32;
    }
    case Q4_K:
    case Q5_K: {
        float d = half(b), dmin = half(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + (t == Q5_K ? 48 : 16);
        for (int j = 0; j < 4; j++) {
            int s1, m1, s2, m2;
            scale_min_k4(2 * j, sc, &s1, &m1);
            scale_min_k4(2 * j + 1, sc, &s2, &m2);
            float d1 = d * (float)s1, n1 = dmin * (float)m1, d2 = d * (float)s2, n2 = dmin * (float)m2;
            for (int l = 0; l < 32; l++) {
                int lo = ql[32 * j + l] & 0xf, hi = ql[32 * j + l] >> 4;
                if (t == Q5_K) {
                    lo += (qh[l] >> (2 * j) & 1) << 4;
                    hi += (qh[l] >> (2 * j + 1) & 1) << 4;
                }
                y[64 * j + l] = d1 * (float)lo - n1;
                y[64 * j + 32 + l] = d2 * (float)hi - n2;
            }
        }
        return 256;
    }
    case Q6_K: {
        float d = half(b + 208);
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, y += 128) {
            for (int is = 0; is < 2; is++) {  /* d * sc first, as the reference multiplies */
                float s1 = d * (float)sc[is], s2 = d * (float)sc[is + 2], s3 = d * (float)sc[is + 4],
                      s4 = d * (float)sc[is + 6];
                for (int l = 16 * is; l < 16 * is + 16; l++) {
                    y[l] = s1 * (float)(((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32);
                    y[l + 32] = s2 * (float)(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    y[l + 64] = s3 * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    y[l + 96] = s4 * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
        }
        return 256;
    }
    case Q3_K: {
        const uint8_t *hm = b, *s = b + 96;
        float d = half(b + 108);
        int scales[16];
        for (int j = 0; j < 16; j++) {
            int low = j < 8 ? s[j] & 0xf : s[j - 8] >> 4;
            scales[j] = (low | ((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32;
        }
        for (int n = 0; n < 2; n++) {
            const uint8_t *q = b + 32 + 32 * n;
            for (int j = 0; j < 4; j++) {
                int shift = 2 * j, m = 1 << (4 * n + j);
                float *out = y + 128 * n + 32 * j;
                float d1 = d * (float)scales[8 * n + 2 * j], d2 = d * (float)scales[8 * n + 2 * j + 1];
                for (int l = 0; l < 32; l++)
                    out[l] = (l < 16 ? d1 : d2) * (float)(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
            }
        }
        return 256;
    }
    case IQ4_XS: {
        float d = half(b), level[16];
        int hi = b[2] | (b[3] << 8);
        const int8_t *levels = (const int8_t *)table;
        for (int ib = 0; ib < 8; ib++) {
            int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xf) | (((hi >> (2 * ib)) & 3) << 4);
            float dl = d * (float)(ls - 32);
            for (int k = 0; k < 16; k++) level[k] = dl * (float)levels[k];
            const uint8_t *qs = b + 8 + 16 * ib;
            for (int j = 0; j < 16; j++) {
                y[32 * ib + j] = level[qs[j] & 0xf];
                y[32 * ib + j + 16] = level[qs[j] >> 4];
            }
        }
        return 256;
    }
    case IQ3_XXS: {
        float d = half(b);
        const uint8_t *qs = b + 2, *signs = table + 1024;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *g = b + 66 + 4 * ib;
            uint32_t aux = (uint32_t)g[0] | (uint32_t)g[1] << 8 | (uint32_t)g[2] << 16 | (uint32_t)g[3] << 24;
            float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            for (int l = 0; l < 4; l++) {
                uint8_t sign = signs[(aux >> (7 * l)) & 127];
                const uint8_t *g1 = table + 4 * qs[8 * ib + 2 * l], *g2 = table + 4 * qs[8 * ib + 2 * l + 1];
                for (int j = 0; j < 4; j++) {
                    y[32 * ib + 8 * l + j] = db * (float)g1[j] * ((sign >> j & 1) ? -1.0f : 1.0f);
                    y[32 * ib + 8 * l + 4 + j] = db * (float)g2[j] * ((sign >> (j + 4) & 1) ? -1.0f : 1.0f);
                }
            }
        }
        return 256;
    }
    }
    return 0;
}

static int block_bytes(int t) {
    switch (t) {
    case Q4_0: return 18;
    case Q8_0: return 34;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case IQ3_XXS: return 98;
    default: return 136;
    }
}

static void decode_row(int t, const uint8_t *b, int64_t cols, const uint8_t *table, float *y) {
    int size = block_bytes(t);
    for (int64_t c = 0; c < cols; b += size) c += block(t, b, table, y + c);
}

/* Rows [rows] of row_bytes each, of type t, into out [rows, cols] (the reference the tests hold to gguf). */
void strata_dequantize(int t, const uint8_t *data, int64_t rows, int64_t row_bytes, int64_t cols,
                       const uint8_t *table, float *out) {
    for (int64_t r = 0; r < rows; r++) decode_row(t, data + r * row_bytes, cols, table, out + r * cols);
}

static float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    for (int64_t i = 0; i < n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0;
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

/* A sparse layer's host experts over their rows. Groups g (one per expert hit): expert[g], its pairs
 * start[g]..start[g+1]-1, pair p reading input row row[p] of x [*, hidden]. gate_up: per expert 2*inter rows
 * of `hidden` columns (its gate rows, then its up rows), expert_bytes apart; down: per expert `hidden` rows of
 * `inter` columns. act [pairs, 2*inter] is scratch; y [pairs, hidden] the outputs. Columns are multiples of 256. */
void strata_expert_pairs(int64_t groups, const int64_t *expert, const int64_t *start, const int64_t *row,
                         const float *x, int64_t hidden, int64_t inter,
                         int gu_type, const uint8_t *gate_up, int64_t gu_expert_bytes, int64_t gu_row_bytes,
                         const uint8_t *gu_table,
                         int dn_type, const uint8_t *down, int64_t dn_expert_bytes, int64_t dn_row_bytes,
                         const uint8_t *dn_table, float *act, float *y, int threads) {
    int64_t pairs = start[groups];
    #pragma omp parallel num_threads(threads)
    {
        float buf[hidden > inter ? hidden : inter];
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * 2 * inter; item++) {
            int64_t g = item / (2 * inter), r = item % (2 * inter);
            decode_row(gu_type, gate_up + expert[g] * gu_expert_bytes + r * gu_row_bytes, hidden, gu_table, buf);
            for (int64_t p = start[g]; p < start[g + 1]; p++) act[p * 2 * inter + r] = dot(buf, x + row[p] * hidden, hidden);
        }
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            float *a = act + p * 2 * inter;
            for (int64_t i = 0; i < inter; i++) a[i] = a[i] / (1.0f + expf(-a[i])) * a[inter + i];
        }
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < groups * hidden; item++) {
            int64_t g = item / hidden, r = item % hidden;
            decode_row(dn_type, down + expert[g] * dn_expert_bytes + r * dn_row_bytes, inter, dn_table, buf);
            for (int64_t p = start[g]; p < start[g + 1]; p++) y[p * hidden + r] = dot(buf, act + p * 2 * inter, inter);
        }
    }
}
