#pragma once

// The CUDA kernels of GGML_OP_H2O_ATTN (one header each, included below) and the host walk over the chunks of a
// batch. These headers need nothing but the CUDA runtime, so that a standalone program
// (tests/cpp/bench-h2o-cuda-op.cu) can check and time the kernels against each other without building all of
// ggml-cuda; h2o-attn.cu adapts the walk to ggml's tensors and memory pool.
//
// Per chunk c = [cs, cs + S) of the batch the host launches
//   1. h2o_attn_mma (head sizes 64 and 128) or h2o_attn_generic (any other): causal attention inside the
//      chunk plus attention to the memory set M_{c-1}, and the per-key sums of each part's probabilities
//      over the block's query rows (the score column sums), written per block;
//   2. h2o_reduce_settle: adds the blocks' column sums, in block order, to the chunk's F32 sums; when the
//      chunk is complete they enter the BF16 scores (seed rule item 4) and start again from zero;
//   3. h2o_build (when the chunk is complete): M_c, the rule of ggml_h2o_build_memory_set.
// With the hybrid, h2o_select_query chooses the memory of chunk c from its own queries before step 1
// instead of step 3; queries of the dense tail run in h2o_attn_dense instead of step 1. With coverage selection every
// tile of H2O_COV_TILE queries gets its own memory before step 1 (h2o_cuda_cover_select), step 1 reads each tile's,
// and the memory sums go straight to the scores (h2o_cov_settle_memory).
// Nothing returns to the host between chunks.

#include "h2o-cuda-common.cuh"
#include "h2o-attn-mma.cuh"
#include "h2o-attn-generic.cuh"
#include "h2o-attn-scores.cuh"
#include "h2o-select-query.cuh"
#include "h2o-attn-dense.cuh"
#include "h2o-coverage.cuh"

// ---------------------------------------------------------------------------------------------------------------
// the host side: one layer's op over the chunks of its batch
// ---------------------------------------------------------------------------------------------------------------

struct h2o_cuda_args {
    const char * q;       // [D,  n_head,    n_tokens] F32
    const char * k;       // [D,  n_head_kv, kv_size]  F16, row p = position p
    const char * v;       // [Dv, n_head_kv, kv_size]  F16
    uint16_t   * scores;  // [kv_size, n_head] BF16
    int32_t    * mem;     // [M, n_head] I32
    float      * acc;     // [S + M, n_head] F32
    float      * dst;     // [Dv, n_head, n_tokens] F32

    size_t nbq1, nbq2, nbk1, nbk2, nbv1, nbv2, nbd1, nbd2, nb_scores1, nb_mem1, nb_acc1;

    int D, Dv, n_head, n_head_kv, n_tokens, kv_size;
    int p0, S, L, H;
    int mem_chunk; // the chunk whose memory set mem holds (-1: none)
    int acc_chunk; // the chunk whose sums wait in acc (-1: none)
    float scale;
    int select     = 0;         // ggml_h2o_select: 0 the seed rule, 3 hybrid, 4 (H2O_COV_SELECT) coverage
    int n_sink     = 0;         // positions 0 .. n_sink - 1 always in memory
    int tail_start = INT32_MAX; // queries from here on attend to everything (INT32_MAX: none)
    float coverage = 1.0f;      // coverage selection: a tile takes no more budget once its estimate reaches this
    int n_sample   = 4;         // coverage selection: sampled queries per tile (a divisor of H2O_COV_TILE)
    int sketch     = 1;         // coverage selection: their logits over D/sketch channels (1: all)
    float softcap  = 0.0f;      // attention logit soft-cap (0: none)
    const float * sinks = nullptr; // [n_head] F32 learned attention sinks (nullptr: none)

    size_t smem_per_block; // what a block may use, opt-in included
};

#define H2O_COV_SELECT 4 // GGML_H2O_SELECT_COVERAGE

enum h2o_cuda_kernel {
    H2O_CUDA_KERNEL_AUTO,    // h2o_attn_mma where it serves the shape, else h2o_attn_generic
    H2O_CUDA_KERNEL_GENERIC, // h2o_attn_generic always (a reference for tests)
};

