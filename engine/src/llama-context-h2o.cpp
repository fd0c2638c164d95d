// H2O in llama_context: its parameters, where the scheduler places its ops, and the chunk state followed
// on the host after each prefill graph (see llama-context-h2o.h).

#include "llama-context-h2o.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-model.h"

#include <algorithm>
#include <cinttypes>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

void llama_h2o_cparams_init(llama_cparams & cparams, const llama_context_params & params, const llama_model & model) {
    if (params.h2o_local < 0 || params.h2o_heavy < 0) {
        throw std::runtime_error(format("H2O: h2o_local = %d and h2o_heavy = %d must both be >= 0", params.h2o_local, params.h2o_heavy));
    }

    cparams.h2o_local      = params.h2o_local;
    cparams.h2o_heavy      = params.h2o_heavy;
    cparams.h2o_select     = params.h2o_select;
    cparams.h2o_sink       = std::max(params.h2o_sink, 0);
    cparams.h2o_dense_tail = std::max(params.h2o_dense_tail, 0);
    cparams.h2o_coverage   = params.h2o_coverage;
    cparams.h2o_tile_samples = params.h2o_tile_samples;
    cparams.h2o_tile_sketch  = params.h2o_tile_sketch;
    cparams.h2o_tile_pool    = params.h2o_tile_pool;
    cparams.h2o_undo_log   = params.h2o_undo_log;
    cparams.h2o_decode_budget = std::max(params.h2o_decode_budget, 0);
    cparams.h2o_decode_coverage = params.h2o_decode_coverage;

    if (cparams.h2o_local + (uint64_t) cparams.h2o_heavy > 0) {
        const uint64_t n_memory = cparams.h2o_local + (uint64_t) cparams.h2o_heavy;

        if (n_memory >= cparams.n_ubatch) {
            throw std::runtime_error(format("H2O: the memory h2o_local + h2o_heavy = %" PRIu64 " must be smaller than the chunk size n_ubatch = %u: "
                        "lower h2o_local/h2o_heavy or raise n_ubatch", n_memory, cparams.n_ubatch));
        }
        if (cparams.n_seq_max > 1 && cparams.kv_unified) {
            throw std::runtime_error(format("H2O: each sequence needs its own KV stream for its H2O state, but the n_seq_max = %u "
                        "sequences share a unified cache: set kv_unified = false", cparams.n_seq_max));
        }
        if (!llama_h2o_select_known(params.h2o_select)) {
            throw std::runtime_error(format("H2O: unknown h2o_select = %d: use LLAMA_H2O_SELECT_SEED, _HYBRID or _COVERAGE "
                        "(1 and 2, whole blocks by the chunk's own queries, were retired; the hybrid chooses half of its "
                        "budget that way)", (int) params.h2o_select));
        }
        if (!(params.h2o_coverage > 0.0f && params.h2o_coverage <= 1.0f)) {
            throw std::runtime_error(format("H2O: the coverage target h2o_coverage = %g must be in (0, 1]", (double) params.h2o_coverage));
        }
        if (params.h2o_tile_samples < 1 || params.h2o_tile_samples > GGML_H2O_TILE || GGML_H2O_TILE % params.h2o_tile_samples != 0) {
            throw std::runtime_error(format("H2O: h2o_tile_samples = %d must divide the tile of %d queries: use 1, 2, 4, 8, 16, 32 or 64",
                        params.h2o_tile_samples, GGML_H2O_TILE));
        }
        if (params.h2o_tile_sketch < 1 || model.hparams.n_embd_head_k_full % (uint32_t) params.h2o_tile_sketch != 0) {
            throw std::runtime_error(format("H2O: h2o_tile_sketch = %d must divide the head size %u: the sketch keeps 1/h2o_tile_sketch "
                        "of the key channels (1: all)", params.h2o_tile_sketch, model.hparams.n_embd_head_k_full));
        }
        if (params.h2o_tile_pool != 0 && (params.h2o_select != LLAMA_H2O_SELECT_COVERAGE ||
                    params.h2o_tile_pool < GGML_H2O_MAX_HEAVY_FACTOR*params.h2o_heavy)) {
            throw std::runtime_error(format("H2O: h2o_tile_pool = %d must be 0 (off) or, with h2o_select = LLAMA_H2O_SELECT_COVERAGE, "
                        "at least %d * h2o_heavy = %d: each tile proposes that many candidates from the pool",
                        params.h2o_tile_pool, GGML_H2O_MAX_HEAVY_FACTOR, GGML_H2O_MAX_HEAVY_FACTOR*params.h2o_heavy));
        }
        if (params.h2o_sink < 0 || params.h2o_sink > params.h2o_heavy) {
            throw std::runtime_error(format("H2O: the sink h2o_sink = %d must be in [0, h2o_heavy = %d]: the sink positions "
                        "take their places out of the heavy budget", params.h2o_sink, params.h2o_heavy));
        }
        if (params.h2o_dense_tail < 0 || (uint32_t) params.h2o_dense_tail > cparams.n_ctx) {
            throw std::runtime_error(format("H2O: the dense tail h2o_dense_tail = %d must be in [0, n_ctx = %u]",
                        params.h2o_dense_tail, cparams.n_ctx));
        }
        if (params.h2o_decode_budget < 0 || (uint32_t) params.h2o_decode_budget > cparams.n_ctx_seq) {
            throw std::runtime_error(format("H2O: the sparse decode budget h2o_decode_budget = %d must be in [0, n_ctx_seq = %u]: "
                        "a step cannot attend to more positions than the sequence holds", params.h2o_decode_budget, cparams.n_ctx_seq));
        }
        if (!(params.h2o_decode_coverage > 0.0f && params.h2o_decode_coverage <= 1.0f)) {
            throw std::runtime_error(format("H2O: the sparse decode coverage h2o_decode_coverage = %g must be in (0, 1]",
                        (double) params.h2o_decode_coverage));
        }
        if (params.h2o_decode_coverage != 1.0f && params.h2o_decode_budget == 0) {
            throw std::runtime_error("H2O: h2o_decode_coverage caps what h2o_decode_budget chooses: set h2o_decode_budget > 0 too");
        }
        if (params.h2o_decode_budget > 0) {
            // the key sketch takes a quarter of a head's channels in quads (GGML_H2O_DECODE_SKETCH_SIZE)
            for (uint32_t il = 0; il < model.hparams.n_layer(); ++il) {
                if (model.hparams.n_embd_head_k(il) % 16 != 0) {
                    throw std::runtime_error(format("H2O: sparse decode needs key heads of a multiple of 16 channels, "
                                "and layer %u's have %u: use full decode (h2o_decode_budget = 0)", il, model.hparams.n_embd_head_k(il)));
                }
            }
        }
        if (!cparams.causal_attn) {
            throw std::runtime_error("H2O: sparse prefill needs causal attention");
        }
        if (params.ctx_type != LLAMA_CONTEXT_TYPE_DEFAULT || params.ctx_other != nullptr) {
            throw std::runtime_error("H2O: sparse prefill needs a default context that owns its memory");
        }
    } else if (params.h2o_sink != 0 || params.h2o_dense_tail != 0 || params.h2o_select != LLAMA_H2O_SELECT_SEED || params.h2o_undo_log ||
               params.h2o_coverage != 1.0f || params.h2o_tile_samples != llama_context_default_params().h2o_tile_samples ||
               params.h2o_tile_sketch != 1 || params.h2o_tile_pool != 0 || params.h2o_decode_budget != 0 ||
               params.h2o_decode_coverage != 1.0f) {
        throw std::runtime_error("H2O: h2o_select, h2o_sink, h2o_dense_tail, h2o_coverage, h2o_tile_samples, h2o_tile_sketch, "
                "h2o_tile_pool, h2o_undo_log, h2o_decode_budget and h2o_decode_coverage need H2O on (h2o_local + h2o_heavy > 0)");
    }
}

