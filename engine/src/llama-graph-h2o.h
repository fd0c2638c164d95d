#pragma once

// H2O in a layer's attention graph (llm_graph_context::build_attn, both for dense models and for the
// non-SWA layers of interleaved ones): the sparse prefill or the sparse decode op where the KV cache runs
// them for this ubatch.

struct ggml_tensor;
struct llm_graph_context;
class llama_kv_cache_context;

// The layer's attention output as [n_embd_v*n_head, n_tokens] when H2O runs it for this ubatch (a prompt
// ubatch of an H2O cache, or a decode step with sparse decode), nullptr when full attention does.
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
        int                            il);