// M: the memory slots the attention reads per head (or per tile, under coverage selection)
static bool h2o_cuda_mma_serves(const h2o_cuda_args & a, int M) {
    const bool aligned = (uintptr_t) a.k % 16 == 0 && (uintptr_t) a.v % 16 == 0 &&
        (uintptr_t) a.q % 8 == 0 && (uintptr_t) a.dst % 8 == 0 &&
        a.nbk1 % 16 == 0 && a.nbk2 % 16 == 0 && a.nbv1 % 16 == 0 && a.nbv2 % 16 == 0 &&
        a.nbq1 % 8 == 0 && a.nbq2 % 8 == 0 && a.nbd1 % 8 == 0 && a.nbd2 % 8 == 0;
    return (a.D == 64 || a.D == 128) && a.Dv == a.D && aligned && h2o_mma_smem_bytes(a.D, M) <= a.smem_per_block;
}

struct h2o_cuda_plan {
    bool   mma;
    int    generic_warps;
    size_t attn_smem;
    size_t build_smem;
    size_t select_smem;
    size_t partial_floats; // scratch for the blocks' column sums (and the block scores of the hybrid, the
                           // buffers of coverage selection: h2o_cov_layout)
    int    n_blocks_max;   // the hybrid: blocks of H2O_SELECT_BLOCK positions in the cache
    // coverage selection
    int    cov_rank;       // R = H2O_COV_FACTOR*H: the candidates a tile ranks, at most
    int    cov_mem;        // Mt = n_sink + L + R: the memory slots of a tile
    int    cov_heads;      // heads per pass of stage 1 (bounds the candidates' scores in the scratch)
    int    cov_dt;         // the selection's logits: 0 F32 on the CUDA cores, 64 or 128 (= D) on the tensor cores
    size_t cov_logit_smem; // h2o_cov_sample_stats, h2o_cov_sample_scores
    size_t cov_sketch_smem; // the same in F32 on D/sketch channels, with a key sketch
    size_t cov_rank_smem;  // h2o_cov_rank
    size_t cov_build_smem; // h2o_cov_build_memory
};

// the buffers of coverage selection, in the op's one scratch buffer (partial), for the chunk sizes of the plan
struct h2o_cov_scratch {
    float    * partial; // [parts][n_head][S + Mt]: the attention's column sums
    float    * st_m;    // [split][head of a pass][sample slot]: stage 1, each split's row maximum and sum
    double   * st_l;
    float    * sm_m;    // [head of a pass][sample slot]: each sampled query's maximum and 1/sum
    float    * sm_il;
    float    * cand;    // [head of a pass][n_t][n_cand]: the candidates' scores
    int32_t  * prop;    // [n_head][n_t][R]: each unit's proposal, ascending
    int32_t  * ranked;  // [n_head][n_t][R]: the same ranked
    float    * col_f;   // [n_head][n_t][R]: the proposal's column sums over the tile's rows
    double   * col_d;
    double   * curves;  // [n_head][n_t][R/STEP + 1]: each unit's estimate after 0, 1, ... steps
    uint64_t * keys;    // [n_head][n_t][R/STEP]: the allocation's keys
    int32_t  * given;   // [n_head][n_t]: each unit's budget steps
    int32_t  * mem_t;   // [n_t][n_head][Mt]: each tile's memory
    int32_t  * mem_n;   // [n_t][n_head]: its slots in use
    float    * far;     // [n_head][kv_size]: memory sums per position, zero between chunks
    double   * energy;  // [split][n_head_kv][D]: the key sketch's energy per channel (sketch > 1)
    int32_t  * chan;    // [n_head_kv][D/sketch]: its channels, ascending
};

template <typename T>
static void h2o_cov_take(T ** ptr, char * base, size_t & at, size_t count) {
    *ptr = base != nullptr ? (T *) (base + at) : nullptr;
    at += (count*sizeof(T) + 255)/256*256;
}

