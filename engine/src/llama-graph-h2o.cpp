// H2O in a layer's attention graph: the sparse prefill or decode op for the ubatch, its logit parameters,
// its name, and its placement beside its state.

#include "llama-graph-h2o.h"

#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-kv-cache.h"

// GGML_OP_H2O_ATTN writes its state (src[3..5]) in place, which the scheduler does not know: left to
// itself, it may run the op on a neighbouring node's backend (a GPU that took over the projections of
// a layer kept on the CPU, say) against copies of the state. Pin the op to the first backend, in the
// scheduler's priority order, that can use the state's buffer and run the op. When there is none, the
// op is left alone and the placement check at context creation reports it.
static void llama_h2o_pin_to_state(ggml_backend_sched_t sched, ggml_tensor * op) {
    const ggml_tensor * state = op->src[3];
    ggml_backend_buffer_t buf = state->view_src ? state->view_src->buffer : state->buffer;
    if (sched == nullptr || buf == nullptr) {
        return;
    }
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t backend = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_supports_buft(backend, ggml_backend_buffer_get_type(buf)) && ggml_backend_supports_op(backend, op)) {
            ggml_backend_sched_set_tensor_backend(sched, op, backend);
            return;
        }
    }
}

ggml_tensor * llama_h2o_build_attn(
        const llm_graph_context      & graph,
        const llama_kv_cache_context * mctx,
        ggml_tensor                  * q,
        ggml_tensor                  * k,
        ggml_tensor                  * v,
        ggml_tensor                  * kq_b,
        ggml_tensor                  * kq_mask,
        ggml_tensor                  * sinks,
        float                          kq_scale,
        int                            il) {
    if (graph.cparams.training) {
        return nullptr;
    }

    const bool prefill = mctx->h2o_prefill(graph.ubatch);
    if (!prefill && !mctx->h2o_decode(graph.ubatch)) {
        return nullptr;
    }

    // models with a KQ bias are refused when the context is created (llama_model::create_memory)
    GGML_ASSERT(kq_b == nullptr);

    // prefill: each chunk attends to itself and to its memory set; decode: each query reads the sinks, its recent
    // window and the key blocks it points at
    ggml_tensor * cur = prefill ?
        mctx->h2o_attn(graph.ctx0, q, k, v, il, kq_scale, graph.ubatch) :
        mctx->h2o_decode_attn(graph.ctx0, q, k, v, kq_mask, il, kq_scale);

    const auto & hparams = graph.hparams;
    ggml_h2o_attn_set_logits(cur, hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f, sinks);
    graph.cb(cur, prefill ? "h2o_attn" : "h2o_decode", il);
    llama_h2o_pin_to_state(graph.sched, cur);

    return ggml_reshape_2d(graph.ctx0, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
}