void llama_h2o_cparams_log(const llama_cparams & cparams) {
    if (cparams.h2o_local + cparams.h2o_heavy == 0) {
        return;
    }
    // the lines of the context's other settings are llama_context's
    LLAMA_LOG_INFO("%s: h2o_local             = %u\n",   "llama_context", cparams.h2o_local);
    LLAMA_LOG_INFO("%s: h2o_heavy             = %u\n",   "llama_context", cparams.h2o_heavy);
    LLAMA_LOG_INFO("%s: h2o_select            = %d\n",   "llama_context", (int) cparams.h2o_select);
    LLAMA_LOG_INFO("%s: h2o_sink              = %u\n",   "llama_context", cparams.h2o_sink);
    LLAMA_LOG_INFO("%s: h2o_dense_tail        = %u\n",   "llama_context", cparams.h2o_dense_tail);
    LLAMA_LOG_INFO("%s: h2o_coverage          = %g\n",   "llama_context", (double) cparams.h2o_coverage);
    LLAMA_LOG_INFO("%s: h2o_tile_samples      = %d\n",   "llama_context", cparams.h2o_tile_samples);
    LLAMA_LOG_INFO("%s: h2o_tile_sketch       = %d\n",   "llama_context", cparams.h2o_tile_sketch);
    LLAMA_LOG_INFO("%s: h2o_tile_pool         = %d\n",   "llama_context", cparams.h2o_tile_pool);
    LLAMA_LOG_INFO("%s: h2o_undo_log          = %s\n",   "llama_context", cparams.h2o_undo_log ? "true" : "false");
}