// lays the buffers out from base (nullptr: only counts); returns the bytes they take
static size_t h2o_cov_layout(const h2o_cuda_args & a, const h2o_cuda_plan & p, char * base, h2o_cov_scratch * s) {
    const size_t n_t    = (a.S + H2O_COV_TILE - 1)/H2O_COV_TILE;
    const size_t units  = (size_t) a.n_head*n_t;
    const size_t slots  = (n_t*a.n_sample + H2O_COV_TILE - 1)/H2O_COV_TILE*H2O_COV_TILE;
    const size_t splits = (a.kv_size + H2O_COV_SPLIT - 1)/H2O_COV_SPLIT;
    const size_t steps  = (p.cov_rank + H2O_COV_STEP - 1)/H2O_COV_STEP;
    const int    rows   = p.mma ? H2O_MMA_ROWS : p.generic_warps*H2O_GENERIC_ROWS_PER_WARP;
    const size_t parts  = (a.S + rows - 1)/rows;
    size_t at = 0;
    h2o_cov_take(&s->partial, base, at, parts*a.n_head*(a.S + p.cov_mem));
    h2o_cov_take(&s->st_m,    base, at, splits*p.cov_heads*slots);
    h2o_cov_take(&s->st_l,    base, at, splits*p.cov_heads*slots);
    h2o_cov_take(&s->sm_m,    base, at, (size_t) p.cov_heads*slots);
    h2o_cov_take(&s->sm_il,   base, at, (size_t) p.cov_heads*slots);
    h2o_cov_take(&s->cand,    base, at, (size_t) p.cov_heads*n_t*a.kv_size);
    h2o_cov_take(&s->prop,    base, at, units*p.cov_rank);
    h2o_cov_take(&s->ranked,  base, at, units*p.cov_rank);
    h2o_cov_take(&s->col_f,   base, at, units*p.cov_rank);
    h2o_cov_take(&s->col_d,   base, at, units*p.cov_rank);
    h2o_cov_take(&s->curves,  base, at, units*(steps + 1));
    h2o_cov_take(&s->keys,    base, at, units*steps);
    h2o_cov_take(&s->given,   base, at, units);
    h2o_cov_take(&s->mem_t,   base, at, units*p.cov_mem);
    h2o_cov_take(&s->mem_n,   base, at, units);
    h2o_cov_take(&s->far,     base, at, (size_t) a.n_head*a.kv_size);
    h2o_cov_take(&s->energy,  base, at, a.sketch > 1 ? splits*a.n_head_kv*a.D : 0);
    h2o_cov_take(&s->chan,    base, at, a.sketch > 1 ? (size_t) a.n_head_kv*(a.D/a.sketch) : 0);
    return at;
}

// coverage selection: what it adds to the plan, or why it cannot run. Its logits run on the tensor cores where
// h2o_attn_mma's would (kernel AUTO, head sizes 64 and 128, K rows 16-byte aligned), else in F32
static const char * h2o_cov_make_plan(const h2o_cuda_args & a, h2o_cuda_kernel kernel, h2o_cuda_plan & p) {
    if (a.n_sample < 1 || a.n_sample > H2O_COV_TILE || H2O_COV_TILE % a.n_sample != 0) {
        return "coverage selection: the sampled queries per tile must divide 64";
    }
    if (H2O_COV_FACTOR*(size_t) a.H > H2O_COV_MAX_RANK) {
        return "coverage selection serves heavy budgets up to 2048 positions";
    }
    if (a.D % 4 != 0) {
        return "coverage selection serves head sizes that are multiples of 4";
    }
    if (a.sketch < 1 || a.D % a.sketch != 0 || a.D > H2O_SELECT_MAX_D) {
        return "coverage selection: the key sketch must divide the head size, at most 256";
    }
    const int n_t   = (a.S + H2O_COV_TILE - 1)/H2O_COV_TILE;
    const int steps = (p.cov_rank + H2O_COV_STEP - 1)/H2O_COV_STEP;
    const size_t rank_sort = (size_t) h2o_cov_pow2(p.cov_rank)*sizeof(uint64_t) + (size_t) steps*sizeof(double);
    const bool k_aligned = (uintptr_t) a.k % 16 == 0 && a.nbk1 % 16 == 0 && a.nbk2 % 16 == 0;
    p.cov_dt = kernel == H2O_CUDA_KERNEL_AUTO && (a.D == 64 || a.D == 128) && k_aligned ? a.D : 0;
    p.cov_logit_smem = p.cov_dt == 64 ? h2o_cov_block<64>::smem_bytes(a.D) :
                       p.cov_dt == 128 ? h2o_cov_block<128>::smem_bytes(a.D) : h2o_cov_block<0>::smem_bytes(a.D);
    p.cov_sketch_smem = h2o_cov_block<0>::smem_bytes(a.D/a.sketch);
    p.cov_rank_smem  = p.cov_logit_smem > rank_sort ? p.cov_logit_smem : rank_sort;
    p.cov_build_smem = (size_t) h2o_cov_pow2(p.cov_rank)*sizeof(uint32_t);
    // (+ 4 KiB: the kernels' static shared memory counts against the same limit)
    if (p.cov_rank_smem + 4096 > a.smem_per_block || p.cov_build_smem + 4096 > a.smem_per_block ||
        p.cov_sketch_smem + 4096 > a.smem_per_block) {
        return "coverage selection: the head size or the heavy budget needs more shared memory than this GPU has";
    }
    const size_t per_head = (size_t) n_t*a.kv_size*sizeof(float);
    p.cov_heads = (int) (H2O_COV_SCORE_BYTES/per_head);
    p.cov_heads = p.cov_heads < 1 ? 1 : p.cov_heads > a.n_head ? a.n_head : p.cov_heads;
    h2o_cov_scratch s;
    p.partial_floats = (h2o_cov_layout(a, p, nullptr, &s) + sizeof(float) - 1)/sizeof(float);
    return nullptr;
}

