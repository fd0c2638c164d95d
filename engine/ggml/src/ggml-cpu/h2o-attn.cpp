// GGML_OP_H2O_ATTN on the CPU: the chunked sparse prefill attention of one layer, its memory
// selection policies (the seed rule, query-aware blocks, the hybrid, coverage selection) and
// the scores it keeps (see ggml_h2o_attn in ggml.h).

#include "ops.h"

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "h2o-common.h"
#include "simd-gemm.h"
#include "ggml.h"
#include "vec.h"

#include <algorithm>
#include <queue>
#include <cfloat>
#include <cmath>

// ggml_compute_forward_h2o_attn

// Query rows go in tiles of H2O_QT and keys in blocks of H2O_KB, so that the logits and the
// weighted V sums are small dense matrix products (simd_gemm), as in the tiled flash attention
// above. With H2O_QT == H2O_KB the causal diagonal of a tile lies in one key block.
static constexpr int64_t H2O_QT = 64;
static constexpr int64_t H2O_KB = 64;
// keys per step of the dense tail (a multiple of H2O_KB)
static constexpr int64_t H2O_TAIL_SPAN = 16*H2O_KB;

static int64_t h2o_n_blocks(int64_t n) {
    return (n + H2O_KB - 1)/H2O_KB;
}

// How many rows ahead h2o_pack_k asks for a row's cache lines: the rows it gathers (a tile's candidates) lie apart in
// the cache, where the hardware prefetcher does not follow, and each would otherwise wait for memory
static constexpr int64_t H2O_PACK_AHEAD = 8;

// n K rows -> F32 blocks [block][D][H2O_KB]: keys contiguous, the GEMM's SIMD dimension;
// padding and rows for which k_row() gives none are zero
template <typename KRow>
static void h2o_pack_k(float * dst, int64_t n, int64_t D, KRow && k_row) {
    thread_local std::vector<float> row;
    row.resize(D);
    const auto zero_key = [&](int64_t j) {
        float * col = dst + (j/H2O_KB)*D*H2O_KB + j%H2O_KB;
        for (int64_t d = 0; d < D; ++d) {
            col[d*H2O_KB] = 0.0f;
        }
    };
    size_t row_bytes = 0; // of the rows' type, once a row is seen
    for (int64_t j = 0; j < n; ++j) {
        const h2o_row kr = k_row(j);
        if (kr.data == nullptr) {
            zero_key(j);
            continue;
        }
        if (row_bytes == 0) {
            row_bytes = ggml_row_size(kr.type->type, D);
        }
#if defined(__GNUC__)
        if (j + H2O_PACK_AHEAD < n) {
            const h2o_row ahead = k_row(j + H2O_PACK_AHEAD);
            for (size_t o = 0; ahead.data != nullptr && o < row_bytes; o += 64) {
                __builtin_prefetch((const char *) ahead.data + o);
            }
        }
#endif
        kr.type->to_f32(kr.data, row.data(), D);
        float * col = dst + (j/H2O_KB)*D*H2O_KB + j%H2O_KB;
        for (int64_t d = 0; d < D; ++d) {
            col[d*H2O_KB] = row[d];
        }
    }
    if (n % H2O_KB != 0) {
        float * last = dst + (n/H2O_KB)*D*H2O_KB;
        for (int64_t d = 0; d < D; ++d) {
            std::fill(last + d*H2O_KB + n%H2O_KB, last + (d + 1)*H2O_KB, 0.0f);
        }
    }
}

// n V rows -> F32 rows [h2o_n_blocks(n)*H2O_KB][Dv], zero where padded or v_row() gives none:
// a zero probability must never meet an uninitialised (possibly NaN) row
template <typename VRow>
static void h2o_pack_v(float * dst, int64_t n, int64_t Dv, VRow && v_row) {
    for (int64_t j = 0; j < h2o_n_blocks(n)*H2O_KB; ++j) {
        const h2o_row vr = j < n ? v_row(j) : h2o_row{};
        if (vr.data != nullptr) {
            vr.type->to_f32(vr.data, dst + j*Dv, Dv);
        } else {
            std::fill(dst + j*Dv, dst + (j + 1)*Dv, 0.0f);
        }
    }
}

// logits of `rows` (pre-scaled) query rows against n_blocks packed key blocks: x[block][row][H2O_KB]; with
// softcap > 0, soft-capped as ggml_flash_attn_ext does: x -> softcap*tanh(x/softcap)
static void h2o_logits(float * x, const float * q_tile, int64_t rows, int64_t D,
        const float * k_packed, int64_t n_blocks, float softcap) {
    for (int64_t b = 0; b < n_blocks; ++b) {
        float * xb = x + b*H2O_QT*H2O_KB;
        std::fill(xb, xb + rows*H2O_KB, 0.0f);
        simd_gemm(xb, q_tile, k_packed + b*D*H2O_KB, (int) rows, (int) D, (int) H2O_KB);
        if (softcap > 0.0f) {
            for (int64_t e = 0; e < rows*H2O_KB; ++e) {
                xb[e] = softcap*tanhf(xb[e]/softcap);
            }
        }
    }
}

// the weights of an output's parts (their row maxima m_a, m_b and sums l_a, l_b; l_b = 0: no second part) in one
// softmax, with the learned sink's logit in its denominator (the online-softmax merge)
static void h2o_merge_weights(float m_a, float l_a, float m_b, float l_b, float sink, float & w_a, float & w_b) {
    float mx = l_b > 0.0f ? std::max(m_a, m_b) : m_a;
    float ea = expf(m_a - mx);
    float eb = l_b > 0.0f ? expf(m_b - mx) : 0.0f;
    float l  = l_a*ea + l_b*eb;
    if (sink != -INFINITY) {
        const float m2 = std::max(mx, sink);
        const float f  = expf(mx - m2);
        l   = l*f + expf(sink - m2);
        ea *= f;
        eb *= f;
        mx  = m2;
    }
    w_a = ea/l;
    w_b = eb/l;
}

// Coverage selection's sampled queries against every key before the chunk: their logits go straight into the rows of
// p (leading dimension ldp), and each row's maximum into mx. The products and their order are h2o_logits's (each logit
// a sum over the channels in order, from zero), so the logits are its bits; what this saves is its zeroed block, the
// copy of every block into the rows and a second pass over them for the maximum, which is taken in registers. The
// maxima pass over a NaN logit, as h2o_max does.
static constexpr int64_t H2O_SAMPLE_LANES = 16; // lanes of a row's running maximum (at least GGML_F32_EPR)

#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
#if defined(__AVX512F__)
#define H2O_SAMPLE_VEC_MAX(x, m) _mm512_max_ps(x, m) // m where x is NaN
#elif defined(__AVX__)
#define H2O_SAMPLE_VEC_MAX(x, m) _mm256_max_ps(x, m)
#endif

// RM rows of q against one key block; with lanes, each row's maximum by lane too (H2O_SAMPLE_LANES apart)
template <int RM>
static inline void h2o_sample_logits_block(float * p, int64_t ldp, float * lanes, const float * q, int64_t R,
        const float * kb) {
    constexpr int KN = GGML_F32_EPR;
    static_assert(KN <= H2O_SAMPLE_LANES, "a vector fits a row's lanes");
    for (int64_t jj = 0; jj < H2O_KB; jj += GEMM_RN*KN) {
        GGML_F32_VEC acc[RM][GEMM_RN];
        for (int i = 0; i < RM; ++i) {
            for (int r = 0; r < GEMM_RN; ++r) {
                acc[i][r] = GGML_F32_VEC_ZERO;
            }
        }
        for (int64_t c = 0; c < R; ++c) {
            GGML_F32_VEC kv[GEMM_RN];
            for (int r = 0; r < GEMM_RN; ++r) {
                kv[r] = GGML_F32_VEC_LOAD(kb + c*H2O_KB + jj + r*KN);
            }
            for (int i = 0; i < RM; ++i) {
                const GGML_F32_VEC qv = GGML_F32_VEC_SET1(q[i*R + c]);
                for (int r = 0; r < GEMM_RN; ++r) {
                    acc[i][r] = GGML_F32_VEC_FMA(acc[i][r], kv[r], qv);
                }
            }
        }
        for (int i = 0; i < RM; ++i) {
            for (int r = 0; r < GEMM_RN; ++r) {
                GGML_F32_VEC_STORE(p + i*ldp + jj + r*KN, acc[i][r]);
            }
        }
#if defined(H2O_SAMPLE_VEC_MAX)
        if (lanes != nullptr) {
            for (int i = 0; i < RM; ++i) {
                GGML_F32_VEC m = GGML_F32_VEC_LOAD(lanes + i*H2O_SAMPLE_LANES);
                for (int r = 0; r < GEMM_RN; ++r) {
                    m = H2O_SAMPLE_VEC_MAX(acc[i][r], m);
                }
                GGML_F32_VEC_STORE(lanes + i*H2O_SAMPLE_LANES, m);
            }
        }
#else
        GGML_UNUSED(lanes);
#endif
    }
}
#endif

// m rows of q (pre-scaled, R values each) against one packed key block kb: p[i*ldp + j] for all H2O_KB keys j. Returns
// whether it also took the rows' maxima into lanes (not without a vector maximum, nor when lanes is nullptr)
static bool h2o_sample_logits_rows(float * p, int64_t ldp, float * lanes, const float * q, int64_t m, int64_t R,
        const float * kb) {
#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
    static_assert(H2O_KB % (GEMM_RN*GGML_F32_EPR) == 0, "a key block is whole vectors");
    int64_t i = 0;
    for (; i + GEMM_RM <= m; i += GEMM_RM) {
        h2o_sample_logits_block<GEMM_RM>(p + i*ldp, ldp, lanes ? lanes + i*H2O_SAMPLE_LANES : nullptr, q + i*R, R, kb);
    }
    for (; i < m; ++i) {
        h2o_sample_logits_block<1>(p + i*ldp, ldp, lanes ? lanes + i*H2O_SAMPLE_LANES : nullptr, q + i*R, R, kb);
    }
#if defined(H2O_SAMPLE_VEC_MAX)
    return lanes != nullptr;
#else
    return false;
#endif
#else
    GGML_UNUSED(lanes);
    thread_local std::vector<float> x;
    x.assign((size_t) m*H2O_KB, 0.0f);
    simd_gemm(x.data(), q, kb, (int) m, (int) R, (int) H2O_KB);
    for (int64_t i = 0; i < m; ++i) {
        memcpy(p + i*ldp, x.data() + i*H2O_KB, H2O_KB*sizeof(float));
    }
    return false;
#endif
}

