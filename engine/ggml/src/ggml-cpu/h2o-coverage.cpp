// GGML_OP_H2O_ATTN on the CPU with coverage selection: each tile of a chunk's queries gets a memory of its own,
// sized by how much of the tile's attention an estimate says it covers (see ggml_h2o_attn_set_coverage in ggml-h2o.h).

#include "ops.h"

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "h2o-common.h"
#include "h2o-tile.h"
#include "simd-gemm.h"
#include "ggml.h"
#include "vec.h"

#include <algorithm>
#include <queue>
#include <cfloat>
#include <cmath>

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
    // the chunk's pool (ggml_h2o_attn_set_coverage_pool), by candidate index (position - the first candidate)
    std::vector<int64_t> scan_rows;  // the scan's sampled rows
    std::vector<int32_t> scan_tile;  // the tile of each
    std::vector<float>   tile_mass;  // [tile][candidate]: the attention of each tile's scanned rows
    std::vector<float>   pool_mass;  // per candidate: summed over the chunk's tiles
    std::vector<int32_t> pool;       // the chunk's pool, ascending
    std::vector<uint8_t> in_pool;    // per candidate
    std::vector<float>   k_pool;     // its keys in the proposal's channels, packed [block][R][H2O_KB]
    std::vector<int32_t> own;        // what a tile adds to it, ascending
    std::vector<float>   k_own;      // their keys, packed as k_pool's
    std::vector<float>   mx_own;     // per sample: the maximum of its logits on them
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

// the sampled rows of tiles ti_begin .. ti_end (every `every`-th of a tile, or its last row when it has none) into
// rows, each one's tile into tile
static void h2o_coverage_sample_rows(std::vector<int64_t> & rows, std::vector<int32_t> & tile, int64_t t_first,
        int32_t i_begin, int32_t q_end, int64_t ti_begin, int64_t ti_end, int32_t every) {
    rows.clear();
    tile.clear();
    for (int64_t ti = ti_begin; ti < ti_end; ++ti) {
        const int64_t t0 = t_first + ti*H2O_QT;
        const int64_t r0 = std::max<int64_t>(t0, i_begin);
        const int64_t r1 = std::min<int64_t>(t0 + H2O_QT, q_end);
        const size_t before = rows.size();
        for (int64_t i = r0; i < r1; ++i) {
            if ((i - t0) % every == every - 1) {
                rows.push_back(i);
                tile.push_back((int32_t) ti);
            }
        }
        if (rows.size() == before) {
            rows.push_back(r1 - 1);
            tile.push_back((int32_t) ti);
        }
    }
}

// the keys of every position up to q_end (and their sketch in R < D channels), packed once for the heads that share
// them (w.far_ikv and w.far_end say which are there); returns the keys the proposal's logits use
template <typename KRow>
static const float * h2o_coverage_pack_far(h2o_coverage_scratch & w, int64_t ikv, int32_t q_end, int64_t D, int64_t R,
        KRow && k_row) {
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
    return R < D ? w.k_sketch.data() : w.k_far.data();
}

// The queries of rows[0 .. n) into w.q_samp, pre-scaled, in the proposal's R channels (the sketch's, or all D)
static void h2o_coverage_load_samples(h2o_coverage_scratch & w, const ggml_tensor * q, int64_t ih, int32_t p0,
        const h2o_head_logits & lg, int64_t D, int64_t R, const int64_t * rows, int64_t n) {
    for (int64_t r = 0; r < n; ++r) {
        const float * qr = (const float *) ((const char *) q->data + (rows[r] - p0)*q->nb[2] + ih*q->nb[1]);
        float * qs = w.q_samp.data() + r*R;
        if (R < D) {
            for (int64_t c = 0; c < R; ++c) {
                qs[c] = qr[w.chan[c]]*lg.scale;
            }
        } else {
            ggml_vec_scale_f32((int) D, (float *) memcpy(qs, qr, D*sizeof(float)), lg.scale);
        }
    }
}