// nullptr when the shape cannot run (then *plan is unset), else the plan
static const char * h2o_cuda_make_plan(const h2o_cuda_args & a, h2o_cuda_kernel kernel, h2o_cuda_plan * plan) {
    const bool coverage = a.select == H2O_COV_SELECT;
    h2o_cuda_plan p {};
    p.cov_rank = H2O_COV_FACTOR*a.H;
    p.cov_mem  = a.n_sink + a.L + p.cov_rank;
    // the memory slots the attention reads: the head's, or (coverage) a tile's
    const int M     = a.L + a.H;
    const int M_att = coverage ? p.cov_mem : M;
    p.build_smem = h2o_build_smem_bytes(a.S, M);
    p.mma        = kernel == H2O_CUDA_KERNEL_AUTO && h2o_cuda_mma_serves(a, M_att);
    if (p.mma) {
        p.attn_smem      = h2o_mma_smem_bytes(a.D, M_att);
        p.partial_floats = (size_t) ((a.S + H2O_MMA_ROWS - 1)/H2O_MMA_ROWS)*a.n_head*(a.S + M_att);
    } else {
        p.generic_warps = 4;
        while (p.generic_warps > 1 && h2o_generic_smem_bytes(p.generic_warps, a.S, M_att, a.D) > a.smem_per_block) {
            p.generic_warps /= 2;
        }
        const int rows_per_tile = p.generic_warps*H2O_GENERIC_ROWS_PER_WARP;
        p.attn_smem      = h2o_generic_smem_bytes(p.generic_warps, a.S, M_att, a.D);
        p.partial_floats = (size_t) ((a.S + rows_per_tile - 1)/rows_per_tile)*a.n_head*(a.S + M_att);
    }
    if (a.select != 0 || a.tail_start != INT32_MAX) {
        if (a.D > H2O_SELECT_MAX_D || a.Dv > H2O_SELECT_MAX_D) {
            return "memory selection and the dense tail serve head sizes up to 256";
        }
        if (a.H/H2O_SELECT_BLOCK + 2 > H2O_SELECT_MAX_PICK) {
            return "memory selection serves heavy budgets up to 8160 positions";
        }
    }
    p.n_blocks_max = (a.kv_size + H2O_SELECT_BLOCK - 1)/H2O_SELECT_BLOCK;
    p.select_smem  = h2o_select_smem_bytes(a.D, a.H);
    if (a.select != 0 && !coverage) {
        const size_t need = (size_t) a.n_head*p.n_blocks_max;
        p.partial_floats = p.partial_floats > need ? p.partial_floats : need;
    }
    if (coverage) {
        if (const char * err = h2o_cov_make_plan(a, kernel, p)) {
            return err;
        }
    }
    if (p.attn_smem > a.smem_per_block || p.build_smem > a.smem_per_block || p.select_smem > a.smem_per_block) {
        return "the chunk (n_ubatch) is too large for this GPU's shared memory";
    }
    *plan = p;
    return nullptr;
}

// coverage selection: every 64-row tile attends to its own memory (mem: [n_t][n_head][M], count: its slots in use),
// and this call's rows start at r_begin, inside the first tile
struct h2o_cov_attn {
    const int32_t * mem;
    const int32_t * count;
    int M;
    int r_begin;
};

template <int D>
static void h2o_cuda_launch_mma(const h2o_cuda_args & a, float * partial, int cs, int i_begin, int q_end, bool has_memory,
        cudaStream_t stream, const h2o_cov_attn * cov = nullptr) {
    const int    M    = cov != nullptr ? cov->M : a.L + a.H;
    const size_t smem = h2o_mma_smem_bytes(D, M);
    cudaFuncSetAttribute(h2o_attn_mma<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem);
    const int  n_tiles = (q_end - i_begin + H2O_MMA_ROWS - 1)/H2O_MMA_ROWS;
    const dim3 grid(n_tiles, a.n_head, 1);
    h2o_attn_mma<D><<<grid, H2O_MMA_WARPS*H2O_WARP_SIZE, smem, stream>>>(
            a.q, a.k, a.v, cov != nullptr ? cov->mem : a.mem, a.dst, partial,
            a.nbq1, a.nbq2, a.nbk1, a.nbk2, a.nbv1, a.nbv2, cov != nullptr ? (size_t) M*sizeof(int32_t) : a.nb_mem1,
            a.nbd1, a.nbd2, a.n_head/a.n_head_kv, a.S, M, a.p0, cs, i_begin, cov != nullptr ? cov->r_begin : i_begin, q_end,
            has_memory, cov != nullptr ? (size_t) a.n_head*M*sizeof(int32_t) : 0, cov != nullptr ? cov->count : nullptr,
            a.scale*1.4426950408889634f, a.softcap*1.4426950408889634f, a.sinks);
}