static void h2o_sample_logits(float * p, int64_t ldp, float * mx, const float * q, int64_t rows, int64_t R,
        const float * k_packed, int64_t n, float softcap) {
    float part[H2O_QT*H2O_KB];                // a last block of fewer than H2O_KB keys, whose whole rows would not fit in p
    float lane[H2O_QT*H2O_SAMPLE_LANES];      // each row's running maxima by lane
    GGML_ASSERT(rows <= H2O_QT);
    std::fill_n(lane, rows*H2O_SAMPLE_LANES, -INFINITY);
    for (int64_t b = 0; b*H2O_KB < n; ++b) {
        const int64_t nk  = std::min(H2O_KB, n - b*H2O_KB);
        float       * dst = nk == H2O_KB ? p + b*H2O_KB : part;
        const int64_t ld  = nk == H2O_KB ? ldp : H2O_KB;
        // the maxima in registers, unless soft-capping changes the logits after them or the block has padded keys
        const bool maxed = h2o_sample_logits_rows(dst, ld, softcap > 0.0f || dst == part ? nullptr : lane, q, rows, R,
                k_packed + b*R*H2O_KB);
        for (int64_t r = 0; r < rows; ++r) {
            float * x = dst + r*ld;
            if (softcap > 0.0f) {
                for (int64_t j = 0; j < nk; ++j) {
                    x[j] = softcap*tanhf(x[j]/softcap);
                }
            }
            if (dst == part) {
                memcpy(p + r*ldp + b*H2O_KB, x, nk*sizeof(float));
            }
            if (!maxed) {
                for (int64_t j = 0; j < nk; ++j) {
                    float & l = lane[r*H2O_SAMPLE_LANES + j%H2O_SAMPLE_LANES];
                    l = std::max(l, x[j]);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        mx[r] = -INFINITY;
        for (int64_t l = 0; l < H2O_SAMPLE_LANES; ++l) {
            mx[r] = std::max(mx[r], lane[r*H2O_SAMPLE_LANES + l]);
        }
    }
}

// row r of x: logits -> exp(x - max) in place over the first n_keys keys; returns (max, sum)
struct h2o_row_part {
    float m = -INFINITY; // row maximum of the scaled logits
    float l = 0.0f;      // sum of exp(x - m)
};

static h2o_row_part h2o_row_softmax(float * x, int64_t r, int64_t n_keys) {
    h2o_row_part part;
    const int64_t nb = h2o_n_blocks(n_keys);
    for (int64_t b = 0; b < nb; ++b) {
        part.m = std::max(part.m, h2o_max(x + b*H2O_QT*H2O_KB + r*H2O_KB, H2O_KB));
    }
    if (part.m == -INFINITY) {
        // no key: zero probabilities, so that the V product adds nothing
        for (int64_t b = 0; b < nb; ++b) {
            std::fill_n(x + b*H2O_QT*H2O_KB + r*H2O_KB, H2O_KB, 0.0f);
        }
        return part;
    }
    ggml_float l = 0.0;
    for (int64_t b = 0; b < nb; ++b) {
        float * xr = x + b*H2O_QT*H2O_KB + r*H2O_KB;
        l += ggml_vec_soft_max_f32((int) H2O_KB, xr, xr, part.m);
    }
    part.l = (float) l;
    return part;
}

// col[j] += w * (p of row r, key j) for the first n_keys keys
static void h2o_add_column_sums(float * col, const float * x, int64_t r, int64_t n_keys, float w) {
    for (int64_t b = 0; b < h2o_n_blocks(n_keys); ++b) {
        const int64_t n = std::min(H2O_KB, n_keys - b*H2O_KB);
        ggml_vec_mad_f32((int) n, col + b*H2O_KB, x + b*H2O_QT*H2O_KB + r*H2O_KB, w);
    }
}

// out[rows][Dv] += p[block][rows][H2O_KB] * v[block*H2O_KB .. ][Dv]
static void h2o_weighted_values(float * out, const float * p, int64_t rows, int64_t n_blocks,
        const float * v_packed, int64_t Dv) {
    for (int64_t b = 0; b < n_blocks; ++b) {
        simd_gemm(out, p + b*H2O_QT*H2O_KB, v_packed + b*H2O_KB*Dv, (int) rows, (int) H2O_KB, (int) Dv);
    }
}

// Query-aware selection (GGML_H2O_SELECT_QUERY*): the memory of chunk c is its Local window [cs - L, cs), the
// sinks [0, n_sink), and whole blocks of GGML_H2O_BLOCK earlier positions chosen by chunk c's own queries. Each
// block is summarised per channel (minimum and maximum, or mean) once per call; a sample of the chunk's queries
// (the last ones, where a question usually is, and a stride over the rest) scores every block: the bound (or
// mean) logits of one query go through a softmax over the blocks, and a block's score is the sum over the
// sample of its share. The best blocks fill the heavy budget, ties to the lower position.
static constexpr int64_t H2O_SAMPLE_LAST   = 32;
static constexpr int64_t H2O_SAMPLE_STRIDE = 32;

// the rows of [r_begin, r_end) that sample the queries: the last H2O_SAMPLE_LAST, then up to H2O_SAMPLE_STRIDE
// evenly spread over the rest
static void h2o_query_sample(std::vector<int64_t> & rows, int64_t r_begin, int64_t r_end) {
    rows.clear();
    const int64_t last0 = std::max(r_begin, r_end - H2O_SAMPLE_LAST);
    for (int64_t r = last0; r < r_end; ++r) {
        rows.push_back(r);
    }
    const int64_t n_rest = last0 - r_begin;
    const int64_t n_pick = std::min(n_rest, H2O_SAMPLE_STRIDE);
    for (int64_t k = 0; k < n_pick; ++k) {
        rows.push_back(r_begin + k*n_rest/n_pick);
    }
}

// Block summaries of one head, kept while its chunks are walked: the keys of a complete block never change, so
// each chunk only summarises the blocks the previous one had not completed. reset() before every head.
struct h2o_block_summary {
    std::vector<float> lo;     // [n_blocks][D]: channel minimum (mean for GGML_H2O_SELECT_QUERY_MEAN)
    std::vector<float> hi;     // [n_blocks][D]: channel maximum
    int32_t b0     = 0;        // the first block
    int32_t n_full = 0;        // blocks b0 .. b0 + n_full - 1 were complete when summarised
    std::vector<float> lo_t;   // [D][n_blocks], for the products
    std::vector<float> hi_t;
    std::vector<float> q_pos;  // [n_q][D]: max(q, 0) (q itself for means)
    std::vector<float> q_neg;  // [n_q][D]: min(q, 0)
    std::vector<float> logit;  // [n_q][n_blocks]
    std::vector<float> score;  // [n_blocks]
    std::vector<int32_t> order;

    void reset() { n_full = 0; }
};

// out of line, so that profiles show what selection costs on its own
#if defined(_MSC_VER)
#define H2O_NOINLINE __declspec(noinline)
#else
#define H2O_NOINLINE __attribute__((noinline))
#endif

// memory of chunk cs.. for one head: Local + Sink + the best blocks of [n_sink, cs - L), ascending, -1 after.
// q_rows holds the sampled queries, pre-scaled, [n_q][D]; key row pos is at k_head + pos*nb_pos, of type kt.
// With scores (GGML_H2O_SELECT_HYBRID), blocks fill half of the budget and the positions with the highest
// accumulated scores among the other candidates the rest.
static H2O_NOINLINE void h2o_select_by_query(int32_t * mem, int32_t M, int32_t L, int32_t H, int32_t n_sink, int32_t cs,
        bool mean, const float * q_rows, int64_t n_q, int64_t D, const char * k_head, size_t nb_pos,
        const h2o_row_type & kt, const ggml_bf16_t * scores, h2o_block_summary & bs) {
    const auto k_row = [&](int64_t pos) { return (const void *) (k_head + pos*nb_pos); };

    const int32_t local_start = std::max(cs - L, 0);
    const int32_t sink_end    = std::min(n_sink, local_start);
    const int32_t cand_begin  = sink_end;
    const int32_t cand_end    = local_start;
    const int32_t budget      = std::max(H - sink_end, 0);
    const int32_t by_score    = scores ? budget/2 : 0;

    std::vector<int32_t> result;
    result.reserve(M);
    for (int32_t pos = 0; pos < sink_end; ++pos) {
        result.push_back(pos);
    }
    for (int32_t pos = local_start; pos < cs; ++pos) {
        result.push_back(pos);
    }

    if (cand_end - cand_begin <= budget) {
        for (int32_t pos = cand_begin; pos < cand_end; ++pos) {
            result.push_back(pos);
        }
    } else {
        // blocks aligned to positions, clipped to the candidates
        const int32_t b0 = cand_begin/GGML_H2O_BLOCK;
        const int32_t b1 = (cand_end + GGML_H2O_BLOCK - 1)/GGML_H2O_BLOCK;
        const int32_t nb = b1 - b0;
        if (bs.n_full > 0 && bs.b0 != b0) {
            bs.n_full = 0;
        }
        bs.b0 = b0;
        bs.lo.resize((size_t) nb*D);
        bs.hi.resize((size_t) nb*D);

        std::vector<float> kf(D);
        int32_t n_full = bs.n_full;
        for (int32_t b = bs.n_full; b < nb; ++b) {
            const int32_t p_begin = std::max((b0 + b)*GGML_H2O_BLOCK, cand_begin);
            const int32_t p_end   = std::min((b0 + b + 1)*GGML_H2O_BLOCK, cand_end);
            float * lo = bs.lo.data() + (size_t) b*D;
            float * hi = bs.hi.data() + (size_t) b*D;
            std::fill(lo, lo + D, mean ? 0.0f :  INFINITY);
            std::fill(hi, hi + D, mean ? 0.0f : -INFINITY);
            for (int32_t pos = p_begin; pos < p_end; ++pos) {
                kt.to_f32(k_row(pos), kf.data(), D);
                if (mean) {
                    ggml_vec_acc_f32((int) D, lo, kf.data());
                } else {
                    for (int64_t d = 0; d < D; ++d) {
                        lo[d] = kf[d] < lo[d] ? kf[d] : lo[d];
                        hi[d] = kf[d] > hi[d] ? kf[d] : hi[d];
                    }
                }
            }
            if (mean) {
                ggml_vec_scale_f32((int) D, lo, 1.0f/(p_end - p_begin));
            }
            if (n_full == b && p_end == (b0 + b + 1)*GGML_H2O_BLOCK) {
                n_full = b + 1;
            }
        }
        bs.n_full = n_full;

        // bound logits of every sampled query against every block as two products: for q >= 0 the bound takes
        // the channel maximum, for q < 0 the minimum; then a softmax over the blocks per query
        bs.lo_t.resize((size_t) D*nb);
        bs.hi_t.resize((size_t) D*nb);
        for (int32_t b = 0; b < nb; ++b) {
            for (int64_t d = 0; d < D; ++d) {
                bs.lo_t[d*nb + b] = bs.lo[(size_t) b*D + d];
                bs.hi_t[d*nb + b] = bs.hi[(size_t) b*D + d];
            }
        }
        bs.q_pos.resize((size_t) n_q*D);
        bs.q_neg.resize((size_t) n_q*D);
        for (int64_t e = 0; e < n_q*D; ++e) {
            bs.q_pos[e] = mean ? q_rows[e] : std::max(q_rows[e], 0.0f);
            bs.q_neg[e] = std::min(q_rows[e], 0.0f);
        }
        bs.logit.assign((size_t) n_q*nb, 0.0f);
        bs.score.assign(nb, 0.0f);
        if (mean) {
            simd_gemm(bs.logit.data(), bs.q_pos.data(), bs.lo_t.data(), (int) n_q, (int) D, nb);
        } else {
            simd_gemm(bs.logit.data(), bs.q_pos.data(), bs.hi_t.data(), (int) n_q, (int) D, nb);
            simd_gemm(bs.logit.data(), bs.q_neg.data(), bs.lo_t.data(), (int) n_q, (int) D, nb);
        }
        for (int64_t i = 0; i < n_q; ++i) {
            float * x = bs.logit.data() + (size_t) i*nb;
            const float mx = h2o_max(x, nb);
            const ggml_float sum = ggml_vec_soft_max_f32(nb, x, x, mx);
            ggml_vec_mad_f32(nb, bs.score.data(), x, (float) (1.0/sum));
        }

        bs.order.resize(nb);
        for (int32_t b = 0; b < nb; ++b) {
            bs.order[b] = b;
        }
        std::stable_sort(bs.order.begin(), bs.order.end(), [&](int32_t a, int32_t b) {
            const float sa = std::isnan(bs.score[a]) ? -INFINITY : bs.score[a];
            const float sb = std::isnan(bs.score[b]) ? -INFINITY : bs.score[b];
            return sa > sb;
        });

        int32_t left = budget - by_score;
        for (int32_t k = 0; k < nb && left > 0; ++k) {
            const int32_t b       = bs.order[k];
            const int32_t p_begin = std::max((b0 + b)*GGML_H2O_BLOCK, cand_begin);
            const int32_t p_end   = std::min(std::min((b0 + b + 1)*GGML_H2O_BLOCK, cand_end), p_begin + left);
            for (int32_t pos = p_begin; pos < p_end; ++pos) {
                result.push_back(pos);
            }
            left -= p_end - p_begin;
        }

        if (by_score > 0) {
            // the best accumulated scores among the candidates no block took, ties to the lower position
            std::vector<char> taken(cand_end, 0);
            for (int32_t pos : result) {
                if (pos < cand_end) {
                    taken[pos] = 1;
                }
            }
            std::vector<std::pair<float, int32_t>> cand;
            for (int32_t pos = cand_begin; pos < cand_end; ++pos) {
                if (!taken[pos]) {
                    const float sc = GGML_BF16_TO_FP32(scores[pos]);
                    cand.emplace_back(std::isnan(sc) ? -INFINITY : sc, pos);
                }
            }
            const int32_t n_in_blocks = (int32_t) result.size() - sink_end - (cs - local_start);
            const size_t  n_best      = std::min<size_t>(budget - n_in_blocks, cand.size());
            std::nth_element(cand.begin(), cand.begin() + n_best, cand.end(),
                    [](const std::pair<float, int32_t> & a, const std::pair<float, int32_t> & b) {
                        return a.first > b.first || (a.first == b.first && a.second < b.second);
                    });
            for (size_t i = 0; i < n_best; ++i) {
                result.push_back(cand[i].second);
            }
        }
    }

    std::sort(result.begin(), result.end());
    for (int32_t m = 0; m < M; ++m) {
        mem[m] = m < (int32_t) result.size() ? result[m] : -1;
    }
}

// Chunk c is complete: its sums enter the BF16 scores, once (F32 until then, so that the result does not depend on
// how the chunk was split across calls): the intra sums acc_intra[0 .. S), and, when with_memory, the memory sums
// acc_intra[S .. S + M) of the memory set mem. Then all sums are zero.
static void h2o_settle(ggml_bf16_t * sc, float * acc_intra, const int32_t * mem, int32_t S, int32_t M, int64_t kv_size,
        int32_t c, bool with_memory) {
    const float * acc_inter = acc_intra + S;
    const int64_t cs = (int64_t) c*S;
    for (int32_t j = 0; j < S && cs + j < kv_size; ++j) {
        if (acc_intra[j] != 0.0f) {
            sc[cs + j] = GGML_FP32_TO_BF16(GGML_BF16_TO_FP32(sc[cs + j]) + acc_intra[j]);
        }
    }
    if (with_memory) {
        for (int32_t m = 0; m < M; ++m) {
            const int32_t pos = mem[m];
            if (pos >= 0 && pos < kv_size && acc_inter[m] != 0.0f) {
                sc[pos] = GGML_FP32_TO_BF16(GGML_BF16_TO_FP32(sc[pos]) + acc_inter[m]);
            }
        }
    }
    std::fill(acc_intra, acc_intra + S + M, 0.0f);
}

// Scratch of one thread for the attention of one tile of query rows.
struct h2o_tile_scratch {
    std::vector<float> q_tile;   // [H2O_QT][D], pre-scaled
    std::vector<float> x_intra;  // logits, then probabilities: [block][H2O_QT][H2O_KB]
    std::vector<float> x_inter;
    std::vector<float> o_tile;   // [H2O_QT][Dv], intra part
    std::vector<float> o_mem;    // [H2O_QT][Dv], memory part
    std::vector<float> w_intra;  // per row: output weight of each part
    std::vector<float> w_inter;
    std::vector<h2o_row_part> part_intra; // per row: maximum and sum of each part's softmax
    std::vector<h2o_row_part> part_mem;

    void reserve(int64_t D, int64_t Dv, int64_t nb_chunk, int64_t nb_memory) {
        q_tile .resize((size_t) H2O_QT*D);
        x_intra.resize((size_t) nb_chunk*H2O_QT*H2O_KB);
        x_inter.resize(std::max(x_inter.size(), (size_t) nb_memory*H2O_QT*H2O_KB));
        o_tile .resize((size_t) H2O_QT*Dv);
        o_mem  .resize((size_t) H2O_QT*Dv);
        w_intra.resize((size_t) H2O_QT);
        w_inter.resize((size_t) H2O_QT);
        part_intra.resize((size_t) H2O_QT);
        part_mem  .resize((size_t) H2O_QT);
    }
};

// Q of rows r0 .. r1 of head ih into q_tile [rows][D], pre-scaled, so that the products are the scaled logits
static void h2o_load_q(float * q_tile, const ggml_tensor * q, int64_t ih, int32_t p0, int64_t r0, int64_t r1, float scale) {
    const int64_t D = q->ne[0];
    for (int64_t r = 0; r < r1 - r0; ++r) {
        const float * qr = (const float *) ((const char *) q->data + (r0 + r - p0)*q->nb[2] + ih*q->nb[1]);
        ggml_vec_scale_f32((int) D, (float *) memcpy(q_tile + r*D, qr, D*sizeof(float)), scale);
    }
}

// The intra part of query rows r0 .. r1 (one tile, aligned to the chunk starting at cs) of head ih: Q pre-scaled into
// s.q_tile, the chunk's packed keys up to the diagonal, s.o_tile the unnormalised P·V and s.part_intra each row's
// softmax maximum and sum. Rows before tail_start add the column sums of this part's own softmax to acc_intra.
static void h2o_tile_intra(const ggml_tensor * q, int64_t ih, int32_t p0, int64_t cs, int64_t r0, int64_t r1, int64_t Dv,
        const h2o_head_logits & lg, int32_t tail_start, const float * k_chunk, const float * v_chunk,
        float * acc_intra, h2o_tile_scratch & s) {
    const int64_t D    = q->ne[0];
    const int64_t rows = r1 - r0;
    const int64_t nbi  = h2o_n_blocks(r1 - cs); // key blocks up to the diagonal

    h2o_load_q(s.q_tile.data(), q, ih, p0, r0, r1, lg.scale);
    h2o_logits(s.x_intra.data(), s.q_tile.data(), rows, D, k_chunk, nbi, lg.softcap);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r0 + r;
        // keys cs .. i of the chunk; later keys of the last block are masked
        const int64_t n_intra = i - cs + 1;
        for (int64_t j = n_intra; j < nbi*H2O_KB; ++j) {
            s.x_intra[(j/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + j%H2O_KB] = -INFINITY;
        }
        s.part_intra[r] = h2o_row_softmax(s.x_intra.data(), r, nbi*H2O_KB);
        // a dense-tail query is recomputed with full attention, and scores nothing
        if (i < tail_start) {
            h2o_add_column_sums(acc_intra, s.x_intra.data(), r, n_intra, 1.0f/s.part_intra[r].l);
        }
    }
    std::fill(s.o_tile.begin(), s.o_tile.begin() + rows*Dv, 0.0f);
    h2o_weighted_values(s.o_tile.data(), s.x_intra.data(), rows, nbi, v_chunk, Dv);
}

// The memory part of the tile whose Q h2o_tile_intra left in s.q_tile: nb_mem packed key blocks, except the slots in
// `masked`; s.o_mem the unnormalised P·V and s.part_mem each row's softmax maximum and sum. Rows before tail_start add
// the column sums of this part's own softmax to acc_mem (n_mem memory slots).
static void h2o_tile_memory(int64_t r0, int64_t rows, int64_t D, int64_t Dv, const h2o_head_logits & lg, int32_t tail_start,
        const float * k_mem, const float * v_mem, int64_t n_mem, int64_t nb_mem, const std::vector<int32_t> & masked,
        float * acc_mem, h2o_tile_scratch & s) {
    h2o_logits(s.x_inter.data(), s.q_tile.data(), rows, D, k_mem, nb_mem, lg.softcap);
    for (int64_t r = 0; r < rows; ++r) {
        // empty slots and padding are masked
        for (const int32_t m : masked) {
            s.x_inter[(m/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + m%H2O_KB] = -INFINITY;
        }
        const h2o_row_part b = h2o_row_softmax(s.x_inter.data(), r, nb_mem*H2O_KB);
        if (r0 + r < tail_start && b.l > 0.0f) {
            h2o_add_column_sums(acc_mem, s.x_inter.data(), r, n_mem, 1.0f/b.l);
        }
        s.part_mem[r] = b;
    }
    std::fill(s.o_mem.begin(), s.o_mem.begin() + rows*Dv, 0.0f);
    h2o_weighted_values(s.o_mem.data(), s.x_inter.data(), rows, nb_mem, v_mem, Dv);
}

// The exact merge of a tile's two parts through their row maxima into dst: the intra part's unnormalised output o_intra
// with its rows' softmax parts `intra`, and, with has_memory, the memory part in s.o_mem and s.part_mem.
static void h2o_tile_merge(ggml_tensor * dst, int64_t ih, int32_t p0, int64_t r0, int64_t rows, const h2o_head_logits & lg,
        const float * o_intra, const h2o_row_part * intra, bool has_memory, h2o_tile_scratch & s) {
    const int64_t Dv = dst->ne[0];
    for (int64_t r = 0; r < rows; ++r) {
        const h2o_row_part b = has_memory ? s.part_mem[r] : h2o_row_part{};
        h2o_merge_weights(intra[r].m, intra[r].l, b.m, b.l, lg.sink, s.w_intra[r], s.w_inter[r]);
    }
    for (int64_t r = 0; r < rows; ++r) {
        float * out = (float *) ((char *) dst->data + (r0 + r - p0)*dst->nb[2] + ih*dst->nb[1]);
        ggml_vec_scale_f32((int) Dv, (float *) memcpy(out, o_intra + r*Dv, Dv*sizeof(float)), s.w_intra[r]);
        if (has_memory && s.w_inter[r] != 0.0f) {
            ggml_vec_mad_f32((int) Dv, out, s.o_mem.data() + r*Dv, s.w_inter[r]);
        }
    }
}

// Query rows r0 .. r1 (one tile, aligned to the chunk starting at cs) of head ih: the intra part attends to the
// chunk's packed keys up to the diagonal; with k_mem, the memory part attends to nb_mem packed key blocks, except the
// slots in `masked`; the two are merged exactly into dst. Rows before tail_start add the column sums of each
// part's own softmax to acc_intra (chunk offsets) and acc_mem (n_mem memory slots).
static void h2o_attend_tile(ggml_tensor * dst, const ggml_tensor * q, int64_t ih, int32_t p0, int64_t cs,
        int64_t r0, int64_t r1, const h2o_head_logits & lg, int32_t tail_start,
        const float * k_chunk, const float * v_chunk,
        const float * k_mem, const float * v_mem, int64_t n_mem, int64_t nb_mem, const std::vector<int32_t> & masked,
        float * acc_intra, float * acc_mem, h2o_tile_scratch & s) {
    const int64_t D  = q->ne[0];
    const int64_t Dv = dst->ne[0];
    const bool has_memory = k_mem != nullptr;

    h2o_tile_intra(q, ih, p0, cs, r0, r1, Dv, lg, tail_start, k_chunk, v_chunk, acc_intra, s);
    if (has_memory) {
        h2o_tile_memory(r0, r1 - r0, D, Dv, lg, tail_start, k_mem, v_mem, n_mem, nb_mem, masked, acc_mem, s);
    }
    h2o_tile_merge(dst, ih, p0, r0, r1 - r0, lg, s.o_tile.data(), s.part_intra.data(), has_memory, s);
}

// Scratch of one thread for the dense tail, and for the sampled queries of GGML_H2O_SELECT_COVERAGE.
struct h2o_span_scratch {
    std::vector<float> k_all;  // K of H2O_TAIL_SPAN positions, packed
    std::vector<float> v_all;
    std::vector<float> x_all;  // [block][H2O_QT][H2O_KB]
    std::vector<float> tail_m; // per row, running maximum and sum of the online softmax
    std::vector<float> tail_l;

    void reserve(int64_t D, int64_t Dv) {
        k_all .resize((size_t) h2o_n_blocks(H2O_TAIL_SPAN)*D*H2O_KB);
        v_all .resize((size_t) h2o_n_blocks(H2O_TAIL_SPAN)*H2O_KB*Dv);
        x_all .resize((size_t) h2o_n_blocks(H2O_TAIL_SPAN)*H2O_QT*H2O_KB);
        tail_m.resize((size_t) H2O_QT);
        tail_l.resize((size_t) H2O_QT);
    }
};

// The dense tail of head ih: queries from tail_start on (in p0 .. p1) attend to every position up to their own,
// H2O_TAIL_SPAN keys at a time merged by online softmax, so that the scratch stays the same size at any prompt length.
template <typename KRow, typename VRow>
static void h2o_dense_tail(ggml_tensor * dst, const ggml_tensor * q, int64_t ih, int32_t p0, int32_t p1,
        int32_t tail_start, const h2o_head_logits & lg, KRow && k_row, VRow && v_row, h2o_tile_scratch & s, h2o_span_scratch & t) {
    const int64_t D  = q->ne[0];
    const int64_t Dv = dst->ne[0];
    for (int64_t t0 = std::max<int64_t>(p0, tail_start); t0 < p1; t0 += H2O_QT) {
        const int64_t t1   = std::min<int64_t>(t0 + H2O_QT, p1);
        const int64_t rows = t1 - t0;

        h2o_load_q(s.q_tile.data(), q, ih, p0, t0, t1, lg.scale);
        std::fill(s.o_tile.begin(), s.o_tile.begin() + rows*Dv, 0.0f);
        std::fill(t.tail_m.begin(), t.tail_m.begin() + rows, -INFINITY);
        std::fill(t.tail_l.begin(), t.tail_l.begin() + rows, 0.0f);

        for (int64_t s0 = 0; s0 < t1; s0 += H2O_TAIL_SPAN) {
            const int64_t n   = std::min<int64_t>(H2O_TAIL_SPAN, t1 - s0);
            const int64_t nbk = h2o_n_blocks(n);

            h2o_pack_k(t.k_all.data(), n, D,  [&](int64_t j) { return k_row(s0 + j); });
            h2o_pack_v(t.v_all.data(), n, Dv, [&](int64_t j) { return v_row(s0 + j); });
            h2o_logits(t.x_all.data(), s.q_tile.data(), rows, D, t.k_all.data(), nbk, lg.softcap);

            for (int64_t r = 0; r < rows; ++r) {
                for (int64_t j = std::max<int64_t>(t0 + r + 1 - s0, 0); j < nbk*H2O_KB; ++j) {
                    t.x_all[(j/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + j%H2O_KB] = -INFINITY;
                }
                const h2o_row_part part = h2o_row_softmax(t.x_all.data(), r, nbk*H2O_KB);
                // rescale what the earlier spans gave this row, and weigh this span alike
                const float m = std::max(t.tail_m[r], part.m);
                const float a = t.tail_m[r] == -INFINITY ? 0.0f : expf(t.tail_m[r] - m);
                const float b = part.m      == -INFINITY ? 0.0f : expf(part.m      - m);
                ggml_vec_scale_f32((int) Dv, s.o_tile.data() + r*Dv, a);
                t.tail_m[r] = m;
                t.tail_l[r] = a*t.tail_l[r] + b*part.l;
                s.w_intra[r] = b;
            }
            std::fill(s.o_mem.begin(), s.o_mem.begin() + rows*Dv, 0.0f);
            h2o_weighted_values(s.o_mem.data(), t.x_all.data(), rows, nbk, t.v_all.data(), Dv);
            for (int64_t r = 0; r < rows; ++r) {
                ggml_vec_mad_f32((int) Dv, s.o_tile.data() + r*Dv, s.o_mem.data() + r*Dv, s.w_intra[r]);
            }
        }

        for (int64_t r = 0; r < rows; ++r) {
            float * out = (float *) ((char *) dst->data + (t0 + r - p0)*dst->nb[2] + ih*dst->nb[1]);
            float w, unused;
            h2o_merge_weights(t.tail_m[r], t.tail_l[r], -INFINITY, 0.0f, lg.sink, w, unused);
            ggml_vec_scale_f32((int) Dv, (float *) memcpy(out, s.o_tile.data() + r*Dv, Dv*sizeof(float)), w);
        }
    }
}

// GGML_H2O_SELECT_COVERAGE (ggml_h2o_attn_set_coverage). Per chunk, after the bookkeeping of each head's state (0):
// 1. every head estimates, for each of its tiles, where the tile's queries attend: n_sample queries of the tile (every
//    H2O_QT/n_sample-th) attend to every position before the chunk; the candidates (after the sinks, before the local
//    window) are ranked by the sampled attention, and the tile's estimate after g budget steps is the samples' mean attention on their chunk, the
//    sinks, the local window and the first g steps of the ranking;
// 2. (after a barrier: the estimates of all heads are in) one budget, on average n_heavy - |sinks| ranked positions
//    per tile, goes one step at a time to the tile whose estimate gains most (ties to the lower head, then tile),
//    among tiles still below the coverage target; every thread computes the same allocation;
// 3. each tile attends to its chunk and to its own memory: the sinks, the local window and its ranked positions up to
//    its budget; the memory set kept is the last tile's at the average budget;
// 4. (after a barrier) each head's column sums, of all its tiles in tile order, go to its state and its scores.
// Steps 1 and 3 go in units of one head's tile, steps 0 and 4 (a head's state) in heads.

// Estimates of one head: ranked[t] and curve[t*stride + g] for its tiles t = ti_begin .. ti_end of rows i_begin .. q_end
// of the chunk at cs, in two stages. The sampled queries attend to every position before the chunk (a softmax over
// those only, so that a sample whose attention stays in its chunk weighs as much as one that reaches far) and propose
// the n_rank candidates with the most of their attention; then every query of the tile attends to its chunk, the
// forced positions and those candidates, and the candidates are ranked by that, the whole tile's attention (normalised
// over those keys). The estimate after g budget steps is the tile's mean attention, so normalised, on its chunk, the
// forced positions and the first g steps of the ranking. The tile's attention to its chunk is the intra part of its
// output, which does not depend on the memory: it is finished here (h2o_tile_intra, its column sums into
// acc_tiles + t*acc_stride) and kept, unnormalised, in o_intra[tile][H2O_QT][Dv] with each row's softmax maximum and
// sum in part_intra[tile][H2O_QT], for step 3.
struct h2o_coverage_scratch {
    std::vector<int64_t> rows;   // sampled query rows
    std::vector<int32_t> tile;   // the tile of each
    std::vector<float>   q_samp; // [H2O_QT][R], pre-scaled, in the sketch's channels
    std::vector<float>   k_far;  // K of every position up to the chunk's last row, packed
    std::vector<int32_t> chan;   // the sketch's R channels, ascending
    std::vector<float>   k_sketch; // k_far in those channels only, packed [block][R][H2O_KB] (R < D)
    int64_t              far_ikv = -1; // the KV head and end of what k_far holds (-1: nothing yet in this call)
    int32_t              far_end = -1;
    std::vector<float>   p;      // [a tile's sample][cs]: logits, then the attention before the chunk
    std::vector<float>   mx;     // per sample: the maximum of its logits
    std::vector<float>   score;  // per candidate
    std::vector<int32_t> order;
    std::vector<uint64_t> key;   // per candidate: h2o_rank_key
    std::vector<int32_t> slot;   // per candidate position: its index in the stage-1 ranking
    std::vector<float>   k_cand; // K of the forced positions and the candidates, packed
    std::vector<float>   x_cand; // [block][H2O_QT][H2O_KB]: a tile's logits, then attention, on k_cand
    std::vector<float>   score2; // per candidate: the whole tile's attention
    std::vector<double>  col;    // the same, summed in double for the estimate
};

// A sort key for rankings by score, highest first, ties to the lower index, NaN last: the score's bits, ordered and
// inverted, above the index (0 <= index < 2^31), so that ascending keys are the ranking. -0 ranks as +0 and NaN as -inf,
// as comparisons of the scores would have them
static uint64_t h2o_rank_key(float score, int32_t index) {
    if (std::isnan(score)) {
        score = -INFINITY;
    }
    if (score == 0.0f) {
        score = 0.0f;
    }
    uint32_t u;
    memcpy(&u, &score, sizeof(u));
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); // ascending with the score
    return ((uint64_t) ~u << 32) | (uint32_t) index;
}

// keys[0 .. n) ascending, as std::sort leaves them: a radix sort, least significant byte first, of the bytes in which
// the keys differ (a ranking's keys share most of them: the index's upper bytes, the score's sign and exponent)
static void h2o_sort_keys(uint64_t * keys, int64_t n) {
    if (n < 256) {
        std::sort(keys, keys + n);
        return;
    }
    thread_local std::vector<uint64_t> tmp;
    tmp.resize(n);
    uint32_t count[8][256] = {};
    for (int64_t i = 0; i < n; ++i) {
        for (int d = 0; d < 8; ++d) {
            count[d][(keys[i] >> 8*d) & 0xff]++;
        }
    }
    uint64_t * src = keys;
    uint64_t * dst = tmp.data();
    for (int d = 0; d < 8; ++d) {
        if (count[d][(keys[0] >> 8*d) & 0xff] == (uint32_t) n) {
            continue; // every key has this byte
        }
        uint32_t offset[256];
        uint32_t sum = 0;
        for (int b = 0; b < 256; ++b) {
            offset[b] = sum;
            sum += count[d][b];
        }
        for (int64_t i = 0; i < n; ++i) {
            dst[offset[(src[i] >> 8*d) & 0xff]++] = src[i];
        }
        std::swap(src, dst);
    }
    if (src != keys) {
        memcpy(keys, src, n*sizeof(uint64_t));
    }
}

// The sketch of coverage selection's proposal: the R channels of the packed keys k_far (nb blocks of D) with the most key
// energy (sum of squares, in double), and the keys in those channels only
static void h2o_coverage_sketch(std::vector<int32_t> & chan, std::vector<float> & k_sketch, const float * k_far, int64_t nb,
        int64_t D, int64_t R) {
    std::vector<double> energy(D, 0.0);
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t d = 0; d < D; ++d) {
            const float * kd = k_far + (b*D + d)*H2O_KB;
            double e = 0.0;
            for (int64_t j = 0; j < H2O_KB; ++j) {
                e += (double) kd[j]*kd[j];
            }
            energy[d] += e;
        }
    }
    chan.resize(R);
    h2o_strongest_channels(chan.data(), energy.data(), D, R);
    k_sketch.resize((size_t) nb*R*H2O_KB);
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t c = 0; c < R; ++c) {
            memcpy(k_sketch.data() + (b*R + c)*H2O_KB, k_far + (b*D + chan[c])*H2O_KB, H2O_KB*sizeof(float));
        }
    }
}

