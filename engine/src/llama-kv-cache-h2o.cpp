// The H2O state of llama_kv_cache (swa_type == LLAMA_SWA_TYPE_H2O): per layer and stream the scores, memory sets and
// chunk sums of the sparse prefill, the chunk bookkeeping, the undo log of prompt cuts, the key sketches of sparse
// decode, and their part of llama.cpp's state files (see llama-kv-cache-h2o.h), and the H2O calls of
// llama_kv_cache_context.

#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"

#include "llama-cparams.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-context.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <stdexcept>
#include <unordered_map>

//
// H2O chunked sparse prefill
//

// the rounding of ggml_fp32_to_bf16 (to nearest even, NaN kept quiet), inlined for the per-score loops
static inline ggml_bf16_t h2o_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));

    ggml_bf16_t h;
    if ((u & 0x7fffffff) > 0x7f800000) {
        h.bits = (u >> 16) | 64;
        return h;
    }
    h.bits = (u + (0x7fff + ((u >> 16) & 1))) >> 16;
    return h;
}

static inline float h2o_bf16_to_f32(ggml_bf16_t h) {
    const uint32_t u = (uint32_t) h.bits << 16;

    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

// host access to an H2O state tensor: its own memory on a host buffer, a staged copy otherwise
// (a device buffer is written back by commit())
struct llama_h2o_host_view {
    ggml_tensor * t;
    uint8_t     * data;

    std::vector<uint8_t> staging;

    explicit llama_h2o_host_view(ggml_tensor * t) : t(t) {
        if (ggml_backend_buffer_is_host(t->buffer)) {
            data = (uint8_t *) t->data;
        } else {
            staging.resize(ggml_nbytes(t));
            ggml_backend_tensor_get(t, staging.data(), 0, staging.size());
            data = staging.data();
        }
    }

    void commit() {
        if (!staging.empty()) {
            ggml_backend_tensor_set(t, staging.data(), 0, staging.size());
        }
    }
};

llama_kv_cache_h2o::llama_kv_cache_h2o(llama_kv_cache & kv, uint32_t n_local, uint32_t n_heavy, uint32_t n_chunk) :
    kv(kv), local_window(n_local), heavy_budget(n_heavy), memory_size(n_local + n_heavy), chunk_size(n_chunk) {
}

void llama_kv_cache_h2o::check(uint32_t kv_size, ggml_type type_k, ggml_type type_v, bool own_cells) const {
    if (kv.swa_type != LLAMA_SWA_TYPE_H2O) {
        GGML_ASSERT(memory_size == 0 && "h2o_local/h2o_heavy need swa_type == LLAMA_SWA_TYPE_H2O");
        return;
    }
    // an H2O state describes the sequence of one stream, whose token at position p lives in cell p of the stream:
    // several sequences need a stream each
    if (kv.n_stream != kv.n_seq_max) {
        throw std::runtime_error(format("H2O sparse prefill serves one sequence per KV stream, but n_seq_max = %u share "
                    "a unified cache: set kv_unified = false", kv.n_seq_max));
    }
    if (!own_cells) {
        throw std::runtime_error("H2O sparse prefill needs a KV cache with its own cells for every layer");
    }
    if (kv.v_trans) {
        throw std::runtime_error("H2O sparse prefill gathers V rows per token and needs a non-transposed V cache");
    }
    if (memory_size == 0 || memory_size >= kv_size) {
        throw std::runtime_error(format("H2O memory size L + H = %u must be in [1, %u)", memory_size, kv_size));
    }
    if (chunk_size <= memory_size) {
        throw std::runtime_error(format("H2O chunk size %u must be larger than the memory size L + H = %u", chunk_size, memory_size));
    }
    // the op reads K and V head by head, converting each row to F32
    for (const auto & [name, type] : { std::make_pair("K", type_k), std::make_pair("V", type_v) }) {
        if (type != GGML_TYPE_F32 && ggml_get_type_traits(type)->to_float == nullptr) {
            throw std::runtime_error(format("H2O sparse prefill cannot read a %s cache of type %s: use f16, bf16, f32 or a "
                        "quantized type such as q8_0 or q4_0", name, ggml_type_name(type)));
        }
        for (uint32_t il = 0; il < kv.hparams.n_layer(); ++il) {
            const uint32_t n_embd_head = name[0] == 'K' ? kv.hparams.n_embd_head_k(il) : kv.hparams.n_embd_head_v(il);
            if (n_embd_head % ggml_blck_size(type) != 0) {
                throw std::runtime_error(format("H2O sparse prefill reads the %s cache by heads of %u elements, which type %s "
                            "packs in blocks of %d: use f16 or bf16 for this model", name, n_embd_head,
                            ggml_type_name(type), (int) ggml_blck_size(type)));
            }
        }
    }
}

void llama_kv_cache_h2o::add_layer(ggml_context * ctx, uint32_t il, uint32_t kv_size, const char * name_tag) {
    if (!enabled()) {
        return;
    }

    const uint32_t n_head = kv.hparams.n_head(il);

    strm.resize(kv.n_stream);

    for (uint32_t s = 0; s < kv.n_stream; ++s) {
        ggml_tensor * scores  = ggml_new_tensor_2d(ctx, GGML_TYPE_BF16, kv_size, n_head);
        ggml_tensor * mem_idx = ggml_new_tensor_2d(ctx, GGML_TYPE_I32,  memory_size, n_head);

        ggml_tensor * acc     = ggml_new_tensor_2d(ctx, GGML_TYPE_F32,  chunk_size + memory_size, n_head);

        // stream 0 keeps the names of a single-sequence cache
        const std::string suffix = s == 0 ? "" : format("_s%u", s);

        ggml_format_name(scores,  "h2o_scores_%sl%d%s",  name_tag, il, suffix.c_str());
        ggml_format_name(mem_idx, "h2o_mem_idx_%sl%d%s", name_tag, il, suffix.c_str());
        ggml_format_name(acc,     "h2o_acc_%sl%d%s",     name_tag, il, suffix.c_str());

        strm[s].scores.push_back(scores);
        strm[s].memory_indices.push_back(mem_idx);
        strm[s].accumulators.push_back(acc);
    }
}

void llama_kv_cache_h2o::init(size_t memory_size_kv) {
    if (!enabled()) {
        return;
    }

    size_t memory_size_scores  = 0;
    size_t memory_size_indices = 0;
    size_t memory_size_acc     = 0;

    for (const auto & hs : strm) {
        for (size_t i = 0; i < hs.scores.size(); ++i) {
            memory_size_scores  += ggml_nbytes(hs.scores[i]);
            memory_size_indices += ggml_nbytes(hs.memory_indices[i]);
            memory_size_acc     += ggml_nbytes(hs.accumulators[i]);
        }
    }

    const size_t memory_size_h2o = memory_size_scores + memory_size_indices + memory_size_acc;

    LLAMA_LOG_INFO("%s: H2O (L = %u, H = %u, S = %u): %7.2f MiB = %.2f%% of K+V, scores (bf16): %7.2f MiB, memory indices (i32): %7.2f MiB, chunk sums (f32): %7.2f MiB\n", "llama_kv_cache",
            local_window, heavy_budget, chunk_size,
            (float)memory_size_h2o / (1024.0f * 1024.0f),
            100.0 * memory_size_h2o / memory_size_kv,
            (float)memory_size_scores  / (1024.0f * 1024.0f),
            (float)memory_size_indices / (1024.0f * 1024.0f),
            (float)memory_size_acc     / (1024.0f * 1024.0f));

    if (!kv.hparams.no_alloc) {
        reset_all();
    }
}

void llama_kv_cache_h2o::configure(const llama_cparams & cparams) {
    set_select(cparams.h2o_select, cparams.h2o_sink, cparams.h2o_dense_tail);
    set_undo_log(cparams.h2o_undo_log);
    set_coverage(cparams.h2o_coverage, cparams.h2o_tile_samples, cparams.h2o_tile_sketch, cparams.h2o_tile_pool);
    set_decode(cparams.h2o_decode_budget, cparams.h2o_decode_coverage);
}

uint32_t llama_kv_cache_h2o::stream(llama_seq_id seq_id) const {
    return kv.seq_to_stream.at(seq_id);
}

bool llama_kv_cache_h2o::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    if (!enabled()) {
        return true;
    }

    // each sequence's scores and memory sets describe it whole: ask every sequence concerned before changing any
    std::vector<std::pair<uint32_t, uint32_t>> undo; // (stream, chunk boundary) to cut back to
    for (uint32_t s = 0; s < kv.n_stream; ++s) {
        if (seq_id >= 0 && s != kv.seq_to_stream[seq_id]) {
            continue;
        }
        int32_t c = -1;
        if (!seq_rm_allowed(s, p0, p1, c)) {
            return false;
        }
        if (c >= 0) {
            undo.emplace_back(s, (uint32_t) c);
        }
    }
    for (const auto & [s, c] : undo) {
        undo_to(c, s);
    }
    // the cells from p0 on will be written again
    for (uint32_t s = 0; s < kv.n_stream; ++s) {
        if (seq_id < 0 || s == kv.seq_to_stream[seq_id]) {
            decode_invalidate(s, p0);
        }
    }

    return true;
}