// the shared memory the selection's logit kernels of the plan take (once per process would do; as cheap per call)
template <int DT>
static void h2o_cov_set_smem(const h2o_cuda_plan & plan) {
    cudaFuncSetAttribute(h2o_cov_sample_stats<DT>,  cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.cov_logit_smem);
    cudaFuncSetAttribute(h2o_cov_sample_scores<DT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.cov_logit_smem);
    cudaFuncSetAttribute(h2o_cov_rank<DT>,          cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.cov_rank_smem);
    cudaFuncSetAttribute(h2o_cov_sample_stats<0>,   cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.cov_sketch_smem);
    cudaFuncSetAttribute(h2o_cov_sample_scores<0>,  cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.cov_sketch_smem);
}

// Coverage selection for chunk [cs, cs + S), this call's rows [i_begin, i_end) of it (the dense tail's included, as
// on the CPU): the stages of the kernels above, and each tile's memory into s.mem_t and s.mem_n, the memory set kept
// into a.mem. DT: plan.cov_dt.
template <int DT>
static void h2o_cuda_cover_select_dt(const h2o_cuda_args & a, const h2o_cuda_plan & plan, const h2o_cov_scratch & s,
        int cs, int i_begin, int i_end, cudaStream_t stream) {
    const int local_start = cs - a.L > 0 ? cs - a.L : 0;
    const int sink_end    = a.n_sink < local_start ? a.n_sink : local_start;
    const int heavy       = a.H - sink_end > 0 ? a.H - sink_end : 0;
    const int n_cand      = local_start - sink_end;
    const int n_rank      = n_cand < plan.cov_rank ? n_cand : plan.cov_rank;
    const int n_steps     = (n_rank + H2O_COV_STEP - 1)/H2O_COV_STEP;
    const int t_first     = cs + (i_begin - cs)/H2O_COV_TILE*H2O_COV_TILE;
    const int n_t         = (i_end - t_first + H2O_COV_TILE - 1)/H2O_COV_TILE;
    const int n_gqa       = a.n_head/a.n_head_kv;
    const int R           = plan.cov_rank;

    if (n_rank > 0 && n_rank < n_cand) {
        // stage 1, a pass over cov_heads heads at a time
        const int n_slots  = n_t*a.n_sample;
        const int n_groups = (n_slots + H2O_COV_TILE - 1)/H2O_COV_TILE;
        const int n_split_e = (i_end + H2O_COV_SPLIT - 1)/H2O_COV_SPLIT; // the sketch's energy: every key up to i_end
        const int n_split1  = (cs + H2O_COV_SPLIT - 1)/H2O_COV_SPLIT;    // the samples' keys: those before the chunk
        const int n_split2  = (local_start + H2O_COV_SPLIT - 1)/H2O_COV_SPLIT;
        const int warps    = H2O_COV_THREADS/H2O_WARP_SIZE;
        // with a key sketch, the samples' logits read its D/sketch channels, in F32
        const int RD = a.D/a.sketch;
        if (a.sketch > 1) {
            h2o_cov_sketch_energy<<<dim3(a.n_head_kv, n_split_e), H2O_COV_THREADS, 0, stream>>>(
                    a.k, s.energy, a.nbk1, a.nbk2, a.D, i_end);
            h2o_cov_sketch_select<<<a.n_head_kv, H2O_COV_THREADS, 0, stream>>>(s.energy, s.chan, a.D, n_split_e, RD);
        }
        for (int h0 = 0; h0 < a.n_head; h0 += plan.cov_heads) {
            const int n_hp = a.n_head - h0 < plan.cov_heads ? a.n_head - h0 : plan.cov_heads;
            if (a.sketch > 1) {
                h2o_cov_sample_stats<0><<<dim3(n_split1, n_groups, n_hp), H2O_COV_THREADS, plan.cov_sketch_smem, stream>>>(
                        a.q, a.k, s.st_m, s.st_l, a.nbq1, a.nbq2, a.nbk1, a.nbk2, RD, n_gqa, h0, a.p0,
                        t_first, i_begin, i_end, cs, a.n_sample, n_slots, a.scale, a.softcap, s.chan);
            } else {
                h2o_cov_sample_stats<DT><<<dim3(n_split1, n_groups, n_hp), H2O_COV_THREADS, plan.cov_logit_smem, stream>>>(
                        a.q, a.k, s.st_m, s.st_l, a.nbq1, a.nbq2, a.nbk1, a.nbk2, a.D, n_gqa, h0, a.p0,
                        t_first, i_begin, i_end, cs, a.n_sample, n_slots, a.scale, a.softcap, nullptr);
            }
            h2o_cov_sample_merge<<<dim3(n_groups*H2O_COV_TILE/warps, n_hp), H2O_COV_THREADS, 0, stream>>>(
                    s.st_m, s.st_l, s.sm_m, s.sm_il, n_split1, n_groups*H2O_COV_TILE);
            if (a.sketch > 1) {
                h2o_cov_sample_scores<0><<<dim3(n_split2, n_groups, n_hp), H2O_COV_THREADS, plan.cov_sketch_smem, stream>>>(
                        a.q, a.k, s.sm_m, s.sm_il, s.cand, a.nbq1, a.nbq2, a.nbk1, a.nbk2, RD, n_gqa, h0, a.p0,
                        t_first, i_begin, i_end, a.n_sample, n_slots, n_t, sink_end, local_start, a.scale, a.softcap, s.chan);
            } else {
                h2o_cov_sample_scores<DT><<<dim3(n_split2, n_groups, n_hp), H2O_COV_THREADS, plan.cov_logit_smem, stream>>>(
                        a.q, a.k, s.sm_m, s.sm_il, s.cand, a.nbq1, a.nbq2, a.nbk1, a.nbk2, a.D, n_gqa, h0, a.p0,
                        t_first, i_begin, i_end, a.n_sample, n_slots, n_t, sink_end, local_start, a.scale, a.softcap, nullptr);
            }
            h2o_cov_propose<<<dim3(n_t, n_hp), H2O_COV_SELECT_THREADS, 0, stream>>>(
                    s.cand, s.prop, h0, n_t, n_cand, n_rank, sink_end, R);
        }
    }
    if (n_rank > 0) {
        // stage 2 and the allocation (with every candidate proposed, stage 2 reads them from their range)
        const int stride = (R + H2O_COV_STEP - 1)/H2O_COV_STEP + 1;
        h2o_cov_rank<DT><<<dim3(n_t, a.n_head), H2O_COV_THREADS, plan.cov_rank_smem, stream>>>(
                a.q, a.k, s.prop, s.ranked, s.col_f, s.col_d, s.curves, a.nbq1, a.nbq2, a.nbk1, a.nbk2,
                a.D, n_gqa, a.p0, cs, t_first, i_begin, i_end, sink_end, local_start, n_rank, n_rank == n_cand, R, stride,
                a.scale, a.softcap);
        const int total = (int) ((long long) a.n_head*n_t*heavy/H2O_COV_STEP);
        h2o_cov_allocate<<<1, H2O_COV_SELECT_THREADS, 0, stream>>>(s.curves, s.keys, s.given, a.n_head*n_t, n_steps,
                stride, total, a.coverage);
    }
    h2o_cov_build_memory<<<dim3(n_t, a.n_head), H2O_COV_THREADS, plan.cov_build_smem, stream>>>(
            s.ranked, s.given, s.mem_t, s.mem_n, a.mem, a.nb_mem1, a.L + a.H, plan.cov_mem, R, cs, sink_end, local_start,
            n_rank, heavy);
}