// The attention of the n_rows queries whose logits are the rows of w.p (n each, leading dimension n) and whose maxima
// are w.mx: a softmax over all n per query; what each gives to the keys out_begin .. out_begin + n_out is added to out
static void h2o_coverage_accumulate(h2o_coverage_scratch & w, int64_t n_rows, int64_t n, int32_t out_begin,
        int32_t n_out, float * out) {
    // each query's attention goes into out right after its softmax, while its row is in cache, a block at a time
    for (int64_t r = 0; r < n_rows; ++r) {
        float * pr = w.p.data() + r*n;
        const ggml_float z = ggml_vec_soft_max_f32((int) n, pr, pr, w.mx[r]);
        const float f = (float) (1.0/z);
        for (int32_t j0 = 0; j0 < n_out; j0 += H2O_TAIL_SPAN) {
            const int m = (int) std::min<int64_t>(H2O_TAIL_SPAN, n_out - j0);
            ggml_vec_scale_f32(m, pr + out_begin + j0, f);
            ggml_vec_acc_f32(m, out + j0, pr + out_begin + j0);
        }
    }
}

// The attention of the n_rows queries in w.q_samp over the n keys of k_keys (packed, R channels), a softmax over all n
// per query, their logits a key block at a time into their rows of w.p; what each gives to the keys out_begin ..
// out_begin + n_out is added to out
static void h2o_coverage_sample_attention(h2o_coverage_scratch & w, int64_t n_rows, int64_t R, const float * k_keys,
        int64_t n, float softcap, int32_t out_begin, int32_t n_out, float * out) {
    w.mx.resize(n_rows);
    h2o_sample_logits(w.p.data(), n, w.mx.data(), w.q_samp.data(), n_rows, R, k_keys, n, softcap);
    h2o_coverage_accumulate(w, n_rows, n, out_begin, n_out, out);
}

// The keys of the n candidates idx[0 .. n) (positions cand_begin + idx[m]) in the proposal's R channels, gathered from
// the packed keys of every position k_prop into dst, packed as they are ([block][R][H2O_KB])
static void h2o_coverage_gather(std::vector<float> & dst, const float * k_prop, int64_t R, int32_t cand_begin,
        const int32_t * idx, int32_t n) {
    dst.assign((size_t) h2o_n_blocks(n)*R*H2O_KB, 0.0f);
    for (int32_t m = 0; m < n; ++m) {
        const int64_t pos = cand_begin + idx[m];
        const float * src = k_prop + (pos/H2O_KB)*R*H2O_KB + pos%H2O_KB;
        float       * out = dst.data() + (m/H2O_KB)*R*H2O_KB + m%H2O_KB;
        for (int64_t c = 0; c < R; ++c) {
            out[c*H2O_KB] = src[c*H2O_KB];
        }
    }
}

// The n_top first of the rank keys w.key[0 .. n) (h2o_rank_key: the highest scores, ties to the lower index, NaN
// last), best first: the indices they carry into top
static void h2o_coverage_top_keys(h2o_coverage_scratch & w, int32_t n, int32_t n_top, std::vector<int32_t> & top) {
    std::nth_element(w.key.begin(), w.key.begin() + n_top, w.key.begin() + n);
    h2o_sort_keys(w.key.data(), n_top);
    top.resize(n_top);
    for (int32_t m = 0; m < n_top; ++m) {
        top[m] = (int32_t) (uint32_t) w.key[m];
    }
}

// The n_top of score[0 .. n) that are highest, best first, ties to the lower index, NaN last: their indices into top
static void h2o_coverage_top(h2o_coverage_scratch & w, const float * score, int32_t n, int32_t n_top,
        std::vector<int32_t> & top) {
    for (int32_t j = 0; j < n; ++j) {
        w.key[j] = h2o_rank_key(score[j], j);
    }
    h2o_coverage_top_keys(w, n, n_top, top);
}