// Whether backend runs node where the answer is not local: an RPC backend's supports_op says yes to every op
// without asking its server, so its registry offers a call that asks (found by name, so that no build needs
// ggml-rpc); every other backend answered when the scheduler placed the op.
static bool llama_h2o_remote_supports_op(ggml_backend_t backend, const ggml_tensor * node) {
    using supports_op_remote_t = bool (*)(ggml_backend_dev_t, const ggml_tensor *);

    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    auto supports_op_remote = reg ? (supports_op_remote_t) ggml_backend_reg_get_proc_address(reg,
            "ggml_backend_rpc_device_supports_op_remote") : nullptr;
    return supports_op_remote == nullptr || supports_op_remote(dev, node);
}

// what an H2O op asks of a backend's kernels, for the messages that refuse one
static std::string llama_h2o_op_config(const ggml_tensor * node) {
    if (node->op == GGML_OP_H2O_DECODE) {
        return "sparse decode (h2o_decode_budget > 0)";
    }
    const int32_t * p = (const int32_t *) node->op_params;
    if (p[GGML_H2O_ATTN_POOL] != 0) {
        return format("h2o_select = %d and h2o_tile_pool = %d", p[GGML_H2O_ATTN_SELECT], p[GGML_H2O_ATTN_POOL]);
    }
    return format("h2o_select = %d", p[GGML_H2O_ATTN_SELECT]);
}

