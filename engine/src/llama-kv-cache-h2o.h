#pragma once

// The H2O state of a llama_kv_cache (swa_type == LLAMA_SWA_TYPE_H2O), a member of it: per layer and stream the
// scores, memory sets and chunk sums of the sparse prefill, the chunk bookkeeping, the undo log of prompt cuts, the key
// sketches of sparse decode, and their part of llama.cpp's state files. Defined in llama-kv-cache-h2o.cpp; the cache
// calls it from its constructor, seq_rm/seq_cp, find_slot and state_read/state_write.

#include "llama.h"

#include "ggml-cpp.h"

#include <cstdint>
#include <utility>
#include <vector>

class llama_batch_allocr;
class llama_kv_cache;
struct llama_cparams;
class llama_io_read_i;
class llama_io_write_i;
struct llama_memory_i;
struct llama_ubatch;

// an H2O cache's state starts with this where other caches' states hold n_stream ("H2OS"), so that a reader that does
// not know H2O stops at once
static constexpr uint32_t LLAMA_H2O_STATE_MAGIC   = 0x534f3248;
static constexpr uint32_t LLAMA_H2O_STATE_VERSION = 5; // 2: with prompt_end, 3: per stream, 4: with the prefill's counts,
                                                       // 5: with sparse decode's key sketches (4 is still read)

// the policies this build runs: 1 and 2 were retired and their numbers are not reused, so that a state saved under one
// of them is refused by its number
static inline bool llama_h2o_select_known(int select) {
    return select == LLAMA_H2O_SELECT_SEED || select == LLAMA_H2O_SELECT_HYBRID || select == LLAMA_H2O_SELECT_COVERAGE;
}

//
// H2O chunked sparse prefill (swa_type == LLAMA_SWA_TYPE_H2O)
//
// The prompt is split into chunks of n_ubatch positions. After chunk c, every layer and query head keeps a memory set
// M_c of L + H earlier positions: the last L positions, and the H heavy hitters with the highest accumulated attention
// score among M_{c-1} and chunk c. Chunk c + 1 attends to its own keys and to M_c.
//
// In H2O mode the cache is position-addressed: the token at position p lives in cell p, so a memory index is both a
// position and a row of K and V. Scores are per query head (heads that share a KV head under GQA still select
// independently).
//
class llama_kv_cache_h2o {
public:
    // L, H and S of the cache kv (all 0: H2O off); kv is only stored here, not read
    llama_kv_cache_h2o(llama_kv_cache & kv, uint32_t n_local, uint32_t n_heavy, uint32_t n_chunk);

    //
    // the cache's calls
    //

    // constructor: throws, naming the setting and its fix, when the cache cannot hold an H2O state (H2O off: nothing)
    //   own_cells: the cache has its own cells for every layer (no other cache's, no reuse, no sharing)
    void check(uint32_t kv_size, ggml_type type_k, ggml_type type_v, bool own_cells) const;

    // constructor, for each layer il: the scores, memory indices and chunk sums of every stream, in ctx (the layer's
    // K/V buffer type, so that the graph reads and updates them on the cache's backend); the tensors per stream
    static constexpr uint32_t n_tensors_per_stream = 3;
    void add_layer(ggml_context * ctx, uint32_t il, uint32_t kv_size, const char * name_tag);

    // constructor, once the tensors are allocated: logs their size beside K and V's, and resets every stream
    void init(size_t memory_size_kv);

    // seq_rm of [p0, p1): false (logged) when a sequence concerned cannot be cut there, with nothing changed; else the
    // state is cut back as far as the cells will be (seq_rm_done after the cells are removed)
    bool seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    void seq_rm_done(llama_seq_id seq_id);

    // find_slot for the n_tokens of sequence seq_id in stream s of the ubatch: the token at position p goes to cell p,
    // so that memory indices are cell indices; false (logged) when a cell is taken or positions are not consecutive
    bool find_slot(const llama_ubatch & ubatch, uint32_t s, uint32_t n_tokens, llama_seq_id seq_id,
            std::vector<uint32_t> & idxs) const;

