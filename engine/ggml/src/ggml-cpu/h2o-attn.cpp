// GGML_OP_H2O_ATTN on the CPU: the chunked sparse prefill attention of one layer, the memory
// selection policies that give a chunk one memory set (the seed rule and the hybrid) and the
// scores it keeps (see ggml_h2o_attn in ggml-h2o.h). Coverage selection, which gives
// each tile of the chunk its own, is in h2o-coverage.cpp; the tiled attention both run, in h2o-tile.h.

#include "ops.h"

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "h2o-common.h"
#include "h2o-tile.h"
#include "simd-gemm.h"
#include "ggml.h"
#include "vec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

// ggml_compute_forward_h2o_attn

// Selection by the chunk's own queries (GGML_H2O_SELECT_HYBRID): the memory of chunk c is its Local window
// [cs - L, cs), the sinks [0, n_sink), whole blocks of GGML_H2O_BLOCK earlier positions chosen by chunk c's own
// queries for half of the heavy budget, and the best accumulated scores for the rest. Each block is summarised per
// channel (minimum and maximum) once per call; a sample of the chunk's queries (the last ones, where a question
// usually is, and a stride over the rest) scores every block: the bound logits of one query go through a softmax
// over the blocks, and a block's score is the sum over the sample of its share. The best blocks fill their half of
// the budget, ties to the lower position.
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
    std::vector<float> lo;     // [n_blocks][D]: channel minimum
    std::vector<float> hi;     // [n_blocks][D]: channel maximum
    int32_t b0     = 0;        // the first block
    int32_t n_full = 0;        // blocks b0 .. b0 + n_full - 1 were complete when summarised
    std::vector<float> lo_t;   // [D][n_blocks], for the products
    std::vector<float> hi_t;
    std::vector<float> q_pos;  // [n_q][D]: max(q, 0)
    std::vector<float> q_neg;  // [n_q][D]: min(q, 0)
    std::vector<float> logit;  // [n_q][n_blocks]
    std::vector<float> score;  // [n_blocks]
    std::vector<int32_t> order;

    void reset() { n_full = 0; }
};

// memory of chunk cs.. for one head: Local + Sink + the best blocks of [n_sink, cs - L) for half of the budget and
// the positions with the highest accumulated scores among the other candidates for the rest, ascending, -1 after.
// q_rows holds the sampled queries, pre-scaled, [n_q][D]; key row pos is at k_head + pos*nb_pos, of type kt.
static H2O_NOINLINE void h2o_select_by_query(int32_t * mem, int32_t M, int32_t L, int32_t H, int32_t n_sink, int32_t cs,
        const float * q_rows, int64_t n_q, int64_t D, const char * k_head, size_t nb_pos,
        const h2o_row_type & kt, const ggml_bf16_t * scores, h2o_block_summary & bs) {
    const auto k_row = [&](int64_t pos) { return (const void *) (k_head + pos*nb_pos); };

    const int32_t local_start = std::max(cs - L, 0);
    const int32_t sink_end    = std::min(n_sink, local_start);
    const int32_t cand_begin  = sink_end;
    const int32_t cand_end    = local_start;
    const int32_t budget      = std::max(H - sink_end, 0);
    const int32_t by_score    = budget/2;

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
            std::fill(lo, lo + D,  INFINITY);
            std::fill(hi, hi + D, -INFINITY);
            for (int32_t pos = p_begin; pos < p_end; ++pos) {
                kt.to_f32(k_row(pos), kf.data(), D);
                for (int64_t d = 0; d < D; ++d) {
                    lo[d] = kf[d] < lo[d] ? kf[d] : lo[d];
                    hi[d] = kf[d] > hi[d] ? kf[d] : hi[d];
                }
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
            bs.q_pos[e] = std::max(q_rows[e], 0.0f);
            bs.q_neg[e] = std::min(q_rows[e], 0.0f);
        }
        bs.logit.assign((size_t) n_q*nb, 0.0f);
        bs.score.assign(nb, 0.0f);
        simd_gemm(bs.logit.data(), bs.q_pos.data(), bs.hi_t.data(), (int) n_q, (int) D, nb);
        simd_gemm(bs.logit.data(), bs.q_neg.data(), bs.lo_t.data(), (int) n_q, (int) D, nb);
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

void ggml_compute_forward_h2o_attn(
        const ggml_compute_params * params,
        ggml_tensor * dst) {
    const ggml_tensor * q       = dst->src[0];
    const ggml_tensor * k       = dst->src[1];
    const ggml_tensor * v       = dst->src[2];
          ggml_tensor * scores  = dst->src[3];
          ggml_tensor * mem_idx = dst->src[4];
          ggml_tensor * acc     = dst->src[5];

    const int32_t p0         = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_P0);
    const int32_t S          = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_CHUNK);
    const int32_t L          = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_LOCAL);
    const int32_t H          = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_HEAVY);
    const int32_t mem_chunk0 = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_MEM_CHUNK);
    const int32_t acc_chunk0 = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_ACC_CHUNK);
    const float   scale      = ggml_get_op_params_f32(dst, GGML_H2O_ATTN_SCALE);
    const int32_t select     = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SELECT);
    const int32_t n_sink     = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SINK);
    const int32_t tail_start = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_TAIL_START);

    if (select == GGML_H2O_SELECT_COVERAGE) {
        ggml_compute_forward_h2o_attn_coverage(params, dst);
        return;
    }

    const bool by_query = select == GGML_H2O_SELECT_HYBRID;

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
    thread_local std::vector<int32_t> masked; // memory slots (and padding) no query may attend to
    thread_local std::vector<int64_t> sample; // query rows that choose the hybrid's blocks
    thread_local std::vector<float> q_sample; // [sample][D], pre-scaled
    thread_local h2o_block_summary blocks;
    thread_local h2o_tile_scratch tile;
    thread_local h2o_span_scratch span;
    tile.reserve(D, Dv, nb_chunk, nb_memory);
    span.reserve(D, Dv);
    float * k_chunk = tile.k_chunk.data();
    float * v_chunk = tile.v_chunk.data();
    float * k_mem   = tile.k_mem.data();
    float * v_mem   = tile.v_mem.data();

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

        // M_c after chunk c; the hybrid's memories are chosen when the next chunk's queries are there instead
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
            h2o_select_by_query(mem, M, L, H, n_sink, c*S, q_sample.data(), (int64_t) sample.size(), D,
                    (const char *) k->data + ikv*k->nb[1], k->nb[2], kt, sc, blocks);
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
            h2o_pack_k(k_chunk, q_end - cs, D,  [&](int64_t j) { return k_row(cs + j, ikv); });
            h2o_pack_v(v_chunk, q_end - cs, Dv, [&](int64_t j) { return v_row(cs + j, ikv); });
            if (has_memory) {
                const auto in_memory = [&](int64_t m) { return mem[m] >= 0 && mem[m] < cs; };
                h2o_pack_k(k_mem, M, D,  [&](int64_t m) { return in_memory(m) ? k_row(mem[m], ikv) : h2o_row{}; });
                h2o_pack_v(v_mem, M, Dv, [&](int64_t m) { return in_memory(m) ? v_row(mem[m], ikv) : h2o_row{}; });
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
                h2o_attend_tile(dst, q, ih, p0, cs, r0, r1, h2o_logits_of(dst, ih), tail_start, k_chunk, v_chunk,
                        has_memory ? k_mem : nullptr, v_mem, M, nb_memory, masked, acc_intra, acc_inter, tile);
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
