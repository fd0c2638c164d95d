// Stage 1's logits of coverage selection in isolation: 16 sampled queries of a tile against every
// key before the chunk on a 16-channel sketch, F32 FMA (the engine's layout and register tiling)
// against 8-bit keys and queries with AVX2 integer products (sign trick, maddubs, madd), one thread.
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>

constexpr int KB = 64, R = 16, NS = 16, RM = 6;

static void f32_logits(float * p, int ldp, const float * q, const float * k, int n) {
    for (int b = 0; b*KB < n; ++b) {
        const float * kb = k + (size_t) b*R*KB;
        for (int jj = 0; jj < KB; jj += 16) {
            for (int i0 = 0; i0 < NS; i0 += RM) {
                const int rm = NS - i0 < RM ? NS - i0 : RM;
                __m256 acc[RM][2];
                for (int i = 0; i < RM; ++i) { acc[i][0] = _mm256_setzero_ps(); acc[i][1] = _mm256_setzero_ps(); }
                for (int c = 0; c < R; ++c) {
                    const __m256 k0 = _mm256_loadu_ps(kb + c*KB + jj);
                    const __m256 k1 = _mm256_loadu_ps(kb + c*KB + jj + 8);
                    for (int i = 0; i < RM; ++i) {
                        if (i >= rm) break;
                        const __m256 qv = _mm256_set1_ps(q[(i0 + i)*R + c]);
                        acc[i][0] = _mm256_fmadd_ps(k0, qv, acc[i][0]);
                        acc[i][1] = _mm256_fmadd_ps(k1, qv, acc[i][1]);
                    }
                }
                for (int i = 0; i < rm; ++i) {
                    _mm256_storeu_ps(p + (size_t) (i0 + i)*ldp + b*KB + jj,     acc[i][0]);
                    _mm256_storeu_ps(p + (size_t) (i0 + i)*ldp + b*KB + jj + 8, acc[i][1]);
                }
            }
        }
    }
}

// keys [block][R/4][KB][4] int8, queries [NS][R] int8; logits = dot * (qscale[i] * kscale[block])
static void i8_logits(float * p, int ldp, const int8_t * q, const float * qscale, const int8_t * k, const float * kscale, int n) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b*KB < n; ++b) {
        const int8_t * kb = k + (size_t) b*R*KB;
        for (int jj = 0; jj < KB; jj += 16) {
            for (int i0 = 0; i0 < NS; i0 += RM) {
                const int rm = NS - i0 < RM ? NS - i0 : RM;
                __m256i acc[RM][2];
                for (int i = 0; i < RM; ++i) { acc[i][0] = _mm256_setzero_si256(); acc[i][1] = _mm256_setzero_si256(); }
                for (int g = 0; g < R/4; ++g) {
                    const __m256i k0 = _mm256_loadu_si256((const __m256i *) (kb + (g*KB + jj)*4));
                    const __m256i k1 = _mm256_loadu_si256((const __m256i *) (kb + (g*KB + jj + 8)*4));
                    const __m256i a0 = _mm256_sign_epi8(k0, k0);
                    const __m256i a1 = _mm256_sign_epi8(k1, k1);
                    for (int i = 0; i < RM; ++i) {
                        if (i >= rm) break;
                        int32_t qg; memcpy(&qg, q + (i0 + i)*R + 4*g, 4);
                        const __m256i qv = _mm256_set1_epi32(qg);
                        const __m256i s0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(qv, k0));
                        const __m256i s1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(qv, k1));
                        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(s0, ones));
                        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(s1, ones));
                    }
                }
                for (int i = 0; i < rm; ++i) {
                    const __m256 sc = _mm256_set1_ps(qscale[i0 + i]*kscale[b]);
                    _mm256_storeu_ps(p + (size_t) (i0 + i)*ldp + b*KB + jj,     _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][0]), sc));
                    _mm256_storeu_ps(p + (size_t) (i0 + i)*ldp + b*KB + jj + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][1]), sc));
                }
            }
        }
    }
}

int main(int argc, char ** argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 16384;
    const int reps = argc > 2 ? atoi(argv[2]) : 48; // 16 tiles x 3 heads sharing a KV head: one chunk of one layer
    const int nb = (n + KB - 1)/KB;
    std::vector<float> k((size_t) nb*R*KB), q(NS*R), p((size_t) NS*nb*KB), p8((size_t) NS*nb*KB);
    srand(1);
    for (auto & x : k) x = (rand()/(float) RAND_MAX - 0.5f)*4.0f;
    for (auto & x : q) x = (rand()/(float) RAND_MAX - 0.5f)*0.5f;
    // 8-bit: keys per block (one scale per block of 64 keys), queries per row
    std::vector<int8_t> k8((size_t) nb*R*KB), q8(NS*R);
    std::vector<float> ks(nb), qs(NS);
    for (int b = 0; b < nb; ++b) {
        float mx = 0; for (int c = 0; c < R; ++c) for (int j = 0; j < KB; ++j) mx = fmaxf(mx, fabsf(k[(size_t) b*R*KB + c*KB + j]));
        ks[b] = mx/127;
        for (int c = 0; c < R; ++c) for (int j = 0; j < KB; ++j)
            k8[(size_t) b*R*KB + ((c/4)*KB + j)*4 + c%4] = (int8_t) lrintf(k[(size_t) b*R*KB + c*KB + j]/ks[b]);
    }
    for (int i = 0; i < NS; ++i) {
        float mx = 0; for (int c = 0; c < R; ++c) mx = fmaxf(mx, fabsf(q[i*R + c]));
        qs[i] = mx/127; for (int c = 0; c < R; ++c) q8[i*R + c] = (int8_t) lrintf(q[i*R + c]/qs[i]);
    }
    const int ldp = nb*KB;
    double best_f = 1e30, best_i = 1e30;
    for (int trial = 0; trial < 5; ++trial) {
        auto t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < reps; ++r) f32_logits(p.data(), ldp, q.data(), k.data(), n);
        auto t1 = std::chrono::steady_clock::now();
        for (int r = 0; r < reps; ++r) i8_logits(p8.data(), ldp, q8.data(), qs.data(), k8.data(), ks.data(), n);
        auto t2 = std::chrono::steady_clock::now();
        best_f = fmin(best_f, std::chrono::duration<double>(t1 - t0).count());
        best_i = fmin(best_i, std::chrono::duration<double>(t2 - t1).count());
    }
    double maxerr = 0, maxv = 0;
    for (size_t x = 0; x < p.size(); ++x) { maxerr = fmax(maxerr, fabs(p[x] - p8[x])); maxv = fmax(maxv, fabs(p[x])); }
    const double per = (double) reps*NS*n;
    printf("n %d: f32 %.3f ns, int8 %.3f ns per (sample, position); int8/f32 time %.2f; sketch %zu KiB f32, %zu KiB int8; max |diff| %.4f of max |logit| %.3f\n",
        n, best_f/per*1e9, best_i/per*1e9, best_i/best_f, k.size()*4/1024, k8.size()/1024, maxerr, maxv);
}