    // state_read: n_stream_cur is the first word of the state; reads the H2O header when it is the magic (then the
    // real n_stream_cur), and throws when the state and this cache do not agree about H2O
    struct selection {
        llama_h2o_select select       = LLAMA_H2O_SELECT_SEED;
        uint32_t         n_sink       = 0;
        uint32_t         n_dense_tail = 0;
        uint32_t         version      = LLAMA_H2O_STATE_VERSION; // the state's: 4 holds no sparse decode sketches
    };
    void state_read_begin(llama_io_read_i & io, llama_seq_id seq_id, uint32_t & n_stream_cur, selection & sel) const;

    // the H2O state in llama.cpp's state format: a header written before the streams (so that a reader without H2O,
    // or with other settings, refuses the state before it changes anything), the state itself after them
    // seq_id -1: every stream's state, else the state of the sequence's stream; nothing with H2O off
    void state_write_header(llama_io_write_i & io, llama_seq_id seq_id) const;
    void state_write_data  (llama_io_write_i & io, llama_seq_id seq_id) const;

    // after the cells: the state's H2O part; a failure empties the streams read (K/V without the H2O state that
    // goes with them would make the next prefill silently differ) and throws
    void state_read_data(llama_io_read_i & io, llama_seq_id seq_id, const selection & sel);

    // seq_cp to another stream: the destination's H2O state becomes the source's (nothing with H2O off)
    void copy_stream(uint32_t s_src, uint32_t s_dst);

    //
    // the context's and the graph's calls
    //

    // the context's settings for every stream: selection, undo log, coverage and sparse decode (see below)
    void configure(const llama_cparams & cparams);

    // chunk bookkeeping of the sequence held by a stream
    struct chunk_state {
        uint32_t current_chunk_idx      = 0; // chunks completed so far = index of the chunk being filled
        uint32_t total_tokens_processed = 0; // prompt positions accounted to completed chunks
        std::vector<uint32_t> chunk_boundaries = { 0 }; // start positions of the chunks: [0, S, 2S, ...]

        int32_t mem_chunk = -1; // the chunk c whose memory set M_c the index tensors hold (-1: none)
        int32_t acc_chunk = -1; // the chunk whose column sums wait in the F32 accumulators (-1: none)

        // positions before it went through a prompt batch; the ones after it were decoded, which leaves the H2O
        // state alone, so a cut at or after it is exact
        uint32_t prompt_end = 0;

        // what the prefill did since the sequence was last emptied, counted as it runs (a cut keeps them, a state
        // file carries them): chunks whose queries attended to a memory set, and prompt positions that took the
        // dense tail. A state with n_tail_tokens == 0 and all its positions in complete chunks is
        // exactly what a plain prefill of those positions leaves.
        int32_t n_sparse_chunks   = 0;
        int32_t n_tail_tokens     = 0;
        int32_t last_sparse_chunk = -1; // the last chunk counted in n_sparse_chunks
    };

    bool     enabled()  const;
    uint32_t n_local()  const { return local_window; }
    uint32_t n_heavy()  const { return heavy_budget; }
    uint32_t n_memory() const { return memory_size; }
    uint32_t n_chunk()  const { return chunk_size; }

    // memory selection (defaults: the seed rule, no sink, no dense tail)
    // (of every stream; set_select_seq sets one sequence's, until the sequence is emptied)
    void set_select(llama_h2o_select select, uint32_t n_sink, uint32_t n_dense_tail);
    void set_select_seq(llama_seq_id seq_id, llama_h2o_select select, uint32_t n_sink, uint32_t n_dense_tail);

    llama_h2o_select get_select  (uint32_t s = 0) const { return strm[s].select; }
    uint32_t         n_sink      (uint32_t s = 0) const { return strm[s].n_sink; }
    uint32_t         n_dense_tail(uint32_t s = 0) const { return strm[s].n_dense_tail; }

