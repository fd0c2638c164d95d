// The H2O part of llama's C API (the context's settings are in llama_context_params): introspection of a
// context's H2O state and per-sequence settings. Included at the end of llama.h; defined in llama-h2o.cpp.

#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

    //
    // H2O chunked sparse prefill [EXPERIMENTAL]
    //
    // Read-only introspection of the H2O state of a context created with h2o_local + h2o_heavy > 0.
    // Functions return a negative llama_h2o_status on error.
    //

    enum llama_h2o_status {
        LLAMA_H2O_STATUS_OK             =  0,
        LLAMA_H2O_STATUS_DISABLED       = -1, // the context was created without H2O
        LLAMA_H2O_STATUS_INVALID_LAYER  = -2, // a layer without H2O state (see llama_h2o_get_layers)
        LLAMA_H2O_STATUS_INVALID_HEAD   = -3, // query head index outside [0, n_head)
        LLAMA_H2O_STATUS_INVALID_RANGE  = -4, // positions outside the cache, or a destination that is too small
        LLAMA_H2O_STATUS_INVALID_SEQ    = -5, // a sequence id outside [0, n_seq_max)
        LLAMA_H2O_STATUS_INVALID_SELECT = -6, // an unknown policy, h2o_sink outside [0, h2o_heavy], or a dense tail outside [0, n_ctx_seq]
        LLAMA_H2O_STATUS_SEQ_NOT_EMPTY  = -7, // the sequence has prompt positions: its policy is set while it is empty
    };

    struct llama_h2o_info {
        int32_t n_local;            // L
        int32_t n_heavy;            // H
        int32_t n_memory;           // M = L + H: slots of a memory set
        int32_t n_chunk;            // S = n_ubatch: positions per chunk
        enum llama_h2o_select select; // how the heavy part is chosen
        int32_t n_sink;             // positions 0 .. n_sink - 1 always in memory
        int32_t n_dense_tail;       // tokens at the end of a prompt that attend to everything
        int32_t n_layer;            // layers with H2O state
        int32_t n_head;             // query heads per layer (memory sets and scores are per query head)
        int32_t kv_size;            // cells = positions the scores cover
        int32_t n_chunks_done;      // chunks completed since the last reset
        int32_t n_tokens_done;      // prompt positions in those chunks
        int32_t n_sparse_chunks;    // chunks whose queries attended to a memory set since the sequence was last
                                    // emptied (counted as they run; kept by cuts, carried by state files)
        int32_t n_tail_tokens;      // prompt positions that took the dense tail, likewise
        bool    memory_initialized; // a memory set has been built since the last reset
        size_t  size_bytes;         // scores + memory indices of all layers
    };

    // fills *info (of sequence 0); returns LLAMA_H2O_STATUS_OK or LLAMA_H2O_STATUS_DISABLED
    LLAMA_API int32_t llama_h2o_get_info(
            const struct llama_context * ctx,
                 struct llama_h2o_info * info);

    // fills *info with the settings and chunk state of sequence seq_id (with n_seq_max > 1, each sequence has its
    // own KV stream and H2O state); returns LLAMA_H2O_STATUS_OK or a negative llama_h2o_status
    LLAMA_API int32_t llama_h2o_get_seq_info(
            const struct llama_context * ctx,
                          llama_seq_id   seq_id,
                 struct llama_h2o_info * info);

    // the memory selection of one sequence, set while it is empty (it holds until the sequence is emptied again,
    // when it returns to the context's h2o_select/h2o_sink/h2o_dense_tail): lets requests sharing a context choose
    // their policy; returns LLAMA_H2O_STATUS_OK or a negative llama_h2o_status
    LLAMA_API int32_t llama_h2o_set_seq_select(
                  struct llama_context * ctx,
                          llama_seq_id   seq_id,
                 enum llama_h2o_select   select,
                               int32_t   n_sink,
                               int32_t   n_dense_tail);

    // the sparse decode budget of one sequence: n_budget positions chosen per decode step (a budget that covers the
    // sequence's context reads every position: full attention), or -1 for the context's h2o_decode_budget. It can be
    // set at any time (it changes no state the prompt built) and holds until the sequence is emptied. Needs a context
    // created with h2o_decode_budget > 0, which keeps the key sketches; returns LLAMA_H2O_STATUS_OK,
    // LLAMA_H2O_STATUS_DISABLED (no sparse decode), LLAMA_H2O_STATUS_INVALID_SEQ or LLAMA_H2O_STATUS_INVALID_RANGE
    // (n_budget below -1 or above n_ctx_seq)
    LLAMA_API int32_t llama_h2o_set_seq_decode(
                  struct llama_context * ctx,
                          llama_seq_id   seq_id,
                               int32_t   n_budget);

    // the positions a query head of seq_id read in the context's last decode call, the mean over its KV heads and the
    // layers with H2O state, when that call ran sparse decode; -1 when it did not (a prompt, or a step whose cells fit
    // its budget, the first block and the window, which reads them all) or the context has no sparse decode. With
    // h2o_decode_coverage below 1 the count follows the attention and is known only once a step has chosen.
    LLAMA_API float llama_h2o_decode_keys(
                  struct llama_context * ctx,
                          llama_seq_id   seq_id);

    // copies the indices of the layers with H2O state (ascending; all layers of a dense model, the
    // non-SWA layers of a model with interleaved sliding-window layers) into dst
    // returns the number written (n_layer), or a negative llama_h2o_status
    LLAMA_API int32_t llama_h2o_get_layers(
            const struct llama_context * ctx,
                               int32_t * dst,
                                size_t   n_dst);

    // copies the memory set of layer il, query head ih (n_memory slots, ascending, -1 = empty) into dst
    // returns the number of slots written (n_memory), or a negative llama_h2o_status
    LLAMA_API int32_t llama_h2o_get_memory_indices(
            const struct llama_context * ctx,
                               int32_t   il,
                               int32_t   ih,
                               int32_t * dst,
                                size_t   n_dst);

    // copies the accumulated scores of positions [pos0, pos0 + n) of layer il, query head ih into dst
    // returns n, or a negative llama_h2o_status
    LLAMA_API int32_t llama_h2o_get_scores(
            const struct llama_context * ctx,
                               int32_t   il,
                               int32_t   ih,
                               int32_t   pos0,
                               int32_t   n,
                                 float * dst);

#ifdef __cplusplus
}
#endif
