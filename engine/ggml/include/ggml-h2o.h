// The H2O ops of ggml (GGML_OP_H2O_ATTN, GGML_OP_H2O_DECODE): their constructors, their parameters by
// name and their selection policies. Included at the end of ggml.h; defined in ggml-h2o.cpp (constructors,
// the seed rule's memory set) and run by the backends' h2o-* units.

#pragma once

#include "ggml.h"

#ifdef  __cplusplus
extern "C" {
#endif

    // H2O chunked sparse prefill attention of one layer, for one sequence whose batch holds positions
    // p0 .. p0 + n_tokens - 1 (position p is cache row p). Chunks are aligned to positions: chunk c holds
    // [c*n_chunk, (c + 1)*n_chunk). A query at position i of chunk c attends to the keys of chunk c up to i
    // (cached ones included) and to the memory set M_{c-1} of its head; the two softmax parts are merged
    // exactly through their row maxima and sums.
    //
    // Side effects, per query head, on the state tensors (which live with the KV cache):
    //   acc:     [n_chunk + n_memory, n_head] F32: column sums of the chunk in progress (intra, then inter)
    //   scores:  [kv_size, n_head] BF16: a chunk's sums are added once, when the chunk completes
    //   mem_idx: [n_memory, n_head] I32: M_c is rebuilt when chunk c completes (and, lazily, for chunks that
    //            were completed outside a prefill, i.e. by decode)
    //
    // q:   [n_embd_k, n_head,    n_tokens] F32
    // k:   [n_embd_k, n_head_kv, n_kv]     F16 (n_head % n_head_kv == 0; query head h reads KV head h/(n_head/n_head_kv))
    // v:   [n_embd_v, n_head_kv, n_kv]     F16
    // res: [n_embd_v, n_head,    n_tokens] F32
    //
    // mem_chunk: the chunk whose memory set mem_idx holds (-1: none)
    // acc_chunk: the chunk whose partial sums acc holds (-1: none)
    GGML_API struct ggml_tensor * ggml_h2o_attn(
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
            float                 scale);

    // How an H2O chunk chooses the n_heavy part of its memory (the last n_local positions are always in it)
    enum ggml_h2o_select {
        // the seed rule: after chunk c, the positions with the highest accumulated attention of earlier queries
        GGML_H2O_SELECT_SEED       = 0,
        // 1 and 2 chose whole blocks by the chunk's own queries alone; they lost to the hybrid everywhere measured and
        // were retired. Their numbers are not reused: saved states name a policy by its number.

        // half of the heavy budget as blocks of GGML_H2O_BLOCK positions that chunk c's own queries may attend to
        // most (each key block summarised per channel by its minimum and maximum, which bound q.k from above), the
        // other half by accumulated attention (the seed rule's scores) among all other earlier positions
        GGML_H2O_SELECT_HYBRID     = 3,
        // every tile of GGML_H2O_TILE queries chooses its own memory, position by position, from the exact
        // attention of a few of its queries; the tiles of all heads of a chunk share the heavy budget, spent where
        // the sampled attention says it covers most (see ggml_h2o_attn_set_coverage)
        GGML_H2O_SELECT_COVERAGE   = 4,
    };

    #define GGML_H2O_BLOCK 16

    // The op parameters of GGML_OP_H2O_ATTN and GGML_OP_H2O_DECODE by slot, for ggml_get_op_params_i32 (or _f32
    // where marked); every reader names them. Set by the constructors and setters below.
    enum ggml_h2o_attn_param {
        GGML_H2O_ATTN_P0         = 0,  // position of the batch's first token
        GGML_H2O_ATTN_CHUNK      = 1,  // n_chunk
        GGML_H2O_ATTN_LOCAL      = 2,  // n_local
        GGML_H2O_ATTN_HEAVY      = 3,  // n_heavy
        GGML_H2O_ATTN_MEM_CHUNK  = 4,  // the chunk whose memory set mem_idx holds (-1: none)
        GGML_H2O_ATTN_ACC_CHUNK  = 5,  // the chunk whose partial sums acc holds (-1: none)
        GGML_H2O_ATTN_SCALE      = 6,  // f32
        GGML_H2O_ATTN_SELECT     = 7,  // enum ggml_h2o_select
        GGML_H2O_ATTN_SINK       = 8,  // n_sink
        GGML_H2O_ATTN_TAIL_START = 9,
        GGML_H2O_ATTN_COVERAGE   = 10, // f32
        GGML_H2O_ATTN_N_SAMPLE   = 11,
        GGML_H2O_ATTN_SOFTCAP    = 12, // f32 logit_softcap
        GGML_H2O_ATTN_SKETCH     = 13,
        GGML_H2O_ATTN_POOL       = 14, // n_pool
    };

    enum ggml_h2o_decode_param {
        GGML_H2O_DECODE_SINK     = 0,  // n_sink
        GGML_H2O_DECODE_LOCAL    = 1,  // n_local
        GGML_H2O_DECODE_BUDGET   = 2,  // n_budget
        GGML_H2O_DECODE_SCALE    = GGML_H2O_ATTN_SCALE,   // f32; the same slot as the prefill's, read by shared code
        GGML_H2O_DECODE_COVERAGE = 7,  // f32
        GGML_H2O_DECODE_SOFTCAP  = GGML_H2O_ATTN_SOFTCAP, // f32; as the scale
    };

    // GGML_H2O_SELECT_COVERAGE: queries per tile, budgets in steps of GGML_H2O_BUDGET_STEP positions, at most
    // GGML_H2O_MAX_HEAVY_FACTOR * n_heavy ranked positions per tile
    #define GGML_H2O_TILE             64
    #define GGML_H2O_BUDGET_STEP      32
    #define GGML_H2O_MAX_HEAVY_FACTOR 4
    // ... and with a pool (ggml_h2o_attn_set_coverage_pool): the queries of each tile that scan every earlier position
    // (one in GGML_H2O_POOL_SCAN_EVERY), and the share of the pool that a tile's own scanned queries add
    #define GGML_H2O_POOL_SCAN_EVERY  16
    #define GGML_H2O_POOL_OWN         4

    // Memory selection of an H2O attention op (default: GGML_H2O_SELECT_SEED, no sink, no dense tail):
    //   n_sink:     positions 0 .. n_sink - 1 are always in the memory set, inside the n_heavy budget
    //   tail_start: queries at positions >= tail_start attend to every earlier position (full attention,
    //               no score updates); INT32_MAX for none
    GGML_API void ggml_h2o_attn_set_select(
            struct ggml_tensor  * a,
            enum ggml_h2o_select  select,
            int32_t               n_sink,
            int32_t               tail_start);

    // GGML_H2O_SELECT_COVERAGE: n_sample queries of each tile (every GGML_H2O_TILE/n_sample-th; a divisor of
    // GGML_H2O_TILE, 4 by default) attend to every earlier position to choose its memory; a tile stops taking
    // budget once the attention its memory covers, as they estimate it, reaches `coverage` (in (0, 1]; 1 by
    // default: the whole budget is spent). The budget is the average n_heavy - n_sink per tile, over all heads
    // and tiles of the chunk.
    GGML_API void ggml_h2o_attn_set_coverage(
            struct ggml_tensor  * a,
            float                 coverage,
            int32_t               n_sample);

    // GGML_H2O_SELECT_COVERAGE: the sampled queries' attention, which proposes each tile's candidates, from logits over
    // only 1/sketch of the key channels: those with the most key energy over the positions the call can see, per KV head
    // (1 by default: every channel, exact logits; a divisor of the head size). A sketch costs that share of the exact
    // proposal, so more queries can propose for the same work; every query still ranks the proposal exactly.
    GGML_API void ggml_h2o_attn_set_coverage_sketch(
            struct ggml_tensor  * a,
            int32_t               sketch);

    // GGML_H2O_SELECT_COVERAGE: a proposal whose reads do not grow with the prompt. With n_pool > 0, once per chunk and
    // head, one in GGML_H2O_POOL_SCAN_EVERY queries of every tile attend (on the sketch's channels) to every earlier
    // position, and the n_pool candidates with the most of their attention form the chunk's pool; each tile adds the
    // n_pool/GGML_H2O_POOL_OWN candidates outside it that its own scanned queries attend to most, and its sampled
    // queries propose among that pool alone (a softmax over it). Chunks with no more candidates than a tile's pool
    // propose among all of them as without a pool. 0 by default: every tile's samples read every earlier position.
    // n_pool is 0 or at least GGML_H2O_MAX_HEAVY_FACTOR * n_heavy, the candidates a proposal names.
    GGML_API void ggml_h2o_attn_set_coverage_pool(
            struct ggml_tensor  * a,
            int32_t               n_pool);

    // The attention logits of an H2O attention op (ggml_h2o_attn or ggml_h2o_decode), as ggml_flash_attn_ext has
    // them (default: neither):
    //   logit_softcap: > 0: every scaled logit x becomes logit_softcap*tanh(x/logit_softcap) (Gemma 2)
    //   sinks:         F32 [n_head] or NULL: learned attention sinks (gpt-oss): the sink logit of each head joins the
    //                  softmax denominator of every query's output, as ggml_flash_attn_ext_add_sinks does; a sink is no
    //                  key, so the scores and the memory selection rank keys without it
    GGML_API void ggml_h2o_attn_set_logits(
            struct ggml_tensor  * a,
            float                 logit_softcap,
            struct ggml_tensor  * sinks);

    // H2O sparse decode attention of one layer: each query (a token a decode step appends; n_tokens per stream, one
    // stream per sequence, position p is cache row p) attends exactly, in one softmax, to
    //   - the first max(ceil(n_sink/B), 1) blocks of B = GGML_H2O_DECODE_BLOCK positions (the attention sinks; n_sink or
    //     its stream's own),
    //   - the recent window [p + 1 - n_local, p], widened down to a block boundary,
    //   - the n_budget positions (or its stream's own budget) between them that its KV head's query heads point at:
    //     each position's logit is estimated from a sketch of its key, the R = n_embd_k/4 channels of the KV head
    //     that hold the most key energy in 8 bits (each position's and each query's values scaled by their largest
    //     magnitude, their products summed as integers), and the positions whose estimate stands least below its
    //     head's best estimate (the least over the heads) are read, ties to the earlier position,
    // of the cells `mask` leaves open. With the whole context within those parts, it is full attention.
    //
    // State, per layer and stream, kept with the KV cache:
    //   summ:   [GGML_H2O_DECODE_SKETCH_SIZE(n_embd_k), n_head_kv, kv_size/B, n_stream] I8: each block's sketch, its
    //           values as bytes [R/4 quads of channels][B positions][4], each value plus 128, then the B positions'
    //           scales as F32
    //   summ_n: [3 + R*n_head_kv, n_stream] I32: blocks sketched, then each KV head's R channels (ascending), then
    //           the stream's own sink and budget (-1: n_sink, n_budget). The op sketches complete blocks up to each
    //           query first; when none was sketched it first chooses the channels from the keys of the complete blocks
    //           (the first step after a prefill: the prompt's). The cache lowers the count when it rewrites cells
    //           (llama_kv_cache::h2o_decode_invalidate) and writes each sequence's own sink and budget
    //           (llama_h2o_set_seq_select, llama_h2o_set_seq_decode)
    //
    // q:    [n_embd_k, n_head,    n_tokens, n_stream] F32
    // k:    [n_embd_k, n_head_kv, n_kv,     n_stream] (any type ggml converts to F32)
    // v:    [n_embd_v, n_head_kv, n_kv,     n_stream]
    // mask: [n_kv, >= n_tokens, 1, n_stream] F32 or F16 (the KQ mask): -INF closes a cell
    // res:  [n_embd_v, n_head,    n_tokens, n_stream] F32
    GGML_API struct ggml_tensor * ggml_h2o_decode(
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
            float                 scale);

    // Sparse decode with a budget that follows the attention (default 1: the n_budget positions): of those positions, a
    // query takes only the fewest whose estimated attention holds this share (in (0, 1]) of that of every candidate
    // between the sinks and the window. A candidate whose gap is x holds exp(-x) of its best head's best candidate;
    // the candidates are counted in buckets of their gaps (the leading 11 bits of the gap's F32 pattern, an eighth of
    // an octave), each weighing exp(-its least gap) in integer units of 2^-24, and whole buckets are taken from the
    // least gaps until their weight reaches the share, so that every backend counts the same positions.
    GGML_API void ggml_h2o_decode_set_coverage(
            struct ggml_tensor  * a,
            float                 coverage);

    // Where the op writes, per stream, the positions a query head read in the call, the mean over the stream's KV
    // heads and tokens: F32 [n_stream] (default: not written). With coverage below 1 that is known only once chosen.
    GGML_API void ggml_h2o_decode_set_keys_read(
            struct ggml_tensor  * a,
            struct ggml_tensor  * keys_read);

    #define GGML_H2O_DECODE_BLOCK 16
    // bytes of one block's sketch for one KV head (ggml_h2o_decode's summ): its 8-bit values, then its F32 scales
    #define GGML_H2O_DECODE_SKETCH_SIZE(n_embd_k) (((n_embd_k)/4 + 4)*GGML_H2O_DECODE_BLOCK)

    // The H2O memory-set rule for one head (used by the op above and by llama's KV cache):
    // Local = [max(chunk_end - n_local, 0), chunk_end); Sink = [0, n_sink) minus Local; candidates = (memory, when
    // has_previous, + [chunk_start, chunk_end)) minus Local and Sink; Heavy = the n_heavy - |Sink| candidates with
    // the highest score, ties to the lower position (NaN ranks last). memory[0 .. n_local + n_heavy) is overwritten
    // with Local + Sink + Heavy ascending, -1 after.
    GGML_API void ggml_h2o_build_memory_set(
            const ggml_bf16_t * scores,
            int32_t           * memory,
            int32_t             n_local,
            int32_t             n_heavy,
            int32_t             n_sink,
            int32_t             chunk_start,
            int32_t             chunk_end,
            bool                has_previous);

#ifdef  __cplusplus
}
#endif