    // the stream holding a sequence's H2O state
    uint32_t stream(llama_seq_id seq_id) const;

    // with several streams, a batch in which some sequence has more than one token (a prompt) is split one sequence
    // per ubatch, so that each sparse prefill ubatch runs on one stream's state; decode batches (one token per
    // sequence) keep llama.cpp's equal split, all sequences in one ubatch
    bool split_per_seq(const llama_batch_allocr & balloc) const;

    // the undo log that lets seq_rm cut back to a chunk boundary inside the prompt (default: off)
    void set_undo_log(bool on);
    // LLAMA_H2O_SELECT_COVERAGE: the coverage a tile's budget stops at, the queries per tile that choose its memory,
    // the share of the key channels their logits read (1/sketch) and the pool they choose among (0: none), for every
    // stream
    void set_coverage(float coverage, int32_t n_sample, int32_t sketch, int32_t pool) {
        coverage_target = coverage;
        tile_samples    = n_sample;
        tile_sketch     = sketch;
        tile_pool       = pool;
    }

    // sparse decode (ggml_h2o_decode) with a budget of n_budget positions (0: full-attention decode): allocates each
    // layer's key sketches beside its K, on the same buffer type
    void     set_decode(uint32_t n_budget, float coverage);
    uint32_t decode_budget() const { return dec_budget; }

    // one sequence's own budget (-1: the context's), until the sequence is emptied; and the least budget of streams
    // s0 .. s1 (a step reads every cell where its cells fit it, the first block and the window)
    void     set_decode_budget_seq(llama_seq_id seq_id, int32_t n_budget);
    uint32_t decode_budget(uint32_t s0, uint32_t s1) const;

    // the positions a query head of stream s read in the last step that ran the sparse decode op, the mean over its
    // KV heads and the cache's layers
    float decode_keys_read(uint32_t s) const;

    // the summaries of stream s from position p on no longer describe the cells (rewritten or removed)
    void decode_invalidate(uint32_t s, llama_pos p);

    // the sparse decode attention of layer il for one query per stream of streams s0 .. s1 (ggml_h2o_decode)
    ggml_tensor * build_decode(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
            ggml_tensor * kq_mask, int32_t il, float kq_scale, uint32_t s0, uint32_t s1) const;
    bool undo_log_on() const { return undo_on; }

    // bytes of the score and memory-index tensors of all layers
    size_t size_bytes() const;

    // forget the sequence of stream s: scores to zero, every memory slot empty (-1), chunk state back to chunk 0,
    // selection back to the cache's; reset_all() does it for every stream (nothing with H2O off)
    void reset(uint32_t s);
    void reset_all();

    // scores of chunk [chunk_start, chunk_start + chunk_len) are set to its intra-chunk column sums
    //   colsum: [n_head][chunk_len], row-major per head
    void init_chunk_scores(int32_t il, uint32_t chunk_start, uint32_t chunk_len, const float * colsum, uint32_t s = 0);

    // the scores of the current memory set M_{c-1} grow by the column sums of chunk c's inter attention
    //   colsum: [n_head][M], aligned with the memory-index slots; empty slots are skipped
    void accumulate_memory_scores(int32_t il, const float * colsum, uint32_t s = 0);

    // build M_c for layer il from its scores, with chunk c = [chunk_boundaries.back(), chunk_end):
    //   Local = the last L positions before chunk_end, Heavy = the H best of (M_{c-1} + chunk c) \ Local
    //   (ties to the lower position), written sorted ascending; slots left over are -1
    void build_memory_set(int32_t il, uint32_t chunk_end, uint32_t s = 0);

    // a chunk of chunk_len positions is complete
    void next_chunk(uint32_t chunk_len, uint32_t s = 0);

    // the sparse prefill attention of layer il for a batch at positions p0 .. p0 + n_tokens - 1 (ggml_h2o_attn):
    //   q: [n_embd_head, n_head, n_tokens], k/v: views of the cache (get_k/get_v) -> [n_embd_head_v, n_head, n_tokens]
    //   queries at positions >= tail_start are the dense tail (INT32_MAX: none)
    ggml_tensor * build_attn(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
            int32_t il, float kq_scale, llama_pos p0, llama_pos tail_start, uint32_t s) const;