void llama_kv_cache_h2o::seq_rm_done(llama_seq_id seq_id) {
    // an emptied sequence has no H2O state either
    for (uint32_t s = 0; enabled() && s < kv.n_stream; ++s) {
        if ((seq_id < 0 || s == kv.seq_to_stream[seq_id]) && kv.v_cells[s].get_used() == 0) {
            reset(s);
        }
    }
}

bool llama_kv_cache_h2o::find_slot(const llama_ubatch & ubatch, uint32_t s, uint32_t n_tokens, llama_seq_id seq_id,
        std::vector<uint32_t> & idxs) const {
    const auto & cells = kv.v_cells[kv.seq_to_stream[seq_id]];

    // the tokens of this sequence are [s*n_tokens, (s + 1)*n_tokens) of the ubatch
    const llama_pos * pos_seq = ubatch.pos + s*n_tokens;

    for (uint32_t i = 0; i < n_tokens; ++i) {
        const llama_pos pos = pos_seq[i];

        if (pos < 0 || (uint32_t) pos >= cells.size() || !cells.is_empty(pos)) {
            LLAMA_LOG_ERROR("%s: H2O: position %d of sequence %d has no free cell (cache size %u)\n", __func__, pos, seq_id, cells.size());
            return false;
        }

        if (i > 0 && pos != pos_seq[i - 1] + 1) {
            LLAMA_LOG_ERROR("%s: H2O: a batch must hold consecutive positions (%d follows %d)\n", __func__, pos, pos_seq[i - 1]);
            return false;
        }

        idxs.push_back(pos);
    }

    return true;
}

void llama_kv_cache_h2o::state_read_begin(llama_io_read_i & io, llama_seq_id seq_id, uint32_t & n_stream_cur, selection & sel) const {
    // an H2O state starts with its header where other states hold n_stream
    if (n_stream_cur == LLAMA_H2O_STATE_MAGIC) {
        state_read_header(io, seq_id, sel);
        io.read(&n_stream_cur, sizeof(n_stream_cur));
    } else if (enabled()) {
        throw std::runtime_error("the state holds no H2O state (it was saved with H2O off): load it into a context "
                "with H2O off (h2o_local = h2o_heavy = 0), or evaluate its prompt again");
    }
}

void llama_kv_cache_h2o::state_read_data(llama_io_read_i & io, llama_seq_id seq_id, const selection & sel) {
    if (!enabled()) {
        return;
    }
    try {
        state_read_streams(io, seq_id, sel);
    } catch (...) {
        // K/V without the H2O state that goes with them would make the next prefill silently differ
        for (uint32_t s = 0; s < kv.n_stream; ++s) {
            if (seq_id >= 0 && s != kv.seq_to_stream[seq_id]) {
                continue;
            }
            kv.v_cells[s].reset();
            kv.v_heads[s] = 0;
            reset(s);
        }
        throw;
    }
}

bool llama_kv_cache_h2o::enabled() const {
    return kv.swa_type == LLAMA_SWA_TYPE_H2O && memory_size > 0;
}

size_t llama_kv_cache_h2o::size_bytes() const {
    size_t size = 0;

    for (const auto & hs : strm) {
        for (size_t i = 0; i < hs.scores.size(); ++i) {
            size += ggml_nbytes(hs.scores[i]) + ggml_nbytes(hs.memory_indices[i]) + ggml_nbytes(hs.accumulators[i]);
        }
    }
    for (size_t i = 0; i < dec_summ.size(); ++i) {
        size += ggml_nbytes(dec_summ[i]) + ggml_nbytes(dec_summ_n[i]) + ggml_nbytes(dec_keys[i]);
    }

    return size;
}

void llama_kv_cache_h2o::set_decode(uint32_t n_budget, float coverage) {
    GGML_ASSERT(enabled() && dec_summ.empty());

    dec_budget   = n_budget;
    dec_coverage = coverage;
    if (n_budget == 0) {
        return;
    }

    const int64_t n_block = (kv.get_size() + GGML_H2O_DECODE_BLOCK - 1)/GGML_H2O_DECODE_BLOCK;

    // one context per buffer type of the layers' K, so that each layer's summaries live where its keys do
    std::vector<std::pair<ggml_backend_buffer_type_t, ggml_context_ptr>> ctxs;
    for (const auto & layer : kv.layers) {
        ggml_backend_buffer_t k_buf = layer.k->view_src ? layer.k->view_src->buffer : layer.k->buffer;
        ggml_backend_buffer_type_t buft = k_buf ? ggml_backend_buffer_get_type(k_buf) : ggml_backend_cpu_buffer_type();

        auto it = std::find_if(ctxs.begin(), ctxs.end(), [&](const auto & e) { return e.first == buft; });
        if (it == ctxs.end()) {
            ggml_init_params params = {
                /*.mem_size   =*/ 3*kv.layers.size()*ggml_tensor_overhead(),
                /*.mem_buffer =*/ NULL,
                /*.no_alloc   =*/ true,
            };
            ctxs.emplace_back(buft, ggml_context_ptr(ggml_init(params)));
            it = ctxs.end() - 1;
        }

        const int32_t il = layer.il;

        // each block's sketch: a quarter of the head's channels, 8 bits each and a scale, for its 16 positions; a KV
        // head's blocks one after another, so that a step's estimate reads each head's sketches as one run
        // (build_decode views them in the op's order, [sketch, head, block, stream])
        const int64_t n_chan = kv.hparams.n_embd_head_k(il)/4;
        ggml_tensor * summ   = ggml_new_tensor_4d(it->second.get(), GGML_TYPE_I8,
                GGML_H2O_DECODE_SKETCH_SIZE(kv.hparams.n_embd_head_k(il)), n_block, kv.hparams.n_head_kv(il), kv.n_stream);
        ggml_tensor * summ_n = ggml_new_tensor_2d(it->second.get(), GGML_TYPE_I32, 3 + n_chan*kv.hparams.n_head_kv(il), kv.n_stream);
        ggml_tensor * keys   = ggml_new_tensor_1d(it->second.get(), GGML_TYPE_F32, kv.n_stream);
        ggml_format_name(summ,   "h2o_dec_summ_l%d",   il);
        ggml_format_name(summ_n, "h2o_dec_summ_n_l%d", il);
        ggml_format_name(keys,   "h2o_dec_keys_l%d",   il);

        dec_summ.push_back(summ);
        dec_summ_n.push_back(summ_n);
        dec_keys.push_back(keys);
    }

    for (auto & [buft, ctx] : ctxs) {
        // the size before allocating: once allocated, the context's tensors count for nothing more
        const size_t size = ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.get(), buft);
        ggml_backend_buffer_t buf = nullptr;
        if (!kv.hparams.no_alloc) {
            buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft);
            if (!buf) {
                throw std::runtime_error("H2O: failed to allocate the key sketches of sparse decode");
            }
            ggml_backend_buffer_clear(buf, 0);
        }
        LLAMA_LOG_INFO("%s: H2O sparse decode, budget %u positions: key sketches %7.2f MiB on %s\n", __func__,
                n_budget, size/1024.0/1024.0, ggml_backend_buft_name(buft));
        dec_bufs.emplace_back(std::move(ctx), ggml_backend_buffer_ptr(buf));
    }
    for (uint32_t s = 0; s < strm.size(); ++s) {
        decode_write_own(s);
    }
}

