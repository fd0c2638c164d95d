// The H2O part of ggml-base (declared in ggml-h2o.h): the ops' constructors and setters, which
// check their operands and write the op parameters by name, and the seed rule's memory set of one
// head, shared by the CPU op and the KV cache so that both choose the same positions.

#include "ggml-impl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

// ggml_h2o_attn

struct ggml_tensor * ggml_h2o_attn(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * scores,
        struct ggml_tensor  * mem_idx,
        struct ggml_tensor  * acc,
        int32_t               p0,
        int32_t               n_chunk,
        int32_t               n_local,
        int32_t               n_heavy,
        int32_t               mem_chunk,
        int32_t               acc_chunk,
        float                 scale) {
    const int64_t n_head   = q->ne[1];
    const int64_t n_tokens = q->ne[2];
    const int64_t n_memory = (int64_t) n_local + n_heavy;

    // K and V of any type ggml converts to F32 (F16, BF16, F32, q8_0, q4_0, ...), each head's row whole blocks
    GGML_ASSERT(q->type == GGML_TYPE_F32);
    GGML_ASSERT((k->type == GGML_TYPE_F32 || ggml_get_type_traits(k->type)->to_float) && k->ne[0] % ggml_blck_size(k->type) == 0);
    GGML_ASSERT((v->type == GGML_TYPE_F32 || ggml_get_type_traits(v->type)->to_float) && v->ne[0] % ggml_blck_size(v->type) == 0);
    GGML_ASSERT(scores->type == GGML_TYPE_BF16 && mem_idx->type == GGML_TYPE_I32 && acc->type == GGML_TYPE_F32);
    GGML_ASSERT(q->ne[0] == k->ne[0] && k->ne[1] == v->ne[1] && k->ne[2] == v->ne[2]);
    GGML_ASSERT(q->ne[3] == 1 && k->ne[3] == 1 && v->ne[3] == 1);
    GGML_ASSERT(n_head % k->ne[1] == 0);
    GGML_ASSERT(ggml_is_contiguous(scores) && ggml_is_contiguous(mem_idx) && ggml_is_contiguous(acc));
    GGML_ASSERT(scores->ne[1] == n_head && mem_idx->ne[1] == n_head && acc->ne[1] == n_head);
    GGML_ASSERT(n_local >= 0 && n_heavy >= 0 && n_memory > 0 && n_memory < n_chunk);
    GGML_ASSERT(mem_idx->ne[0] == n_memory && acc->ne[0] == n_chunk + n_memory);
    GGML_ASSERT(p0 >= 0 && p0 + n_tokens <= k->ne[2] && p0 + n_tokens <= scores->ne[0]);
    GGML_ASSERT(mem_chunk >= -1 && acc_chunk >= -1);

    int64_t ne[4] = { v->ne[0], n_head, n_tokens, 1 };
    struct ggml_tensor * result = ggml_new_tensor(ctx, GGML_TYPE_F32, 4, ne);

    ggml_set_op_params_i32(result, GGML_H2O_ATTN_P0,        p0);
    ggml_set_op_params_i32(result, GGML_H2O_ATTN_CHUNK,     n_chunk);
    ggml_set_op_params_i32(result, GGML_H2O_ATTN_LOCAL,     n_local);
    ggml_set_op_params_i32(result, GGML_H2O_ATTN_HEAVY,     n_heavy);
    ggml_set_op_params_i32(result, GGML_H2O_ATTN_MEM_CHUNK, mem_chunk);
    ggml_set_op_params_i32(result, GGML_H2O_ATTN_ACC_CHUNK, acc_chunk);
    ggml_set_op_params_f32(result, GGML_H2O_ATTN_SCALE,     scale);

    result->op     = GGML_OP_H2O_ATTN;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = v;
    result->src[3] = scores;
    result->src[4] = mem_idx;
    result->src[5] = acc;

    ggml_h2o_attn_set_select(result, GGML_H2O_SELECT_SEED, 0, INT32_MAX);
    ggml_h2o_attn_set_coverage(result, 1.0f, 4);
    ggml_h2o_attn_set_coverage_sketch(result, 1);
    ggml_h2o_attn_set_coverage_pool(result, 0);
    ggml_h2o_attn_set_logits(result, 0.0f, NULL);

    return result;
}

void ggml_h2o_attn_set_select(
        struct ggml_tensor  * a,
        enum ggml_h2o_select  select,
        int32_t               n_sink,
        int32_t               tail_start) {
    GGML_ASSERT(a->op == GGML_OP_H2O_ATTN);
    GGML_ASSERT(select == GGML_H2O_SELECT_SEED || select == GGML_H2O_SELECT_HYBRID || select == GGML_H2O_SELECT_COVERAGE);
    GGML_ASSERT(n_sink >= 0 && n_sink <= ggml_get_op_params_i32(a, GGML_H2O_ATTN_HEAVY)); // inside the heavy budget
    GGML_ASSERT(tail_start >= 0);

    ggml_set_op_params_i32(a, GGML_H2O_ATTN_SELECT,     select);
    ggml_set_op_params_i32(a, GGML_H2O_ATTN_SINK,       n_sink);
    ggml_set_op_params_i32(a, GGML_H2O_ATTN_TAIL_START, tail_start);
}

