// The H2O part of llama.h's C API: what an H2O context holds (llama_h2o_get_info, _get_seq_info, _get_layers,
// _get_memory_indices, _get_scores) and the per-sequence settings (llama_h2o_set_seq_select, _set_seq_decode).

#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama.h"

// the context's KV cache when it holds H2O state, nullptr otherwise
static const llama_kv_cache * llama_h2o_cache(const llama_context * ctx) {
    if (!ctx) {
        return nullptr;
    }

    const auto * kv = llama_h2o_kv(ctx->get_memory());
    if (!kv || !kv->h2o().enabled()) {
        return nullptr;
    }

    return kv;
}

int32_t llama_h2o_get_info(const llama_context * ctx, llama_h2o_info * info) {
    return llama_h2o_get_seq_info(ctx, 0, info);
}

int32_t llama_h2o_get_seq_info(const llama_context * ctx, llama_seq_id seq_id, llama_h2o_info * info) {
    const auto * kv = llama_h2o_cache(ctx);
    if (!kv || !info) {
        return LLAMA_H2O_STATUS_DISABLED;
    }

    if (seq_id < 0 || (uint32_t) seq_id >= kv->get_n_seq_max()) {
        return LLAMA_H2O_STATUS_INVALID_SEQ;
    }

    const uint32_t s = kv->h2o().stream(seq_id);

    const auto layer_ids = kv->get_layer_ids();
    const auto & state   = kv->h2o().get_chunk_state(s);

    info->n_local            = kv->h2o().n_local();
    info->n_heavy            = kv->h2o().n_heavy();
    info->n_memory           = kv->h2o().n_memory();
    info->n_chunk            = ctx->n_ubatch();
    info->select             = kv->h2o().get_select(s);
    info->n_sink             = kv->h2o().n_sink(s);
    info->n_dense_tail       = kv->h2o().n_dense_tail(s);
    info->n_layer            = layer_ids.size();
    info->n_head             = layer_ids.empty() ? 0 : kv->h2o().get_scores(layer_ids[0])->ne[1];
    info->kv_size            = kv->get_size();
    info->n_chunks_done      = state.current_chunk_idx;
    info->n_tokens_done      = state.total_tokens_processed;
    info->n_sparse_chunks    = state.n_sparse_chunks;
    info->n_tail_tokens      = state.n_tail_tokens;
    info->memory_initialized = kv->h2o().is_memory_initialized(s);
    info->size_bytes         = kv->h2o().size_bytes();

    return LLAMA_H2O_STATUS_OK;
}

int32_t llama_h2o_set_seq_select(llama_context * ctx, llama_seq_id seq_id, enum llama_h2o_select select, int32_t n_sink, int32_t n_dense_tail) {
    auto * kv = ctx ? llama_h2o_kv(ctx->get_memory()) : nullptr;
    if (!kv || !kv->h2o().enabled()) {
        return LLAMA_H2O_STATUS_DISABLED;
    }

    if (seq_id < 0 || (uint32_t) seq_id >= kv->get_n_seq_max()) {
        return LLAMA_H2O_STATUS_INVALID_SEQ;
    }

    if (!llama_h2o_select_known(select) ||
        n_sink < 0 || (uint32_t) n_sink > kv->h2o().n_heavy() || n_dense_tail < 0 || (uint32_t) n_dense_tail > kv->get_size()) {
        return LLAMA_H2O_STATUS_INVALID_SELECT;
    }

    // the scores and memory sets of a sequence follow one policy from its first chunk on
    if (kv->h2o().get_chunk_state(kv->h2o().stream(seq_id)).prompt_end > 0) {
        return LLAMA_H2O_STATUS_SEQ_NOT_EMPTY;
    }

    // the sink also goes to the sketch state of sparse decode (see llama_h2o_set_seq_decode)
    ctx->synchronize();
    kv->h2o().set_select_seq(seq_id, select, n_sink, n_dense_tail);

    return LLAMA_H2O_STATUS_OK;
}