void llama_kv_cache_h2o::set_decode_budget_seq(llama_seq_id seq_id, int32_t n_budget) {
    GGML_ASSERT(enabled() && dec_budget > 0 && n_budget >= -1);

    const uint32_t s = stream(seq_id);
    strm[s].n_decode_budget = n_budget;
    decode_write_own(s);
}

uint32_t llama_kv_cache_h2o::decode_budget(uint32_t s0, uint32_t s1) const {
    uint32_t budget = UINT32_MAX;
    for (uint32_t s = s0; s <= s1 && s < strm.size(); ++s) {
        const int32_t own = strm[s].n_decode_budget;
        budget = std::min(budget, own >= 0 ? (uint32_t) own : dec_budget);
    }
    return budget == UINT32_MAX ? dec_budget : budget;
}

float llama_kv_cache_h2o::decode_keys_read(uint32_t s) const {
    if (dec_keys.empty() || kv.hparams.no_alloc) {
        return 0.0f;
    }

    double sum = 0.0;
    for (ggml_tensor * keys : dec_keys) {
        float n = 0.0f;
        ggml_backend_tensor_get(keys, &n, s*sizeof(float), sizeof(float));
        sum += n;
    }
    return (float) (sum/dec_keys.size());
}

void llama_kv_cache_h2o::decode_write_own(uint32_t s) {
    if (dec_summ_n.empty() || kv.hparams.no_alloc) {
        return;
    }

    // the stream's sink, and its own budget (-1: the context's)
    const int32_t own[2] = { (int32_t) strm[s].n_sink, strm[s].n_decode_budget };
    for (ggml_tensor * summ_n : dec_summ_n) {
        ggml_backend_tensor_set(summ_n, own, s*summ_n->nb[1] + (summ_n->ne[0] - 2)*sizeof(int32_t), sizeof(own));
    }
}

void llama_kv_cache_h2o::decode_invalidate(uint32_t s, llama_pos p) {
    if (dec_summ_n.empty() || kv.hparams.no_alloc) {
        return;
    }

    const int32_t keep = std::max<llama_pos>(p, 0)/GGML_H2O_DECODE_BLOCK;
    for (ggml_tensor * summ_n : dec_summ_n) {
        int32_t n = 0;
        ggml_backend_tensor_get(summ_n, &n, s*summ_n->nb[1], sizeof(int32_t));
        if (n > keep) {
            ggml_backend_tensor_set(summ_n, &keep, s*summ_n->nb[1], sizeof(int32_t));
        }
    }
}

ggml_tensor * llama_kv_cache_h2o::build_decode(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
        ggml_tensor * kq_mask, int32_t il, float kq_scale, uint32_t s0, uint32_t s1) const {
    const int32_t ikv = kv.map_layer_ids.at(il);
    const int64_t ns  = s1 - s0 + 1;

    ggml_tensor * summ   = dec_summ[ikv];
    ggml_tensor * summ_n = dec_summ_n[ikv];

    // the streams of this ubatch; one query per sequence, in stream order (as build_attn_mha splits them)
    summ   = ggml_view_4d(ctx, summ, summ->ne[0], summ->ne[2], summ->ne[1], ns, summ->nb[2], summ->nb[1], summ->nb[3],
            s0*summ->nb[3]);
    summ_n = ggml_view_2d(ctx, summ_n, summ_n->ne[0], ns, summ_n->nb[1], s0*summ_n->nb[1]);
    q      = ggml_reshape_4d(ctx, q, q->ne[0], q->ne[1], q->ne[2]/ns, ns);

    // each stream's sink and budget are in its row of summ_n (decode_write_own); the op's are the context's. The
    // local window is L, as in the prefill
    ggml_tensor * out = ggml_h2o_decode(ctx, q, k, v, kq_mask, summ, summ_n, sink_size, local_window, dec_budget, kq_scale);
    ggml_h2o_decode_set_coverage(out, dec_coverage);
    ggml_h2o_decode_set_keys_read(out, ggml_view_1d(ctx, dec_keys[ikv], ns, s0*sizeof(float)));
    return out;
}

void llama_kv_cache_h2o::reset_all() {
    if (!enabled()) {
        return;
    }
    for (uint32_t s = 0; s < strm.size(); ++s) {
        reset(s);
    }
}

void llama_kv_cache_h2o::reset(uint32_t s) {
    GGML_ASSERT(enabled() && s < strm.size());

    auto & hs = strm[s];

    decode_invalidate(s, 0);

    if (!kv.hparams.no_alloc) {
        for (size_t i = 0; i < hs.scores.size(); ++i) {
            ggml_backend_tensor_memset(hs.scores[i],         0x00, 0, ggml_nbytes(hs.scores[i]));
            ggml_backend_tensor_memset(hs.memory_indices[i], 0xff, 0, ggml_nbytes(hs.memory_indices[i])); // -1: empty
            ggml_backend_tensor_memset(hs.accumulators[i],   0x00, 0, ggml_nbytes(hs.accumulators[i]));
        }
    }

    hs.chunk = {};
    hs.memory_initialized = false;
    hs.undo = {};

    hs.select       = select_rule;
    hs.n_sink       = sink_size;
    hs.n_dense_tail = dense_tail_size;

    hs.n_decode_budget = -1;
    decode_write_own(s);
}

bool llama_kv_cache_h2o::at_chunk_boundary(uint32_t s) const {
    const auto & st = strm[s].chunk;

    return enabled() && st.current_chunk_idx > 0 && st.acc_chunk == -1 &&
        st.mem_chunk + 1 == (int32_t) st.current_chunk_idx &&
        st.total_tokens_processed == st.current_chunk_idx*chunk_size &&
        st.prompt_end == st.total_tokens_processed;
}

void llama_kv_cache_h2o::set_undo_log(bool on) {
    GGML_ASSERT(enabled());

    undo_on = on;
    for (auto & hs : strm) {
        hs.undo = {};
    }
}

void llama_kv_cache_h2o::undo_record(uint32_t s) {
    GGML_ASSERT(undo_on && at_chunk_boundary(s));

    auto & hs = strm[s];
    auto & u  = hs.undo;

    const uint32_t c = hs.chunk.current_chunk_idx;
    if (u.valid && c == u.base_chunk) {
        return;
    }

    // the next boundary after the base: log what its chunk changed; anything else starts the log here
    const bool extend = u.valid && c == u.base_chunk + 1;

    const size_t   n_layer = hs.scores.size();
    const uint32_t n_base  = u.base_chunk*chunk_size; // positions with scores at the base
    const uint32_t n_pos   = c*chunk_size;

    chunk_undo entry;
    if (extend) {
        entry.mem = std::move(u.base_mem);
        entry.mem.resize(n_layer);
        entry.changed.resize(n_layer);
        entry.old_value.resize(n_layer);
    }

    u.base_scores.resize(n_layer);
    u.base_mem.assign(n_layer, {});

    for (size_t i = 0; i < n_layer; ++i) {
        ggml_tensor * scores  = hs.scores[i];
        ggml_tensor * mem_idx = hs.memory_indices[i];

        const uint32_t n_head  = scores->ne[1];
        const uint32_t kv_size = scores->ne[0];

        std::vector<uint16_t> cur((size_t) n_head*n_pos);
        for (uint32_t ih = 0; ih < n_head; ++ih) {
            ggml_backend_tensor_get(scores, cur.data() + (size_t) ih*n_pos, ih*scores->nb[1], n_pos*sizeof(uint16_t));
        }

        if (extend) {
            // usually the M positions of the memory the chunk read, per head
            const auto & base = u.base_scores[i];
            entry.changed[i].reserve((size_t) n_head*memory_size);
            entry.old_value[i].reserve((size_t) n_head*memory_size);
            for (uint32_t ih = 0; ih < n_head; ++ih) {
                for (uint32_t pos = 0; pos < n_base; ++pos) {
                    const uint16_t before = base[(size_t) ih*n_base + pos];
                    if (cur[(size_t) ih*n_pos + pos] != before) {
                        entry.changed[i].push_back(ih*kv_size + pos);
                        entry.old_value[i].push_back(before);
                    }
                }
            }
            entry.changed[i].shrink_to_fit();
            entry.old_value[i].shrink_to_fit();
            if (entry.mem[i].empty()) {
                entry.mem[i].assign((size_t) n_head*memory_size, -1);
            }
        }

        u.base_scores[i] = std::move(cur);
        u.base_mem[i].resize((size_t) n_head*memory_size);
        ggml_backend_tensor_get(mem_idx, u.base_mem[i].data(), 0, u.base_mem[i].size()*sizeof(int32_t));
    }

    if (extend) {
        u.chunks.push_back(std::move(entry));
    } else {
        u.chunks.clear();
        u.first = c;
    }

    u.base_chunk = c;
    u.valid      = true;
}