    // the prefill graph of a batch at positions p0 .. p0 + n_tokens - 1 (its dense tail from tail_start on) has run:
    // advance the chunk state as ggml_h2o_attn did on the device (chunks completed, memory set and accumulators
    // held), and count the chunks that ran sparse and the dense-tail positions
    void prefill_done(llama_pos p0, uint32_t n_tokens, llama_pos tail_start, uint32_t s);

    // the last prompt batch ended on a chunk boundary, with that chunk complete: the state a prefill of exactly
    // these positions leaves
    bool at_chunk_boundary(uint32_t s) const;

    // records the state at a chunk boundary in the undo log (after prefill_done, once the graph has run),
    // so that the sequence can later be cut back to this or an earlier recorded boundary
    void undo_record(uint32_t s);

    uint32_t get_chunk_idx        (uint32_t s = 0) const { return strm[s].chunk.current_chunk_idx; }
    uint32_t get_total_tokens     (uint32_t s = 0) const { return strm[s].chunk.total_tokens_processed; }
    bool     is_memory_initialized(uint32_t s = 0) const { return strm[s].memory_initialized; }

    const chunk_state & get_chunk_state(uint32_t s = 0) const { return strm[s].chunk; }

    // the state tensors of a layer: scores [kv_size, n_head] BF16, memory indices [M, n_head] I32
    ggml_tensor * get_scores        (int32_t il, uint32_t s = 0) const;
    ggml_tensor * get_memory_indices(int32_t il, uint32_t s = 0) const;

    // copies for inspection, whatever buffer the tensors live in
    //   scores of positions [pos0, pos0 + n) of query head ih, as F32
    //   memory indices of query head ih: M values, -1 = empty slot
    void read_scores        (int32_t il, uint32_t ih, uint32_t pos0, uint32_t n, float * dst, uint32_t s = 0) const;
    void read_memory_indices(int32_t il, uint32_t ih, int32_t * dst, uint32_t s = 0) const;


private:
    llama_kv_cache & kv;

    // hyperparameters (LLAMA_SWA_TYPE_H2O only)
    const uint32_t local_window = 0; // L
    const uint32_t heavy_budget = 0; // H
    const uint32_t memory_size  = 0; // M = L + H, < n_ubatch

    // the selection a stream starts with (set_select)
    llama_h2o_select select_rule     = LLAMA_H2O_SELECT_SEED;
    uint32_t         sink_size       = 0; // <= H
    uint32_t         dense_tail_size = 0;
    float            coverage_target = 1.0f;
    int32_t          tile_samples    = 4;
    int32_t          tile_sketch     = 1;
    int32_t          tile_pool       = 0;

    // chunk size S
    const uint32_t chunk_size = 0;

    // Undo log: cutting a sequence back to a chunk boundary b = cS inside its prompt (seq_rm keeping [0, b)) puts
    // back the state a prefill of [0, b) left. Chunk c changes only the scores of its own positions (zero before it)
    // and of the memory it read (below b), and replaces the memory set; so the log holds the scores and memory sets
    // at the last recorded boundary, and per chunk since the first recorded one, its memory sets at its start and
    // the scores below its start that it changed, with their values then. Host memory: one copy of the scores up
    // to the last boundary, plus at most M scores per head, layer and chunk. Boundaries are recorded when a prompt
    // batch ends on one (every ubatch does when a prompt starts at a boundary); a gap restarts the log.
    struct chunk_undo {
        std::vector<std::vector<int32_t>>  mem;       // per cache layer: memory sets at the chunk's start [n_head][M]
        std::vector<std::vector<uint32_t>> changed;   // per cache layer: ih*kv_size + pos of each score it changed
        std::vector<std::vector<uint16_t>> old_value; // per cache layer: their BF16 bits at the chunk's start
    };