void ggml_h2o_attn_set_coverage(
        struct ggml_tensor  * a,
        float                 coverage,
        int32_t               n_sample) {
    GGML_ASSERT(a->op == GGML_OP_H2O_ATTN);
    GGML_ASSERT(coverage > 0.0f && coverage <= 1.0f);
    GGML_ASSERT(n_sample >= 1 && n_sample <= GGML_H2O_TILE && GGML_H2O_TILE % n_sample == 0);

    ggml_set_op_params_f32(a, GGML_H2O_ATTN_COVERAGE, coverage);
    ggml_set_op_params_i32(a, GGML_H2O_ATTN_N_SAMPLE, n_sample);
}

void ggml_h2o_attn_set_coverage_sketch(
        struct ggml_tensor  * a,
        int32_t               sketch) {
    GGML_ASSERT(a->op == GGML_OP_H2O_ATTN);
    GGML_ASSERT(sketch >= 1 && a->src[0]->ne[0] % sketch == 0);

    ggml_set_op_params_i32(a, GGML_H2O_ATTN_SKETCH, sketch);
}

void ggml_h2o_attn_set_coverage_pool(
        struct ggml_tensor  * a,
        int32_t               n_pool) {
    GGML_ASSERT(a->op == GGML_OP_H2O_ATTN);
    GGML_ASSERT(n_pool == 0 || n_pool >= GGML_H2O_MAX_HEAVY_FACTOR*ggml_get_op_params_i32(a, GGML_H2O_ATTN_HEAVY));

    ggml_set_op_params_i32(a, GGML_H2O_ATTN_POOL, n_pool);
}

void ggml_h2o_attn_set_logits(
        struct ggml_tensor  * a,
        float                 logit_softcap,
        struct ggml_tensor  * sinks) {
    GGML_ASSERT(a->op == GGML_OP_H2O_ATTN || a->op == GGML_OP_H2O_DECODE);
    GGML_ASSERT(logit_softcap >= 0.0f);
    if (sinks) {
        GGML_ASSERT(sinks->type == GGML_TYPE_F32 && ggml_is_contiguous(sinks) && ggml_nelements(sinks) == a->ne[1]);
    }

    ggml_set_op_params_f32(a, GGML_H2O_ATTN_SOFTCAP, logit_softcap); // GGML_H2O_DECODE_SOFTCAP too
    a->src[6] = sinks;
}

// ggml_h2o_decode

struct ggml_tensor * ggml_h2o_decode(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * summ,
        struct ggml_tensor  * summ_n,
        int32_t               n_sink,
        int32_t               n_local,
        int32_t               n_budget,
        float                 scale) {
    const int64_t n_head   = q->ne[1];
    const int64_t n_stream = q->ne[3];

    GGML_ASSERT(q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float));
    GGML_ASSERT((k->type == GGML_TYPE_F32 || ggml_get_type_traits(k->type)->to_float) && k->ne[0] % ggml_blck_size(k->type) == 0);
    GGML_ASSERT((v->type == GGML_TYPE_F32 || ggml_get_type_traits(v->type)->to_float) && v->ne[0] % ggml_blck_size(v->type) == 0);
    GGML_ASSERT(k->nb[0] == ggml_type_size(k->type) && v->nb[0] == ggml_type_size(v->type));
    GGML_ASSERT(q->ne[0] == k->ne[0] && k->ne[1] == v->ne[1] && k->ne[2] == v->ne[2]);
    GGML_ASSERT(n_head % k->ne[1] == 0);
    GGML_ASSERT(k->ne[3] == n_stream && v->ne[3] == n_stream);
    GGML_ASSERT(mask->type == GGML_TYPE_F32 || mask->type == GGML_TYPE_F16);
    GGML_ASSERT(mask->ne[0] == k->ne[2] && mask->ne[1] >= q->ne[2] && mask->ne[3] == n_stream);
    GGML_ASSERT(k->ne[0] % 16 == 0 && summ->type == GGML_TYPE_I8 && summ_n->type == GGML_TYPE_I32);
    GGML_ASSERT(summ->ne[0] == GGML_H2O_DECODE_SKETCH_SIZE(k->ne[0]) && summ->ne[1] == k->ne[1] && summ->ne[3] == n_stream);
    GGML_ASSERT(summ->nb[0] == 1 && summ->nb[1] % 64 == 0 && summ->ne[2]*GGML_H2O_DECODE_BLOCK >= k->ne[2]);
    GGML_ASSERT(summ_n->ne[0] == 3 + (k->ne[0]/4)*k->ne[1] && summ_n->ne[1] == n_stream && summ_n->nb[0] == sizeof(int32_t));
    GGML_ASSERT(n_sink >= 0 && n_local >= 0 && n_budget >= 0);

    int64_t ne[4] = { v->ne[0], n_head, q->ne[2], n_stream };
    struct ggml_tensor * result = ggml_new_tensor(ctx, GGML_TYPE_F32, 4, ne);

    ggml_set_op_params_i32(result, GGML_H2O_DECODE_SINK,     n_sink);
    ggml_set_op_params_i32(result, GGML_H2O_DECODE_LOCAL,    n_local);
    ggml_set_op_params_i32(result, GGML_H2O_DECODE_BUDGET,   n_budget);
    ggml_set_op_params_f32(result, GGML_H2O_DECODE_SCALE,    scale);
    ggml_set_op_params_f32(result, GGML_H2O_DECODE_COVERAGE, 1.0f); // coverage: the budget

    result->op     = GGML_OP_H2O_DECODE;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = v;
    result->src[3] = summ;
    result->src[4] = summ_n;
    result->src[5] = mask;

    ggml_h2o_attn_set_logits(result, 0.0f, NULL);

    return result;
}