// seq_rm of [p0, p1) from the sequence of stream s (sequence s; seq 0 in a unified cache): its scores and memory sets
// describe it whole, so it can be removed as a whole, or cut where only decoded tokens go (they never entered the
// scores), or cut at a chunk boundary the undo log reaches (undo_to = that boundary's chunk), not elsewhere
bool llama_kv_cache_h2o::seq_rm_allowed(uint32_t s, llama_pos p0, llama_pos p1, int32_t & undo_to) const {
    const auto & hs    = strm[s];
    const auto & cells = kv.v_cells[s];

    const llama_seq_id seq = s;

    undo_to = -1;

    const llama_pos pos_min = cells.seq_pos_min(seq);
    const llama_pos pos_max = cells.seq_pos_max(seq);

    if (pos_max < 0 || p1 <= pos_min || p0 > pos_max) {
        return true; // nothing to remove
    }

    const bool whole    = p0 <= pos_min && p1 > pos_max;
    const bool cut_tail = p0 > pos_min && p1 > pos_max && p0 >= (llama_pos) hs.chunk.prompt_end;

    // a cut into the scored positions at a chunk boundary the undo log reaches
    const uint32_t S  = chunk_size;
    const bool     to_boundary = !whole && !cut_tail && p0 > pos_min && p1 > pos_max && p0 % S == 0 &&
        undo_on && hs.undo.valid && (uint32_t) p0/S >= hs.undo.first && (uint32_t) p0/S <= hs.undo.base_chunk;

    if (!whole && !cut_tail && !to_boundary) {
        if (undo_on) {
            const uint32_t first = hs.undo.valid ? hs.undo.first*S : hs.chunk.prompt_end;
            LLAMA_LOG_ERROR("%s: H2O: cannot remove positions [%d, %d) of sequence %d holding [%d, %d]: its prompt batches "
                    "scored positions up to %u, so it can be removed whole, cut from position %u on, or cut at a chunk "
                    "boundary (a multiple of n_ubatch = %u) from %u on; to keep [0, %d), cut at %d and evaluate the "
                    "positions from there again\n",
                    __func__, p0, p1, seq, pos_min, pos_max, hs.chunk.prompt_end, hs.chunk.prompt_end, S, first, p0,
                    p0/(llama_pos) S*(llama_pos) S);
        } else {
            LLAMA_LOG_ERROR("%s: H2O: cannot remove positions [%d, %d) of sequence %d holding [%d, %d]: its prompt batches "
                    "scored positions up to %u, so it can be removed whole or cut from position %u on; with h2o_undo_log "
                    "on in llama_context_params it can also be cut at a chunk boundary (a multiple of n_ubatch = %u)\n",
                    __func__, p0, p1, seq, pos_min, pos_max, hs.chunk.prompt_end, hs.chunk.prompt_end, S);
        }
        return false;
    }

    if (to_boundary) {
        undo_to = p0/(llama_pos) S;
    }

    return true;
}

void llama_kv_cache_h2o::copy_stream(uint32_t s_src, uint32_t s_dst) {
    if (!enabled()) {
        return;
    }

    const auto & src = strm[s_src];
    auto       & dst = strm[s_dst];

    for (size_t i = 0; i < src.scores.size(); ++i) {
        ggml_backend_tensor_copy(src.scores[i],         dst.scores[i]);
        ggml_backend_tensor_copy(src.memory_indices[i], dst.memory_indices[i]);
        ggml_backend_tensor_copy(src.accumulators[i],   dst.accumulators[i]);
    }

    // the copied cells are not summarised in the destination's stream
    decode_invalidate(s_dst, 0);

    dst.chunk              = src.chunk;
    dst.memory_initialized = src.memory_initialized;
    dst.select             = src.select;
    dst.n_sink             = src.n_sink;
    dst.n_dense_tail       = src.n_dense_tail;
    dst.n_decode_budget    = src.n_decode_budget;
    dst.undo               = src.undo;

    decode_write_own(s_dst);
}

bool llama_kv_cache_h2o::split_per_seq(const llama_batch_allocr & balloc) const {
    if (!enabled() || kv.n_stream == 1) {
        return false;
    }

    for (uint32_t s = 0; s < kv.n_seq_max; ++s) {
        if (balloc.seq_pos_max(s) > balloc.seq_pos_min(s)) {
            return true;
        }
    }

    return false;
}

void llama_kv_cache_h2o::undo_to(uint32_t c, uint32_t s) {
    auto & hs = strm[s];
    auto & u  = hs.undo;

    GGML_ASSERT(u.valid && u.first <= c && c <= u.base_chunk);

    const uint32_t S      = chunk_size;
    const uint32_t n_base = u.base_chunk*S;
    const uint32_t n_pos  = c*S;

    u.base_scores.resize(hs.scores.size());
    u.base_mem.resize(hs.scores.size());

    for (size_t i = 0; i < hs.scores.size(); ++i) {
        ggml_tensor * scores  = hs.scores[i];
        ggml_tensor * mem_idx = hs.memory_indices[i];

        const uint32_t n_head  = scores->ne[1];
        const uint32_t kv_size = scores->ne[0];

        // from the base back to boundary c, chunk by chunk
        std::vector<uint16_t> sc  = std::move(u.base_scores[i]);
        std::vector<int32_t>  mem = std::move(u.base_mem[i]);
        sc.resize((size_t) n_head*n_base);
        mem.resize((size_t) n_head*memory_size, -1);
        for (uint32_t k = u.base_chunk; k-- > c;) {
            const auto & e = u.chunks[k - u.first];
            for (size_t j = 0; j < e.changed[i].size(); ++j) {
                const uint32_t ih  = e.changed[i][j]/kv_size;
                const uint32_t pos = e.changed[i][j]%kv_size;
                sc[(size_t) ih*n_base + pos] = e.old_value[i][j];
            }
            mem = e.mem[i];
        }

        std::vector<uint16_t> kept((size_t) n_head*n_pos);
        for (uint32_t ih = 0; ih < n_head; ++ih) {
            std::copy_n(sc.begin() + (size_t) ih*n_base, n_pos, kept.begin() + (size_t) ih*n_pos);
            if (n_pos > 0) {
                ggml_backend_tensor_set(scores, kept.data() + (size_t) ih*n_pos, ih*scores->nb[1], n_pos*sizeof(uint16_t));
            }
            ggml_backend_tensor_memset(scores, 0x00, ih*scores->nb[1] + n_pos*sizeof(uint16_t), (kv_size - n_pos)*sizeof(uint16_t));
        }
        ggml_backend_tensor_set(mem_idx, mem.data(), 0, mem.size()*sizeof(int32_t));
        ggml_backend_tensor_memset(hs.accumulators[i], 0x00, 0, ggml_nbytes(hs.accumulators[i]));

        u.base_scores[i] = std::move(kept);
        u.base_mem[i]    = std::move(mem);
    }

    u.chunks.resize(c - u.first);
    u.base_chunk = c;

    // the chunk state a prefill of [0, cS) leaves
    auto & st = hs.chunk;
    st.current_chunk_idx      = c;
    st.total_tokens_processed = n_pos;
    st.chunk_boundaries.resize(c + 1);
    for (uint32_t k = 0; k <= c; ++k) {
        st.chunk_boundaries[k] = k*S;
    }
    st.mem_chunk  = (int32_t) c - 1;
    st.acc_chunk  = -1;
    st.prompt_end = n_pos;
    st.last_sparse_chunk = std::min(st.last_sparse_chunk, (int32_t) c - 1); // the counts keep what ran

    hs.memory_initialized = c > 0;
}