// Stage 1 of one tile, its samples w.rows[r_first .. r_end): their logits against every position before the chunk
// (exact, or in the sketch's R channels), and each one's attention over them. The n_rank candidates of cand_begin ..
// cand_begin + n_cand with the most of the samples' attention go to rk, best first, ties to the lower position, NaN
// last
static void h2o_coverage_propose(h2o_coverage_scratch & w, const ggml_tensor * q, int64_t ih, int32_t p0, int32_t cs,
        const h2o_head_logits & lg, int64_t D, int64_t R, const float * k_prop, int64_t r_first, int64_t r_end,
        int32_t cand_begin, int32_t n_cand, int32_t n_rank, std::vector<int32_t> & rk) {
    h2o_coverage_load_samples(w, q, ih, p0, lg, D, R, w.rows.data() + r_first, r_end - r_first);
    std::fill(w.score.begin(), w.score.end(), 0.0f);
    h2o_coverage_sample_attention(w, r_end - r_first, R, k_prop, cs, lg.softcap, cand_begin, n_cand, w.score.data());
    h2o_coverage_top(w, w.score.data(), n_cand, n_rank, rk);
    for (int32_t & j : rk) {
        j += cand_begin;
    }
}

// The chunk's pool of one head (ggml_h2o_attn_set_coverage_pool): the scan's rows (every GGML_H2O_POOL_SCAN_EVERY-th
// query of each of the chunk's n_t tiles) attend, as stage 1's samples do, to every position before the chunk; each
// tile's attention on the candidates goes to w.tile_mass, the n_pool candidates with the most of all tiles' attention,
// ascending, to w.pool, and their keys to w.k_pool
static void h2o_coverage_scan(h2o_coverage_scratch & w, const ggml_tensor * q, int64_t ih, int32_t p0, int32_t cs,
        const h2o_head_logits & lg, int64_t D, int64_t R, const float * k_prop, int64_t t_first, int32_t i_begin,
        int32_t q_end, int64_t n_t, int32_t n_cand, int32_t cand_begin, int32_t n_pool) {
    h2o_coverage_sample_rows(w.scan_rows, w.scan_tile, t_first, i_begin, q_end, 0, n_t, GGML_H2O_POOL_SCAN_EVERY);
    w.tile_mass.assign((size_t) n_t*n_cand, 0.0f);
    const int64_t n_s = (int64_t) w.scan_rows.size();
    for (int64_t r_first = 0; r_first < n_s; ) {
        int64_t r_end = r_first;
        while (r_end < n_s && w.scan_tile[r_end] == w.scan_tile[r_first]) {
            ++r_end;
        }
        h2o_coverage_load_samples(w, q, ih, p0, lg, D, R, w.scan_rows.data() + r_first, r_end - r_first);
        h2o_coverage_sample_attention(w, r_end - r_first, R, k_prop, cs, lg.softcap, cand_begin, n_cand,
                w.tile_mass.data() + (size_t) w.scan_tile[r_first]*n_cand);
        r_first = r_end;
    }
    w.pool_mass.assign(n_cand, 0.0f);
    for (int64_t ti = 0; ti < n_t; ++ti) {
        ggml_vec_acc_f32(n_cand, w.pool_mass.data(), w.tile_mass.data() + (size_t) ti*n_cand);
    }
    h2o_coverage_top(w, w.pool_mass.data(), n_cand, n_pool, w.pool);
    std::sort(w.pool.begin(), w.pool.end());
    w.in_pool.assign(n_cand, 0);
    for (int32_t j : w.pool) {
        w.in_pool[j] = 1;
    }
    h2o_coverage_gather(w.k_pool, k_prop, R, cand_begin, w.pool.data(), n_pool);
}