static void h2o_cuda_cover_select(const h2o_cuda_args & a, const h2o_cuda_plan & plan, const h2o_cov_scratch & s,
        int cs, int i_begin, int i_end, cudaStream_t stream) {
    switch (plan.cov_dt) {
        case 64:  h2o_cuda_cover_select_dt<64> (a, plan, s, cs, i_begin, i_end, stream); break;
        case 128: h2o_cuda_cover_select_dt<128>(a, plan, s, cs, i_begin, i_end, stream); break;
        default:  h2o_cuda_cover_select_dt<0>  (a, plan, s, cs, i_begin, i_end, stream); break;
    }
}

struct h2o_cuda_chunk_state {
    int mem_chunk;
    int acc_chunk;
};

// runs the op: the chunks of the batch in order, from the chunk state in a (mem_chunk, acc_chunk); partial
// holds plan.partial_floats floats. Returns the chunk state after the batch (what llama's KV cache follows on
// the host). Launch errors are the caller's to check (cudaGetLastError).
static h2o_cuda_chunk_state h2o_cuda_run(const h2o_cuda_args & a, const h2o_cuda_plan & plan, float * partial,
        cudaStream_t stream) {
    const int S  = a.S;
    const int M  = a.L + a.H;
    const int p1 = a.p0 + a.n_tokens;

    int mem_chunk = a.mem_chunk;
    int acc_chunk = a.acc_chunk;

    cudaFuncSetAttribute(h2o_build, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.build_smem);
    cudaFuncSetAttribute(h2o_select_query, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.select_smem);
    const bool coverage = a.select == H2O_COV_SELECT;
    const bool by_query = a.select != 0 && !coverage;
    if (!plan.mma) {
        cudaFuncSetAttribute(h2o_attn_generic, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.attn_smem);
    }

    // coverage selection: its buffers, and the per-position memory sums zero
    h2o_cov_scratch cov {};
    const int rows_per_part  = plan.mma ? H2O_MMA_ROWS : plan.generic_warps*H2O_GENERIC_ROWS_PER_WARP;
    const int M_att          = coverage ? plan.cov_mem : M; // memory slots per head (per tile under coverage)
    if (coverage) {
        h2o_cov_layout(a, plan, (char *) partial, &cov);
        cudaMemsetAsync(cov.far, 0, (size_t) a.n_head*a.kv_size*sizeof(float), stream);
        switch (plan.cov_dt) {
            case 64:  h2o_cov_set_smem<64> (plan); break;
            case 128: h2o_cov_set_smem<128>(plan); break;
            default:  h2o_cov_set_smem<0>  (plan); break;
        }
        cudaFuncSetAttribute(h2o_cov_build_memory, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.cov_build_smem);
    }

    const dim3 reduce_grid((S + M + 255)/256, a.n_head, 1);
    const auto reduce_settle = [&](int c, int n_parts, bool complete) {
        const bool with_memory = c >= 1 && mem_chunk == c - 1;
        h2o_reduce_settle<<<reduce_grid, 256, 0, stream>>>(partial, n_parts, S + M, a.acc, a.nb_acc1, a.scores, a.nb_scores1,
                a.mem, a.nb_mem1, S, M, c*S, a.kv_size, complete, with_memory);
    };
    // M_c after chunk c; the hybrid and coverage memories are chosen when the next chunk's queries are there instead
    const auto build = [&](int c) {
        if (!by_query && !coverage) {
            const bool has_previous = mem_chunk >= 0 && mem_chunk == c - 1;
            h2o_build<<<a.n_head, H2O_BUILD_THREADS, plan.build_smem, stream>>>(a.scores, a.mem, a.nb_scores1, a.nb_mem1,
                    a.L, a.H, a.n_sink, c*S, (c + 1)*S, has_previous);
        }
        mem_chunk = c;
    };

    for (int c = a.p0/S; c <= (p1 - 1)/S; ++c) {
        const int cs = c*S;
        const int ce = cs + S;

        // chunks completed outside a prefill (by decode) get their sums and memory sets now
        while (mem_chunk < c - 1) {
            const int kc = mem_chunk + 1;
            if (acc_chunk == kc) {
                reduce_settle(kc, 0, true);
                acc_chunk = -1;
            }
            build(kc);
        }
        if (acc_chunk != c) {
            // sums of a chunk that cannot continue any more (or none): start this one from zero
            cudaMemsetAsync(a.acc, 0, a.nb_acc1*a.n_head, stream);
            acc_chunk = c;
        }

        const int i_begin = a.p0 > cs ? a.p0 : cs;
        const int i_end   = p1 < ce ? p1 : ce;

        if (c >= 1 && by_query) {
            // the memory of chunk c from its own queries in this call; an earlier part's memory sums go first
            h2o_flush_memory_sums<<<a.n_head, 256, 0, stream>>>(a.acc, a.nb_acc1, a.scores, a.nb_scores1, a.mem, a.nb_mem1,
                    S, M, cs);
            h2o_select_query<<<a.n_head, H2O_SELECT_WARPS*H2O_WARP_SIZE, plan.select_smem, stream>>>(
                    a.q, a.k, a.mem, partial, a.scores, a.nbq1, a.nbq2, a.nbk1, a.nbk2, a.nb_mem1, a.nb_scores1,
                    a.D, a.n_head/a.n_head_kv, a.L, a.H, a.n_sink, a.p0, cs, i_begin, i_end, a.scale, plan.n_blocks_max);
            mem_chunk = c - 1;
        }
        if (c >= 1 && coverage) {
            // every tile's memory, chosen by this call's rows of the chunk (as on the CPU, the memory sums of an earlier
            // part of the chunk are in the scores already)
            h2o_cuda_cover_select(a, plan, cov, cs, i_begin, i_end, stream);
            mem_chunk = c - 1;
        }

        // the dense tail's queries run on their own, and score nothing
        const int q_end = i_end < a.tail_start ? i_end : (a.tail_start > i_begin ? a.tail_start : i_begin);
        if (q_end < i_end) {
            const dim3 grid(i_end - q_end, a.n_head, 1);
            h2o_attn_dense<<<grid, H2O_DENSE_WARPS*H2O_WARP_SIZE, 0, stream>>>(a.q, a.k, a.v, a.dst,
                    a.nbq1, a.nbq2, a.nbk1, a.nbk2, a.nbv1, a.nbv2, a.nbd1, a.nbd2,
                    a.D, a.Dv, a.n_head/a.n_head_kv, a.p0, q_end, a.scale, a.softcap, a.sinks);
        }

        // coverage: the attention's blocks are aligned to the chunk's tiles, and each reads its tile's memory
        const int          a_begin = coverage ? cs + (i_begin - cs)/H2O_COV_TILE*H2O_COV_TILE : i_begin;
        const h2o_cov_attn cov_attn = {cov.mem_t, cov.mem_n, M_att, i_begin};
        const int32_t *    mem_att  = coverage ? cov.mem_t : a.mem;
        const size_t       nbm_att  = coverage ? (size_t) M_att*sizeof(int32_t) : a.nb_mem1;
        const size_t       nbm_tile = coverage ? (size_t) a.n_head*M_att*sizeof(int32_t) : 0;

        int n_parts = 0;
        if (q_end <= i_begin) {
            // every query of the chunk in this call is in the dense tail
        } else if (plan.mma) {
            n_parts = (q_end - a_begin + H2O_MMA_ROWS - 1)/H2O_MMA_ROWS;
            if (a.D == 64) {
                h2o_cuda_launch_mma<64>(a, partial, cs, a_begin, q_end, c >= 1, stream, coverage ? &cov_attn : nullptr);
            } else {
                h2o_cuda_launch_mma<128>(a, partial, cs, a_begin, q_end, c >= 1, stream, coverage ? &cov_attn : nullptr);
            }
        } else {
            n_parts = (q_end - a_begin + rows_per_part - 1)/rows_per_part;
            const dim3 grid(n_parts, a.n_head, 1);
            h2o_attn_generic<<<grid, plan.generic_warps*H2O_WARP_SIZE, plan.attn_smem, stream>>>(
                    a.q, a.k, a.v, mem_att, a.dst, partial,
                    a.nbq1, a.nbq2, a.nbk1, a.nbk2, a.nbv1, a.nbv2, nbm_att, a.nbd1, a.nbd2,
                    a.D, a.Dv, a.n_head/a.n_head_kv, S, M_att, a.p0, cs, a_begin, i_begin, q_end, rows_per_part, c >= 1,
                    nbm_tile, a.scale, a.softcap, a.sinks);
        }

        const bool complete = p1 >= ce;
        if (!coverage) {
            reduce_settle(c, n_parts, complete);
        } else {
            // the intra sums as for the other policies; the memory sums straight into the scores
            h2o_reduce_settle<<<dim3((S + 255)/256, a.n_head, 1), 256, 0, stream>>>(partial, n_parts, S + M_att, a.acc,
                    a.nb_acc1, a.scores, a.nb_scores1, a.mem, a.nb_mem1, S, 0, cs, a.kv_size, complete, false);
            if (c >= 1) {
                h2o_cov_settle_memory<<<a.n_head, H2O_COV_SELECT_THREADS, 0, stream>>>(partial, n_parts,
                        H2O_COV_TILE/rows_per_part, S + M_att, cov.mem_t, cov.mem_n, M_att, cov.far, a.kv_size,
                        a.scores, a.nb_scores1, a.acc, a.nb_acc1, S, M);
            }
        }
        if (complete) {
            acc_chunk = -1;
            build(c);
        }
    }
    return {mem_chunk, acc_chunk};
}