static uint32_t llama_h2o_read_u32(llama_io_read_i & io) {
    uint32_t v;
    io.read(&v, sizeof(v));
    return v;
}

// the streams a state of seq_id holds: one stream for a sequence, all of them for the whole cache (-1)
static std::vector<uint32_t> llama_h2o_state_streams(const std::vector<uint32_t> & seq_to_stream, uint32_t n_stream, llama_seq_id seq_id) {
    if (seq_id >= 0) {
        return { seq_to_stream.at(seq_id) };
    }

    std::vector<uint32_t> res(n_stream);
    for (uint32_t s = 0; s < n_stream; ++s) {
        res[s] = s;
    }

    return res;
}

void llama_kv_cache_h2o::state_write_header(llama_io_write_i & io, llama_seq_id seq_id) const {
    if (!enabled()) {
        return;
    }

    const auto streams = llama_h2o_state_streams(kv.seq_to_stream, kv.n_stream, seq_id);

    // one selection for the header: a state of several streams whose sequences select differently cannot be saved
    const auto & hs0 = strm[streams[0]];
    for (uint32_t s : streams) {
        if (strm[s].select != hs0.select || strm[s].n_sink != hs0.n_sink) {
            throw std::runtime_error(format("H2O: sequences %u and %u select their memory differently (h2o_select %d/%d, "
                    "h2o_sink %u/%u): save them one by one (llama_state_seq_save_file)",
                    streams[0], s, (int) hs0.select, (int) strm[s].select, hs0.n_sink, strm[s].n_sink));
        }
    }

    const uint32_t header[7] = {
        LLAMA_H2O_STATE_MAGIC, LLAMA_H2O_STATE_VERSION,
        local_window, heavy_budget, chunk_size, (uint32_t) hs0.select, hs0.n_sink,
    };

    io.write(header, sizeof(header));
}

void llama_kv_cache_h2o::state_read_header(llama_io_read_i & io, llama_seq_id seq_id, selection & sel) const {
    // the magic has been read by the caller
    uint32_t header[6];
    io.read(header, sizeof(header));

    const uint32_t version = header[0];
    const uint32_t local   = header[1];
    const uint32_t heavy   = header[2];
    const uint32_t chunk   = header[3];
    const uint32_t select  = header[4];
    const uint32_t sink    = header[5];

    if (version != LLAMA_H2O_STATE_VERSION && version != 4) {
        throw std::runtime_error(format("the state's H2O section has version %u, this build reads versions 4 and %u: "
                "evaluate its tokens again", version, LLAMA_H2O_STATE_VERSION));
    }

    if (!enabled()) {
        throw std::runtime_error(format("the state was saved with H2O on (h2o_local = %u, h2o_heavy = %u, n_ubatch = %u): "
                "load it into a context with the same settings", local, heavy, chunk));
    }

    if (local != local_window || heavy != heavy_budget || chunk != chunk_size) {
        throw std::runtime_error(format("the state was saved with h2o_local = %u, h2o_heavy = %u, n_ubatch = %u; "
                "this context has %u, %u, %u: load it into a context with the state's settings",
                local, heavy, chunk, local_window, heavy_budget, chunk_size));
    }

    if (!llama_h2o_select_known((int) select)) {
        throw std::runtime_error(format("the state was saved with h2o_select = %u, a policy this build no longer runs "
                "(1 and 2, whole blocks by the chunk's own queries, were retired): its scores and memory sets follow "
                "that policy, so it cannot continue here; evaluate its tokens again", select));
    }

    for (uint32_t s : llama_h2o_state_streams(kv.seq_to_stream, kv.n_stream, seq_id)) {
        const auto & hs = strm[s];
        if (select != (uint32_t) hs.select || sink != hs.n_sink) {
            throw std::runtime_error(format("the state was saved with h2o_select = %u, h2o_sink = %u; this context has %u, %u: "
                    "its scores and memory sets follow the state's policy, so load it into a context with that policy",
                    select, sink, (uint32_t) hs.select, hs.n_sink));
        }
        sel = { hs.select, hs.n_sink, hs.n_dense_tail, version };
    }
}

// after the streams: per stream of the state, the chunk bookkeeping, then per layer the scores of the stored
// positions, the memory sets and the column sums of a chunk in progress
void llama_kv_cache_h2o::state_write_data(llama_io_write_i & io, llama_seq_id seq_id) const {
    if (!enabled()) {
        return;
    }

    const auto streams = llama_h2o_state_streams(kv.seq_to_stream, kv.n_stream, seq_id);

    const uint32_t n_strm = streams.size();
    io.write(&n_strm, sizeof(n_strm));

    for (uint32_t s : streams) {
        const auto & hs = strm[s];
        const auto & st = hs.chunk;

        // stream s holds sequence s (seq 0 in a unified cache, which serves one sequence)
        const llama_pos pos_max = kv.v_cells[s].seq_pos_max(s);
        const uint32_t  n_pos   = pos_max < 0 ? 0 : (uint32_t) pos_max + 1;

        const uint32_t n_bound = st.chunk_boundaries.size();
        const uint32_t mem_init = hs.memory_initialized ? 1 : 0;

        io.write(&n_pos,                     sizeof(n_pos));
        io.write(&st.current_chunk_idx,      sizeof(st.current_chunk_idx));
        io.write(&st.total_tokens_processed, sizeof(st.total_tokens_processed));
        io.write(&n_bound,                   sizeof(n_bound));
        io.write(st.chunk_boundaries.data(), n_bound*sizeof(uint32_t));
        io.write(&st.mem_chunk,              sizeof(st.mem_chunk));
        io.write(&st.acc_chunk,              sizeof(st.acc_chunk));
        io.write(&mem_init,                  sizeof(mem_init));
        io.write(&st.prompt_end,             sizeof(st.prompt_end));
        io.write(&st.n_sparse_chunks,        sizeof(st.n_sparse_chunks));
        io.write(&st.n_tail_tokens,          sizeof(st.n_tail_tokens));
        io.write(&st.last_sparse_chunk,      sizeof(st.last_sparse_chunk));

        const uint32_t n_layer = hs.scores.size();
        io.write(&n_layer, sizeof(n_layer));

        for (uint32_t i = 0; i < n_layer; ++i) {
            ggml_tensor * scores  = hs.scores[i];
            ggml_tensor * mem_idx = hs.memory_indices[i];
            ggml_tensor * acc     = hs.accumulators[i];

            const uint32_t n_head = scores->ne[1];
            io.write(&n_head, sizeof(n_head));

            // scores past the stored positions are zero (reset) and are set when their chunk arrives
            for (uint32_t ih = 0; ih < n_head; ++ih) {
                io.write_tensor(scores, ih*scores->nb[1], n_pos*ggml_element_size(scores));
            }

            io.write_tensor(mem_idx, 0, ggml_nbytes(mem_idx));
            io.write_tensor(acc,     0, ggml_nbytes(acc));
        }

        state_write_decode(io, s);
    }
}