void ggml_h2o_decode_set_coverage(
        struct ggml_tensor  * a,
        float                 coverage) {
    GGML_ASSERT(a->op == GGML_OP_H2O_DECODE);
    GGML_ASSERT(coverage > 0.0f && coverage <= 1.0f);
    ggml_set_op_params_f32(a, GGML_H2O_DECODE_COVERAGE, coverage);
}

void ggml_h2o_decode_set_keys_read(
        struct ggml_tensor  * a,
        struct ggml_tensor  * keys_read) {
    GGML_ASSERT(a->op == GGML_OP_H2O_DECODE);
    GGML_ASSERT(keys_read->type == GGML_TYPE_F32 && ggml_is_contiguous(keys_read) && ggml_nelements(keys_read) == a->ne[3]);
    a->src[7] = keys_read;
}

// ggml_h2o_build_memory_set

void ggml_h2o_build_memory_set(
        const ggml_bf16_t * scores,
        int32_t           * memory,
        int32_t             n_local,
        int32_t             n_heavy,
        int32_t             n_sink,
        int32_t             chunk_start,
        int32_t             chunk_end,
        bool                has_previous) {
    const int32_t n_memory    = n_local + n_heavy;
    const int32_t local_start = std::max(chunk_end - n_local, 0);
    const int32_t sink_end    = std::min(n_sink, local_start); // sinks inside Local are Local's

    chunk_start = std::min(chunk_start, chunk_end);

    const auto score = [&](int32_t pos) {
        const float s = GGML_BF16_TO_FP32(scores[pos]);
        return std::isnan(s) ? -INFINITY : s; // keeps the ordering strict
    };

    // (score, position); the better candidate has the higher score, ties go to the lower position
    thread_local std::vector<std::pair<float, int32_t>> cand;
    thread_local std::vector<int32_t> result;
    cand.clear();
    result.clear();

    // M_{c-1} \ (Local + Sink) (it precedes the chunk)
    if (has_previous) {
        for (int32_t m = 0; m < n_memory; ++m) {
            const int32_t pos = memory[m];
            if (pos >= sink_end && pos < chunk_start && pos < local_start) {
                cand.emplace_back(score(pos), pos);
            }
        }
    }

    // C_c \ (Local + Sink)
    for (int32_t pos = std::max(chunk_start, sink_end); pos < std::max(chunk_start, local_start); ++pos) {
        cand.emplace_back(score(pos), pos);
    }

    // the sinks take their places out of the heavy budget
    for (int32_t pos = 0; pos < sink_end; ++pos) {
        result.push_back(pos);
    }

    const size_t n_best = std::min<size_t>(std::max(n_heavy - sink_end, 0), cand.size());
    if (n_best < cand.size()) {
        std::nth_element(cand.begin(), cand.begin() + n_best, cand.end(),
                [](const std::pair<float, int32_t> & a, const std::pair<float, int32_t> & b) {
                    return a.first > b.first || (a.first == b.first && a.second < b.second);
                });
    }

    for (size_t i = 0; i < n_best; ++i) {
        result.push_back(cand[i].second);
    }
    for (int32_t pos = local_start; pos < chunk_end; ++pos) {
        result.push_back(pos);
    }

    // Local, Sink and Heavy are disjoint: the sorted set has no duplicates
    std::sort(result.begin(), result.end());

    for (int32_t m = 0; m < n_memory; ++m) {
        memory[m] = m < (int32_t) result.size() ? result[m] : -1;
    }
}