template <typename KRow>
static H2O_NOINLINE void h2o_coverage_estimate(const ggml_tensor * q, int64_t ih, int64_t ikv, int32_t p0, int32_t cs,
        int32_t i_begin, int32_t q_end, int64_t ti_begin, int64_t ti_end, const h2o_head_logits & lg, int32_t every,
        int32_t sketch, KRow && k_row, const std::vector<int32_t> & forced,
        int32_t cand_begin, int32_t cand_end, int32_t n_rank, int32_t n_steps,
        std::vector<int32_t> * ranked, double * curve, int64_t stride,
        int64_t Dv, int32_t tail_start, const float * k_chunk, const float * v_chunk, float * acc_tiles, int64_t acc_stride,
        float * o_intra, h2o_row_part * part_intra,
        h2o_coverage_scratch & w, h2o_tile_scratch & s) {
    const int64_t D  = q->ne[0];
    const int64_t t_first = cs + (int64_t) (i_begin - cs)/H2O_QT*H2O_QT;

    // the sampled rows of each tile, or its last row when it has none
    w.rows.clear();
    w.tile.clear();
    for (int64_t ti = ti_begin; ti < ti_end; ++ti) {
        const int64_t t0 = t_first + ti*H2O_QT;
        const int64_t r0 = std::max<int64_t>(t0, i_begin);
        const int64_t r1 = std::min<int64_t>(t0 + H2O_QT, q_end);
        const size_t before = w.rows.size();
        for (int64_t i = r0; i < r1; ++i) {
            if ((i - t0) % every == every - 1) {
                w.rows.push_back(i);
                w.tile.push_back((int32_t) ti);
            }
        }
        if (w.rows.size() == before) {
            w.rows.push_back(r1 - 1);
            w.tile.push_back((int32_t) ti);
        }
    }
    const int64_t n_s = (int64_t) w.rows.size();

    // the keys (and their sketch), packed once for the heads that share them (w.far_ikv and w.far_end say which are there)
    const int64_t R = D/sketch;
    if (w.far_ikv != ikv || w.far_end != q_end) {
        w.k_far.resize((size_t) h2o_n_blocks(q_end)*D*H2O_KB);
        for (int64_t s0 = 0; s0 < q_end; s0 += H2O_TAIL_SPAN) {
            h2o_pack_k(w.k_far.data() + (s0/H2O_KB)*D*H2O_KB, std::min<int64_t>(H2O_TAIL_SPAN, q_end - s0), D,
                    [&](int64_t j) { return k_row(s0 + j); });
        }
        if (R < D) {
            h2o_coverage_sketch(w.chan, w.k_sketch, w.k_far.data(), h2o_n_blocks(q_end), D, R);
        }
        w.far_ikv = ikv;
        w.far_end = q_end;
    }
    const float * k_prop = R < D ? w.k_sketch.data() : w.k_far.data();
    // a tile's samples (at most H2O_QT) at a time, so that their attention rows stay small: many samples over a long
    // prompt would otherwise stream through memory several times
    w.p.resize((size_t) H2O_QT*cs);
    w.q_samp.resize((size_t) H2O_QT*R);

    const int32_t n_cand = cand_end - cand_begin;
    w.score.resize(n_cand);
    w.order.resize(n_cand);
    w.key  .resize(n_cand);
    w.slot .resize(n_cand);
    for (int64_t ti = ti_begin, r_first = 0; ti < ti_end; ++ti) {
        int64_t r_end = r_first;
        while (r_end < n_s && w.tile[r_end] == ti) {
            ++r_end;
        }
        // the samples' logits against every position before the chunk (exact, or in the sketch's R channels), a key
        // block at a time into their rows; then each one's attention over them
        for (int64_t r = r_first; r < r_end; ++r) {
            const float * qr = (const float *) ((const char *) q->data + (w.rows[r] - p0)*q->nb[2] + ih*q->nb[1]);
            float * qs = w.q_samp.data() + (r - r_first)*R;
            if (R < D) {
                for (int64_t c = 0; c < R; ++c) {
                    qs[c] = qr[w.chan[c]]*lg.scale;
                }
            } else {
                ggml_vec_scale_f32((int) D, (float *) memcpy(qs, qr, D*sizeof(float)), lg.scale);
            }
        }
        w.mx.resize(r_end - r_first);
        h2o_sample_logits(w.p.data(), cs, w.mx.data(), w.q_samp.data(), r_end - r_first, R, k_prop, cs, lg.softcap);

        // stage 1: the candidates with the most of the samples' attention, ties to the lower position, NaN last. Each
        // sample's attention goes into the scores right after its softmax, while its row is in cache, a block at a time
        std::fill(w.score.begin(), w.score.end(), 0.0f);
        for (int64_t r = r_first; r < r_end; ++r) {
            float * pr = w.p.data() + (r - r_first)*cs;
            const ggml_float z = ggml_vec_soft_max_f32((int) cs, pr, pr, w.mx[r - r_first]);
            const float f = (float) (1.0/z);
            for (int32_t j0 = 0; j0 < n_cand; j0 += H2O_TAIL_SPAN) {
                const int n = (int) std::min<int64_t>(H2O_TAIL_SPAN, n_cand - j0);
                ggml_vec_scale_f32(n, pr + cand_begin + j0, f);
                ggml_vec_acc_f32(n, w.score.data() + j0, pr + cand_begin + j0);
            }
        }
        for (int32_t j = 0; j < n_cand; ++j) {
            w.key[j] = h2o_rank_key(w.score[j], j);
        }
        std::nth_element(w.key.begin(), w.key.begin() + n_rank, w.key.begin() + n_cand);
        h2o_sort_keys(w.key.data(), n_rank);
        std::vector<int32_t> & rk = ranked[ti];
        rk.resize(n_rank);
        for (int32_t m = 0; m < n_rank; ++m) {
            rk[m] = cand_begin + (int32_t) (uint32_t) w.key[m];
        }

        // stage 2: every query of the tile against its chunk (up to the diagonal): the intra part of its output, kept;
        // then against the forced positions and the candidates; a softmax over all those keys per query
        const int64_t t0   = t_first + ti*H2O_QT;
        const int64_t r0   = std::max<int64_t>(t0, i_begin);
        const int64_t r1   = std::min<int64_t>(t0 + H2O_QT, q_end);
        const int64_t rows = r1 - r0;
        const int64_t n_f  = (int64_t) forced.size();
        const int64_t n2   = n_f + n_rank;
        const int64_t nb2  = h2o_n_blocks(n2);
        w.k_cand.resize((size_t) nb2*D*H2O_KB);
        w.x_cand.resize((size_t) nb2*H2O_QT*H2O_KB);
        h2o_pack_k(w.k_cand.data(), n2, D, [&](int64_t m) { return k_row(m < n_f ? forced[m] : rk[m - n_f]); });
        h2o_tile_intra(q, ih, p0, cs, r0, r1, Dv, lg, tail_start, k_chunk, v_chunk, acc_tiles + ti*acc_stride, s);
        memcpy(o_intra + ti*H2O_QT*Dv, s.o_tile.data(), rows*Dv*sizeof(float));
        std::copy(s.part_intra.begin(), s.part_intra.begin() + rows, part_intra + ti*H2O_QT);
        h2o_logits(w.x_cand.data(), s.q_tile.data(), rows, D, w.k_cand.data(), nb2, lg.softcap);
        w.score2.assign(n_rank, 0.0f);
        w.col.assign(n_rank, 0.0);
        // the estimate before any budget step: the mean attention on the chunk and the forced positions
        double covered = 0.0;
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t m = n2; m < nb2*H2O_KB; ++m) {
                w.x_cand[(m/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + m%H2O_KB] = -INFINITY;
            }
            const h2o_row_part & a = s.part_intra[r];
            const h2o_row_part   b = h2o_row_softmax(w.x_cand.data(), r, nb2*H2O_KB);
            // both parts as one softmax: exp(x - max) rescaled to the common maximum, over the common sum
            const float mx = std::max(a.m, b.m);
            const float ea = expf(a.m - mx);
            const float eb = expf(b.m - mx);
            const float l  = a.l*ea + b.l*eb;
            double base = (double) (a.l*ea/l);
            for (int64_t m = 0; m < n_f; ++m) {
                base += (double) (w.x_cand[(m/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + m%H2O_KB]*eb/l);
            }
            covered += base;
            const float f = eb/l;
            for (int64_t m = n_f; m < n2; ) {
                const int64_t n = std::min(H2O_KB - m%H2O_KB, n2 - m);
                float  * x  = w.x_cand.data() + (m/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + m%H2O_KB;
                float  * sc = w.score2.data() + (m - n_f);
                double * cl = w.col.data()    + (m - n_f);
                for (int64_t j = 0; j < n; ++j) {
                    x[j]  *= f;
                    sc[j] += x[j];
                    cl[j] += (double) x[j];
                }
                m += n;
            }
        }
        // the candidates by the whole tile's attention, ties to the lower position, NaN last
        for (int32_t m = 0; m < n_rank; ++m) {
            w.key[m] = h2o_rank_key(w.score2[m], rk[m] - cand_begin);
            w.slot[rk[m] - cand_begin] = m;
        }
        h2o_sort_keys(w.key.data(), n_rank);
        for (int32_t m = 0; m < n_rank; ++m) {
            w.order[m] = w.slot[(uint32_t) w.key[m]];
        }

        // the estimate after each budget step, then the ranking in its final order
        double * cu = curve + ti*stride;
        for (int32_t g = 0; g <= n_steps; ++g) {
            if (g > 0) {
                for (int32_t m = (g - 1)*GGML_H2O_BUDGET_STEP; m < std::min(g*GGML_H2O_BUDGET_STEP, n_rank); ++m) {
                    covered += w.col[w.order[m]];
                }
            }
            cu[g] = covered/(double) rows;
        }
        std::vector<int32_t> stage1(rk.begin(), rk.end());
        for (int32_t m = 0; m < n_rank; ++m) {
            rk[m] = stage1[w.order[m]];
        }
        r_first = r_end;
    }
}

// Budget steps of every unit (head h, tile t: unit h*n_t + t): `total` steps, one at a time, to the unit whose estimate
// gains most, ties to the lower unit, among units below `coverage` that can take one more.
static void h2o_coverage_allocate(std::vector<int32_t> & given, const double * curves, int64_t stride, int64_t n_units,
        int32_t n_steps, int64_t total, float coverage) {
    given.assign(n_units, 0);
    struct gain {
        double  g;
        int64_t u;
        bool operator<(const gain & o) const { return g < o.g || (g == o.g && u > o.u); }
    };
    std::priority_queue<gain> queue;
    const auto offer = [&](int64_t u) {
        const double * cu = curves + u*stride;
        const int32_t  g  = given[u];
        if (g < n_steps && cu[g] < (double) coverage) {
            queue.push({ cu[g + 1] - cu[g], u });
        }
    };
    for (int64_t u = 0; u < n_units; ++u) {
        offer(u);
    }
    for (; total > 0 && !queue.empty(); --total) {
        const int64_t u = queue.top().u;
        queue.pop();
        given[u] += 1;
        offer(u);
    }
}

// What the threads share of coverage selection's work buffer, in two sets (even and odd chunks), so that a thread
// working on the next chunk never overwrites what a slower one still reads. Per unit (head h, tile t: h*n_tiles + t):
struct h2o_coverage_shared {
    double  * curves;  // [stride]: the estimate after 0 .. n_steps budget steps
    float   * cols;    // [S]: the column sums of the tile's intra part (chunk offsets)
    int32_t * mem_pos; // [mem_max]: the tile's memory, ascending
    float   * mem_sum; // [mem_max]: its column sums
    int32_t * n_mem;   // its size
};

// the two sets in wdata (none: nullptr); returns their size
static size_t h2o_coverage_layout(h2o_coverage_shared * sets, void * wdata, int64_t n_units, int64_t stride, int64_t S,
        int64_t mem_max) {
    char * p = (char *) wdata;
    size_t size = 0;
    for (int set = 0; set < 2; ++set) {
        h2o_coverage_shared sh;
        sh.curves  = (double  *) (p + size); size += (size_t) n_units*stride*sizeof(double);
        sh.cols    = (float   *) (p + size); size += (size_t) n_units*S*sizeof(float);
        sh.mem_pos = (int32_t *) (p + size); size += (size_t) n_units*mem_max*sizeof(int32_t);
        sh.mem_sum = (float   *) (p + size); size += (size_t) n_units*mem_max*sizeof(float);
        sh.n_mem   = (int32_t *) (p + size); size += (size_t) n_units*sizeof(int32_t);
        size = GGML_PAD(size, sizeof(double));
        if (sets) {
            sets[set] = sh;
        }
    }
    return size;
}

size_t ggml_h2o_attn_coverage_work_size(const ggml_tensor * dst) {
    if (ggml_get_op_params_i32(dst, 7) != GGML_H2O_SELECT_COVERAGE) {
        return 0;
    }
    const int64_t S       = ggml_get_op_params_i32(dst, 1);
    const int64_t L       = ggml_get_op_params_i32(dst, 2);
    const int64_t H       = ggml_get_op_params_i32(dst, 3);
    const int64_t n_sink  = ggml_get_op_params_i32(dst, 8);
    const int64_t n_head  = dst->src[0]->ne[1];
    const int64_t stride  = (GGML_H2O_MAX_HEAVY_FACTOR*H + GGML_H2O_BUDGET_STEP - 1)/GGML_H2O_BUDGET_STEP + 1;
    const int64_t n_tiles = (S + H2O_QT - 1)/H2O_QT;
    const int64_t mem_max = n_sink + L + GGML_H2O_MAX_HEAVY_FACTOR*H;
    return h2o_coverage_layout(nullptr, nullptr, n_head*n_tiles, stride, S, mem_max);
}

// One call of GGML_OP_H2O_ATTN with coverage selection: its tensors, parameters and shapes, the thread's buffers, the
// chunk being walked, and the steps each chunk takes, a barrier between the estimates and the budget and after the
// attention (ggml_compute_forward_h2o_attn_coverage).
struct h2o_coverage_call {
    const ggml_compute_params * params;
    ggml_tensor * dst;

    const ggml_tensor * q;
    const ggml_tensor * k;
    const ggml_tensor * v;
          ggml_tensor * scores;
          ggml_tensor * mem_idx;
          ggml_tensor * acc;

    int32_t p0;
    int32_t S;
    int32_t L;
    int32_t H;
    int32_t mem_chunk0;
    int32_t acc_chunk0;
    int32_t n_sink;
    int32_t tail_start;
    float   coverage;
    int32_t every;  // a sampled query in every `every`
    int32_t sketch; // the proposal's logits over D/sketch channels

    int64_t D;
    int64_t Dv;
    int64_t n_head;
    int64_t n_tokens;
    int64_t n_head_kv;
    int64_t n_gqa;
    int64_t kv_size;
    int32_t M;
    int32_t p1;

    int32_t n_steps_max;
    int64_t n_tiles;
    int64_t stride;
    int64_t nb_chunk;
    int64_t mem_max;
    int64_t nb_mem_max;
    h2o_coverage_shared shared[2];

    h2o_row_type kt;
    h2o_row_type vt;

    // A head's state (its scores, memory set and sums) is one thread's, a contiguous range of heads. The estimates and
    // the attention go in units of one head's tile, a contiguous range of units per thread (the same in steps 1 and 3,
    // which keep a tile's intra part on the thread that computed it), so that nine heads on two threads are not four
    // and five; heads sharing a KV head (GQA) mostly share a thread and the packed keys of step 1. A unit's column sums
    // go to the shared buffers, and the head's thread adds them to its state in tile order.
    int64_t head_begin;
    int64_t head_end;

    // the thread's buffers, kept across calls
    struct buffers {
        std::vector<float> k_chunk;
        std::vector<float> v_chunk;
        std::vector<float> k_mem;
        std::vector<float> v_mem;
        std::vector<int32_t> masked;
        std::vector<int32_t> memory;     // one tile's memory, ascending
        std::vector<float> far_sums;     // per position before the chunk: column sums of all its tiles
        std::vector<int32_t> forced;     // sinks and local window
        std::vector<int32_t> given;      // budget steps of every unit
        std::vector<std::vector<int32_t>> ranked; // [head][tile]
        std::vector<int32_t> mem_chunk;  // per head, as in the other policies
        std::vector<int32_t> acc_chunk;
        std::vector<float> o_intra;      // [head][tile][H2O_QT][Dv]: each tile's intra part, from step 1
        std::vector<h2o_row_part> part_intra; // [head][tile][H2O_QT]
        h2o_coverage_scratch est;
        h2o_tile_scratch tile;
        h2o_span_scratch span;
    };
    static buffers & thread_buffers() {
        thread_local buffers b;
        return b;
    }
    std::vector<float> & k_chunk;
    std::vector<float> & v_chunk;
    std::vector<float> & k_mem;
    std::vector<float> & v_mem;
    std::vector<int32_t> & masked;
    std::vector<int32_t> & memory;
    std::vector<float> & far_sums;
    std::vector<int32_t> & forced;
    std::vector<int32_t> & given;
    std::vector<std::vector<int32_t>> & ranked;
    std::vector<int32_t> & mem_chunk;
    std::vector<int32_t> & acc_chunk;
    std::vector<float> & o_intra;
    std::vector<h2o_row_part> & part_intra;
    h2o_coverage_scratch & est;
    h2o_tile_scratch & tile;
    h2o_span_scratch & span;

    // the chunk being walked (begin_chunk)
    int32_t c = 0;
    int32_t cs = 0;
    int32_t ce = 0;
    int32_t q_end = 0;
    int32_t i_begin = 0;
    bool    has_memory = false;
    int64_t t_first = 0;
    int64_t n_t = 0;
    int64_t n_units = 0;
    int64_t u_begin = 0;
    int64_t u_end = 0;
    const h2o_coverage_shared * chunk_shared = nullptr; // shared[c % 2]
    int32_t local_start = 0;
    int32_t sink_end = 0;
    int32_t heavy = 0;
    int32_t n_rank = 0;
    int32_t n_steps = 0;

    h2o_coverage_call(const ggml_compute_params * params, ggml_tensor * dst) :
        params(params), dst(dst),
        q(dst->src[0]), k(dst->src[1]), v(dst->src[2]), scores(dst->src[3]), mem_idx(dst->src[4]), acc(dst->src[5]),
        p0(ggml_get_op_params_i32(dst, 0)), S(ggml_get_op_params_i32(dst, 1)), L(ggml_get_op_params_i32(dst, 2)),
        H(ggml_get_op_params_i32(dst, 3)), mem_chunk0(ggml_get_op_params_i32(dst, 4)),
        acc_chunk0(ggml_get_op_params_i32(dst, 5)), n_sink(ggml_get_op_params_i32(dst, 8)),
        tail_start(ggml_get_op_params_i32(dst, 9)), coverage(ggml_get_op_params_f32(dst, 10)),
        every(H2O_QT/ggml_get_op_params_i32(dst, 11)), sketch(ggml_get_op_params_i32(dst, 13)),
        D(q->ne[0]), Dv(v->ne[0]), n_head(q->ne[1]), n_tokens(q->ne[2]), n_head_kv(k->ne[1]),
        n_gqa(n_head/n_head_kv), kv_size(scores->ne[0]), M(L + H), p1(p0 + (int32_t) n_tokens),
        n_steps_max((GGML_H2O_MAX_HEAVY_FACTOR*H + GGML_H2O_BUDGET_STEP - 1)/GGML_H2O_BUDGET_STEP),
        n_tiles((S + H2O_QT - 1)/H2O_QT), stride(n_steps_max + 1), nb_chunk(h2o_n_blocks(S)),
        mem_max((int64_t) n_sink + L + (int64_t) GGML_H2O_MAX_HEAVY_FACTOR*H), nb_mem_max(h2o_n_blocks(mem_max)),
        kt(k->type), vt(v->type),
        head_begin(n_head*params->ith/params->nth), head_end(n_head*(params->ith + 1)/params->nth),
        k_chunk(thread_buffers().k_chunk), v_chunk(thread_buffers().v_chunk), k_mem(thread_buffers().k_mem),
        v_mem(thread_buffers().v_mem), masked(thread_buffers().masked), memory(thread_buffers().memory),
        far_sums(thread_buffers().far_sums), forced(thread_buffers().forced), given(thread_buffers().given),
        ranked(thread_buffers().ranked), mem_chunk(thread_buffers().mem_chunk), acc_chunk(thread_buffers().acc_chunk),
        o_intra(thread_buffers().o_intra), part_intra(thread_buffers().part_intra), est(thread_buffers().est),
        tile(thread_buffers().tile), span(thread_buffers().span) {
        GGML_ASSERT(k->nb[0] == ggml_type_size(k->type) && v->nb[0] == ggml_type_size(v->type) && q->nb[0] == sizeof(float));
        GGML_ASSERT(params->wsize >= ggml_h2o_attn_coverage_work_size(dst));
        h2o_coverage_layout(shared, params->wdata, n_head*n_tiles, stride, S, mem_max);

        k_chunk.resize((size_t) nb_chunk*D*H2O_KB);
        v_chunk.resize((size_t) nb_chunk*H2O_KB*Dv);
        k_mem  .resize((size_t) nb_mem_max*D*H2O_KB);
        v_mem  .resize((size_t) nb_mem_max*H2O_KB*Dv);
        tile.reserve(D, Dv, nb_chunk, nb_mem_max);
        span.reserve(D, Dv);
        ranked.resize((size_t) n_head*n_tiles);
        est.far_ikv = -1; // keys packed by an earlier call are not this call's
        o_intra.resize((size_t) n_head*n_tiles*H2O_QT*Dv);
        part_intra.resize((size_t) n_head*n_tiles*H2O_QT);
        mem_chunk.assign(n_head, mem_chunk0);
        acc_chunk.assign(n_head, acc_chunk0);
    }

    h2o_row k_row(int64_t pos, int64_t ikv) const {
        return h2o_row { (const char *) k->data + pos*k->nb[2] + ikv*k->nb[1], &kt };
    }
    h2o_row v_row(int64_t pos, int64_t ikv) const {
        return h2o_row { (const char *) v->data + pos*v->nb[2] + ikv*v->nb[1], &vt };
    }
    void head_state(int64_t ih, ggml_bf16_t ** sc, int32_t ** mem, float ** acc_intra) const {
        *sc        = (ggml_bf16_t *) ((char *) scores->data  + ih*scores->nb[1]);
        *mem       = (int32_t     *) ((char *) mem_idx->data + ih*mem_idx->nb[1]);
        *acc_intra = (float       *) ((char *) acc->data     + ih*acc->nb[1]);
    }

    // the chunk c: its queries' range, this thread's units, its shared buffers, the memory's fixed part
    void begin_chunk(int32_t chunk) {
        c          = chunk;
        cs         = c*S;
        ce         = cs + S;
        q_end      = std::min(p1, ce);
        i_begin    = std::max(p0, cs);
        has_memory = c >= 1;
        t_first    = cs + (int64_t) (i_begin - cs)/H2O_QT*H2O_QT;
        n_t        = (q_end - t_first + H2O_QT - 1)/H2O_QT;
        n_units    = n_head*n_t;
        u_begin    = n_units*params->ith/params->nth;
        u_end      = n_units*(params->ith + 1)/params->nth;
        chunk_shared = &shared[c % 2];

        local_start = std::max(cs - L, 0);
        sink_end    = std::min(n_sink, local_start);
        heavy       = std::max(H - sink_end, 0);
        n_rank      = std::min(local_start - sink_end, GGML_H2O_MAX_HEAVY_FACTOR*H);
        n_steps     = (n_rank + GGML_H2O_BUDGET_STEP - 1)/GGML_H2O_BUDGET_STEP;
        forced.clear();
        for (int32_t pos = 0; pos < sink_end; ++pos) {
            forced.push_back(pos);
        }
        for (int32_t pos = local_start; pos < cs; ++pos) {
            forced.push_back(pos);
        }
    }

    // tile ti: its rows r0 .. r1; its queries' intra part reaches the chunk offsets 0 .. r1 - cs
    void tile_rows(int64_t ti, int64_t & r0, int64_t & r1) const {
        r0 = std::max<int64_t>(t_first + ti*H2O_QT, i_begin);
        r1 = std::min<int64_t>(t_first + (ti + 1)*H2O_QT, q_end);
    }

    // 0. bookkeeping of this thread's heads
    void bookkeep_heads() {
        for (int64_t ih = head_begin; ih < head_end; ++ih) {
            ggml_bf16_t * sc; int32_t * mem; float * acc_intra;
            head_state(ih, &sc, &mem, &acc_intra);
            // chunks completed outside a prefill (by decode) get their sums now; their memory is chosen by the next
            while (mem_chunk[ih] < c - 1) {
                const int32_t kc = mem_chunk[ih] + 1;
                if (acc_chunk[ih] == kc) {
                    h2o_settle(sc, acc_intra, mem, S, M, kv_size, kc, mem_chunk[ih] == kc - 1);
                    acc_chunk[ih] = -1;
                }
                mem_chunk[ih] = kc;
            }
            if (acc_chunk[ih] != c) {
                std::fill(acc_intra, acc_intra + S + M, 0.0f);
                acc_chunk[ih] = c;
            }
        }
    }

    // 1. the estimates of this thread's units (a run of tiles of one head at a time), their intra parts kept
    void estimate_units() {
        const h2o_coverage_shared & sh = *chunk_shared;
        for (int64_t u = u_begin; u < u_end; ) {
            const int64_t ih       = u/n_t;
            const int64_t ikv      = ih/n_gqa;
            const int64_t ti_begin = u % n_t;
            const int64_t ti_end   = std::min(n_t, ti_begin + (u_end - u));
            h2o_pack_k(k_chunk.data(), q_end - cs, D,  [&](int64_t j) { return k_row(cs + j, ikv); });
            h2o_pack_v(v_chunk.data(), q_end - cs, Dv, [&](int64_t j) { return v_row(cs + j, ikv); });
            for (int64_t ti = ti_begin; ti < ti_end; ++ti) {
                int64_t r0, r1;
                tile_rows(ti, r0, r1);
                std::fill_n(sh.cols + (ih*n_tiles + ti)*S, r1 - cs, 0.0f);
            }
            h2o_coverage_estimate(q, ih, ikv, p0, cs, i_begin, q_end, ti_begin, ti_end, h2o_logits_of(dst, ih), every,
                    sketch, [&](int64_t pos) { return k_row(pos, ikv); },
                    forced, sink_end, local_start, n_rank, n_steps, ranked.data() + ih*n_tiles,
                    sh.curves + ih*n_tiles*stride, stride, Dv, tail_start, k_chunk.data(), v_chunk.data(),
                    sh.cols + ih*n_tiles*S, S,
                    o_intra.data() + ih*n_tiles*H2O_QT*Dv, part_intra.data() + ih*n_tiles*H2O_QT, est, tile);
            u += ti_end - ti_begin;
        }
    }

    // 2. one budget over all heads' tiles
    void allocate_budget() {
        const h2o_coverage_shared & sh = *chunk_shared;
        // units h*n_t + t: the curves of head h start at h*n_tiles
        std::vector<double> packed((size_t) n_head*n_t*stride);
        for (int64_t ih = 0; ih < n_head; ++ih) {
            memcpy(packed.data() + ih*n_t*stride, sh.curves + ih*n_tiles*stride, n_t*stride*sizeof(double));
        }
        h2o_coverage_allocate(given, packed.data(), stride, n_head*n_t, n_steps,
                n_head*n_t*heavy/GGML_H2O_BUDGET_STEP, coverage);
    }

    // 3. every unit of this thread attends to its own memory, merged with its intra part from step 1 (without a
    //    memory: to its chunk); the column sums and the memory go to the shared buffers
    void attend_units() {
        const h2o_coverage_shared & sh = *chunk_shared;
        int64_t chunk_head = -1; // without a memory: the head whose chunk k_chunk and v_chunk hold
        for (int64_t u = u_begin; u < u_end; ++u) {
            const int64_t ih   = u/n_t;
            const int64_t ti   = u % n_t;
            const int64_t ikv  = ih/n_gqa;
            const int64_t unit = ih*n_tiles + ti;
            const h2o_head_logits lg = h2o_logits_of(dst, ih);
            int64_t r0, r1;
            tile_rows(ti, r0, r1);
            if (!has_memory) {
                if (chunk_head != ih) {
                    h2o_pack_k(k_chunk.data(), q_end - cs, D,  [&](int64_t j) { return k_row(cs + j, ikv); });
                    h2o_pack_v(v_chunk.data(), q_end - cs, Dv, [&](int64_t j) { return v_row(cs + j, ikv); });
                    chunk_head = ih;
                }
                std::fill_n(sh.cols + unit*S, r1 - cs, 0.0f);
                h2o_attend_tile(dst, q, ih, p0, cs, r0, r1, lg, tail_start, k_chunk.data(), v_chunk.data(),
                        nullptr, nullptr, 0, 0, masked, sh.cols + unit*S, nullptr, tile);
                continue;
            }
            const std::vector<int32_t> & rk = ranked[unit];
            // the sinks, the first n ranked positions (which lie between them and the window) ascending, the window
            const auto memory_of = [&](int32_t n) {
                memory.assign(forced.begin(), forced.begin() + sink_end);
                memory.insert(memory.end(), rk.begin(), rk.begin() + n);
                std::sort(memory.begin() + sink_end, memory.end());
                memory.insert(memory.end(), forced.begin() + sink_end, forced.end());
            };
            memory_of(std::min(given[ih*n_t + ti]*GGML_H2O_BUDGET_STEP, n_rank));
            const int64_t n_mem = (int64_t) memory.size();
            h2o_pack_k(k_mem.data(), n_mem, D,  [&](int64_t m) { return k_row(memory[m], ikv); });
            h2o_pack_v(v_mem.data(), n_mem, Dv, [&](int64_t m) { return v_row(memory[m], ikv); });
            masked.clear();
            for (int64_t m = n_mem; m < h2o_n_blocks(n_mem)*H2O_KB; ++m) {
                masked.push_back((int32_t) m);
            }
            float * mem_sums = sh.mem_sum + unit*mem_max;
            std::fill_n(mem_sums, n_mem, 0.0f);
            std::copy(memory.begin(), memory.end(), sh.mem_pos + unit*mem_max);
            sh.n_mem[unit] = (int32_t) n_mem;
            h2o_load_q(tile.q_tile.data(), q, ih, p0, r0, r1, lg.scale);
            h2o_tile_memory(r0, r1 - r0, D, Dv, lg, tail_start, k_mem.data(), v_mem.data(), n_mem, h2o_n_blocks(n_mem),
                    masked, mem_sums, tile);
            h2o_tile_merge(dst, ih, p0, r0, r1 - r0, lg, o_intra.data() + unit*H2O_QT*Dv,
                    part_intra.data() + unit*H2O_QT, true, tile);
            if (ti == n_t - 1) {
                // the memory set kept: the last tile's at the average budget
                ggml_bf16_t * sc; int32_t * mem; float * acc_intra;
                head_state(ih, &sc, &mem, &acc_intra);
                memory_of(std::min(heavy, n_rank));
                for (int32_t m = 0; m < M; ++m) {
                    mem[m] = m < (int32_t) memory.size() ? memory[m] : -1;
                }
            }
        }
    }

    // 4. the column sums of every tile of this thread's heads, in tile order, into their state
    void add_column_sums() {
        const h2o_coverage_shared & sh = *chunk_shared;
        for (int64_t ih = head_begin; ih < head_end; ++ih) {
            ggml_bf16_t * sc; int32_t * mem; float * acc_intra;
            head_state(ih, &sc, &mem, &acc_intra);
            for (int64_t ti = 0; ti < n_t; ++ti) {
                int64_t r0, r1;
                tile_rows(ti, r0, r1);
                ggml_vec_acc_f32((int) (r1 - cs), acc_intra, sh.cols + (ih*n_tiles + ti)*S);
            }
            if (has_memory) {
                // the memory sums into the scores at once (tiles share positions)
                far_sums.assign(cs, 0.0f);
                for (int64_t ti = 0; ti < n_t; ++ti) {
                    const int64_t  unit = ih*n_tiles + ti;
                    const int32_t * pos = sh.mem_pos + unit*mem_max;
                    const float   * sum = sh.mem_sum + unit*mem_max;
                    for (int32_t m = 0; m < sh.n_mem[unit]; ++m) {
                        far_sums[pos[m]] += sum[m];
                    }
                }
                for (int32_t pos = 0; pos < cs && pos < kv_size; ++pos) {
                    if (far_sums[pos] != 0.0f) {
                        sc[pos] = GGML_FP32_TO_BF16(GGML_BF16_TO_FP32(sc[pos]) + far_sums[pos]);
                    }
                }
                std::fill(acc_intra + S, acc_intra + S + M, 0.0f);
                mem_chunk[ih] = c - 1;
            }
            if (p1 >= ce) {
                h2o_settle(sc, acc_intra, mem, S, M, kv_size, c, false);
                acc_chunk[ih] = -1;
                mem_chunk[ih] = c;
            }
        }
    }

    // this thread's heads, whose tail rows step 3 wrote before the last barrier
    void dense_tails() {
        for (int64_t ih = head_begin; ih < head_end; ++ih) {
            const int64_t ikv = ih/n_gqa;
            h2o_dense_tail(dst, q, ih, p0, p1, tail_start, h2o_logits_of(dst, ih),
                    [&](int64_t pos) { return k_row(pos, ikv); }, [&](int64_t pos) { return v_row(pos, ikv); }, tile, span);
        }
    }
};

static void ggml_compute_forward_h2o_attn_coverage(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
    h2o_coverage_call call(params, dst);

    for (int32_t c = call.p0/call.S; c <= (call.p1 - 1)/call.S; ++c) {
        call.begin_chunk(c);
        call.bookkeep_heads();
        if (call.has_memory) {
            call.estimate_units();
            ggml_barrier(params->threadpool);
            call.allocate_budget();
        }
        call.attend_units();
        ggml_barrier(params->threadpool);
        call.add_column_sums();
    }
    call.dense_tails();
}

void ggml_compute_forward_h2o_attn(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
    const ggml_tensor * q       = dst->src[0];
    const ggml_tensor * k       = dst->src[1];
    const ggml_tensor * v       = dst->src[2];
          ggml_tensor * scores  = dst->src[3];
          ggml_tensor * mem_idx = dst->src[4];
          ggml_tensor * acc     = dst->src[5];

    const int32_t p0         = ggml_get_op_params_i32(dst, 0);
    const int32_t S          = ggml_get_op_params_i32(dst, 1);
    const int32_t L          = ggml_get_op_params_i32(dst, 2);
    const int32_t H          = ggml_get_op_params_i32(dst, 3);
    const int32_t mem_chunk0 = ggml_get_op_params_i32(dst, 4);
    const int32_t acc_chunk0 = ggml_get_op_params_i32(dst, 5);
    const float   scale      = ggml_get_op_params_f32(dst, 6);
    const int32_t select     = ggml_get_op_params_i32(dst, 7);
    const int32_t n_sink     = ggml_get_op_params_i32(dst, 8);
    const int32_t tail_start = ggml_get_op_params_i32(dst, 9);

    if (select == GGML_H2O_SELECT_COVERAGE) {
        ggml_compute_forward_h2o_attn_coverage(params, dst);
        return;
    }

    const bool by_query = select == GGML_H2O_SELECT_QUERY || select == GGML_H2O_SELECT_QUERY_MEAN ||
        select == GGML_H2O_SELECT_HYBRID;

    const int64_t D         = q->ne[0];
    const int64_t Dv        = v->ne[0];
    const int64_t n_head    = q->ne[1];
    const int64_t n_tokens  = q->ne[2];
    const int64_t n_head_kv = k->ne[1];
    const int64_t n_gqa     = n_head/n_head_kv;
    const int64_t kv_size   = scores->ne[0];
    const int32_t M         = L + H;
    const int32_t p1        = p0 + (int32_t) n_tokens;

    GGML_ASSERT(k->nb[0] == ggml_type_size(k->type) && v->nb[0] == ggml_type_size(v->type) && q->nb[0] == sizeof(float));

    const int64_t nb_chunk  = h2o_n_blocks(S);
    const int64_t nb_memory = h2o_n_blocks(M);

    // per-thread scratch, reused across calls
    thread_local std::vector<float> k_chunk;  // K of the chunk, packed
    thread_local std::vector<float> v_chunk;  // V of the chunk, F32
    thread_local std::vector<float> k_mem;    // K of the memory set, packed
    thread_local std::vector<float> v_mem;    // V of the memory set, F32
    thread_local std::vector<int32_t> masked; // memory slots (and padding) no query may attend to
    thread_local std::vector<int64_t> sample; // query rows that choose a query-aware memory
    thread_local std::vector<float> q_sample; // [sample][D], pre-scaled
    thread_local h2o_block_summary blocks;
    thread_local h2o_tile_scratch tile;
    thread_local h2o_span_scratch span;
    k_chunk.resize((size_t) nb_chunk*D*H2O_KB);
    v_chunk.resize((size_t) nb_chunk*H2O_KB*Dv);
    k_mem  .resize((size_t) nb_memory*D*H2O_KB);
    v_mem  .resize((size_t) nb_memory*H2O_KB*Dv);
    tile.reserve(D, Dv, nb_chunk, nb_memory);
    span.reserve(D, Dv);

    const h2o_row_type kt(k->type);
    const h2o_row_type vt(v->type);
    const auto k_row = [&](int64_t pos, int64_t ikv) {
        return h2o_row { (const char *) k->data + pos*k->nb[2] + ikv*k->nb[1], &kt };
    };
    const auto v_row = [&](int64_t pos, int64_t ikv) {
        return h2o_row { (const char *) v->data + pos*v->nb[2] + ikv*v->nb[1], &vt };
    };

    // every query head walks the chunks of the batch on its own: heads are independent
    for (int64_t ih = params->ith; ih < n_head; ih += params->nth) {
        const int64_t ikv = ih/n_gqa;

        ggml_bf16_t * sc        = (ggml_bf16_t *) ((char *) scores->data  + ih*scores->nb[1]);
        int32_t     * mem       = (int32_t     *) ((char *) mem_idx->data + ih*mem_idx->nb[1]);
        float       * acc_intra = (float       *) ((char *) acc->data     + ih*acc->nb[1]);
        float       * acc_inter = acc_intra + S;

        int32_t mem_chunk = mem_chunk0;
        int32_t acc_chunk = acc_chunk0;

        blocks.reset();

        const auto settle = [&](int32_t c) {
            h2o_settle(sc, acc_intra, mem, S, M, kv_size, c, c >= 1 && mem_chunk == c - 1);
        };

        // M_c after chunk c; query-aware memories are chosen when the next chunk's queries are there instead
        const auto build = [&](int32_t c) {
            if (!by_query) {
                ggml_h2o_build_memory_set(sc, mem, L, H, n_sink, c*S, (c + 1)*S, mem_chunk >= 0 && mem_chunk == c - 1);
            }
            mem_chunk = c;
        };

        // the memory of chunk c from the queries of chunk c in this call
        const auto select_by_query = [&](int32_t c, int64_t i_begin, int64_t i_end) {
            // when a part of the chunk ran in an earlier call, with the memory chosen then, its memory sums go
            // with that memory (otherwise they are zero: the chunk's sums were just reset)
            for (int32_t m = 0; m < M; ++m) {
                const int32_t pos = mem[m];
                if (pos >= 0 && pos < kv_size && acc_inter[m] != 0.0f) {
                    sc[pos] = GGML_FP32_TO_BF16(GGML_BF16_TO_FP32(sc[pos]) + acc_inter[m]);
                }
            }
            std::fill(acc_inter, acc_inter + M, 0.0f);
            h2o_query_sample(sample, i_begin, i_end);
            q_sample.resize(sample.size()*D);
            for (size_t r = 0; r < sample.size(); ++r) {
                const float * qr = (const float *) ((const char *) q->data + (sample[r] - p0)*q->nb[2] + ih*q->nb[1]);
                ggml_vec_scale_f32((int) D, (float *) memcpy(q_sample.data() + r*D, qr, D*sizeof(float)), scale);
            }
            h2o_select_by_query(mem, M, L, H, n_sink, c*S, select == GGML_H2O_SELECT_QUERY_MEAN,
                    q_sample.data(), (int64_t) sample.size(), D, (const char *) k->data + ikv*k->nb[1], k->nb[2], kt,
                    select == GGML_H2O_SELECT_HYBRID ? sc : nullptr, blocks);
            mem_chunk = c - 1;
        };

        for (int32_t c = p0/S; c <= (p1 - 1)/S; ++c) {
            const int32_t cs = c*S;
            const int32_t ce = cs + S;

            // chunks completed outside a prefill (by decode) get their sums and memory sets now
            while (mem_chunk < c - 1) {
                const int32_t kc = mem_chunk + 1;
                if (acc_chunk == kc) {
                    settle(kc);
                    acc_chunk = -1;
                }
                build(kc);
            }
            if (acc_chunk != c) {
                // sums of a chunk that cannot continue any more (or none): start this one from zero
                std::fill(acc_intra, acc_intra + S + M, 0.0f);
                acc_chunk = c;
            }

            const bool    has_memory = c >= 1;
            const int32_t q_end      = std::min(p1, ce);

            if (has_memory && by_query) {
                select_by_query(c, std::max(p0, cs), q_end);
            }

            // K/V of the chunk's keys (positions cs .. q_end) and of the memory set M_{c-1}, as F32,
            // once per chunk; memory slots that are empty (or, defensively, not before the chunk)
            // stay zero and are masked out of the logits below
            h2o_pack_k(k_chunk.data(), q_end - cs, D,  [&](int64_t j) { return k_row(cs + j, ikv); });
            h2o_pack_v(v_chunk.data(), q_end - cs, Dv, [&](int64_t j) { return v_row(cs + j, ikv); });
            if (has_memory) {
                const auto in_memory = [&](int64_t m) { return mem[m] >= 0 && mem[m] < cs; };
                h2o_pack_k(k_mem.data(), M, D,  [&](int64_t m) { return in_memory(m) ? k_row(mem[m], ikv) : h2o_row{}; });
                h2o_pack_v(v_mem.data(), M, Dv, [&](int64_t m) { return in_memory(m) ? v_row(mem[m], ikv) : h2o_row{}; });
                // usually none: a memory set is full from chunk 1 on, and M is often a multiple of H2O_KB
                masked.clear();
                for (int64_t m = 0; m < nb_memory*H2O_KB; ++m) {
                    if (m >= M || !in_memory(m)) {
                        masked.push_back((int32_t) m);
                    }
                }
            }

            // query tiles aligned to the chunk, so that tile t's causal diagonal is key block t
            const int32_t i_begin = std::max(p0, cs);
            for (int64_t t0 = cs + (int64_t) (i_begin - cs)/H2O_QT*H2O_QT; t0 < q_end; t0 += H2O_QT) {
                const int64_t r0 = std::max<int64_t>(t0, i_begin); // first row computed
                const int64_t r1 = std::min<int64_t>(t0 + H2O_QT, q_end);
                h2o_attend_tile(dst, q, ih, p0, cs, r0, r1, h2o_logits_of(dst, ih), tail_start, k_chunk.data(), v_chunk.data(),
                        has_memory ? k_mem.data() : nullptr, v_mem.data(), M, nb_memory, masked, acc_intra, acc_inter, tile);
            }

            if (p1 >= ce) {
                settle(c);
                acc_chunk = -1;
                build(c);
            }
        }

        h2o_dense_tail(dst, q, ih, p0, p1, tail_start, h2o_logits_of(dst, ih),
                [&](int64_t pos) { return k_row(pos, ikv); }, [&](int64_t pos) { return v_row(pos, ikv); }, tile, span);
    }
}