// the sketches a restored sequence decodes with must be the ones it had: chosen again, its channels would come from the
// positions of the whole cache instead of those present at its first sparse step, and it would continue differently
void llama_kv_cache_h2o::state_write_decode(llama_io_write_i & io, uint32_t s) const {
    const uint32_t n_layer = kv.hparams.no_alloc ? 0 : (uint32_t) dec_summ.size();
    io.write(&n_layer, sizeof(n_layer));

    std::vector<int32_t> row;
    for (uint32_t i = 0; i < n_layer; ++i) {
        ggml_tensor * summ   = dec_summ[i];
        ggml_tensor * summ_n = dec_summ_n[i];

        // the stream's row: the blocks sketched and each KV head's channels (then its sink and budget, which the
        // sequence's settings give)
        const uint32_t n_row = summ_n->ne[0] - 2;
        row.resize(n_row);
        ggml_backend_tensor_get(summ_n, row.data(), s*summ_n->nb[1], n_row*sizeof(int32_t));

        const uint32_t n_head      = summ->ne[2];
        const uint32_t block_bytes = summ->nb[1];
        io.write(&n_row,       sizeof(n_row));
        io.write(row.data(),   n_row*sizeof(int32_t));
        io.write(&n_head,      sizeof(n_head));
        io.write(&block_bytes, sizeof(block_bytes));

        // a KV head's blocks lie one after another
        for (uint32_t ih = 0; ih < n_head && row[0] > 0; ++ih) {
            io.write_tensor(summ, s*summ->nb[3] + ih*summ->nb[2], (size_t) row[0]*block_bytes);
        }
    }
}

void llama_kv_cache_h2o::state_read_decode(llama_io_read_i & io, uint32_t s, uint32_t n_pos) {
    // the sequence was emptied before its cells were read: nothing is sketched, and a state without sketches (saved
    // with full decode, or before any sparse step) leaves it so
    const uint32_t n_layer = llama_h2o_read_u32(io);
    const bool     keep    = !dec_summ.empty() && !kv.hparams.no_alloc;
    if (keep && n_layer != 0 && n_layer != dec_summ.size()) {
        throw std::runtime_error(format("the state holds sparse decode's key sketches of %u layers, this cache %zu",
                n_layer, dec_summ.size()));
    }

    std::vector<int32_t> row;
    std::vector<uint8_t> skipped;
    for (uint32_t i = 0; i < n_layer; ++i) {
        const uint32_t n_row = llama_h2o_read_u32(io);
        if (n_row < 1 || n_row > (1u << 20)) {
            throw std::runtime_error(format("the state's sparse decode row of layer %u has %u entries (a damaged state)", i, n_row));
        }
        row.resize(n_row);
        io.read(row.data(), n_row*sizeof(int32_t));
        const uint32_t n_head      = llama_h2o_read_u32(io);
        const uint32_t block_bytes = llama_h2o_read_u32(io);

        const int32_t n_blocks = row[0];
        const int32_t n_chan   = n_head > 0 && (n_row - 1) % n_head == 0 ? (n_row - 1)/n_head : 0;
        bool valid = n_blocks >= 0 && (uint64_t) n_blocks*GGML_H2O_DECODE_BLOCK <= n_pos && n_chan > 0 &&
                     block_bytes == GGML_H2O_DECODE_SKETCH_SIZE(4*n_chan);
        for (uint32_t j = 1; valid && j < n_row; ++j) {
            valid = row[j] >= 0 && row[j] < 4*n_chan;
        }
        if (!valid) {
            throw std::runtime_error(format("the state's sparse decode sketches of layer %u are inconsistent (%d blocks "
                    "of a sequence of %u positions; a damaged state)", i, n_blocks, n_pos));
        }

        if (!keep) {
            // full decode here: the sketches are of no use
            for (uint64_t left = (uint64_t) n_head*n_blocks*block_bytes; left > 0; ) {
                const size_t n = (size_t) std::min<uint64_t>(left, 1u << 16);
                skipped.resize(n);
                io.read(skipped.data(), n);
                left -= n;
            }
            continue;
        }

        ggml_tensor * summ   = dec_summ[i];
        ggml_tensor * summ_n = dec_summ_n[i];
        if (n_row != summ_n->ne[0] - 2 || n_head != summ->ne[2] || block_bytes != summ->nb[1]) {
            throw std::runtime_error(format("the state's sparse decode sketches of layer %u are %u heads of %d channels, "
                    "this cache's %d of %d: load it into a context of the same model",
                    i, n_head, n_chan, (int) summ->ne[2], (int) (summ_n->ne[0] - 3)/(int) summ->ne[2]));
        }
        ggml_backend_tensor_set(summ_n, row.data(), s*summ_n->nb[1], n_row*sizeof(int32_t));
        for (uint32_t ih = 0; ih < n_head && n_blocks > 0; ++ih) {
            io.read_tensor(summ, s*summ->nb[3] + ih*summ->nb[2], (size_t) n_blocks*block_bytes);
        }
    }
}

void llama_kv_cache_h2o::state_read_streams(llama_io_read_i & io, llama_seq_id seq_id, const selection & sel) {
    const auto streams = llama_h2o_state_streams(kv.seq_to_stream, kv.n_stream, seq_id);

    const uint32_t n_strm = llama_h2o_read_u32(io);
    if (n_strm != streams.size()) {
        throw std::runtime_error(format("the H2O state holds %u sequences, the restore expects %zu", n_strm, streams.size()));
    }

    for (uint32_t s : streams) {
        // the sequence's cells were emptied before they were read, and its H2O state with them (seq_rm of the whole
        // sequence, or clear): every H2O tensor of the stream is in its reset state here
        auto & hs = strm[s];

        // the restored sequence: seq_id, or the one a stream holds (s) in a whole-cache restore
        const llama_seq_id seq = seq_id >= 0 ? seq_id : (llama_seq_id) s;

        const auto & cells = kv.v_cells[s];

        const llama_pos pos_max = cells.seq_pos_max(seq);
        const uint32_t  n_cells = pos_max < 0 ? 0 : (uint32_t) pos_max + 1;

        const uint32_t n_pos = llama_h2o_read_u32(io);
        if (n_pos != n_cells || n_pos > cells.size() || (n_pos > 0 && cells.seq_pos_min(seq) != 0)) {
            throw std::runtime_error(format("the H2O state covers positions [0, %u), the restored cells [%d, %d]",
                    n_pos, cells.seq_pos_min(seq), pos_max));
        }

        chunk_state st;
        st.current_chunk_idx      = llama_h2o_read_u32(io);
        st.total_tokens_processed = llama_h2o_read_u32(io);

        const uint32_t n_bound = llama_h2o_read_u32(io);
        if (n_bound != st.current_chunk_idx + 1) {
            throw std::runtime_error(format("the H2O chunk state lists %u chunk starts for %u chunks", n_bound, st.current_chunk_idx));
        }
        st.chunk_boundaries.resize(n_bound);
        io.read(st.chunk_boundaries.data(), n_bound*sizeof(uint32_t));

        io.read(&st.mem_chunk, sizeof(st.mem_chunk));
        io.read(&st.acc_chunk, sizeof(st.acc_chunk));
        const uint32_t mem_init = llama_h2o_read_u32(io);
        st.prompt_end = llama_h2o_read_u32(io);
        io.read(&st.n_sparse_chunks,   sizeof(st.n_sparse_chunks));
        io.read(&st.n_tail_tokens,     sizeof(st.n_tail_tokens));
        io.read(&st.last_sparse_chunk, sizeof(st.last_sparse_chunk));

        // the chunks are aligned to positions: chunk c starts at c*S
        bool valid = st.total_tokens_processed == st.current_chunk_idx*chunk_size && st.total_tokens_processed <= n_pos &&
                     st.prompt_end <= n_pos &&
                     st.n_sparse_chunks >= 0 && st.n_tail_tokens >= 0 && st.last_sparse_chunk >= -1 &&
                     st.mem_chunk >= -1 && st.mem_chunk < (int32_t) st.current_chunk_idx &&
                     (st.acc_chunk == -1 || st.acc_chunk == (int32_t) st.current_chunk_idx) && mem_init == (st.mem_chunk >= 0 ? 1u : 0u);
        for (uint32_t c = 0; valid && c < n_bound; ++c) {
            valid = st.chunk_boundaries[c] == c*chunk_size;
        }
        if (!valid) {
            throw std::runtime_error("the H2O chunk state is inconsistent (a damaged state)");
        }

        const uint32_t n_layer = llama_h2o_read_u32(io);
        if (n_layer != hs.scores.size()) {
            throw std::runtime_error(format("the H2O state has %u layers, this cache %zu", n_layer, hs.scores.size()));
        }

        for (uint32_t i = 0; i < n_layer; ++i) {
            ggml_tensor * scores  = hs.scores[i];
            ggml_tensor * mem_idx = hs.memory_indices[i];
            ggml_tensor * acc     = hs.accumulators[i];

            const uint32_t n_head = llama_h2o_read_u32(io);
            if (n_head != scores->ne[1]) {
                throw std::runtime_error(format("the H2O state of layer %u has %u heads, this cache %d", i, n_head, (int) scores->ne[1]));
            }

            for (uint32_t ih = 0; ih < n_head; ++ih) {
                io.read_tensor(scores, ih*scores->nb[1], n_pos*ggml_element_size(scores));
            }

            io.read_tensor(mem_idx, 0, ggml_nbytes(mem_idx));
            io.read_tensor(acc,     0, ggml_nbytes(acc));
        }

        if (sel.version >= 5) {
            state_read_decode(io, s, n_pos);
        }

        hs.chunk = std::move(st);
        hs.memory_initialized = mem_init != 0;

        // emptying the sequence before its cells were read put its selection back to the cache's; the state's is the
        // one its scores follow
        hs.select       = sel.select;
        hs.n_sink       = sel.n_sink;
        hs.n_dense_tail = sel.n_dense_tail;

        // the undo log starts at the loaded state, when it is at a chunk boundary
        hs.undo = {};
        hs.undo.valid = false;
        if (undo_on && at_chunk_boundary(s)) {
            undo_record(s);
        }
    }
}