int32_t llama_h2o_set_seq_decode(llama_context * ctx, llama_seq_id seq_id, int32_t n_budget) {
    auto * kv = ctx ? llama_h2o_kv(ctx->get_memory()) : nullptr;
    if (!kv || !kv->h2o().enabled() || kv->h2o().decode_budget() == 0) {
        return LLAMA_H2O_STATUS_DISABLED;
    }

    if (seq_id < 0 || (uint32_t) seq_id >= kv->get_n_seq_max()) {
        return LLAMA_H2O_STATUS_INVALID_SEQ;
    }

    if (n_budget < -1 || (n_budget >= 0 && (uint32_t) n_budget > ctx->n_ctx_seq())) {
        return LLAMA_H2O_STATUS_INVALID_RANGE;
    }

    // the budget goes to the sketch state, where the backend may still be reading it for a step in flight
    ctx->synchronize();
    kv->h2o().set_decode_budget_seq(seq_id, n_budget);

    return LLAMA_H2O_STATUS_OK;
}

float llama_h2o_decode_keys(llama_context * ctx, llama_seq_id seq_id) {
    auto * kv = ctx ? llama_h2o_kv(ctx->get_memory()) : nullptr;
    if (!kv || !kv->h2o().enabled() || kv->h2o().decode_budget() == 0 || seq_id < 0 ||
            (uint32_t) seq_id >= kv->get_n_seq_max() || !ctx->h2o_last_decode_sparse()) {
        return -1.0f;
    }

    ctx->synchronize();
    return kv->h2o().decode_keys_read(kv->h2o().stream(seq_id));
}

int32_t llama_h2o_get_layers(const llama_context * ctx, int32_t * dst, size_t n_dst) {
    const auto * kv = llama_h2o_cache(ctx);
    if (!kv) {
        return LLAMA_H2O_STATUS_DISABLED;
    }

    const auto layer_ids = kv->get_layer_ids();
    if (!dst || n_dst < layer_ids.size()) {
        return LLAMA_H2O_STATUS_INVALID_RANGE;
    }

    for (size_t i = 0; i < layer_ids.size(); ++i) {
        dst[i] = (int32_t) layer_ids[i];
    }

    return (int32_t) layer_ids.size();
}

// checks a (layer, query head) pair against the cache; LLAMA_H2O_STATUS_OK when both exist
static int32_t llama_h2o_check_head(const llama_kv_cache * kv, int32_t il, int32_t ih) {
    const auto layer_ids = kv->get_layer_ids();

    if (il < 0 || std::find(layer_ids.begin(), layer_ids.end(), (uint32_t) il) == layer_ids.end()) {
        return LLAMA_H2O_STATUS_INVALID_LAYER;
    }

    if (ih < 0 || ih >= kv->h2o().get_scores(il)->ne[1]) {
        return LLAMA_H2O_STATUS_INVALID_HEAD;
    }

    return LLAMA_H2O_STATUS_OK;
}

int32_t llama_h2o_get_memory_indices(const llama_context * ctx, int32_t il, int32_t ih, int32_t * dst, size_t n_dst) {
    const auto * kv = llama_h2o_cache(ctx);
    if (!kv) {
        return LLAMA_H2O_STATUS_DISABLED;
    }

    const int32_t status = llama_h2o_check_head(kv, il, ih);
    if (status != LLAMA_H2O_STATUS_OK) {
        return status;
    }

    if (!dst || n_dst < kv->h2o().n_memory()) {
        return LLAMA_H2O_STATUS_INVALID_RANGE;
    }

    kv->h2o().read_memory_indices(il, ih, dst);

    return kv->h2o().n_memory();
}

int32_t llama_h2o_get_scores(const llama_context * ctx, int32_t il, int32_t ih, int32_t pos0, int32_t n, float * dst) {
    const auto * kv = llama_h2o_cache(ctx);
    if (!kv) {
        return LLAMA_H2O_STATUS_DISABLED;
    }

    const int32_t status = llama_h2o_check_head(kv, il, ih);
    if (status != LLAMA_H2O_STATUS_OK) {
        return status;
    }

    if (pos0 < 0 || n < 0 || (int64_t) pos0 + n > (int64_t) kv->get_size() || (n > 0 && !dst)) {
        return LLAMA_H2O_STATUS_INVALID_RANGE;
    }

    kv->h2o().read_scores(il, ih, pos0, n, dst);

    return n;
}