// Stage 1 of tile ti with a pool: its pool is the chunk's and the n_own candidates outside it with the most of the
// tile's own scanned attention (ties to the lower position); its samples w.rows[r_first .. r_end) attend to those
// alone, on their keys in the R channels (a softmax over the tile's pool), and the n_rank with the most of that
// attention go to rk, best first, ties to the lower position, NaN last. The chunk's part of the pool and its keys are
// the scan's, shared by the tiles; only the tile's own are gathered here
static void h2o_coverage_propose_pooled(h2o_coverage_scratch & w, const ggml_tensor * q, int64_t ih, int32_t p0,
        const h2o_head_logits & lg, int64_t D, int64_t R, const float * k_prop, int64_t ti, int64_t r_first,
        int64_t r_end, int32_t cand_begin, int32_t n_cand, int32_t n_own, int32_t n_rank, std::vector<int32_t> & rk) {
    // the tile's best outside the pool, by candidate index
    const float * mass = w.tile_mass.data() + (size_t) ti*n_cand;
    int32_t n_out = 0;
    for (int32_t j = 0; j < n_cand; ++j) {
        if (!w.in_pool[j]) {
            w.key[n_out++] = h2o_rank_key(mass[j], j);
        }
    }
    h2o_coverage_top_keys(w, n_out, n_own, w.own);
    std::sort(w.own.begin(), w.own.end());
    h2o_coverage_gather(w.k_own, k_prop, R, cand_begin, w.own.data(), n_own);

    // the samples' logits on the chunk's pool (packed once, by h2o_coverage_scan), then on the tile's own, in one row
    const int32_t n_pool = (int32_t) w.pool.size();
    const int32_t n      = n_pool + n_own;
    const int64_t n_rows = r_end - r_first;
    h2o_coverage_load_samples(w, q, ih, p0, lg, D, R, w.rows.data() + r_first, n_rows);
    w.mx.resize(n_rows);
    w.mx_own.resize(n_rows);
    h2o_sample_logits(w.p.data(), n, w.mx.data(), w.q_samp.data(), n_rows, R, w.k_pool.data(), n_pool, lg.softcap);
    h2o_sample_logits(w.p.data() + n_pool, n, w.mx_own.data(), w.q_samp.data(), n_rows, R, w.k_own.data(), n_own,
            lg.softcap);
    for (int64_t r = 0; r < n_rows; ++r) {
        w.mx[r] = std::max(w.mx[r], w.mx_own[r]);
    }
    std::fill(w.score.begin(), w.score.begin() + n, 0.0f);
    h2o_coverage_accumulate(w, n_rows, n, 0, n, w.score.data());

    // the ranking by candidate index, whichever part holds it
    for (int32_t m = 0; m < n; ++m) {
        w.key[m] = h2o_rank_key(w.score[m], m < n_pool ? w.pool[m] : w.own[m - n_pool]);
    }
    h2o_coverage_top_keys(w, n, n_rank, rk);
    for (int32_t & j : rk) {
        j += cand_begin;
    }
}

// Stage 2's attention of one tile, rows r0 .. r1: every query against its chunk (up to the diagonal), the intra part
// of its output, kept in o_intra and part_intra (its column sums into acc_tile); then against the forced positions
// and the candidates rk, a softmax over all those keys per query. The candidates' attention, summed over the tile,
// goes to w.score2 (and in double to w.col); returns the tile's summed attention on its chunk and the forced positions
template <typename KRow>
static double h2o_coverage_attend_candidates(h2o_coverage_scratch & w, h2o_tile_scratch & s, const ggml_tensor * q,
        int64_t ih, int32_t p0, int32_t cs, int64_t r0, int64_t r1, int64_t Dv, const h2o_head_logits & lg,
        int32_t tail_start, const float * k_chunk, const float * v_chunk, float * acc_tile, float * o_intra,
        h2o_row_part * part_intra, KRow && k_row, const std::vector<int32_t> & forced, const std::vector<int32_t> & rk) {
    const int64_t D      = q->ne[0];
    const int32_t n_rank = (int32_t) rk.size();
    const int64_t rows   = r1 - r0;
    const int64_t n_f    = (int64_t) forced.size();
    const int64_t n2     = n_f + n_rank;
    const int64_t nb2    = h2o_n_blocks(n2);
    w.k_cand.resize((size_t) nb2*D*H2O_KB);
    w.x_cand.resize((size_t) nb2*H2O_QT*H2O_KB);
    h2o_pack_k(w.k_cand.data(), n2, D, [&](int64_t m) { return k_row(m < n_f ? forced[m] : rk[m - n_f]); });
    h2o_tile_intra(q, ih, p0, cs, r0, r1, Dv, lg, tail_start, k_chunk, v_chunk, acc_tile, s);
    memcpy(o_intra, s.o_tile.data(), rows*Dv*sizeof(float));
    std::copy(s.part_intra.begin(), s.part_intra.begin() + rows, part_intra);
    h2o_logits(w.x_cand.data(), s.q_tile.data(), rows, D, w.k_cand.data(), nb2, lg.softcap);
    w.score2.assign(n_rank, 0.0f);
    w.col.assign(n_rank, 0.0);
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
    return covered;
}