ggml_tensor * llama_kv_cache_h2o::get_scores(int32_t il, uint32_t s) const {
    GGML_ASSERT(enabled() && s < strm.size());

    return strm[s].scores[kv.map_layer_ids.at(il)];
}

ggml_tensor * llama_kv_cache_h2o::get_memory_indices(int32_t il, uint32_t s) const {
    GGML_ASSERT(enabled() && s < strm.size());

    return strm[s].memory_indices[kv.map_layer_ids.at(il)];
}

void llama_kv_cache_h2o::init_chunk_scores(int32_t il, uint32_t chunk_start, uint32_t chunk_len, const float * colsum, uint32_t s) {
    ggml_tensor * scores = get_scores(il, s);

    const uint32_t kv_size = scores->ne[0];
    const uint32_t n_head  = scores->ne[1];

    GGML_ASSERT(chunk_start <= kv_size && chunk_len <= kv_size - chunk_start);

    llama_h2o_host_view view(scores);

    for (uint32_t ih = 0; ih < n_head; ++ih) {
        ggml_bf16_t * row = (ggml_bf16_t *) (view.data + ih*scores->nb[1]);

        for (uint32_t i = 0; i < chunk_len; ++i) {
            row[chunk_start + i] = h2o_f32_to_bf16(colsum[(size_t) ih*chunk_len + i]);
        }
    }

    view.commit();
}

void llama_kv_cache_h2o::accumulate_memory_scores(int32_t il, const float * colsum, uint32_t s) {
    ggml_tensor * scores  = get_scores(il, s);
    ggml_tensor * mem_idx = get_memory_indices(il, s);

    if (!strm[s].memory_initialized) {
        return; // chunk 0 has no memory to credit
    }

    const int32_t  kv_size = scores->ne[0];
    const uint32_t n_head  = scores->ne[1];
    const uint32_t M       = memory_size;

    llama_h2o_host_view view_scores(scores);
    llama_h2o_host_view view_idx(mem_idx);

    for (uint32_t ih = 0; ih < n_head; ++ih) {
        ggml_bf16_t   * row = (ggml_bf16_t   *) (view_scores.data + ih*scores->nb[1]);
        const int32_t * idx = (const int32_t *) (view_idx.data    + ih*mem_idx->nb[1]);

        for (uint32_t m = 0; m < M; ++m) {
            const int32_t pos = idx[m];

            assert(pos < kv_size);
            if (pos < 0 || pos >= kv_size) {
                continue; // empty slot
            }

            row[pos] = h2o_f32_to_bf16(h2o_bf16_to_f32(row[pos]) + colsum[(size_t) ih*M + m]);
        }
    }

    view_scores.commit();
}

void llama_kv_cache_h2o::build_memory_set(int32_t il, uint32_t chunk_end, uint32_t s) {
    ggml_tensor * scores  = get_scores(il, s);
    ggml_tensor * mem_idx = get_memory_indices(il, s);

    auto & hs = strm[s];

    const uint32_t kv_size = scores->ne[0];
    const uint32_t n_head  = scores->ne[1];

    GGML_ASSERT(chunk_end <= kv_size);

    // chunk c = [chunk_boundaries.back(), chunk_end)
    const uint32_t chunk_start = std::min(hs.chunk.chunk_boundaries.back(), chunk_end);

    llama_h2o_host_view view_scores(scores);
    llama_h2o_host_view view_idx(mem_idx);

    for (uint32_t ih = 0; ih < n_head; ++ih) {
        ggml_h2o_build_memory_set(
                (const ggml_bf16_t *) (view_scores.data + ih*scores->nb[1]),
                (int32_t *)           (view_idx.data    + ih*mem_idx->nb[1]),
                local_window, heavy_budget, hs.n_sink, chunk_start, chunk_end, hs.memory_initialized);
    }

    view_idx.commit();

    hs.memory_initialized = true;
}

void llama_kv_cache_h2o::next_chunk(uint32_t chunk_len, uint32_t s) {
    GGML_ASSERT(enabled() && s < strm.size());

    auto & hs = strm[s];

    hs.chunk.total_tokens_processed += chunk_len;
    hs.chunk.current_chunk_idx++;
    hs.chunk.chunk_boundaries.push_back(hs.chunk.total_tokens_processed);

    if (kv.debug >= 1) {
        LLAMA_LOG_DEBUG("%s: H2O chunk %u complete, %u tokens\n", __func__,
                hs.chunk.current_chunk_idx - 1, hs.chunk.total_tokens_processed);
    }
}

void llama_kv_cache_h2o::set_select(llama_h2o_select select, uint32_t n_sink, uint32_t n_dense_tail) {
    GGML_ASSERT(enabled() && n_sink <= heavy_budget);

    select_rule     = select;
    sink_size       = n_sink;
    dense_tail_size = n_dense_tail;

    for (uint32_t s = 0; s < strm.size(); ++s) {
        auto & hs = strm[s];
        hs.select       = select;
        hs.n_sink       = n_sink;
        hs.n_dense_tail = n_dense_tail;
        decode_write_own(s);
    }
}

void llama_kv_cache_h2o::set_select_seq(llama_seq_id seq_id, llama_h2o_select select, uint32_t n_sink, uint32_t n_dense_tail) {
    GGML_ASSERT(enabled() && n_sink <= heavy_budget);

    const uint32_t s = stream(seq_id);
    auto & hs = strm[s];

    hs.select       = select;
    hs.n_sink       = n_sink;
    hs.n_dense_tail = n_dense_tail;

    decode_write_own(s);
}