    struct undo_log {
        bool     valid = true; // base_* hold the state at boundary base_chunk
        uint32_t first = 0;    // the earliest boundary the log can go back to
        uint32_t base_chunk = 0;

        std::vector<std::vector<uint16_t>> base_scores; // per cache layer [n_head][base_chunk*S] (empty: none yet)
        std::vector<std::vector<int32_t>>  base_mem;    // per cache layer [n_head][M] (empty: all -1)
        std::vector<chunk_undo>        chunks;      // chunks[c - first]: from boundary c + 1 back to boundary c
    };

    // the H2O state of the sequence held by one stream: a unified cache has one stream and serves one sequence; a
    // non-unified cache (kv_unified = false) gives every sequence its stream, its cells and this state
    struct stream_state {
        // per cache layer: accumulated attention scores [kv_size, n_head] BF16, element (pos, ih) at ih*kv_size + pos
        std::vector<ggml_tensor *> scores;

        // per cache layer: memory set [M, n_head] I32, sorted ascending per head, -1 = empty slot
        std::vector<ggml_tensor *> memory_indices;

        // per cache layer: column sums of the chunk in progress [S + M, n_head] F32 (intra, then inter); they enter
        // the BF16 scores once, when the chunk completes, so that scores do not depend on how the prompt was split
        std::vector<ggml_tensor *> accumulators;

        chunk_state chunk;

        // true once a memory set has been built since the last reset
        bool memory_initialized = false;

        // memory selection of this sequence
        llama_h2o_select select       = LLAMA_H2O_SELECT_SEED;
        uint32_t         n_sink       = 0;
        uint32_t         n_dense_tail = 0;

        // sparse decode budget of this sequence (-1: the context's dec_budget)
        int32_t n_decode_budget = -1;

        undo_log undo;
    };

    std::vector<stream_state> strm; // [n_stream]

    // sparse decode: per cache layer, the key sketches [n_embd_head_k/4*B, n_head_kv, kv_size/B, n_stream] F16 and
    // each stream's count of sketched blocks, channels and own budget [2 + n_embd_head_k/4*n_head_kv, n_stream] I32
    // (ggml_h2o_decode), in buffers of their own
    uint32_t dec_budget   = 0;
    float    dec_coverage = 1.0f; // of the estimated attention between the sinks and the window (1: the budget)
    std::vector<ggml_tensor *> dec_summ;
    std::vector<ggml_tensor *> dec_summ_n;
    std::vector<ggml_tensor *> dec_keys; // [n_stream] F32: the positions a query head read in the last step
    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> dec_bufs;

    bool undo_on = false;

    // writes stream s's sink and own decode budget into every layer's sketch state, where the op reads them
    void decode_write_own(uint32_t s);

    // puts the state back to boundary c, first <= c <= base_chunk: scores, memory sets, accumulators and chunk state
    void undo_to(uint32_t c, uint32_t s);

    // whether seq_rm may remove [p0, p1) from the sequence of stream s; undo_to: the chunk boundary to cut back to (-1: none)
    bool seq_rm_allowed(uint32_t s, llama_pos p0, llama_pos p1, int32_t & undo_to) const;

    // throws, naming the difference, when the header's settings are not this cache's
    // the header's selection is the restored sequences' (sel)
    void state_read_header(llama_io_read_i & io, llama_seq_id seq_id, selection & sel) const;
    void state_read_streams(llama_io_read_i & io, llama_seq_id seq_id, const selection & sel);

    // sparse decode's part of stream s's state: per layer, the blocks sketched, their channels and their sketches;
    // the reader takes them where this cache decodes sparsely and skips them where it does not
    void state_write_decode(llama_io_write_i & io, uint32_t s) const;
    void state_read_decode (llama_io_read_i  & io, uint32_t s, uint32_t n_pos);
};

// the H2O cache behind a memory: the memory itself, or the base cache of an iswa memory (nullptr when neither)
llama_kv_cache * llama_h2o_kv(llama_memory_i * mem);