// Stage 2's ranking of one tile: its candidates rk by the whole tile's attention (w.score2), ties to the lower
// position, NaN last; the estimate after each budget step into cu[0 .. n_steps] (covered: the tile's summed attention
// before any step, over `rows` queries); then rk in that order
static void h2o_coverage_rank(h2o_coverage_scratch & w, std::vector<int32_t> & rk, int32_t cand_begin, int32_t n_steps,
        double covered, int64_t rows, double * cu) {
    const int32_t n_rank = (int32_t) rk.size();
    for (int32_t m = 0; m < n_rank; ++m) {
        w.key[m] = h2o_rank_key(w.score2[m], rk[m] - cand_begin);
        w.slot[rk[m] - cand_begin] = m;
    }
    h2o_sort_keys(w.key.data(), n_rank);
    for (int32_t m = 0; m < n_rank; ++m) {
        w.order[m] = w.slot[(uint32_t) w.key[m]];
    }

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
}

template <typename KRow>
static H2O_NOINLINE void h2o_coverage_estimate(const ggml_tensor * q, int64_t ih, int64_t ikv, int32_t p0, int32_t cs,
        int32_t i_begin, int32_t q_end, int64_t ti_begin, int64_t ti_end, const h2o_head_logits & lg, int32_t every,
        int32_t sketch, int32_t n_pool, KRow && k_row, const std::vector<int32_t> & forced,
        int32_t cand_begin, int32_t cand_end, int32_t n_rank, int32_t n_steps,
        std::vector<int32_t> * ranked, double * curve, int64_t stride,
        int64_t Dv, int32_t tail_start, const float * k_chunk, const float * v_chunk, float * acc_tiles, int64_t acc_stride,
        float * o_intra, h2o_row_part * part_intra,
        h2o_coverage_scratch & w, h2o_tile_scratch & s) {
    const int64_t D       = q->ne[0];
    const int64_t R       = D/sketch;
    const int64_t t_first = cs + (int64_t) (i_begin - cs)/H2O_QT*H2O_QT;

    h2o_coverage_sample_rows(w.rows, w.tile, t_first, i_begin, q_end, ti_begin, ti_end, every);
    const int64_t n_s = (int64_t) w.rows.size();
    const float * k_prop = h2o_coverage_pack_far(w, ikv, q_end, D, R, k_row);
    // a tile's samples (at most H2O_QT) at a time, so that their attention rows stay small: many samples over a long
    // prompt would otherwise stream through memory several times
    w.p.resize((size_t) H2O_QT*cs);
    w.q_samp.resize((size_t) H2O_QT*R);

    const int32_t n_cand = cand_end - cand_begin;
    w.score.resize(n_cand);
    w.order.resize(n_cand);
    w.key  .resize(n_cand);
    w.slot .resize(n_cand);
    // with a pool, only where the chunk has more candidates than a tile's pool holds
    const int32_t n_own  = n_pool/GGML_H2O_POOL_OWN;
    const bool    pooled = n_pool > 0 && n_cand > n_pool + n_own;
    if (pooled) {
        const int64_t n_t = (q_end - t_first + H2O_QT - 1)/H2O_QT;
        h2o_coverage_scan(w, q, ih, p0, cs, lg, D, R, k_prop, t_first, i_begin, q_end, n_t, n_cand, cand_begin, n_pool);
    }
    for (int64_t ti = ti_begin, r_first = 0; ti < ti_end; ++ti) {
        int64_t r_end = r_first;
        while (r_end < n_s && w.tile[r_end] == ti) {
            ++r_end;
        }
        const int64_t t0 = t_first + ti*H2O_QT;
        const int64_t r0 = std::max<int64_t>(t0, i_begin);
        const int64_t r1 = std::min<int64_t>(t0 + H2O_QT, q_end);
        if (pooled) {
            h2o_coverage_propose_pooled(w, q, ih, p0, lg, D, R, k_prop, ti, r_first, r_end, cand_begin, n_cand, n_own,
                    n_rank, ranked[ti]);
        } else {
            h2o_coverage_propose(w, q, ih, p0, cs, lg, D, R, k_prop, r_first, r_end, cand_begin, n_cand, n_rank,
                    ranked[ti]);
        }
        const double covered = h2o_coverage_attend_candidates(w, s, q, ih, p0, cs, r0, r1, Dv, lg, tail_start, k_chunk,
                v_chunk, acc_tiles + ti*acc_stride, o_intra + ti*H2O_QT*Dv, part_intra + ti*H2O_QT, k_row, forced,
                ranked[ti]);
        h2o_coverage_rank(w, ranked[ti], cand_begin, n_steps, covered, r1 - r0, curve + ti*stride);
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
    if (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SELECT) != GGML_H2O_SELECT_COVERAGE) {
        return 0;
    }
    const int64_t S       = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_CHUNK);
    const int64_t L       = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_LOCAL);
    const int64_t H       = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_HEAVY);
    const int64_t n_sink  = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SINK);
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
    int32_t pool;   // the chunk's pool of candidates that the proposals read (0: none, every candidate)

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
        p0        (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_P0)),
        S         (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_CHUNK)),
        L         (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_LOCAL)),
        H         (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_HEAVY)),
        mem_chunk0(ggml_get_op_params_i32(dst, GGML_H2O_ATTN_MEM_CHUNK)),
        acc_chunk0(ggml_get_op_params_i32(dst, GGML_H2O_ATTN_ACC_CHUNK)),
        n_sink    (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SINK)),
        tail_start(ggml_get_op_params_i32(dst, GGML_H2O_ATTN_TAIL_START)),
        coverage  (ggml_get_op_params_f32(dst, GGML_H2O_ATTN_COVERAGE)),
        every     (H2O_QT/ggml_get_op_params_i32(dst, GGML_H2O_ATTN_N_SAMPLE)),
        sketch    (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SKETCH)),
        pool      (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_POOL)),
        D(q->ne[0]), Dv(v->ne[0]), n_head(q->ne[1]), n_tokens(q->ne[2]), n_head_kv(k->ne[1]),
        n_gqa(n_head/n_head_kv), kv_size(scores->ne[0]), M(L + H), p1(p0 + (int32_t) n_tokens),
        n_steps_max((GGML_H2O_MAX_HEAVY_FACTOR*H + GGML_H2O_BUDGET_STEP - 1)/GGML_H2O_BUDGET_STEP),
        n_tiles((S + H2O_QT - 1)/H2O_QT), stride(n_steps_max + 1), nb_chunk(h2o_n_blocks(S)),
        mem_max((int64_t) n_sink + L + (int64_t) GGML_H2O_MAX_HEAVY_FACTOR*H), nb_mem_max(h2o_n_blocks(mem_max)),
        kt(k->type), vt(v->type),
        head_begin(n_head*params->ith/params->nth), head_end(n_head*(params->ith + 1)/params->nth),
        k_chunk(thread_buffers().tile.k_chunk), v_chunk(thread_buffers().tile.v_chunk),
        k_mem(thread_buffers().tile.k_mem), v_mem(thread_buffers().tile.v_mem), masked(thread_buffers().masked), memory(thread_buffers().memory),
        far_sums(thread_buffers().far_sums), forced(thread_buffers().forced), given(thread_buffers().given),
        ranked(thread_buffers().ranked), mem_chunk(thread_buffers().mem_chunk), acc_chunk(thread_buffers().acc_chunk),
        o_intra(thread_buffers().o_intra), part_intra(thread_buffers().part_intra), est(thread_buffers().est),
        tile(thread_buffers().tile), span(thread_buffers().span) {
        GGML_ASSERT(k->nb[0] == ggml_type_size(k->type) && v->nb[0] == ggml_type_size(v->type) && q->nb[0] == sizeof(float));
        GGML_ASSERT(params->wsize >= ggml_h2o_attn_coverage_work_size(dst));
        h2o_coverage_layout(shared, params->wdata, n_head*n_tiles, stride, S, mem_max);

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
                    sketch, pool, [&](int64_t pos) { return k_row(pos, ikv); },
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

void ggml_compute_forward_h2o_attn_coverage(
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