ggml_tensor * llama_kv_cache_h2o::build_attn(
        ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, int32_t il, float kq_scale, llama_pos p0,
        llama_pos tail_start, uint32_t s) const {
    const int32_t ikv = kv.map_layer_ids.at(il);

    const auto & hs = strm[s];

    // views of the cache as [n_embd_head, n_head_kv, n_kv]
    k = ggml_view_3d(ctx, k, k->ne[0], k->ne[1], k->ne[2], k->nb[1], k->nb[2], 0);
    v = ggml_view_3d(ctx, v, v->ne[0], v->ne[1], v->ne[2], v->nb[1], v->nb[2], 0);

    ggml_tensor * cur = ggml_h2o_attn(ctx, q, k, v, hs.scores[ikv], hs.memory_indices[ikv], hs.accumulators[ikv],
            p0, chunk_size, local_window, heavy_budget, hs.chunk.mem_chunk, hs.chunk.acc_chunk, kq_scale);
    ggml_h2o_attn_set_select(cur, (ggml_h2o_select) hs.select, hs.n_sink, tail_start);
    ggml_h2o_attn_set_coverage(cur, coverage_target, tile_samples);
    ggml_h2o_attn_set_coverage_sketch(cur, tile_sketch);
    ggml_h2o_attn_set_coverage_pool(cur, tile_pool);

    return cur;
}

void llama_kv_cache_h2o::prefill_done(llama_pos p0, uint32_t n_tokens, llama_pos tail_start, uint32_t s) {
    GGML_ASSERT(enabled() && n_tokens > 0 && s < strm.size());

    auto & hs = strm[s];

    // the same walk as ggml_h2o_attn, on the bookkeeping only
    const int32_t S  = chunk_size;
    const int32_t p1 = p0 + (int32_t) n_tokens;

    auto & st = hs.chunk;

    st.prompt_end = std::max<uint32_t>(st.prompt_end, p1);

    const auto complete = [&](int32_t c) {
        st.mem_chunk = c;
        while ((int32_t) st.current_chunk_idx <= c) {
            next_chunk(S, s);
        }
    };

    for (int32_t c = p0/S; c <= (p1 - 1)/S; ++c) {
        while (st.mem_chunk < c - 1) {
            if (st.acc_chunk == st.mem_chunk + 1) {
                st.acc_chunk = -1;
            }
            complete(st.mem_chunk + 1);
        }
        // the op gives chunk c its memory set M_{c-1}; rows from tail_start on attend to everything instead
        const bool sparse = c >= 1 && st.mem_chunk == c - 1 && std::max(p0, c*S) < tail_start;
        if (sparse && c > st.last_sparse_chunk) {
            st.n_sparse_chunks++;
            st.last_sparse_chunk = c;
        }
        st.acc_chunk = c;
        if (p1 >= (c + 1)*S) {
            st.acc_chunk = -1;
            complete(c);
        }
    }

    if (tail_start < p1) {
        st.n_tail_tokens += p1 - std::max(p0, tail_start);
    }

    hs.memory_initialized = st.mem_chunk >= 0;
}

void llama_kv_cache_h2o::read_scores(int32_t il, uint32_t ih, uint32_t pos0, uint32_t n, float * dst, uint32_t s) const {
    ggml_tensor * scores = get_scores(il, s);

    GGML_ASSERT(ih < scores->ne[1]);
    GGML_ASSERT(pos0 <= scores->ne[0] && n <= scores->ne[0] - pos0);

    std::vector<ggml_bf16_t> tmp(n);
    ggml_backend_tensor_get(scores, tmp.data(), ih*scores->nb[1] + pos0*sizeof(ggml_bf16_t), n*sizeof(ggml_bf16_t));

    for (uint32_t i = 0; i < n; ++i) {
        dst[i] = h2o_bf16_to_f32(tmp[i]);
    }
}

void llama_kv_cache_h2o::read_memory_indices(int32_t il, uint32_t ih, int32_t * dst, uint32_t s) const {
    ggml_tensor * mem_idx = get_memory_indices(il, s);

    GGML_ASSERT(ih < mem_idx->ne[1]);

    ggml_backend_tensor_get(mem_idx, dst, ih*mem_idx->nb[1], memory_size*sizeof(int32_t));
}

//
// llama_kv_cache_context: which ubatches H2O runs, and its ops for them
//

void llama_kv_cache_context::h2o_init_batch() {
    if (!kv->h2o().enabled()) {
        return;
    }

    // per stream (= per sequence): its tokens in the batch, and its last position
    const uint32_t n_stream = kv->get_n_stream();

    std::vector<uint32_t>  n_tokens(n_stream, 0);
    std::vector<llama_pos> end     (n_stream, -1);
    std::vector<bool>      output  (n_stream, false);
    for (size_t iu = 0; iu < ubatches.size(); ++iu) {
        const auto & ub    = ubatches[iu];
        const auto & sinfo = sinfos[iu];
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            const uint32_t s = n_stream == 1 ? 0 : sinfo.strm[i/(ub.n_tokens/ub.n_seqs_unq)];
            n_tokens[s]++;
            if (ub.pos && ub.pos[i] >= end[s]) {
                end[s]    = ub.pos[i] + 1;
                output[s] = ub.output && ub.output[i];
            }
        }
    }

    h2o_batch_prefill.resize(n_stream);
    h2o_batch_end_output.resize(n_stream);
    for (uint32_t s = 0; s < n_stream; ++s) {
        h2o_batch_prefill[s]    = n_tokens[s] > 1;
        h2o_batch_end_output[s] = output[s] ? end[s] : -1;
    }
}

uint32_t llama_kv_cache_context::h2o_stream() const {
    return sinfos[i_cur].s0;
}

bool llama_kv_cache_context::h2o_prefill(const llama_ubatch & ubatch) const {
    if (!kv->h2o().enabled()) {
        return false;
    }

    // a ubatch of several streams holds one token per sequence (see llama_kv_cache::h2o_split_per_seq): decode
    const auto & sinfo = sinfos[i_cur];
    if (sinfo.s0 != sinfo.s1) {
        return false;
    }

    return ubatch.n_tokens > 1 || (sinfo.s0 < h2o_batch_prefill.size() && h2o_batch_prefill[sinfo.s0]);
}

llama_pos llama_kv_cache_context::h2o_tail_start() const {
    const uint32_t  s          = h2o_stream();
    const uint32_t  n_tail     = kv->h2o().n_dense_tail(s);
    const llama_pos end_output = s < h2o_batch_end_output.size() ? h2o_batch_end_output[s] : -1;

    return n_tail > 0 && end_output >= 0 ? std::max<llama_pos>(end_output - (llama_pos) n_tail, 0) : INT32_MAX;
}

// a step with no more cells than the budget, the first block and the recent window would read every one of them:
// llama.cpp's own attention does that faster
bool llama_kv_cache_context::h2o_decode(const llama_ubatch & ubatch) const {
    if (!kv->h2o().enabled() || kv->h2o().decode_budget() == 0 || h2o_prefill(ubatch)) {
        return false;
    }
    // the least budget of the step's sequences decides: a sequence with more reads every cell in the op
    const auto & sinfo = sinfos[i_cur];
    const uint64_t n_covered = (uint64_t) kv->h2o().decode_budget(sinfo.s0, sinfo.s1) + kv->h2o().n_local() + GGML_H2O_DECODE_BLOCK;
    return (uint64_t) n_kv > n_covered;
}

ggml_tensor * llama_kv_cache_context::h2o_decode_attn(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k,
        ggml_tensor * v, ggml_tensor * kq_mask, int32_t il, float kq_scale) const {
    const auto & sinfo = sinfos[i_cur];
    return kv->h2o().build_decode(ctx, q, k, v, kq_mask, il, kq_scale, sinfo.s0, sinfo.s1);
}

ggml_tensor * llama_kv_cache_context::h2o_attn(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
        int32_t il, float kq_scale, const llama_ubatch & ubatch) const {
    return kv->h2o().build_attn(ctx, q, k, v, il, kq_scale, ubatch.pos ? ubatch.pos[0] : 0, h2o_tail_start(), h2o_stream());
}

llama_kv_cache * llama_h2o_kv(llama_memory_i * mem) {
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        return iswa->get_base();
    }
    return dynamic_cast<llama_kv_cache *>(mem);
}