bool llama_h2o_check_placement(ggml_backend_sched_t sched, ggml_cgraph * gf, bool log) {
    std::vector<std::pair<ggml_backend_t, int>> n_per_backend;
    int n_ops = 0;
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        if (node->op != GGML_OP_H2O_ATTN && node->op != GGML_OP_H2O_DECODE) {
            continue;
        }
        ggml_backend_t backend = ggml_backend_sched_get_tensor_backend(sched, node);
        if (backend == nullptr) {
            LLAMA_LOG_ERROR("%s: H2O: the scheduler assigned no backend to %s\n", __func__, node->name);
            return false;
        }
        if (!llama_h2o_remote_supports_op(backend, node)) {
            ggml_backend_dev_t dev = ggml_backend_get_device(backend);
            LLAMA_LOG_ERROR("%s: H2O: %s (%s) holds the state of %s but its server cannot run it with %s: that server's "
                    "H2O kernels do not implement it, or it runs another build. Choose another h2o_select (or full decode, "
                    "h2o_decode_budget = 0), or keep those layers local (n_gpu_layers)\n", __func__, ggml_backend_name(backend),
                    dev ? ggml_backend_dev_description(dev) : "?", node->name, llama_h2o_op_config(node).c_str());
            return false;
        }
        // a backend that holds the state but cannot run the op as configured (its kernels lack the op's memory
        // selection) leaves it to another backend: say which, and why
        const ggml_tensor * scores = node->src[3];
        ggml_backend_buffer_t state_buf = scores->view_src ? scores->view_src->buffer : scores->buffer;
        for (int b = 0; state_buf != nullptr && b < ggml_backend_sched_get_n_backends(sched); ++b) {
            ggml_backend_t other = ggml_backend_sched_get_backend(sched, b);
            if (other != backend && ggml_backend_supports_buft(other, ggml_backend_buffer_get_type(state_buf)) &&
                !ggml_backend_supports_op(other, node)) {
                LLAMA_LOG_ERROR("%s: H2O: %s holds the state of %s but cannot run it with %s: its H2O kernels do not "
                        "implement it. Choose another h2o_select (or full decode, h2o_decode_budget = 0), or keep those "
                        "layers on the CPU (n_gpu_layers)\n", __func__, ggml_backend_name(other), node->name,
                        llama_h2o_op_config(node).c_str());
                return false;
            }
        }
        // the state: scores, memory sets and sums of H2O_ATTN; block summaries and their count of H2O_DECODE
        for (int j = 3; j <= (node->op == GGML_OP_H2O_ATTN ? 5 : 4); ++j) {
            const ggml_tensor * state = node->src[j];
            ggml_backend_buffer_t buf = state->view_src ? state->view_src->buffer : state->buffer;
            if (buf == nullptr || !ggml_backend_supports_buft(backend, ggml_backend_buffer_get_type(buf))) {
                LLAMA_LOG_ERROR("%s: H2O: the scheduler placed %s on %s, which cannot use the %s buffer holding its state %s: "
                        "the op would update a copy of the state. The backend of the offloaded layers must support "
                        "GGML_OP_H2O_ATTN (build with its H2O kernels), or keep those layers on the CPU (n_gpu_layers)\n",
                        __func__, node->name, ggml_backend_name(backend),
                        buf ? ggml_backend_buffer_name(buf) : "(unallocated)", state->name);
                return false;
            }
        }
        auto it = std::find_if(n_per_backend.begin(), n_per_backend.end(), [&](const auto & e) { return e.first == backend; });
        if (it == n_per_backend.end()) {
            n_per_backend.emplace_back(backend, 1);
        } else {
            it->second++;
        }
        n_ops++;
    }
    if (log && n_ops > 0) {
        std::string where;
        for (const auto & [backend, n] : n_per_backend) {
            where += format("%s%s %d", where.empty() ? "" : ", ", ggml_backend_name(backend), n);
        }
        LLAMA_LOG_INFO("%s: H2O attention ops: %d, each on the backend holding its state (%s)\n", __func__, n_ops, where.c_str());
    }
    return true;
}

void llama_h2o_check_reserved(ggml_backend_sched_t sched, ggml_cgraph * gf, const char * what) {
    ggml_backend_sched_split_graph(sched, gf);
    const bool placed = llama_h2o_check_placement(sched, gf, true);
    ggml_backend_sched_reset(sched);
    if (!placed) {
        throw std::runtime_error(format("H2O: an H2O %s op was placed away from its state (see the log)", what));
    }
}

const llama_kv_cache_context * llama_h2o_kv_context(const llama_memory_context_i * mctx) {
    if (const auto * iswa = dynamic_cast<const llama_kv_cache_iswa_context *>(mctx)) {
        return iswa->get_base();
    }
    return dynamic_cast<const llama_kv_cache_context *>(mctx);
}

bool llama_context::h2o_prefill(const llama_memory_context_i * mctx, const llama_ubatch & ubatch) const {
    const auto * kv_ctx = llama_h2o_kv_context(mctx);
    return cparams.h2o_local + cparams.h2o_heavy > 0 && kv_ctx && kv_ctx->h2o_prefill(ubatch);
}

bool llama_context::h2o_decode(const llama_memory_context_i * mctx, const llama_ubatch & ubatch) const {
    const auto * kv_ctx = llama_h2o_kv_context(mctx);
    return cparams.h2o_decode_budget > 0 && kv_ctx && kv_ctx->h2o_decode(ubatch);
}

void llama_context::h2o_prefill_done(const llama_memory_context_i * mctx, const llama_ubatch & ubatch) {
    auto * kv = llama_h2o_kv(memory.get());
    if (!kv || !kv->h2o().enabled()) {
        return;
    }
    const auto *   kv_ctx = llama_h2o_kv_context(mctx);
    const uint32_t s      = kv_ctx->h2o_stream();
    kv->h2o().prefill_done(ubatch.pos[0], ubatch.n_tokens, kv_ctx->h2o_tail_start(), s);
    if (kv->h2o().undo_log_on() && kv->h2o().at_chunk_boundary(s)) {
        // the undo log reads the state the graph has just written
        ggml_backend_sched_synchronize(sched.get());
        kv->h2o().undo_record(s);
    }
}
