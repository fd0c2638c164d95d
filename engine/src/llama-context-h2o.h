#pragma once

// H2O in llama_context: its parameters checked into cparams, where the scheduler places the H2O ops,
// and the chunk state followed on the host after each prefill graph. Called from llama-context.cpp;
// the llama_context members named here are defined in llama-context-h2o.cpp.

#include "llama.h"

struct ggml_backend_sched;
struct ggml_cgraph;
struct llama_cparams;
struct llama_model;
class llama_kv_cache_context;
struct llama_memory_context_i;

// Copies the H2O settings of params into cparams, or throws naming the setting that is out of range and
// what to change. Called once n_ctx, n_ctx_seq, n_ubatch, n_seq_max and causal_attn are known.
void llama_h2o_cparams_init(llama_cparams & cparams, const llama_context_params & params, const llama_model & model);

// Logs the H2O settings beside the context's others (nothing when H2O is off).
void llama_h2o_cparams_log(const llama_cparams & cparams);

// Every H2O op of gf runs on a backend that holds its state. GGML_OP_H2O_ATTN updates its scores,
// memory indices and accumulators in place; the scheduler runs an op on a backend that cannot use one
// of its sources' buffers against a copy of that source, so an H2O op placed away from its state would
// update the copy and leave the state stale. Returns false, saying which op went where, in that case;
// with log set, says where the graph's H2O ops run.
bool llama_h2o_check_placement(ggml_backend_sched * sched, ggml_cgraph * gf, bool log);

// The same for a graph just reserved (the reserve leaves the scheduler reset, so the graph is split
// again to see where each op goes); throws when an op of `what` ("attention", "sparse decode") is placed
// away from its state.
void llama_h2o_check_reserved(ggml_backend_sched * sched, ggml_cgraph * gf, const char * what);

// The KV cache context holding the H2O state: the cache of a dense model, or the non-SWA cache of a
// model with interleaved sliding-window layers; nullptr for other memories.
const llama_kv_cache_context * llama_h2o_kv_context(const llama_memory_context_i * mctx);
