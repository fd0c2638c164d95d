#pragma once

// The CUDA kernels of GGML_OP_H2O_ATTN and the host walk over the chunks of a batch. This header needs
// nothing but the CUDA runtime, so that a standalone program (tests/cpp/bench-h2o-cuda-op.cu) can check
// and time the kernels against each other without building all of ggml-cuda; h2o-attn.cu adapts it to
// ggml's tensors and memory pool.
//
// Per chunk c = [cs, cs + S) of the batch the host launches
//   1. h2o_attn_mma (head sizes 64 and 128) or h2o_attn_generic (any other): causal attention inside the
//      chunk plus attention to the memory set M_{c-1}, and the per-key sums of each part's probabilities
//      over the block's query rows (the score column sums), written per block;
//   2. h2o_reduce_settle: adds the blocks' column sums, in block order, to the chunk's F32 sums; when the
//      chunk is complete they enter the BF16 scores (seed rule item 4) and start again from zero;
//   3. h2o_build (when the chunk is complete): M_c, the rule of ggml_h2o_build_memory_set.
// With query-aware selection, h2o_select_query chooses the memory of chunk c from its own queries before step 1
// instead of step 3; queries of the dense tail run in h2o_attn_dense instead of step 1. With coverage selection every
// tile of H2O_COV_TILE queries gets its own memory before step 1 (h2o_cuda_cover_select), step 1 reads each tile's,
// and the memory sums go straight to the scores (h2o_cov_settle_memory).
// Nothing returns to the host between chunks.

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#define H2O_WARP_SIZE 32

// coverage selection (GGML_H2O_SELECT_COVERAGE): queries per tile, positions per budget step, ranked candidates per tile
// at most this many times H. The same values as GGML_H2O_TILE, GGML_H2O_BUDGET_STEP and GGML_H2O_MAX_HEAVY_FACTOR
// (h2o-attn.cu checks), repeated because this header needs nothing but the CUDA runtime.
#define H2O_COV_TILE   64
#define H2O_COV_STEP   32
#define H2O_COV_FACTOR 4

// ---------------------------------------------------------------------------------------------------------------
// shared helpers
// ---------------------------------------------------------------------------------------------------------------

static __device__ __forceinline__ float h2o_bf16_to_f32(uint16_t h) {
    return __uint_as_float((uint32_t) h << 16);
}

// round to nearest even, quiet NaN: the same bits as GGML_FP32_TO_BF16 on the CPU
static __device__ __forceinline__ uint16_t h2o_f32_to_bf16(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffff) > 0x7f800000) {
        return (uint16_t) ((u >> 16) | 64);
    }
    return (uint16_t) ((u + (0x7fff + ((u >> 16) & 1))) >> 16);
}

// a BF16 score as an unsigned 16-bit key that orders like the CPU rule's float compare: NaN lowest (0),
// -inf .. +inf from 0x0080 to 0xff80, -0 and +0 equal. Integer keys also keep subnormal scores apart under
// -use_fast_math, which flushes them to zero in float compares.
static __device__ __forceinline__ uint32_t h2o_score_key(uint16_t h) {
    const int32_t mag = h & 0x7fff;
    if (mag > 0x7f80) {
        return 0;
    }
    return (uint32_t) (((h & 0x8000) ? -mag : mag) + 0x8000);
}

static __device__ __forceinline__ float h2o_warp_max(float x) {
#pragma unroll
    for (int o = H2O_WARP_SIZE/2; o > 0; o >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    }
    return x;
}

static __device__ __forceinline__ float h2o_warp_sum(float x) {
#pragma unroll
    for (int o = H2O_WARP_SIZE/2; o > 0; o >>= 1) {
        x += __shfl_xor_sync(0xffffffff, x, o);
    }
    return x;
}

// ---------------------------------------------------------------------------------------------------------------
// h2o_attn_mma: tensor-core attention of one chunk, head sizes 64 and 128
//
// One block = 64 query rows of one head, 4 warps of 16 rows. Keys come in tiles of 64: the chunk's up to the
// block's causal diagonal, then the head's memory set gathered by index. Two sweeps over the tiles:
//   sweep 1: Q·K^T, each row's maximum and sum over its intra keys and over its memory keys (base 2);
//   sweep 2: Q·K^T again; p = 2^(s - m_part)/l_part is each part's exact probability, whose sums over the
//            block's rows are the column sums; p times the part's merge weight is the row's probability in
//            the softmax over the union of both key sets, multiplied by V into the output.
// Q·K^T and P·V are mma.sync m16n8k16 products with F32 accumulators; Q enters as the sum of two F16 parts, so
// that Q·K^T is as exact as the CPU kernel's F32 one, P and V as F16 (as in llama.cpp's flash attention). K/V
// tiles arrive by cp.async, double buffered. Column sums leave each warp by a butterfly over its rows and are added across
// the warps in warp order, so the result never depends on scheduling.
// ---------------------------------------------------------------------------------------------------------------

#define H2O_MMA_WARPS 4
#define H2O_MMA_ROWS  (16*H2O_MMA_WARPS) // query rows per block
#define H2O_MMA_KEYS  64                 // keys per tile

static __host__ __device__ constexpr int h2o_mma_stride(int D) {
    return D + 8; // halves per K/V row in shared memory: 16 bytes of padding keep ldmatrix free of bank conflicts
}

static size_t h2o_mma_smem_bytes(int D, int M) {
    return 2*2*(size_t) H2O_MMA_KEYS*h2o_mma_stride(D)*sizeof(half) // K and V, two stages
        + 2*(size_t) H2O_MMA_ROWS*h2o_mma_stride(D)*sizeof(half)    // Q as high and low F16 parts
        + 2*H2O_MMA_KEYS*sizeof(int32_t)                            // key positions, two stages
        + 2*H2O_MMA_WARPS*H2O_MMA_KEYS*sizeof(float)                // column sums of the warps, two stages
        + (size_t) M*sizeof(int32_t);                               // the memory set
}

static __device__ __forceinline__ uint32_t h2o_smem_addr(const void * p) {
    return (uint32_t) __cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, or 16 zero bytes when !valid
static __device__ __forceinline__ void h2o_cp_async_16(void * dst, const void * src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(h2o_smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}

static __device__ __forceinline__ void h2o_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int n>
static __device__ __forceinline__ void h2o_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(n));
}

static __device__ __forceinline__ void h2o_ldmatrix_x4(uint32_t (&r)[4], const half * p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(h2o_smem_addr(p)));
}

static __device__ __forceinline__ void h2o_ldmatrix_x4_trans(uint32_t (&r)[4], const half * p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(h2o_smem_addr(p)));
}

// c += a·b, m16n8k16, F16 operands, F32 accumulators. Not volatile (as in ggml's mma.cuh): a pure register
// operation that the compiler may interleave with independent ones
static __device__ __forceinline__ void h2o_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t h2o_pack_half2(float lo, float hi) {
    const half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t *) &h;
}

// x[k] (k < 2*n) summed over the 8 lanes that share lane%4, as a butterfly that halves the values at every
// step: afterwards x[0], x[1] of lane (g, c) (lane = 4g + c) hold the sums of indices 2g and 2g + 1
template <int n>
static __device__ __forceinline__ void h2o_reduce_rows_step(float * x, int lane, int mask) {
    const bool upper = lane & mask;
#pragma unroll
    for (int k = 0; k < n; ++k) {
        const float send = upper ? x[k] : x[k + n];
        const float keep = upper ? x[k + n] : x[k];
        x[k] = keep + __shfl_xor_sync(0xffffffff, send, mask);
    }
}

// attention logit soft-capping (ggml_h2o_attn_set_logits): x -> c*tanh(x/c), c in the logits' units (0: none)
static __device__ __forceinline__ float h2o_softcap(float x, float c) {
    return c > 0.0f ? c*tanhf(x/c) : x;
}

// the learned attention sink of head ih (ggml_h2o_attn_set_logits), in natural units; -INFINITY: none
static __device__ __forceinline__ float h2o_sink_of(const float * sinks, int ih) {
    return sinks != nullptr ? sinks[ih] : -INFINITY;
}

template <int D>
__launch_bounds__(H2O_MMA_WARPS*H2O_WARP_SIZE, 2)
static __global__ void h2o_attn_mma(
        const char * __restrict__ q, const char * __restrict__ k, const char * __restrict__ v,
        const int32_t * __restrict__ mem, float * __restrict__ dst, float * __restrict__ col_partial,
        size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2, size_t nbv1, size_t nbv2, size_t nbm1, size_t nbd1, size_t nbd2,
        int n_gqa, int S, int M, int p0, int cs, int i_begin, int r_begin, int q_end, bool has_memory,
        size_t nbm_tile, const int32_t * __restrict__ mem_count, float scale_log2, float softcap_log2,
        const float * __restrict__ sinks) {
    constexpr int KT = H2O_MMA_KEYS;
    constexpr int SD = h2o_mma_stride(D);
    constexpr int NK = D/16; // k-steps of Q·K^T
    constexpr int ND = D/8;  // n-tiles of the output

    extern __shared__ char h2o_mma_smem[];
    half    * Ks    = (half    *) h2o_mma_smem;     // [2][KT][SD]
    half    * Vs    = Ks + 2*KT*SD;                 // [2][KT][SD]
    half    * Qh    = Vs + 2*KT*SD;                 // [H2O_MMA_ROWS][SD]: the query rows' high F16 parts
    half    * Ql    = Qh + H2O_MMA_ROWS*SD;         // [H2O_MMA_ROWS][SD]: and what the high parts leave
    int32_t * kpos  = (int32_t *) (Ql + H2O_MMA_ROWS*SD); // [2][KT]: position of each key row, -1 = masked
    float   * red   = (float   *) (kpos + 2*KT);    // [2][H2O_MMA_WARPS][KT]
    int32_t * mem_s = (int32_t *) (red + 2*H2O_MMA_WARPS*KT); // [M]: the memory set, -1 where a slot cannot be read

    const int tid  = threadIdx.x;
    const int warp = tid/H2O_WARP_SIZE;
    const int lane = tid%H2O_WARP_SIZE;
    const int g    = lane/4;
    const int c4   = lane%4;

    const int ih     = blockIdx.y;
    const int n_head = gridDim.y;
    const int ikv    = ih/n_gqa;
    const int n_keys = S + M;

    // the longest tiles first: tile b covers query rows [tile_begin, tile_end), of which those from r_begin on are
    // this call's (r_begin > i_begin only for coverage selection, whose tiles are aligned to the chunk)
    const int b          = gridDim.x - 1 - blockIdx.x;
    const int tile_begin = i_begin + b*H2O_MMA_ROWS;
    const int i_last     = min(tile_begin + H2O_MMA_ROWS, q_end) - 1;
    const int n_intra    = (i_last - cs)/KT + 1;

    // the memory: the head's M slots, or (coverage selection, nbm_tile != 0) this tile's own, whose mem_count slots
    // come first, so that the block reads only as many memory tiles as they fill
    const int n_slots  = has_memory && mem_count != nullptr ? mem_count[b*gridDim.y + ih] : M;
    const int n_memory = has_memory ? (n_slots + KT - 1)/KT : 0;
    const int n_tiles  = n_intra + n_memory;

    // the memory set once into shared memory; whether every slot is readable (then memory tiles but a last
    // partial one need no mask)
    bool memory_full = true;
    if (has_memory) {
        const int32_t * mem_h = (const int32_t *) ((const char *) mem + ih*nbm1 + b*nbm_tile);
        for (int m = tid; m < n_slots; m += H2O_MMA_WARPS*H2O_WARP_SIZE) {
            const int32_t pos = mem_h[m];
            const bool    ok  = pos >= 0 && pos < cs;
            mem_s[m] = ok ? pos : -1;
            memory_full = memory_full && ok;
        }
    }
    memory_full = __syncthreads_and(memory_full) && n_slots % KT == 0;

    // this thread's two query rows (scalars: an array captured by the lambdas below would live in local memory)
    const int  row0   = tile_begin + 16*warp + g;
    const int  row1   = row0 + 8;
    const bool valid0 = row0 >= r_begin && row0 < q_end;
    const bool valid1 = row1 >= r_begin && row1 < q_end;

    // Q scaled by scale·log2(e) (the softmax runs in base 2), as the sum of two F16 parts: Q·K^T as two products
    // is then as exact as the CPU's F32 one, which keeps near-tied scores in the CPU's order far more often
    // than F16 operands alone would (llama.cpp's flash attention rounds Q to F16). Rows past the batch are zero.
    for (int idx = tid; idx < H2O_MMA_ROWS*(D/2); idx += H2O_MMA_WARPS*H2O_WARP_SIZE) {
        const int r = idx/(D/2);
        const int d = 2*(idx%(D/2));
        const int i = tile_begin + r;
        float2 x = make_float2(0.0f, 0.0f);
        if (i >= r_begin && i < q_end) {
            x = *(const float2 *) ((const float *) (q + (size_t) (i - p0)*nbq2 + (size_t) ih*nbq1) + d);
        }
        x.x *= scale_log2;
        x.y *= scale_log2;
        const half2 h = __floats2half2_rn(x.x, x.y);
        const float2 hf = __half22float2(h);
        *(half2 *) (Qh + r*SD + d) = h;
        *(half2 *) (Ql + r*SD + d) = __floats2half2_rn(x.x - hf.x, x.y - hf.y);
    }

    // tile u of the two sweeps (u < n_tiles: sweep 1, K only; else sweep 2, K and V) into stage st. Each thread
    // copies the same 16-byte column of every RPI-th row.
    constexpr int CPR = D/8;                                // 16-byte chunks per row
    constexpr int RPI = H2O_MMA_WARPS*H2O_WARP_SIZE/CPR;    // rows per pass of the block
    const int    ld_ch  = tid%CPR;
    const int    ld_r0  = tid/CPR;
    const char * k_base = k + (size_t) ikv*nbk1 + 16*ld_ch;
    const char * v_base = v + (size_t) ikv*nbv1 + 16*ld_ch;
    const auto load_tile = [&](int u, int st) {
        const bool with_v = u >= n_tiles;
        const int  t      = with_v ? u - n_tiles : u;
        half * ks = Ks + st*KT*SD + ld_r0*SD + 8*ld_ch;
        half * vs = Vs + st*KT*SD + ld_r0*SD + 8*ld_ch;
#pragma unroll
        for (int i = 0; i < KT/RPI; ++i) {
            const int r = ld_r0 + i*RPI;
            int pos;
            if (t < n_intra) {
                pos = cs + t*KT + r;
                pos = pos <= i_last ? pos : -1;
            } else {
                const int slot = (t - n_intra)*KT + r;
                pos = slot < n_slots ? mem_s[slot] : -1;
            }
            const bool   ok     = pos >= 0;
            const size_t ok_pos = ok ? (size_t) pos : 0;
            h2o_cp_async_16(ks + i*RPI*SD, k_base + ok_pos*nbk2, ok);
            if (with_v) {
                h2o_cp_async_16(vs + i*RPI*SD, v_base + ok_pos*nbv2, ok);
            }
            if (ld_ch == 0) {
                kpos[st*KT + r] = pos;
            }
        }
        h2o_cp_async_commit();
    };

    // s = Q·K^T of the tile in stage st, masked keys -inf; k-steps outside, so that consecutive products go to
    // the 8 independent accumulators and overlap
    float s[8][4];
    const auto logits = [&](int t, int st) {
        const half * ks = Ks + st*KT*SD;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = 0.0f;
            }
        }
        const int q_row = 16*warp + lane%8 + 8*((lane/8)%2); // this lane's row address for the A fragments
#pragma unroll
        for (int kk = 0; kk < NK; kk += 2) {
            uint32_t qh[2][4], ql[2][4];
#pragma unroll
            for (int k2 = 0; k2 < 2; ++k2) {
                h2o_ldmatrix_x4(qh[k2], Qh + q_row*SD + 16*(kk + k2) + 8*(lane/16));
                h2o_ldmatrix_x4(ql[k2], Ql + q_row*SD + 16*(kk + k2) + 8*(lane/16));
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                uint32_t kb[4];
                h2o_ldmatrix_x4(kb, ks + (8*nt + lane%8)*SD + 16*kk + 8*(lane/8));
                h2o_mma(s[nt], qh[0], kb[0], kb[1]);
                h2o_mma(s[nt], ql[0], kb[0], kb[1]);
                h2o_mma(s[nt], qh[1], kb[2], kb[3]);
                h2o_mma(s[nt], ql[1], kb[2], kb[3]);
            }
        }
        // the soft-cap in base 2: c·log2(e)·tanh(x/(c·log2(e))) of the base-2 logit x
        if (softcap_log2 > 0.0f) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[nt][e] = h2o_softcap(s[nt][e], softcap_log2);
                }
            }
        }
        // masks only where a tile needs them (warp-uniform): the causal diagonal and keys past the block's rows,
        // empty memory slots, a last partial memory tile
        const bool need_mask = t < n_intra ? cs + (t + 1)*KT - 1 > tile_begin + 16*warp : !memory_full;
        if (need_mask) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int32_t pos = kpos[st*KT + 8*nt + 2*c4 + (e & 1)];
                    const bool    ok  = pos >= 0 && (t >= n_intra || pos <= (e < 2 ? row0 : row1));
                    s[nt][e] = ok ? s[nt][e] : -INFINITY;
                }
            }
        }
    };

    // sweep 1 state per row: maximum and (this thread's share of the) sum of the part in progress
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.0f, 0.0f};
    float m_intra[2], l_intra[2];

    // sweep 2 constants per row and part: maximum, 1/sum, merge weight
    float m_part[2][2], inv_l[2][2], w_part[2][2];

    float o[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o[nd][e] = 0.0f;
        }
    }

    float * part_out = col_partial + ((size_t) b*n_head + ih)*n_keys;

    // the warps' column sums of a tile wait in red[stage] until the next barrier, then threads 0..KT-1 add
    // them in warp order: one barrier per tile
    int pending_j = -1; // (threads < KT) where the sum of the previous tile goes, -1: nowhere
    const auto flush_column_sums = [&](int st) {
        if (tid < KT && pending_j >= 0) {
            const float * rs = red + st*H2O_MMA_WARPS*KT;
            float sum = rs[tid];
#pragma unroll
            for (int w = 1; w < H2O_MMA_WARPS; ++w) {
                sum += rs[w*KT + tid];
            }
            part_out[pending_j] = sum;
        }
        pending_j = -1;
    };

    load_tile(0, 0);
    for (int u = 0; u < 2*n_tiles; ++u) {
        const int st = u & 1;
        // tile u has landed, and every warp is done with tile u - 1, whose stage the next copy overwrites
        h2o_cp_async_wait<0>();
        __syncthreads();
        if (u + 1 < 2*n_tiles) {
            load_tile(u + 1, st ^ 1);
        }
        flush_column_sums(st ^ 1);

        const int t = u < n_tiles ? u : u - n_tiles;
        logits(t, st);

        if (u < n_tiles) {
            // sweep 1: online maximum and sum of the current part
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                // trees, not chains: the row's 16 values are independent
                float mx4[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    mx4[j] = fmaxf(fmaxf(s[2*j][2*r], s[2*j][2*r + 1]), fmaxf(s[2*j + 1][2*r], s[2*j + 1][2*r + 1]));
                }
                float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                const float m_new = fmaxf(m_run[r], mx);
                if (m_new != -INFINITY) {
                    float sum4[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        sum4[j] = (exp2f(s[2*j][2*r] - m_new) + exp2f(s[2*j][2*r + 1] - m_new)) +
                                  (exp2f(s[2*j + 1][2*r] - m_new) + exp2f(s[2*j + 1][2*r + 1] - m_new));
                    }
                    const float prev = m_run[r] == -INFINITY ? 0.0f : l_run[r]*exp2f(m_run[r] - m_new);
                    l_run[r] = prev + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
                    m_run[r] = m_new;
                }
            }
            if (u == n_intra - 1) {
                // the intra part is complete: keep it, start the memory part
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    m_intra[r] = m_run[r];
                    l_intra[r] = l_run[r];
                    m_run[r]   = -INFINITY;
                    l_run[r]   = 0.0f;
                }
            }
            if (u == n_tiles - 1) {
                // both parts complete: the sums over the quad, then each part's constants and merge weight
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float la = l_intra[r];
                    la += __shfl_xor_sync(0xffffffff, la, 1);
                    la += __shfl_xor_sync(0xffffffff, la, 2);
                    float lb = l_run[r];
                    lb += __shfl_xor_sync(0xffffffff, lb, 1);
                    lb += __shfl_xor_sync(0xffffffff, lb, 2);
                    const float ma = m_intra[r];
                    const float mb = m_run[r];
                    // a learned sink's logit (base 2) joins the denominator of the merged softmax
                    const float sk = sinks != nullptr ? sinks[ih]*1.4426950408889634f : -INFINITY;
                    const float mx = fmaxf(fmaxf(ma, mb), sk);
                    const float ea = la*exp2f(ma - mx);
                    const float eb = lb > 0.0f ? lb*exp2f(mb - mx) : 0.0f;
                    const float es = sinks != nullptr ? exp2f(sk - mx) : 0.0f;
                    // masked logits are -inf and 2^-inf = 0, so sweep 2 needs no masks: an empty memory part gets
                    // a finite maximum, and rows past the batch a zero 1/l, so they add nothing to the column sums
                    const bool valid = r == 0 ? valid0 : valid1;
                    m_part[r][0] = ma;
                    m_part[r][1] = lb > 0.0f ? mb : 0.0f;
                    inv_l[r][0]  = valid ? 1.0f/la : 0.0f;
                    inv_l[r][1]  = valid && lb > 0.0f ? 1.0f/lb : 0.0f;
                    w_part[r][0] = ea/(ea + eb + es);
                    w_part[r][1] = eb/(ea + eb + es);
                }
            }
        } else {
            // sweep 2: each part's probabilities, their column sums, and P·V
            // this part's constants of both rows (selects, not a run-time index, keep them in registers)
            const bool  memory_part = t >= n_intra;
            const float mp[2] = {memory_part ? m_part[0][1] : m_part[0][0], memory_part ? m_part[1][1] : m_part[1][0]};
            const float il[2] = {memory_part ? inv_l[0][1]  : inv_l[0][0],  memory_part ? inv_l[1][1]  : inv_l[1][0]};
            const float wp[2] = {memory_part ? w_part[0][1] : w_part[0][0], memory_part ? w_part[1][1] : w_part[1][0]};
            float     cols[16];
            uint32_t  pa[4][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[nt][e] = exp2f(s[nt][e] - mp[e/2])*il[e/2];
                }
                cols[2*nt + 0] = s[nt][0] + s[nt][2];
                cols[2*nt + 1] = s[nt][1] + s[nt][3];
            }
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                pa[ks][0] = h2o_pack_half2(s[2*ks + 0][0]*wp[0], s[2*ks + 0][1]*wp[0]);
                pa[ks][1] = h2o_pack_half2(s[2*ks + 0][2]*wp[1], s[2*ks + 0][3]*wp[1]);
                pa[ks][2] = h2o_pack_half2(s[2*ks + 1][0]*wp[0], s[2*ks + 1][1]*wp[0]);
                pa[ks][3] = h2o_pack_half2(s[2*ks + 1][2]*wp[1], s[2*ks + 1][3]*wp[1]);
            }

            const half * vs = Vs + st*KT*SD;
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
                for (int nd = 0; nd < ND; nd += 2) {
                    uint32_t vb[4];
                    h2o_ldmatrix_x4_trans(vb, vs + (16*ks + lane%8 + 8*((lane/8)%2))*SD + 8*(nd + lane/16));
                    h2o_mma(o[nd + 0], pa[ks], vb[0], vb[1]);
                    h2o_mma(o[nd + 1], pa[ks], vb[2], vb[3]);
                }
            }

            // column sums: over the warp's 16 rows, then over the warps in order
            h2o_reduce_rows_step<8>(cols, lane, 16);
            h2o_reduce_rows_step<4>(cols, lane, 8);
            h2o_reduce_rows_step<2>(cols, lane, 4);
            float * rs = red + st*H2O_MMA_WARPS*KT + warp*KT;
            rs[8*g + 2*c4 + 0] = cols[0];
            rs[8*g + 2*c4 + 1] = cols[1];
            if (tid < KT) {
                const int j = t < n_intra ? t*KT + tid : S + (t - n_intra)*KT + tid;
                pending_j = (t < n_intra ? j < S : j < n_keys) ? j : -1;
            }
        }
    }
    __syncthreads();
    flush_column_sums((2*n_tiles - 1) & 1);

    // keys this block never reached: zero, so that the reduction can add every block's sums
    for (int j = n_intra*KT + tid; j < n_keys; j += H2O_MMA_WARPS*H2O_WARP_SIZE) {
        if (j < S || !has_memory || j >= S + n_memory*KT) {
            part_out[j] = 0.0f;
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (!(r == 0 ? valid0 : valid1)) {
            continue;
        }
        float * out = (float *) ((char *) dst + (size_t) ((r == 0 ? row0 : row1) - p0)*nbd2 + (size_t) ih*nbd1);
#pragma unroll
        for (int nd = 0; nd < ND; ++nd) {
            *(float2 *) (out + 8*nd + 2*c4) = make_float2(o[nd][2*r + 0], o[nd][2*r + 1]);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// h2o_attn_generic: any head size, one warp per query row, F32 arithmetic (the first CUDA kernel, kept for the
// head sizes h2o_attn_mma does not serve)
// ---------------------------------------------------------------------------------------------------------------

#define H2O_GENERIC_ROWS_PER_WARP 4

static __device__ __forceinline__ float h2o_dot_f16(const float * q, const half * k, int D) {
    float sum = 0.0f;
    for (int d = 0; d < D; ++d) {
        sum += q[d]*__half2float(k[d]);
    }
    return sum;
}

static size_t h2o_generic_smem_bytes(int n_warps, int S, int M, int D) {
    return ((size_t) (n_warps + 1)*(S + M) + (size_t) n_warps*D + 2*n_warps)*sizeof(float);
}

// one block per (tile of query rows, query head); one warp per row at a time
// shared memory: per warp, the row's logits (S + M) and its scaled query (D); per block, the column sums (S + M)
// and, per warp, the reciprocal sums of its row's two parts
static __global__ void h2o_attn_generic(
        const char * q, const char * k, const char * v, const int32_t * mem, float * dst, float * col_partial,
        size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2, size_t nbv1, size_t nbv2, size_t nbm1, size_t nbd1, size_t nbd2,
        int D, int Dv, int n_gqa, int S, int M, int p0, int cs, int i_begin, int r_begin, int q_end, int rows_per_tile,
        bool has_memory, size_t nbm_tile, float scale, float softcap, const float * sinks) {
    extern __shared__ float h2o_generic_smem[];

    const int n_warps = blockDim.x/H2O_WARP_SIZE;
    const int warp    = threadIdx.x/H2O_WARP_SIZE;
    const int lane    = threadIdx.x%H2O_WARP_SIZE;
    const int ih      = blockIdx.y;
    const int ikv     = ih/n_gqa;
    const int n_head  = gridDim.y;
    const int n_keys  = S + M;

    float * x_all   = h2o_generic_smem;                // [n_warps][S + M]
    float * q_all   = x_all + (size_t) n_warps*n_keys; // [n_warps][D]
    float * col_sum = q_all + (size_t) n_warps*D;      // [S + M]
    float * inv_l   = col_sum + n_keys;                // [n_warps][2]: 1/l of the intra and memory parts

    float * x  = x_all + (size_t) warp*n_keys;
    float * qs = q_all + (size_t) warp*D;

    for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
        col_sum[j] = 0.0f;
    }

    // the head's memory, or (coverage selection, nbm_tile != 0) that of the H2O_COV_TILE-row tile this block's rows
    // are in (rows_per_tile divides it); rows before r_begin belong to an earlier call
    const int32_t * mem_h = (const int32_t *) ((const char *) mem + ih*nbm1 +
            (size_t) (blockIdx.x*rows_per_tile/H2O_COV_TILE)*nbm_tile);
    const int tile_begin  = i_begin + blockIdx.x*rows_per_tile;
    const int tile_end    = min(tile_begin + rows_per_tile, q_end);

    // rounds: every warp takes one row; the column sums of a round are added in warp order
    for (int round0 = tile_begin; round0 < tile_end; round0 += n_warps) {
        const int  i     = round0 + warp;
        const bool valid = i >= r_begin && i < tile_end;
        float wa = 0.0f;
        float wb = 0.0f;
        float la = 1.0f;
        float lb = 0.0f;
        int   n_intra = 0;

        if (valid) {
            const float * qr = (const float *) (q + (size_t) (i - p0)*nbq2 + (size_t) ih*nbq1);
            for (int d = lane; d < D; d += H2O_WARP_SIZE) {
                qs[d] = qr[d]*scale;
            }
            __syncwarp();

            // intra: keys cs .. i of the chunk
            n_intra = i - cs + 1;
            float ma = -INFINITY;
            for (int j = lane; j < n_intra; j += H2O_WARP_SIZE) {
                const half * kr = (const half *) (k + (size_t) (cs + j)*nbk2 + (size_t) ikv*nbk1);
                x[j] = h2o_softcap(h2o_dot_f16(qs, kr, D), softcap);
                ma = fmaxf(ma, x[j]);
            }
            ma = h2o_warp_max(ma);
            float sa = 0.0f;
            for (int j = lane; j < n_intra; j += H2O_WARP_SIZE) {
                x[j] = expf(x[j] - ma);
                sa += x[j];
            }
            la = h2o_warp_sum(sa);

            // inter: the memory set M_{c-1}; empty slots (and, defensively, slots not before the chunk) are masked
            float mb = -INFINITY;
            if (has_memory) {
                for (int m = lane; m < M; m += H2O_WARP_SIZE) {
                    const int32_t pos = mem_h[m];
                    if (pos >= 0 && pos < cs) {
                        const half * kr = (const half *) (k + (size_t) pos*nbk2 + (size_t) ikv*nbk1);
                        x[S + m] = h2o_softcap(h2o_dot_f16(qs, kr, D), softcap);
                        mb = fmaxf(mb, x[S + m]);
                    } else {
                        x[S + m] = -INFINITY;
                    }
                }
                mb = h2o_warp_max(mb);
                float sb = 0.0f;
                for (int m = lane; m < M; m += H2O_WARP_SIZE) {
                    x[S + m] = mb == -INFINITY ? 0.0f : expf(x[S + m] - mb);
                    sb += x[S + m];
                }
                lb = h2o_warp_sum(sb);
            }

            // exact merge of the two parts through their row maxima, a learned sink's logit in
            // the denominator
            const float sk = h2o_sink_of(sinks, ih);
            wa = 1.0f/la;
            if ((has_memory && lb > 0.0f) || sk != -INFINITY) {
                const float mx = fmaxf(fmaxf(ma, lb > 0.0f ? mb : -INFINITY), sk);
                const float ea = expf(ma - mx);
                const float eb = lb > 0.0f ? expf(mb - mx) : 0.0f;
                const float l  = la*ea + lb*eb + (sk != -INFINITY ? expf(sk - mx) : 0.0f);
                wa = ea/l;
                wb = eb/l;
            }
            if (lane == 0) {
                inv_l[2*warp + 0] = 1.0f/la;
                inv_l[2*warp + 1] = lb > 0.0f ? 1.0f/lb : 0.0f;
            }
            __syncwarp();

            // out = wa·Σ p_intra·V + wb·Σ p_memory·V (unnormalised probabilities in x)
            float * out = (float *) ((char *) dst + (size_t) (i - p0)*nbd2 + (size_t) ih*nbd1);
            for (int d = lane; d < Dv; d += H2O_WARP_SIZE) {
                float oa = 0.0f;
                for (int j = 0; j < n_intra; ++j) {
                    oa += x[j]*__half2float(((const half *) (v + (size_t) (cs + j)*nbv2 + (size_t) ikv*nbv1))[d]);
                }
                float ob = 0.0f;
                if (wb != 0.0f) {
                    for (int m = 0; m < M; ++m) {
                        const int32_t pos = mem_h[m];
                        if (pos >= 0 && pos < cs) {
                            ob += x[S + m]*__half2float(((const half *) (v + (size_t) pos*nbv2 + (size_t) ikv*nbv1))[d]);
                        }
                    }
                }
                out[d] = oa*wa + ob*wb;
            }
        }
        __syncthreads();

        // column sums of this round's rows: each row's normalised probabilities (p·(1/l), as on the
        // CPU), added warp by warp so that the order never changes
        for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
            float sum = col_sum[j];
            for (int w = 0; w < n_warps && round0 + w < tile_end; ++w) {
                if (round0 + w < r_begin) {
                    continue;
                }
                const float * xw = x_all + (size_t) w*n_keys;
                if (j < S) {
                    if (j < round0 + w - cs + 1) {
                        sum += xw[j]*inv_l[2*w + 0];
                    }
                } else if (has_memory) {
                    sum += xw[j]*inv_l[2*w + 1];
                }
            }
            col_sum[j] = sum;
        }
        __syncthreads();
    }

    float * part = col_partial + ((size_t) blockIdx.x*n_head + ih)*n_keys;
    for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
        part[j] = col_sum[j];
    }
}

// ---------------------------------------------------------------------------------------------------------------
// h2o_reduce_settle: acc[ih][j] += Σ_b partial[b][ih][j] (blocks in order); when the chunk c = [cs, cs + S) is
// complete, the sums enter the BF16 scores (intra key j at position cs + j, memory slot m at its position) and
// acc starts again from zero. Positions are distinct (M_{c-1} is a set before cs), so keys need no ordering.
// A block's partial sums are part_keys floats apart (S + M, or S + the tiles' memory size under coverage selection,
// which reduces only the S intra keys here: M = 0).
// ---------------------------------------------------------------------------------------------------------------

static __global__ void h2o_reduce_settle(const float * __restrict__ col_partial, int n_parts, int part_keys, float * acc,
        size_t nb_acc1, uint16_t * scores, size_t nb_scores1, const int32_t * mem, size_t nb_mem1,
        int S, int M, int cs, int kv_size, bool complete, bool with_memory) {
    const int ih     = blockIdx.y;
    const int n_head = gridDim.y;
    const int n_keys = S + M;
    const int j      = blockIdx.x*blockDim.x + threadIdx.x;
    if (j >= n_keys) {
        return;
    }

    float * acc_h = (float *) ((char *) acc + ih*nb_acc1);
    float   sum   = acc_h[j];
    for (int b = 0; b < n_parts; ++b) {
        sum += col_partial[((size_t) b*n_head + ih)*part_keys + j];
    }
    if (!complete) {
        acc_h[j] = sum;
        return;
    }

    uint16_t * sc = (uint16_t *) ((char *) scores + ih*nb_scores1);
    if (j < S) {
        if (cs + j < kv_size && sum != 0.0f) {
            sc[cs + j] = h2o_f32_to_bf16(h2o_bf16_to_f32(sc[cs + j]) + sum);
        }
    } else if (with_memory) {
        const int32_t pos = ((const int32_t *) ((const char *) mem + ih*nb_mem1))[j - S];
        if (pos >= 0 && pos < cs && sum != 0.0f) {
            sc[pos] = h2o_f32_to_bf16(h2o_bf16_to_f32(sc[pos]) + sum);
        }
    }
    acc_h[j] = 0.0f;
}

// ---------------------------------------------------------------------------------------------------------------
// h2o_build: M_c of one head per block, the rule of ggml_h2o_build_memory_set. Local = [max(end - L, 0), end);
// candidates = (M_{c-1}, when has_previous, + [start, end)) minus Local, in ascending position; Heavy = the H best
// by score, ties to the lower position, NaN last. A radix select on the 16-bit score keys finds the H-th best key;
// the candidates above it, and the first ones equal to it, are compacted in order, so the set comes out ascending:
// Heavy, then Local (every candidate precedes Local), then -1.
// ---------------------------------------------------------------------------------------------------------------

#define H2O_BUILD_THREADS 1024

static size_t h2o_build_smem_bytes(int S, int M) {
    return 2*(size_t) (S + M)*sizeof(int32_t);
}

// exclusive prefix sum of x over the block (threads in order), and the total
static __device__ __forceinline__ int h2o_block_scan(int x, int * warp_sums, int & total) {
    const int lane    = threadIdx.x%H2O_WARP_SIZE;
    const int warp    = threadIdx.x/H2O_WARP_SIZE;
    const int n_warps = blockDim.x/H2O_WARP_SIZE;

    int incl = x;
#pragma unroll
    for (int o = 1; o < H2O_WARP_SIZE; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffff, incl, o);
        incl += lane >= o ? y : 0;
    }
    if (lane == H2O_WARP_SIZE - 1) {
        warp_sums[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        int w = lane < n_warps ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < H2O_WARP_SIZE; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffff, w, o);
            w += lane >= o ? y : 0;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    const int base = warp > 0 ? warp_sums[warp - 1] : 0;
    total = warp_sums[n_warps - 1];
    __syncthreads();
    return base + incl - x;
}

// one step of the radix select on 16-bit keys, for the first warp: from the histogram of a key byte (pass 0: high,
// pass 1: low, of the keys whose high byte is sel[0]), the highest bin at which the count from the top reaches
// n_best. Pass 0 leaves the bin in sel[0] and the count above it in sel[2]; pass 1 the threshold key in sel[1] and
// in sel[2] how many keys equal to it to take. n_best must not exceed the number of keys.
static __device__ __forceinline__ void h2o_radix_bin(const int * hist, int * sel, int pass, int n_best) {
    const int lane  = threadIdx.x%H2O_WARP_SIZE;
    const int above = pass == 0 ? 0 : sel[2];
    // lane l holds bins 255 - 8l .. 248 - 8l
    int own = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        own += hist[255 - 8*lane - i];
    }
    int incl = own;
#pragma unroll
    for (int o = 1; o < H2O_WARP_SIZE; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffff, incl, o);
        incl += lane >= o ? y : 0;
    }
    const unsigned reached = __ballot_sync(0xffffffff, above + incl >= n_best);
    // n_best <= the number of keys, so some lane reaches it (the last one at the latest)
    const int first = reached ? __ffs(reached) - 1 : H2O_WARP_SIZE - 1;
    if (lane == first) {
        int acc = above + incl - own;
        int bin = 255 - 8*lane;
        for (int i = 0; i < 7 && acc + hist[bin] < n_best; ++i) {
            acc += hist[bin];
            --bin;
        }
        if (pass == 0) {
            sel[0] = bin;
            sel[2] = acc;
        } else {
            sel[1] = (sel[0] << 8) | bin;
            sel[2] = n_best - acc;
        }
    }
}

static __global__ void h2o_build(const uint16_t * scores, int32_t * mem,
        size_t nb_scores1, size_t nb_mem1, int L, int H, int n_sink, int chunk_start, int chunk_end, bool has_previous) {
    extern __shared__ int32_t h2o_build_smem[];
    __shared__ int warp_sums[H2O_WARP_SIZE];
    __shared__ int hist[256];
    __shared__ int sel[3]; // high byte of the threshold, then the threshold, and how many candidates equal to it to take

    const int tid = threadIdx.x;
    const int nt  = blockDim.x;
    const int ih  = blockIdx.x;
    const int M   = L + H;

    const uint16_t * sc    = (const uint16_t *) ((const char *) scores + ih*nb_scores1);
    int32_t        * mem_h = (int32_t        *) ((char       *) mem    + ih*nb_mem1);

    const int local_start = max(chunk_end - L, 0);
    const int sink_end    = min(n_sink, local_start); // sinks inside Local are Local's
    chunk_start = min(chunk_start, chunk_end);
    const int cand_start = max(chunk_start, sink_end);
    const int n_chunk    = max(cand_start, local_start) - cand_start;

    int32_t * cand_pos = h2o_build_smem;     // [M + n_chunk]
    int32_t * cand_key = cand_pos + M + n_chunk; // [M + n_chunk]

    // M_{c-1} \ (Local + Sink), compacted in slot order (slots ascend): each thread a contiguous run of slots
    int n_prev = 0;
    {
        const int per = (M + nt - 1)/nt;
        const int m0  = min(tid*per, M);
        const int m1  = min(m0 + per, M);
        int count = 0;
        for (int m = m0; m < m1; ++m) {
            const int32_t pos = mem_h[m];
            count += has_previous && pos >= sink_end && pos < chunk_start && pos < local_start;
        }
        int at = h2o_block_scan(count, warp_sums, n_prev);
        for (int m = m0; m < m1; ++m) {
            const int32_t pos = mem_h[m];
            if (has_previous && pos >= sink_end && pos < chunk_start && pos < local_start) {
                cand_pos[at++] = pos;
            }
        }
    }
    const int n_cand = n_prev + n_chunk;
    for (int j = tid; j < n_chunk; j += nt) {
        cand_pos[n_prev + j] = cand_start + j;
    }
    __syncthreads();
    for (int i = tid; i < n_cand; i += nt) {
        cand_key[i] = (int32_t) h2o_score_key(sc[cand_pos[i]]);
    }

    const int n_best = min(max(H - sink_end, 0), n_cand);

    // the n_best-th largest key, one byte at a time
    for (int pass = 0; pass < 2; ++pass) {
        for (int i = tid; i < 256; i += nt) {
            hist[i] = 0;
        }
        __syncthreads();
        for (int i = tid; i < n_cand; i += nt) {
            const int key = cand_key[i];
            if (pass == 0) {
                atomicAdd(&hist[key >> 8], 1);
            } else if ((key >> 8) == sel[0]) {
                atomicAdd(&hist[key & 0xff], 1);
            }
        }
        __syncthreads();
        if (tid < H2O_WARP_SIZE) {
            h2o_radix_bin(hist, sel, pass, n_best);
        }
        __syncthreads();
    }
    const int threshold = sel[1];
    const int n_equal   = sel[2];

    // heavy: key above the threshold, or equal to it and among the first n_equal such (lower positions first)
    const int per = (n_cand + nt - 1)/nt;
    const int i0  = min(tid*per, n_cand);
    const int i1  = min(i0 + per, n_cand);
    int count_equal = 0;
    for (int i = i0; i < i1; ++i) {
        count_equal += cand_key[i] == threshold;
    }
    int total;
    int rank_equal = h2o_block_scan(count_equal, warp_sums, total);
    int count_heavy = 0;
    for (int i = i0; i < i1; ++i) {
        const int key = cand_key[i];
        count_heavy += key > threshold || (key == threshold && rank_equal++ < n_equal);
    }
    int slot = h2o_block_scan(count_heavy, warp_sums, total);
    rank_equal -= count_equal;
    for (int i = i0; i < i1; ++i) {
        const int key = cand_key[i];
        if (key > threshold || (key == threshold && rank_equal++ < n_equal)) {
            mem_h[sink_end + slot++] = cand_pos[i];
        }
    }
    // Sink, then Heavy (every candidate is at or after sink_end), then Local, then -1
    for (int m = tid; m < sink_end; m += nt) {
        mem_h[m] = m;
    }
    for (int m = sink_end + n_best + tid; m < M; m += nt) {
        const int pos = local_start + (m - sink_end - n_best);
        mem_h[m] = pos < chunk_end ? pos : -1;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// h2o_flush_memory_sums: a chunk that continues in this call under query-aware selection gets a new memory;
// the sums its earlier part left for the old memory's slots go to their positions' scores first
// ---------------------------------------------------------------------------------------------------------------

static __global__ void h2o_flush_memory_sums(float * acc, size_t nb_acc1, uint16_t * scores, size_t nb_scores1,
        const int32_t * mem, size_t nb_mem1, int S, int M, int cs) {
    const int ih = blockIdx.x;
    float          * acc_h = (float          *) ((char       *) acc    + ih*nb_acc1) + S;
    uint16_t       * sc    = (uint16_t       *) ((char       *) scores + ih*nb_scores1);
    const int32_t  * mem_h = (const int32_t  *) ((const char *) mem    + ih*nb_mem1);
    for (int m = threadIdx.x; m < M; m += blockDim.x) {
        const int32_t pos = mem_h[m];
        if (pos >= 0 && pos < cs && acc_h[m] != 0.0f) {
            sc[pos] = h2o_f32_to_bf16(h2o_bf16_to_f32(sc[pos]) + acc_h[m]);
        }
        acc_h[m] = 0.0f;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// h2o_select_query: the memory of chunk cs.. for one head per block, chosen by the chunk's queries in this call
// (the rule of h2o_select_by_query in ggml-cpu/ops.cpp): Local [cs - L, cs), Sink [0, n_sink), and the best blocks
// of H2O_SELECT_BLOCK positions of [n_sink, cs - L). A block is summarised per channel by the minimum and maximum
// of its keys (or their mean); the sampled queries (the last H2O_SAMPLE_LAST rows, then up to H2O_SAMPLE_STRIDE
// spread over the rest) each give every block a bound logit, and a block's score is the sum over the queries of
// its share in the softmax over blocks. Each warp takes blocks in turn; the softmax runs in two sweeps (row maxima
// and sums, then shares), so nothing per (query, block) is stored. Block scores go to global scratch.
// ---------------------------------------------------------------------------------------------------------------

#define H2O_SELECT_BLOCK    16
#define H2O_SAMPLE_LAST     32
#define H2O_SAMPLE_STRIDE   32
#define H2O_SAMPLE_MAX      (H2O_SAMPLE_LAST + H2O_SAMPLE_STRIDE)
#define H2O_SELECT_WARPS    8
#define H2O_SELECT_MAX_D    256
#define H2O_SELECT_MAX_PICK 512

static size_t h2o_select_smem_bytes(int D, int H) {
    return (size_t) H2O_SAMPLE_MAX*D*sizeof(float) + (size_t) H*sizeof(int32_t);
}

// position pos is in one of the n picked blocks [begin[i], end[i]), sorted by position
static __device__ __forceinline__ bool h2o_in_picks(const int * begin, const int * end, int n, int pos) {
    int lo = 0;
    int hi = n;
    while (lo < hi) {
        const int mid = (lo + hi)/2;
        if (end[mid] <= pos) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo < n && begin[lo] <= pos;
}

// the bound (or mean) logits of every sampled query against block b, lane 0 of the warp holding them in x[]
static __device__ __forceinline__ void h2o_block_logits(float * x, const float * q_s, int n_q, const char * k,
        size_t nbk2, int D, int p_begin, int p_end, bool mean) {
    const int lane = threadIdx.x%H2O_WARP_SIZE;
    float lo[H2O_SELECT_MAX_D/H2O_WARP_SIZE];
    float hi[H2O_SELECT_MAX_D/H2O_WARP_SIZE];
#pragma unroll
    for (int t = 0; t < H2O_SELECT_MAX_D/H2O_WARP_SIZE; ++t) {
        lo[t] = mean ? 0.0f :  INFINITY;
        hi[t] = mean ? 0.0f : -INFINITY;
    }
    for (int pos = p_begin; pos < p_end; ++pos) {
        const half * kr = (const half *) (k + pos*nbk2);
#pragma unroll
        for (int t = 0; t < H2O_SELECT_MAX_D/H2O_WARP_SIZE; ++t) {
            const int d = lane + t*H2O_WARP_SIZE;
            if (d < D) {
                const float v = __half2float(kr[d]);
                if (mean) {
                    lo[t] += v;
                } else {
                    lo[t] = fminf(lo[t], v);
                    hi[t] = fmaxf(hi[t], v);
                }
            }
        }
    }
    if (mean) {
#pragma unroll
        for (int t = 0; t < H2O_SELECT_MAX_D/H2O_WARP_SIZE; ++t) {
            lo[t] *= 1.0f/(p_end - p_begin);
        }
    }
    for (int i = 0; i < n_q; ++i) {
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < H2O_SELECT_MAX_D/H2O_WARP_SIZE; ++t) {
            const int d = lane + t*H2O_WARP_SIZE;
            if (d < D) {
                const float qd = q_s[i*D + d];
                sum += mean ? qd*lo[t] : fmaxf(qd*lo[t], qd*hi[t]);
            }
        }
        // every lane holds the sum; lane 0, which reads x[], writes it
        const float xi = h2o_warp_sum(sum);
        if (lane == 0) {
            x[i] = xi;
        }
    }
}

// hybrid: the blocks fill half of the budget; the other half goes to the positions outside them with the highest
// accumulated scores (ties to the lower position), found by the radix select of h2o_build over the cache.
static __global__ void h2o_select_query(const char * q, const char * k, int32_t * mem, float * block_scores,
        const uint16_t * scores, size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2, size_t nb_mem1, size_t nb_scores1,
        int D, int n_gqa, int L, int H, int n_sink, int p0, int cs, int i_begin, int i_end, float scale, bool mean,
        bool hybrid, int n_blocks_max) {
    extern __shared__ float h2o_select_smem[];
    __shared__ float row_m[H2O_SELECT_WARPS][H2O_SAMPLE_MAX];
    __shared__ float row_l[H2O_SELECT_WARPS][H2O_SAMPLE_MAX];
    __shared__ float x_w[H2O_SELECT_WARPS][H2O_SAMPLE_MAX];
    __shared__ int   sample[H2O_SAMPLE_MAX];
    __shared__ int   pick_begin[H2O_SELECT_MAX_PICK];
    __shared__ int   pick_end[H2O_SELECT_MAX_PICK];
    __shared__ float best_s[H2O_SELECT_WARPS];
    __shared__ int   best_b[H2O_SELECT_WARPS];
    __shared__ int   n_pick;
    __shared__ int   warp_sums[H2O_WARP_SIZE];
    __shared__ int   hist[256];
    __shared__ int   sel[3];
    __shared__ int   n_by_score;

    const int ih   = blockIdx.x;
    const int tid  = threadIdx.x;
    const int lane = tid%H2O_WARP_SIZE;
    const int warp = tid/H2O_WARP_SIZE;

    int32_t * mem_h = (int32_t *) ((char *) mem + ih*nb_mem1);
    float   * score = block_scores + (size_t) ih*n_blocks_max;
    const char * k_h = k + (ih/n_gqa)*nbk1;

    const int M           = L + H;
    const int local_start = max(cs - L, 0);
    const int sink_end    = min(n_sink, local_start);
    const int cand_begin  = sink_end;
    const int cand_end    = local_start;
    const int budget      = max(H - sink_end, 0);
    const int by_score    = hybrid ? budget/2 : 0;

    const uint16_t * sc = (const uint16_t *) ((const char *) scores + ih*nb_scores1);
    int32_t * by_score_pos = (int32_t *) (h2o_select_smem + H2O_SAMPLE_MAX*D); // [H]

    if (tid == 0) {
        n_pick     = 0;
        n_by_score = 0;
    }
    if (cand_end - cand_begin > budget) {
        // the sample and its queries, pre-scaled
        const int last0  = max(i_begin, i_end - H2O_SAMPLE_LAST);
        const int n_rest = last0 - i_begin;
        const int n_more = min(n_rest, H2O_SAMPLE_STRIDE);
        const int n_q    = (i_end - last0) + n_more;
        for (int s = tid; s < n_q; s += blockDim.x) {
            sample[s] = s < i_end - last0 ? last0 + s : i_begin + (int) ((long long) (s - (i_end - last0))*n_rest/n_more);
        }
        __syncthreads();
        float * q_s = h2o_select_smem;
        for (int e = tid; e < n_q*D; e += blockDim.x) {
            const int s = e/D;
            const int d = e%D;
            q_s[e] = ((const float *) (q + (size_t) (sample[s] - p0)*nbq2 + ih*nbq1))[d]*scale;
        }
        for (int i = tid; i < H2O_SELECT_WARPS*H2O_SAMPLE_MAX; i += blockDim.x) {
            row_m[i/H2O_SAMPLE_MAX][i%H2O_SAMPLE_MAX] = -INFINITY;
            row_l[i/H2O_SAMPLE_MAX][i%H2O_SAMPLE_MAX] = 0.0f;
        }
        __syncthreads();

        const int b0 = cand_begin/H2O_SELECT_BLOCK;
        const int nb = (cand_end + H2O_SELECT_BLOCK - 1)/H2O_SELECT_BLOCK - b0;
        const auto block_range = [&](int b, int & pb, int & pe) {
            pb = max((b0 + b)*H2O_SELECT_BLOCK, cand_begin);
            pe = min((b0 + b + 1)*H2O_SELECT_BLOCK, cand_end);
        };

        // sweep 1: per query, the maximum and the sum over the blocks, per warp (online), then over the warps
        for (int b = warp; b < nb; b += H2O_SELECT_WARPS) {
            int pb, pe;
            block_range(b, pb, pe);
            h2o_block_logits(x_w[warp], q_s, n_q, k_h, nbk2, D, pb, pe, mean);
            if (lane == 0) {
                for (int i = 0; i < n_q; ++i) {
                    const float m = fmaxf(row_m[warp][i], x_w[warp][i]);
                    row_l[warp][i] = row_l[warp][i]*expf(row_m[warp][i] - m) + expf(x_w[warp][i] - m);
                    row_m[warp][i] = m;
                }
            }
            __syncwarp();
        }
        __syncthreads();
        if (tid < n_q) {
            float m = -INFINITY;
            for (int w = 0; w < H2O_SELECT_WARPS; ++w) {
                m = fmaxf(m, row_m[w][tid]);
            }
            float l = 0.0f;
            for (int w = 0; w < H2O_SELECT_WARPS; ++w) {
                l += row_m[w][tid] == -INFINITY ? 0.0f : row_l[w][tid]*expf(row_m[w][tid] - m);
            }
            row_m[0][tid] = m;
            row_l[0][tid] = l;
        }
        __syncthreads();

        // sweep 2: each block's share, summed over the queries in sample order
        for (int b = warp; b < nb; b += H2O_SELECT_WARPS) {
            int pb, pe;
            block_range(b, pb, pe);
            h2o_block_logits(x_w[warp], q_s, n_q, k_h, nbk2, D, pb, pe, mean);
            if (lane == 0) {
                float sc = 0.0f;
                for (int i = 0; i < n_q; ++i) {
                    sc += expf(x_w[warp][i] - row_m[0][i])/row_l[0][i];
                }
                score[b] = isnan(sc) ? -INFINITY : sc;
            }
            __syncwarp();
        }
        __syncthreads();

        // the best blocks, one at a time (ties to the lower block), until their part of the budget is spent
        int left = budget - by_score;
        while (left > 0) {
            float bs = -INFINITY;
            int   bb = -1;
            for (int b = tid; b < nb; b += blockDim.x) {
                if (score[b] > bs) {
                    bs = score[b];
                    bb = b;
                }
            }
            // the warp's best, then the block's: higher score, or the same score and a lower block
            for (int o = H2O_WARP_SIZE/2; o > 0; o >>= 1) {
                const float os = __shfl_xor_sync(0xffffffff, bs, o);
                const int   ob = __shfl_xor_sync(0xffffffff, bb, o);
                if (ob >= 0 && (bb < 0 || os > bs || (os == bs && ob < bb))) {
                    bs = os;
                    bb = ob;
                }
            }
            if (lane == 0) {
                best_s[warp] = bs;
                best_b[warp] = bb;
            }
            __syncthreads();
            bs = best_s[0];
            bb = best_b[0];
            for (int w = 1; w < H2O_SELECT_WARPS; ++w) {
                const float os = best_s[w];
                const int   ob = best_b[w];
                if (ob >= 0 && (bb < 0 || os > bs || (os == bs && ob < bb))) {
                    bs = os;
                    bb = ob;
                }
            }
            // read before the barrier, written after it: no thread reads the count thread 0 is raising
            const int picked = n_pick;
            __syncthreads();
            if (bb < 0 || picked >= H2O_SELECT_MAX_PICK) {
                break; // every block taken (cannot happen while the candidates exceed the budget)
            }
            int pb, pe;
            block_range(bb, pb, pe);
            pe = min(pe, pb + left);
            left -= pe - pb;
            if (tid == 0) {
                pick_begin[picked] = pb;
                pick_end[picked]   = pe;
                score[bb]          = -INFINITY;
                n_pick             = picked + 1;
            }
            // a taken block must not win again: its score is -inf, and a block of -inf never wins (bb stays -1
            // only when all are -inf, which the count of candidates rules out)
            __syncthreads();
        }

        // the picks in position order (insertion sort: a few dozen at most)
        if (tid == 0) {
            for (int i = 1; i < n_pick; ++i) {
                const int pb = pick_begin[i];
                const int pe = pick_end[i];
                int j = i - 1;
                while (j >= 0 && pick_begin[j] > pb) {
                    pick_begin[j + 1] = pick_begin[j];
                    pick_end[j + 1]   = pick_end[j];
                    --j;
                }
                pick_begin[j + 1] = pb;
                pick_end[j + 1]   = pe;
            }
        }
        __syncthreads();

        if (by_score > 0) {
            int in_blocks = 0;
            for (int i = 0; i < n_pick; ++i) {
                in_blocks += pick_end[i] - pick_begin[i];
            }
            const int n_best = budget - in_blocks; // <= the candidates outside the blocks, as they exceed the budget
            const int nt     = blockDim.x;
            for (int pass = 0; pass < 2; ++pass) {
                for (int i = tid; i < 256; i += nt) {
                    hist[i] = 0;
                }
                __syncthreads();
                for (int pos = cand_begin + tid; pos < cand_end; pos += nt) {
                    if (h2o_in_picks(pick_begin, pick_end, n_pick, pos)) {
                        continue;
                    }
                    const int key = (int) h2o_score_key(sc[pos]);
                    if (pass == 0) {
                        atomicAdd(&hist[key >> 8], 1);
                    } else if ((key >> 8) == sel[0]) {
                        atomicAdd(&hist[key & 0xff], 1);
                    }
                }
                __syncthreads();
                if (tid < H2O_WARP_SIZE) {
                    h2o_radix_bin(hist, sel, pass, n_best);
                }
                __syncthreads();
            }
            const int threshold = sel[1];
            const int n_equal   = sel[2];

            // compaction in position order: each thread a contiguous run of candidates
            const int n_cand = cand_end - cand_begin;
            const int per    = (n_cand + nt - 1)/nt;
            const int q0     = cand_begin + min(tid*per, n_cand);
            const int q1     = cand_begin + min(tid*per + per, n_cand);
            const auto key_of = [&](int pos) {
                return h2o_in_picks(pick_begin, pick_end, n_pick, pos) ? -1 : (int) h2o_score_key(sc[pos]);
            };
            int count_equal = 0;
            for (int pos = q0; pos < q1; ++pos) {
                count_equal += key_of(pos) == threshold;
            }
            int total;
            int rank_equal = h2o_block_scan(count_equal, warp_sums, total);
            int count = 0;
            int rank  = rank_equal;
            for (int pos = q0; pos < q1; ++pos) {
                const int key = key_of(pos);
                count += key > threshold || (key == threshold && rank++ < n_equal);
            }
            int slot = h2o_block_scan(count, warp_sums, total);
            rank = rank_equal;
            for (int pos = q0; pos < q1; ++pos) {
                const int key = key_of(pos);
                if (key > threshold || (key == threshold && rank++ < n_equal)) {
                    by_score_pos[slot++] = pos;
                }
            }
            if (tid == 0) {
                n_by_score = total;
            }
        }
    }
    __syncthreads();

    // Sink, the picked blocks in position order, Local, then -1 (one thread: at most M slots)
    if (tid == 0) {
        int m = 0;
        for (int pos = 0; pos < sink_end; ++pos) {
            mem_h[m++] = pos;
        }
        if (cand_end - cand_begin <= budget) {
            for (int pos = cand_begin; pos < cand_end; ++pos) {
                mem_h[m++] = pos;
            }
        } else {
            // the picked blocks (sorted) merged with the positions taken by score (ascending, outside the blocks)
            int s = 0;
            for (int i = 0; i < n_pick; ++i) {
                while (s < n_by_score && by_score_pos[s] < pick_begin[i]) {
                    mem_h[m++] = by_score_pos[s++];
                }
                for (int pos = pick_begin[i]; pos < pick_end[i]; ++pos) {
                    mem_h[m++] = pos;
                }
            }
            while (s < n_by_score) {
                mem_h[m++] = by_score_pos[s++];
            }
        }
        for (int pos = local_start; pos < cs; ++pos) {
            mem_h[m++] = pos;
        }
        for (; m < M; ++m) {
            mem_h[m] = -1;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// h2o_attn_dense: the dense tail. One block of H2O_DENSE_WARPS warps per (query row, head): full causal attention
// over every position up to the row, keys split between the warps in contiguous runs, each warp an online softmax
// (lanes hold channels), merged through shared memory. F32 arithmetic, any head size up to H2O_SELECT_MAX_D.
// ---------------------------------------------------------------------------------------------------------------

#define H2O_DENSE_WARPS 4

static __global__ void h2o_attn_dense(const char * q, const char * k, const char * v, float * dst,
        size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2, size_t nbv1, size_t nbv2, size_t nbd1, size_t nbd2,
        int D, int Dv, int n_gqa, int p0, int r_begin, float scale, float softcap, const float * sinks) {
    constexpr int T = H2O_SELECT_MAX_D/H2O_WARP_SIZE;
    __shared__ float w_m[H2O_DENSE_WARPS];
    __shared__ float w_l[H2O_DENSE_WARPS];
    __shared__ float w_o[H2O_DENSE_WARPS][H2O_SELECT_MAX_D];

    const int i    = r_begin + blockIdx.x;
    const int ih   = blockIdx.y;
    const int lane = threadIdx.x%H2O_WARP_SIZE;
    const int warp = threadIdx.x/H2O_WARP_SIZE;

    const float * qr = (const float *) (q + (size_t) (i - p0)*nbq2 + ih*nbq1);
    float qv[T];
    float o[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
        const int d = lane + t*H2O_WARP_SIZE;
        qv[t] = d < D ? qr[d]*scale : 0.0f;
        o[t]  = 0.0f;
    }
    const char * k_h = k + (ih/n_gqa)*nbk1;
    const char * v_h = v + (ih/n_gqa)*nbv1;

    const int n_keys = i + 1;
    const int per    = (n_keys + H2O_DENSE_WARPS - 1)/H2O_DENSE_WARPS;
    const int j0     = min(warp*per, n_keys);
    const int j1     = min(j0 + per, n_keys);
    float m = -INFINITY;
    float l = 0.0f;
    for (int j = j0; j < j1; ++j) {
        const half * kr = (const half *) (k_h + (size_t) j*nbk2);
        float x = 0.0f;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const int d = lane + t*H2O_WARP_SIZE;
            x += d < D ? qv[t]*__half2float(kr[d]) : 0.0f;
        }
        x = h2o_softcap(h2o_warp_sum(x), softcap);
        const float mn = fmaxf(m, x);
        const float c  = expf(m - mn);
        const float p  = expf(x - mn);
        l = l*c + p;
        const half * vr = (const half *) (v_h + (size_t) j*nbv2);
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const int d = lane + t*H2O_WARP_SIZE;
            o[t] = o[t]*c + (d < Dv ? p*__half2float(vr[d]) : 0.0f);
        }
        m = mn;
    }
    if (lane == 0) {
        w_m[warp] = m;
        w_l[warp] = l;
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
        const int d = lane + t*H2O_WARP_SIZE;
        if (d < Dv) {
            w_o[warp][d] = o[t];
        }
    }
    __syncthreads();
    if (warp == 0) {
        float mx = -INFINITY;
        for (int w = 0; w < H2O_DENSE_WARPS; ++w) {
            mx = fmaxf(mx, w_m[w]);
        }
        // a learned sink's logit joins the denominator
        const float sk = h2o_sink_of(sinks, ih);
        if (sk != -INFINITY) {
            mx = fmaxf(mx, sk);
        }
        float lt = sk != -INFINITY ? expf(sk - mx) : 0.0f;
        for (int w = 0; w < H2O_DENSE_WARPS; ++w) {
            lt += w_m[w] == -INFINITY ? 0.0f : w_l[w]*expf(w_m[w] - mx);
        }
        float * out = (float *) ((char *) dst + (size_t) (i - p0)*nbd2 + ih*nbd1);
        for (int d = lane; d < Dv; d += H2O_WARP_SIZE) {
            float sum = 0.0f;
            for (int w = 0; w < H2O_DENSE_WARPS; ++w) {
                sum += w_m[w] == -INFINITY ? 0.0f : w_o[w][d]*expf(w_m[w] - mx);
            }
            out[d] = sum/lt;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Coverage selection (GGML_H2O_SELECT_COVERAGE): the kernels of h2o_cuda_cover_select, in the order it runs them for
// chunk c = [cs, cs + S) and this call's rows [i_begin, i_end) of it. Tiles are H2O_COV_TILE rows aligned to the
// chunk (t_first = the first one this call touches); a unit is (head, tile), unit = ih*n_t + ti. The rule is that of
// ggml_compute_forward_h2o_attn_coverage (ggml-cpu/ops.cpp) and src/reference/tiles.rs:
//   1. h2o_cov_sample_stats, h2o_cov_sample_merge, h2o_cov_sample_scores, h2o_cov_propose: the sampled queries of
//      each tile attend to every position before the chunk (two sweeps, keys split over blocks); a candidate's score is the sum
//      of their attention on it; the n_rank best candidates (ties to the lower position) are proposed, ascending.
//      Skipped when every candidate is proposed anyway;
//   2. h2o_cov_rank: every row of the tile attends to its chunk, the forced positions (sinks, local window) and the
//      proposal; the candidates are ranked by the tile's summed attention, and the tile's estimate after g budget
//      steps is written out (double, as on the CPU);
//   3. h2o_cov_allocate: one block spends the chunk's budget over all units, as the CPU's priority queue does;
//   4. h2o_cov_build_memory: each tile's memory (forced + its ranked positions up to its budget, ascending) and the
//      memory set kept (the last tile's at the average budget).
// Then h2o_attn_mma/h2o_attn_generic attend with each tile's memory and h2o_cov_settle_memory adds the memory
// column sums, tile by tile, to the scores. The selection's logits are as exact as the CPU's F32 dot products of the
// pre-scaled query and the key (h2o_cov_block: on the tensor cores with Q in two F16 parts for head sizes 64 and 128,
// else in F32), and its sums follow the CPU's order where they rank something; still, float sums in another order
// can flip a near-tie, so the selection agrees with the CPU's up to those.
// ---------------------------------------------------------------------------------------------------------------

#define H2O_COV_THREADS  256            // threads of the logit kernels: 16 x 16, each 4 rows x 4 keys of a 64 x 64 block
#define H2O_COV_KEYS     64             // keys per block of the logit kernels
#define H2O_COV_SPLIT    512            // keys per block of the sampled queries' attention
#define H2O_COV_MAX_RANK 8192           // 4 H at most (the ranking sorts a tile's candidates in shared memory)
#define H2O_COV_SCORE_BYTES (64u << 20) // candidates' scores of one pass over the heads, at most (scratch)
#define H2O_COV_SELECT_THREADS 1024     // threads of the select, allocate and settle kernels

static_assert(H2O_COV_STEP == H2O_WARP_SIZE, "h2o_cov_rank_estimate: a warp sums one budget step");

static __host__ __device__ int h2o_cov_pow2(int n) {
    int p = 1;
    while (p < n) {
        p *= 2;
    }
    return p;
}

// an F32 score as an unsigned key that orders like the CPU's float compare after it replaced NaN by -inf; -0 = +0
static __device__ __forceinline__ uint32_t h2o_f32_key(float x) {
    uint32_t u = __float_as_uint(x);
    u = (u & 0x7fffffff) > 0x7f800000 ? 0xff800000 : u;
    u = u == 0x80000000 ? 0 : u;
    return (u & 0x80000000) ? ~u : u | 0x80000000;
}

// the same for doubles; NaN (and -inf) key above 0, which marks no element at all
static __device__ __forceinline__ uint64_t h2o_f64_key(double x) {
    uint64_t u = (uint64_t) __double_as_longlong(x);
    u = (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull ? 0xfff0000000000000ull : u;
    u = u == 0x8000000000000000ull ? 0 : u;
    return (u >> 63) ? ~u : u | 0x8000000000000000ull;
}

static __device__ __forceinline__ double h2o_warp_sum_f64(double x) {
#pragma unroll
    for (int o = H2O_WARP_SIZE/2; o > 0; o >>= 1) {
        x += __shfl_xor_sync(0xffffffff, x, o);
    }
    return x;
}

// over the 16 threads of a half-warp (the 16 threads that share a row in the logit kernels)
static __device__ __forceinline__ float h2o_row16_max(float x) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
    }
    return x;
}

static __device__ __forceinline__ double h2o_row16_sum(double x) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
        x += __shfl_xor_sync(0xffffffff, x, o);
    }
    return x;
}

// one pass of a radix select, for the first warp: hist counts one key byte of the keys that match the bytes chosen so
// far, `above` keys rank above all of those. The highest bin at which the count from the top reaches n_best goes to
// sel[0], the count above that bin to sel[1]. (h2o_radix_bin with the count above carried, for any number of passes.)
static __device__ __forceinline__ void h2o_radix_pick(const int * hist, int above, int n_best, int * sel) {
    const int lane = threadIdx.x%H2O_WARP_SIZE;
    int own = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        own += hist[255 - 8*lane - i];
    }
    int incl = own;
#pragma unroll
    for (int o = 1; o < H2O_WARP_SIZE; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffff, incl, o);
        incl += lane >= o ? y : 0;
    }
    const unsigned reached = __ballot_sync(0xffffffff, above + incl >= n_best);
    const int first = reached ? __ffs(reached) - 1 : H2O_WARP_SIZE - 1;
    if (lane == first) {
        int acc = above + incl - own;
        int bin = 255 - 8*lane;
        for (int i = 0; i < 7 && acc + hist[bin] < n_best; ++i) {
            acc += hist[bin];
            --bin;
        }
        sel[0] = bin;
        sel[1] = acc;
    }
}

// the n_best-th largest (1 <= n_best <= n) of the keys key_of(i), i < n, one byte at a time from the top, by the whole
// block; returns it, and in n_equal how many keys equal to it are among the n_best (every key above it is)
template <typename key_t, typename key_fn>
static __device__ key_t h2o_block_radix_select(int n, int n_best, key_fn key_of, int * hist, int * sel, int & n_equal) {
    constexpr int n_bytes = (int) sizeof(key_t);
    key_t prefix = 0;
    int   above  = 0;
    for (int pass = 0; pass < n_bytes; ++pass) {
        const int shift = 8*(n_bytes - 1 - pass);
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            hist[i] = 0;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const key_t key = key_of(i);
            if (pass == 0 || (key >> (shift + 8)) == prefix) {
                atomicAdd(&hist[(int) ((key >> shift) & 0xff)], 1);
            }
        }
        __syncthreads();
        if (threadIdx.x < H2O_WARP_SIZE) {
            h2o_radix_pick(hist, above, n_best, sel);
        }
        __syncthreads();
        prefix = (key_t) ((prefix << 8) | (key_t) sel[0]);
        above  = sel[1];
        __syncthreads(); // sel is written again by the next pass
    }
    n_equal = n_best - above;
    return prefix;
}

// put(slot, i) for the indices i < n whose key is above the threshold, or equal to it and among the first n_equal
// such: slots 0, 1, ... in index order. Each thread a contiguous run of indices (as in h2o_build).
template <typename key_t, typename key_fn, typename put_fn>
static __device__ void h2o_block_compact_best(int n, key_t threshold, int n_equal, key_fn key_of, put_fn put, int * warp_sums) {
    const int per = (n + blockDim.x - 1)/blockDim.x;
    const int i0  = min((int) threadIdx.x*per, n);
    const int i1  = min(i0 + per, n);
    int count_equal = 0;
    for (int i = i0; i < i1; ++i) {
        count_equal += key_of(i) == threshold;
    }
    int total;
    int rank_equal = h2o_block_scan(count_equal, warp_sums, total);
    const int rank_equal0 = rank_equal;
    int count = 0;
    for (int i = i0; i < i1; ++i) {
        const key_t key = key_of(i);
        count += key > threshold || (key == threshold && rank_equal++ < n_equal);
    }
    int slot = h2o_block_scan(count, warp_sums, total);
    rank_equal = rank_equal0;
    for (int i = i0; i < i1; ++i) {
        const key_t key = key_of(i);
        if (key > threshold || (key == threshold && rank_equal++ < n_equal)) {
            put(slot++, i);
        }
    }
}

// x[0 .. n_pow2) ascending, by the whole block (bitonic; n_pow2 a power of 2)
template <typename T>
static __device__ void h2o_block_sort(T * x, int n_pow2) {
    for (int size = 2; size <= n_pow2; size *= 2) {
        for (int stride = size/2; stride > 0; stride /= 2) {
            __syncthreads();
            for (int i = threadIdx.x; i < n_pow2/2; i += blockDim.x) {
                const int  lo = 2*i - (i & (stride - 1)); // i with a zero inserted at bit `stride`
                const int  hi = lo + stride;
                const bool up = (lo & size) == 0;
                const T    a  = x[lo];
                const T    b  = x[hi];
                if ((a > b) == up) {
                    x[lo] = b;
                    x[hi] = a;
                }
            }
        }
    }
    __syncthreads();
}

// x[i][j] = qs row (ty + 16 i) · ks row (tx + 16 j), thread (tx, ty) = (tid % 16, tid / 16): F32 products added in
// channel order; rows S4 float4 apart (D a multiple of 4: four channels per shared-memory load)
static __device__ __forceinline__ void h2o_cov_dot(float (&x)[4][4], const float * qs, const float * ks, int D, int S4) {
    const int tx = threadIdx.x%16;
    const int ty = threadIdx.x/16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            x[i][j] = 0.0f;
        }
    }
    const float4 * qr = (const float4 *) qs + ty*S4;
    const float4 * kr = (const float4 *) ks + tx*S4;
#pragma unroll 2
    for (int d4 = 0; d4 < D/4; ++d4) {
        float4 a[4];
        float4 b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            a[i] = qr[16*i*S4 + d4];
            b[i] = kr[16*i*S4 + d4];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float acc = x[i][j];
                acc = fmaf(a[i].x, b[j].x, acc);
                acc = fmaf(a[i].y, b[j].y, acc);
                acc = fmaf(a[i].z, b[j].z, acc);
                acc = fmaf(a[i].w, b[j].w, acc);
                x[i][j] = acc;
            }
        }
    }
}

// xs[r][kk] (rows 65 floats apart) = Q row r · K row kk for 64 rows and 64 keys on the tensor cores, Q as the sum of
// two F16 parts qh + ql, exactly the products of h2o_attn_mma's sweeps; rows SD halves apart. Warp w takes rows
// 16 (w % 4) .. + 16 and keys 32 (w / 4) .. + 32 (8 warps).
template <int D>
static __device__ __forceinline__ void h2o_cov_mma_logits(float * xs, const half * qh, const half * ql, const half * ks) {
    constexpr int SD = h2o_mma_stride(D);
    const int warp = threadIdx.x/H2O_WARP_SIZE;
    const int lane = threadIdx.x%H2O_WARP_SIZE;
    const int r0   = 16*(warp%4);
    const int k0   = 32*(warp/4);
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nt][e] = 0.0f;
        }
    }
    const int q_row = r0 + lane%8 + 8*((lane/8)%2); // this lane's row address for the A fragments
#pragma unroll
    for (int kk = 0; kk < D/16; kk += 2) {
        uint32_t ah[2][4];
        uint32_t al[2][4];
#pragma unroll
        for (int k2 = 0; k2 < 2; ++k2) {
            h2o_ldmatrix_x4(ah[k2], qh + q_row*SD + 16*(kk + k2) + 8*(lane/16));
            h2o_ldmatrix_x4(al[k2], ql + q_row*SD + 16*(kk + k2) + 8*(lane/16));
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            uint32_t kb[4];
            h2o_ldmatrix_x4(kb, ks + (k0 + 8*nt + lane%8)*SD + 16*kk + 8*(lane/8));
            h2o_mma(s[nt], ah[0], kb[0], kb[1]);
            h2o_mma(s[nt], al[0], kb[0], kb[1]);
            h2o_mma(s[nt], ah[1], kb[2], kb[3]);
            h2o_mma(s[nt], al[1], kb[2], kb[3]);
        }
    }
    const int g  = lane/4;
    const int c4 = lane%4;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            xs[(r0 + g + 8*(e/2))*(H2O_COV_KEYS + 1) + k0 + 8*nt + 2*c4 + (e & 1)] = s[nt][e];
        }
    }
}

// The logit blocks of the selection kernels: 64 query rows (pre-scaled as on the CPU) and 64 keys in shared memory;
// logits() gives thread (tx, ty) = (tid % 16, tid / 16) x[i][j] = query row (ty + 16 i) · key (tx + 16 j), after which
// probs() (64 x 65 floats) is the caller's until the next logits(). DT = 0: F32 products on the CUDA cores, any head
// size that is a multiple of 4. DT = 64 or 128 (= D): the tensor cores, as h2o_attn_mma computes Q·K^T (Q as the sum of
// two F16 parts, F32 accumulators: as exact as the F32 products, ten times the throughput).
template <int DT>
struct h2o_cov_block {
    char * smem;
    int    D;
    float  softcap; // of the logits (pre-scaled queries: natural units), 0: none
    const int32_t * chan = nullptr; // DT = 0: the D channels of Q and K it reads (a key sketch), nullptr: 0 .. D - 1

    // floats (DT = 0, 16-byte rows with 4 floats of padding: the 16 keys a half-warp reads spread over the banks) or
    // halves (DT > 0, as h2o_attn_mma's) per row
    static __host__ __device__ int stride(int D) {
        return DT == 0 ? D + 4 : h2o_mma_stride(D);
    }

    // Q and K (DT > 0: Q as two parts), then the probabilities
    static __host__ __device__ size_t smem_bytes(int D) {
        const size_t blocks = DT == 0 ? 2*(size_t) H2O_COV_TILE*stride(D)*sizeof(float) :
                                        3*(size_t) H2O_COV_TILE*stride(D)*sizeof(half);
        return blocks + (size_t) H2O_COV_TILE*(H2O_COV_KEYS + 1)*sizeof(float);
    }

    __device__ float * probs() const {
        return (float *) (smem + smem_bytes(D)) - H2O_COV_TILE*(H2O_COV_KEYS + 1);
    }

    // the soft-cap on a block of logits, before any mask
    __device__ void cap(float (&x)[4][4]) const {
        if (softcap > 0.0f) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    x[i][j] = h2o_softcap(x[i][j], softcap);
                }
            }
        }
    }

    // query rows rows[r] (-1: zero) of head ih, times scale
    __device__ void load_queries(const int * rows, const char * q, size_t nbq1, size_t nbq2, int ih, int p0, float scale) const {
        const int SD = stride(D);
        for (int e = threadIdx.x; e < H2O_COV_TILE*D; e += blockDim.x) {
            const int   r = e/D;
            const int   d = e%D;
            const int   i = rows[r];
            const int   c = chan != nullptr ? chan[d] : d;
            const float x = i >= 0 ? ((const float *) (q + (size_t) (i - p0)*nbq2 + (size_t) ih*nbq1))[c]*scale : 0.0f;
            if constexpr (DT == 0) {
                ((float *) smem)[r*SD + d] = x;
            } else {
                const half h = __float2half_rn(x);
                ((half *) smem)[r*SD + d]                    = h;
                ((half *) smem)[(H2O_COV_TILE + r)*SD + d]   = __float2half_rn(x - __half2float(h));
            }
        }
    }

    // the key rows kpos[kk] (-1: zero) of one KV head
    __device__ void load_keys(const int * kpos, const char * k_h, size_t nbk2) const {
        const int SD = stride(D);
        if constexpr (DT == 0) {
            float * ks = (float *) smem + H2O_COV_TILE*SD;
            for (int e = threadIdx.x; e < H2O_COV_KEYS*D; e += blockDim.x) {
                const int kk  = e/D;
                const int d   = e%D;
                const int pos = kpos[kk];
                const int c   = chan != nullptr ? chan[d] : d;
                ks[kk*SD + d] = pos >= 0 ? __half2float(((const half *) (k_h + (size_t) pos*nbk2))[c]) : 0.0f;
            }
        } else {
            half * ks = (half *) smem + 2*H2O_COV_TILE*SD;
            constexpr int CPR = DT/8; // 16-byte pieces per row
            for (int e = threadIdx.x; e < H2O_COV_KEYS*CPR; e += blockDim.x) {
                const int kk  = e/CPR;
                const int c   = e%CPR;
                const int pos = kpos[kk];
                uint4 x = make_uint4(0, 0, 0, 0);
                if (pos >= 0) {
                    x = *(const uint4 *) (k_h + (size_t) pos*nbk2 + 16*c);
                }
                *(uint4 *) (ks + kk*SD + 8*c) = x;
            }
        }
    }

    // after load_keys and a barrier; every thread calls it
    __device__ void logits(float (&x)[4][4]) const {
        const int SD = stride(D);
        if constexpr (DT == 0) {
            h2o_cov_dot(x, (const float *) smem, (const float *) smem + H2O_COV_TILE*SD, D, SD/4);
            cap(x);
        } else {
            const half * qh = (const half *) smem;
            float      * xs = probs();
            h2o_cov_mma_logits<DT>(xs, qh, qh + H2O_COV_TILE*SD, qh + 2*H2O_COV_TILE*SD);
            __syncthreads();
            const int tx = threadIdx.x%16;
            const int ty = threadIdx.x/16;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    x[i][j] = xs[(ty + 16*i)*(H2O_COV_KEYS + 1) + tx + 16*j];
                }
            }
            cap(x);
            __syncthreads(); // probs() is the caller's again
        }
    }
};

// online softmax of this thread's 4 rows over a block of logits (masked ones -inf): maximum m and sum l, the same in
// the 16 threads of a row. The sum is kept in double, as the CPU's softmax sums are.
static __device__ __forceinline__ void h2o_cov_online(const float (&x)[4][4], float (&m)[4], double (&l)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float bm = h2o_row16_max(fmaxf(fmaxf(x[i][0], x[i][1]), fmaxf(x[i][2], x[i][3])));
        const float mn = fmaxf(m[i], bm);
        double s = 0.0;
        if (mn != -INFINITY) {
            s = (double) ((expf(x[i][0] - mn) + expf(x[i][1] - mn)) + (expf(x[i][2] - mn) + expf(x[i][3] - mn)));
        }
        s = h2o_row16_sum(s);
        if (mn != -INFINITY) {
            l[i] = (m[i] == -INFINITY ? 0.0 : l[i]*(double) expf(m[i] - mn)) + s;
            m[i] = mn;
        }
    }
}

// the row of sample slot s (tile s / n_samp from t_first, its (s % n_samp)-th sample): the rows i of the tile with
// (i - t0) % every == every - 1, every = H2O_COV_TILE/n_samp; a tile holding none of them samples its last row (slot
// 0). -1: no such sample, or no such tile.
static __device__ __forceinline__ int h2o_cov_sample_row(int s, int n_samp, int t_first, int i_begin, int i_end) {
    const int every = H2O_COV_TILE/n_samp;
    const int t0    = t_first + (s/n_samp)*H2O_COV_TILE;
    const int k     = s%n_samp;
    const int r0    = max(t0, i_begin);
    const int r1    = min(t0 + H2O_COV_TILE, i_end);
    if (r0 >= r1) {
        return -1;
    }
    const int row = t0 + k*every + every - 1;
    if (row >= r0 && row < r1) {
        return row;
    }
    const int lead  = t0 + every - 1;
    const int first = r0 <= lead ? lead : lead + (r0 - lead + every - 1)/every*every; // the first sample at or after r0
    return k == 0 && first >= r1 ? r1 - 1 : -1;
}

// The key sketch of the proposal (ggml_h2o_attn_set_coverage_sketch), the CPU's h2o_coverage_sketch: each KV head's
// key energy sum_j k_j[c]^2 per channel over positions [0, n_pos), in double, H2O_COV_SPLIT positions per block
// (grid: KV head, split; a thread per channel), then the R channels of most energy, ties to the lower channel,
// ascending, one block per KV head
static __global__ void h2o_cov_sketch_energy(const char * k, double * energy, size_t nbk1, size_t nbk2, int D, int n_pos) {
    const int    ikv = blockIdx.x;
    const int    j0  = blockIdx.y*H2O_COV_SPLIT;
    const int    j1  = min(j0 + H2O_COV_SPLIT, n_pos);
    const char * k_h = k + (size_t) ikv*nbk1;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        double e = 0.0;
        for (int j = j0; j < j1; ++j) {
            const float x = __half2float(((const half *) (k_h + (size_t) j*nbk2))[c]);
            e += (double) x*x;
        }
        energy[((size_t) blockIdx.y*gridDim.x + ikv)*D + c] = e;
    }
}

static __global__ void h2o_cov_sketch_select(const double * energy, int32_t * chan, int D, int n_split, int R) {
    __shared__ double e[H2O_SELECT_MAX_D];
    __shared__ int    chosen[H2O_SELECT_MAX_D];
    const int ikv    = blockIdx.x;
    const int n_kv   = gridDim.x;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        double sum = 0.0;
        for (int sp = 0; sp < n_split; ++sp) {
            sum += energy[((size_t) sp*n_kv + ikv)*D + c];
        }
        e[c] = sum;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        int rank = 0;
        for (int o = 0; o < D; ++o) {
            rank += e[o] > e[c] || (e[o] == e[c] && o < c);
        }
        chosen[c] = rank < R;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        if (chosen[c]) {
            int at = 0;
            for (int o = 0; o < c; ++o) {
                at += chosen[o];
            }
            chan[(size_t) ikv*R + at] = c;
        }
    }
}

// Stage 1, sweep 1: the maximum and sum of each sampled query's logits over the keys of one split, [split*SPLIT, ...)
// before the chunk (key_end: its first position). Grid (split, group of 64 sample slots, head of this pass).
template <int DT>
static __global__ void h2o_cov_sample_stats(const char * q, const char * k, float * st_m, double * st_l,
        size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2, int D, int n_gqa, int h0, int p0,
        int t_first, int i_begin, int i_end, int key_end, int n_samp, int n_slots, float scale, float softcap,
        const int32_t * chan) {
    extern __shared__ __align__(16) char h2o_cov_smem[];
    __shared__ int rows[H2O_COV_TILE];
    __shared__ int kpos[H2O_COV_KEYS];

    const int split = blockIdx.x;
    const int grp   = blockIdx.y;
    const int ihp   = blockIdx.z;
    const int ih    = h0 + ihp;
    const h2o_cov_block<DT> blk = {h2o_cov_smem, D, softcap, chan != nullptr ? chan + (size_t) (ih/n_gqa)*D : nullptr};
    const int tx    = threadIdx.x%16;
    const int ty    = threadIdx.x/16;

    if (threadIdx.x < H2O_COV_TILE) {
        const int s = grp*H2O_COV_TILE + threadIdx.x;
        rows[threadIdx.x] = s < n_slots ? h2o_cov_sample_row(s, n_samp, t_first, i_begin, i_end) : -1;
    }
    __syncthreads();
    blk.load_queries(rows, q, nbq1, nbq2, ih, p0, scale);
    int row[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        row[i] = rows[ty + 16*i];
    }

    const char * k_h = k + (size_t) (ih/n_gqa)*nbk1;
    const int    k0  = split*H2O_COV_SPLIT;
    const int    k1  = min(k0 + H2O_COV_SPLIT, key_end);
    float  m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    double l[4] = {0.0, 0.0, 0.0, 0.0};
    for (int kb = k0; kb < k1; kb += H2O_COV_KEYS) {
        __syncthreads(); // the queries are in, the previous keys are done with
        if (threadIdx.x < H2O_COV_KEYS) {
            kpos[threadIdx.x] = kb + (int) threadIdx.x < k1 ? kb + (int) threadIdx.x : -1;
        }
        __syncthreads();
        blk.load_keys(kpos, k_h, nbk2);
        __syncthreads();
        float x[4][4];
        blk.logits(x);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int key = kb + tx + 16*j;
                x[i][j] = row[i] >= 0 && key < k1 ? x[i][j] : -INFINITY;
            }
        }
        h2o_cov_online(x, m, l);
    }
    if (tx == 0) {
        const size_t n_slots_pad = (size_t) gridDim.y*H2O_COV_TILE;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const size_t at = ((size_t) split*gridDim.z + ihp)*n_slots_pad + grp*H2O_COV_TILE + ty + 16*i;
            st_m[at] = m[i];
            st_l[at] = l[i];
        }
    }
}

// Stage 1: the splits' maxima and sums merged, one warp per (sample slot, head of this pass): each sampled query's
// maximum and 1/sum over all its keys (the CPU's (float) (1.0/z), z summed in double)
static __global__ void h2o_cov_sample_merge(const float * st_m, const double * st_l, float * sm_m, float * sm_il,
        int n_splits, int n_slots_pad) {
    const int lane = threadIdx.x%H2O_WARP_SIZE;
    const int slot = blockIdx.x*(blockDim.x/H2O_WARP_SIZE) + threadIdx.x/H2O_WARP_SIZE;
    const int ihp  = blockIdx.y;
    const int n_hp = gridDim.y;
    if (slot >= n_slots_pad) {
        return;
    }
    float m = -INFINITY;
    for (int s = lane; s < n_splits; s += H2O_WARP_SIZE) {
        m = fmaxf(m, st_m[((size_t) s*n_hp + ihp)*n_slots_pad + slot]);
    }
    m = h2o_warp_max(m);
    double l = 0.0;
    for (int s = lane; s < n_splits; s += H2O_WARP_SIZE) {
        const size_t at = ((size_t) s*n_hp + ihp)*n_slots_pad + slot;
        const float  ms = st_m[at];
        l += ms == -INFINITY ? 0.0 : st_l[at]*(double) expf(ms - m);
    }
    l = h2o_warp_sum_f64(l);
    if (lane == 0) {
        sm_m[(size_t) ihp*n_slots_pad + slot]  = m;
        sm_il[(size_t) ihp*n_slots_pad + slot] = l > 0.0 ? (float) (1.0/l) : 0.0f;
    }
}

// Stage 1, sweep 2: each candidate's score per tile, the sum of its tile's sampled queries' attention on it (in
// sample order, from zero, as on the CPU), for the candidates [cand_begin, cand_end) in one split. Every candidate
// precedes the chunk, so no sampled query needs a mask. Grid as h2o_cov_sample_stats.
template <int DT>
static __global__ void h2o_cov_sample_scores(const char * q, const char * k, const float * sm_m, const float * sm_il, float * cand,
        size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2, int D, int n_gqa, int h0, int p0,
        int t_first, int i_begin, int i_end, int n_samp, int n_slots, int n_t, int cand_begin, int cand_end, float scale,
        float softcap, const int32_t * chan) {
    extern __shared__ __align__(16) char h2o_cov_smem[];
    __shared__ int rows[H2O_COV_TILE];
    __shared__ int kpos[H2O_COV_KEYS];

    const int split = blockIdx.x;
    const int grp   = blockIdx.y;
    const int ihp   = blockIdx.z;
    const int ih    = h0 + ihp;
    const int tx    = threadIdx.x%16;
    const int ty    = threadIdx.x/16;
    const int k0    = max(split*H2O_COV_SPLIT, cand_begin);
    const int k1    = min(split*H2O_COV_SPLIT + H2O_COV_SPLIT, cand_end);
    if (k0 >= k1) {
        return;
    }

    const h2o_cov_block<DT> blk = {h2o_cov_smem, D, softcap, chan != nullptr ? chan + (size_t) (ih/n_gqa)*D : nullptr};
    float * xs = blk.probs(); // [64][65]: the block's probabilities

    if (threadIdx.x < H2O_COV_TILE) {
        const int s = grp*H2O_COV_TILE + threadIdx.x;
        rows[threadIdx.x] = s < n_slots ? h2o_cov_sample_row(s, n_samp, t_first, i_begin, i_end) : -1;
    }
    __syncthreads();
    blk.load_queries(rows, q, nbq1, nbq2, ih, p0, scale);
    const size_t n_slots_pad = (size_t) gridDim.y*H2O_COV_TILE;
    int   row[4];
    float mr[4];
    float il[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        row[i] = rows[ty + 16*i];
        mr[i]  = sm_m [(size_t) ihp*n_slots_pad + grp*H2O_COV_TILE + ty + 16*i];
        il[i]  = sm_il[(size_t) ihp*n_slots_pad + grp*H2O_COV_TILE + ty + 16*i];
    }

    const char * k_h    = k + (size_t) (ih/n_gqa)*nbk1;
    const int    n_cand = cand_end - cand_begin;
    const int    n_tg   = H2O_COV_TILE/n_samp; // tiles per group of slots
    for (int kb = k0; kb < k1; kb += H2O_COV_KEYS) {
        __syncthreads(); // the queries are in; the previous block's keys and probabilities are done with
        if (threadIdx.x < H2O_COV_KEYS) {
            kpos[threadIdx.x] = kb + (int) threadIdx.x < k1 ? kb + (int) threadIdx.x : -1;
        }
        __syncthreads();
        blk.load_keys(kpos, k_h, nbk2);
        __syncthreads();
        float x[4][4];
        blk.logits(x);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bool ok = row[i] >= 0 && kb + tx + 16*j < k1;
                xs[(ty + 16*i)*(H2O_COV_KEYS + 1) + tx + 16*j] = ok ? expf(x[i][j] - mr[i])*il[i] : 0.0f;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < n_tg*H2O_COV_KEYS; e += blockDim.x) {
            const int tl  = e/H2O_COV_KEYS;
            const int kk  = e%H2O_COV_KEYS;
            const int ti  = grp*n_tg + tl;
            const int pos = kb + kk;
            if (ti >= n_t || pos >= k1) {
                continue;
            }
            float sum = 0.0f;
            for (int s = 0; s < n_samp; ++s) {
                const int r = tl*n_samp + s;
                if (rows[r] >= 0) {
                    sum += xs[r*(H2O_COV_KEYS + 1) + kk];
                }
            }
            cand[((size_t) ihp*n_t + ti)*n_cand + (pos - cand_begin)] = sum;
        }
    }
}

// Stage 1: the proposal of one unit, the n_rank candidates with the highest scores (ties to the lower position, NaN
// as -inf), ascending. Grid (tile, head of this pass), H2O_COV_SELECT_THREADS threads.
static __global__ void h2o_cov_propose(const float * cand, int32_t * prop, int h0, int n_t, int n_cand, int n_rank,
        int cand_begin, int R) {
    __shared__ int hist[256];
    __shared__ int sel[2];
    __shared__ int warp_sums[H2O_WARP_SIZE];

    const int ti  = blockIdx.x;
    const int ihp = blockIdx.y;
    const float * sc  = cand + ((size_t) ihp*n_t + ti)*n_cand;
    int32_t     * out = prop + ((size_t) (h0 + ihp)*n_t + ti)*R;

    const auto key_of = [&](int i) { return h2o_f32_key(sc[i]); };
    int n_equal;
    const uint32_t threshold = h2o_block_radix_select<uint32_t>(n_cand, n_rank, key_of, hist, sel, n_equal);
    h2o_block_compact_best<uint32_t>(n_cand, threshold, n_equal, key_of, [&](int slot, int i) { out[slot] = cand_begin + i; },
            warp_sums);
}

// the row maxima and sums of a tile's rows over the keys of a list (kpos_of(m), m < n; for the chunk keys, m is the
// offset from cs and a key after the row is masked), 64 at a time: the two softmax parts of h2o_cov_rank
template <int DT, typename pos_fn>
static __device__ void h2o_cov_row_stats(float (&m)[4], double (&l)[4], const int (&row)[4], int n, bool causal, int cs,
        pos_fn kpos_of, const h2o_cov_block<DT> & blk, int * kpos, const char * k_h, size_t nbk2) {
    const int tx = threadIdx.x%16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0;
    }
    for (int kb = 0; kb < n; kb += H2O_COV_KEYS) {
        __syncthreads();
        if (threadIdx.x < H2O_COV_KEYS) {
            kpos[threadIdx.x] = kb + (int) threadIdx.x < n ? kpos_of(kb + (int) threadIdx.x) : -1;
        }
        __syncthreads();
        blk.load_keys(kpos, k_h, nbk2);
        __syncthreads();
        float x[4][4];
        blk.logits(x);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int  key = kb + tx + 16*j;
                const bool ok  = row[i] >= 0 && key < n && (!causal || cs + key <= row[i]);
                x[i][j] = ok ? x[i][j] : -INFINITY;
            }
        }
        h2o_cov_online(x, m, l);
    }
}

// The end of h2o_cov_rank: the proposal ranked by its column sums cf (score descending, ties to the lower position: the
// proposal is ascending, so to the lower index) in keys (shared memory, pow2(n_rank) + n_steps/2 elements: the score's key
// inverted, then the index), the ranked positions b_pos(n_f + index), and the unit's estimate after g = 0 .. n_steps
// steps, cu[g] = (Σ base + the F64 column sums cd of the first g steps)/rows
template <typename pos_fn>
static __device__ void h2o_cov_rank_estimate(uint64_t * keys, const float * cf, const double * cd, int n_rank, int n_f,
        pos_fn b_pos, int32_t * ranked, const double * row_base, double n_rows, double * cu) {
    const int n_pow2 = h2o_cov_pow2(n_rank);
    for (int i = threadIdx.x; i < n_pow2; i += blockDim.x) {
        keys[i] = i < n_rank ? ((uint64_t) ~h2o_f32_key(cf[i]) << 32) | (uint64_t) i : ~(uint64_t) 0;
    }
    h2o_block_sort(keys, n_pow2);
    for (int i = threadIdx.x; i < n_rank; i += blockDim.x) {
        ranked[i] = b_pos(n_f + (int) (keys[i] & 0xffffffff));
    }

    // each step's column sums by a warp, then the steps in order
    double *  steps   = (double *) (keys + n_pow2);
    const int n_steps = (n_rank + H2O_COV_STEP - 1)/H2O_COV_STEP;
    const int lane    = threadIdx.x%H2O_WARP_SIZE;
    for (int g = threadIdx.x/H2O_WARP_SIZE; g < n_steps; g += blockDim.x/H2O_WARP_SIZE) {
        const int i = g*H2O_COV_STEP + lane; // H2O_COV_STEP == H2O_WARP_SIZE
        const double sum = h2o_warp_sum_f64(i < n_rank ? cd[keys[i] & 0xffffffff] : 0.0);
        if (lane == 0) {
            steps[g] = sum;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (int r = 0; r < H2O_COV_TILE; ++r) {
            sum += row_base[r];
        }
        cu[0] = sum/n_rows;
        for (int g = 0; g < n_steps; ++g) {
            sum += steps[g];
            cu[g + 1] = sum/n_rows;
        }
    }
}

// Stage 2 of one unit (grid: tile, head): every row of the tile (this call's rows of it, the dense tail's included)
// attends to its chunk up to itself (part a) and to the forced positions and the proposal (part b, n_f + n_rank keys),
// one softmax over both. base[r] = the row's attention on its chunk and the forced positions; the candidates' column
// sums over the rows (F32 in row order, which ranks them as the CPU does, and F64 for the estimate). Then the ranking
// (score descending, ties to the lower position: the proposal is ascending, so to the lower index), the ranked
// positions, and the estimate after g = 0 .. n_steps budget steps: (Σ base + Σ of the first g steps' column sums)/rows.
template <int DT>
static __global__ void h2o_cov_rank(const char * q, const char * k, const int32_t * prop, int32_t * ranked,
        float * col_f, double * col_d, double * curves, size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2,
        int D, int n_gqa, int p0, int cs, int t_first, int i_begin, int i_end, int sink_end, int local_start,
        int n_rank, bool propose_all, int R, int stride, float scale, float softcap) {
    extern __shared__ __align__(16) char h2o_cov_smem[];
    __shared__ int    rows[H2O_COV_TILE];
    __shared__ int    kpos[H2O_COV_KEYS];
    __shared__ float  row_m[2][H2O_COV_TILE];
    __shared__ double row_l[2][H2O_COV_TILE];
    __shared__ float  row_w[H2O_COV_TILE];    // part b's probabilities in the softmax over both parts: exp(x - m_b)*w
    __shared__ double row_base[H2O_COV_TILE];

    const int ti   = blockIdx.x;
    const int ih   = blockIdx.y;
    const int n_t  = gridDim.x;
    const int unit = ih*n_t + ti;
    const int tx   = threadIdx.x%16;
    const int ty   = threadIdx.x/16;
    const int t0   = t_first + ti*H2O_COV_TILE;
    const int r0   = max(t0, i_begin);
    const int r1   = min(t0 + H2O_COV_TILE, i_end);
    const int n_f  = sink_end + (cs - local_start);
    const int n_b  = n_f + n_rank;

    const int32_t * pr = prop + (size_t) unit*R;
    const auto b_pos = [&](int m) -> int {
        return m < sink_end ? m : m < n_f ? local_start + (m - sink_end) : propose_all ? sink_end + (m - n_f) : pr[m - n_f];
    };

    const h2o_cov_block<DT> blk = {h2o_cov_smem, D, softcap};
    float * xs = blk.probs();

    if (threadIdx.x < H2O_COV_TILE) {
        const int i = t0 + (int) threadIdx.x;
        rows[threadIdx.x] = i >= r0 && i < r1 ? i : -1;
    }
    __syncthreads();
    blk.load_queries(rows, q, nbq1, nbq2, ih, p0, scale);
    int row[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        row[i] = rows[ty + 16*i];
    }
    const char * k_h = k + (size_t) (ih/n_gqa)*nbk1;

    // sweep 1: each part's maximum and sum per row
    for (int part = 0; part < 2; ++part) {
        float  m[4];
        double l[4];
        if (part == 0) {
            h2o_cov_row_stats(m, l, row, r1 - cs, true, cs, [&](int j) { return cs + j; }, blk, kpos, k_h, nbk2);
        } else {
            h2o_cov_row_stats(m, l, row, n_b, false, cs, b_pos, blk, kpos, k_h, nbk2);
        }
        if (tx == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                row_m[part][ty + 16*i] = m[i];
                row_l[part][ty + 16*i] = l[i];
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < H2O_COV_TILE) {
        // both parts as one softmax (the CPU's arithmetic: F32 sums, exp rescaled to the common maximum)
        const int   r  = threadIdx.x;
        const float la = (float) row_l[0][r];
        const float lb = (float) row_l[1][r];
        const float ma = row_m[0][r];
        const float mb = row_m[1][r];
        const float mx = fmaxf(ma, mb);
        const float ea = expf(ma - mx);
        const float eb = mb == -INFINITY ? 0.0f : expf(mb - mx);
        const float ls = la*ea + lb*eb;
        const bool  ok = rows[r] >= 0;
        row_w[r]    = ok ? eb/ls : 0.0f;
        row_base[r] = ok ? (double) (la*ea/ls) : 0.0;
    }

    // sweep 2: part b's probabilities; the forced ones add to base, the candidates' go to their column sums
    for (int kb = 0; kb < n_b; kb += H2O_COV_KEYS) {
        __syncthreads();
        if (threadIdx.x < H2O_COV_KEYS) {
            kpos[threadIdx.x] = kb + (int) threadIdx.x < n_b ? b_pos(kb + (int) threadIdx.x) : -1;
        }
        __syncthreads();
        blk.load_keys(kpos, k_h, nbk2);
        __syncthreads();
        float x[4][4];
        blk.logits(x);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = ty + 16*i;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bool ok = row[i] >= 0 && kb + tx + 16*j < n_b;
                xs[r*(H2O_COV_KEYS + 1) + tx + 16*j] = ok ? expf(x[i][j] - row_m[1][r])*row_w[r] : 0.0f;
            }
        }
        __syncthreads();
        if (threadIdx.x < H2O_COV_TILE) {
            const int r = threadIdx.x;
            if (rows[r] >= 0) {
                double base = row_base[r];
                for (int kk = 0; kk < H2O_COV_KEYS && kb + kk < n_f; ++kk) {
                    base += (double) xs[r*(H2O_COV_KEYS + 1) + kk];
                }
                row_base[r] = base;
            }
        } else if (threadIdx.x < H2O_COV_TILE + H2O_COV_KEYS) {
            const int kk = threadIdx.x - H2O_COV_TILE;
            const int mm = kb + kk;
            if (mm >= n_f && mm < n_b) {
                float  sf = 0.0f;
                double sd = 0.0;
                for (int r = 0; r < H2O_COV_TILE; ++r) {
                    if (rows[r] >= 0) {
                        const float p = xs[r*(H2O_COV_KEYS + 1) + kk];
                        sf += p;
                        sd += (double) p;
                    }
                }
                col_f[(size_t) unit*R + (mm - n_f)] = sf;
                col_d[(size_t) unit*R + (mm - n_f)] = sd;
            }
        }
    }
    __syncthreads();

    h2o_cov_rank_estimate((uint64_t *) h2o_cov_smem, col_f + (size_t) unit*R, col_d + (size_t) unit*R, n_rank, n_f, b_pos,
            ranked + (size_t) unit*R, row_base, (double) (r1 - r0), curves + (size_t) unit*stride);
}

// The budget of the chunk: `total` steps over the units, one at a time to the unit whose next step gains most (ties to
// the lower unit), among units below `coverage` with steps left; the CPU does it with a priority queue. A unit u may take
// steps g < G_u (G_u: its first step whose estimate is not below the target, at most n_steps). The greedy compares
// only the units' next gains, so a step is taken by its key: the smallest gain up to it in its unit (a larger gain
// behind a smaller one waits for it). The queue takes the steps in the order (key descending, unit, step), which makes
// the result: every step whose key is above the total-th largest key, and of the steps with that key the first ones
// in (unit, step) order. One block: a radix select over all steps' keys and a scan over the units.
static __global__ void h2o_cov_allocate(const double * curves, uint64_t * keys, int32_t * given, int n_units, int n_steps,
        int stride, int total, float coverage) {
    __shared__ int hist[256];
    __shared__ int sel[2];
    __shared__ int warp_sums[H2O_WARP_SIZE];

    // each unit's keys (0: no such step) and G_u, held in given[] until the end
    int n_all = 0;
    for (int u = threadIdx.x; u < n_units; u += blockDim.x) {
        const double * cu = curves + (size_t) u*stride;
        uint64_t     * ku = keys + (size_t) u*n_steps;
        double key = INFINITY;
        int    g   = 0;
        for (; g < n_steps && cu[g] < (double) coverage; ++g) {
            const double gain = cu[g + 1] - cu[g];
            key = fmin(key, isnan(gain) ? -INFINITY : gain);
            ku[g] = h2o_f64_key(key);
        }
        given[u] = g;
        n_all += g;
        for (; g < n_steps; ++g) {
            ku[g] = 0;
        }
    }
    int total_steps;
    h2o_block_scan(n_all, warp_sums, total_steps);
    if (total_steps <= total) {
        return; // every unit takes every step it may
    }
    __syncthreads(); // given[] as G_u is read by other threads below
    if (total <= 0) {
        for (int u = threadIdx.x; u < n_units; u += blockDim.x) {
            given[u] = 0;
        }
        return;
    }

    const int n = n_units*n_steps;
    int n_equal;
    const uint64_t threshold = h2o_block_radix_select<uint64_t>(n, total, [&](int i) { return keys[i]; }, hist, sel, n_equal);

    // per unit: the steps above the threshold, and those equal to it in unit order; each thread a contiguous run of units
    const int per = (n_units + blockDim.x - 1)/blockDim.x;
    const int u0  = min((int) threadIdx.x*per, n_units);
    const int u1  = min(u0 + per, n_units);
    int n_eq = 0;
    for (int u = u0; u < u1; ++u) {
        for (int g = 0; g < n_steps; ++g) {
            n_eq += keys[(size_t) u*n_steps + g] == threshold;
        }
    }
    int n_eq_total;
    int before = h2o_block_scan(n_eq, warp_sums, n_eq_total);
    for (int u = u0; u < u1; ++u) {
        int above = 0;
        int equal = 0;
        for (int g = 0; g < n_steps; ++g) {
            const uint64_t key = keys[(size_t) u*n_steps + g];
            above += key > threshold;
            equal += key == threshold;
        }
        given[u] = above + min(equal, max(n_equal - before, 0));
        before += equal;
    }
}

// Each unit's memory (grid: tile, head), ascending: the sinks, its first min(given*STEP, n_rank) ranked positions, the
// local window, then -1 up to Mt, and the count of its slots; the last tile's unit also writes the memory set kept, at
// the average budget (its first min(heavy, n_rank) ranked positions), into mem.
static __global__ void h2o_cov_build_memory(const int32_t * ranked, const int32_t * given, int32_t * mem_t, int32_t * mem_n,
        int32_t * mem, size_t nb_mem1, int M, int Mt, int R, int cs, int sink_end, int local_start, int n_rank, int heavy) {
    extern __shared__ __align__(16) char h2o_cov_smem[];
    uint32_t * sorted = (uint32_t *) h2o_cov_smem; // [pow2(n_rank)]

    const int ti     = blockIdx.x;
    const int ih     = blockIdx.y;
    const int n_t    = gridDim.x;
    const int n_head = gridDim.y;
    const int unit   = ih*n_t + ti;
    const int32_t * rk = ranked + (size_t) unit*R;

    // the first n ranked positions, ascending, into slots [sink_end, sink_end + n) of out; the rest around them
    const auto write = [&](int32_t * out, int n, int n_out) {
        const int n_pow2 = h2o_cov_pow2(n);
        __syncthreads(); // sorted[] is free
        for (int i = threadIdx.x; i < n_pow2; i += blockDim.x) {
            sorted[i] = i < n ? (uint32_t) rk[i] : 0xffffffff;
        }
        h2o_block_sort(sorted, n_pow2);
        const int n_local = cs - local_start;
        for (int m = threadIdx.x; m < n_out; m += blockDim.x) {
            int32_t pos = -1;
            if (m < sink_end) {
                pos = m;
            } else if (m < sink_end + n) {
                pos = (int32_t) sorted[m - sink_end];
            } else if (m < sink_end + n + n_local) {
                pos = local_start + (m - sink_end - n);
            }
            out[m] = pos;
        }
    };

    const int n_take = n_rank > 0 ? min(given[unit]*H2O_COV_STEP, n_rank) : 0;
    write(mem_t + ((size_t) ti*n_head + ih)*Mt, n_take, Mt);
    if (threadIdx.x == 0) {
        mem_n[ti*n_head + ih] = sink_end + n_take + (cs - local_start);
    }
    if (ti == n_t - 1) {
        write((int32_t *) ((char *) mem + ih*nb_mem1), min(heavy, n_rank), M);
    }
}

// The memory column sums of the chunk's tiles (n_parts blocks of the attention, parts_per_tile per tile) into the scores,
// per head (grid: head): added per position in tile order (tiles share positions), then settled once, each position
// at its first slot; acc's memory sums, unused by this selection, are zeroed as the CPU does. The sums per position
// wait in far[ih][pos] (zero before and after).
static __global__ void h2o_cov_settle_memory(const float * __restrict__ col_partial, int n_parts, int parts_per_tile, int part_keys,
        const int32_t * mem_t, const int32_t * mem_n, int Mt, float * far, int kv_size, uint16_t * scores, size_t nb_scores1,
        float * acc, size_t nb_acc1, int S, int M) {
    const int ih     = blockIdx.x;
    const int n_head = gridDim.x;
    const int n_t    = (n_parts + parts_per_tile - 1)/parts_per_tile;
    float    * far_h = far + (size_t) ih*kv_size;
    uint16_t * sc    = (uint16_t *) ((char *) scores + ih*nb_scores1);

    for (int ti = 0; ti < n_t; ++ti) {
        const int32_t * mt = mem_t + ((size_t) ti*n_head + ih)*Mt;
        const int       n  = mem_n[ti*n_head + ih];
        for (int b = ti*parts_per_tile; b < min((ti + 1)*parts_per_tile, n_parts); ++b) {
            const float * part = col_partial + ((size_t) b*n_head + ih)*part_keys + S;
            for (int m = threadIdx.x; m < n; m += blockDim.x) {
                far_h[mt[m]] += part[m]; // a tile's positions are distinct
            }
        }
        __syncthreads();
    }
    for (int ti = 0; ti < n_t; ++ti) {
        const int32_t * mt = mem_t + ((size_t) ti*n_head + ih)*Mt;
        const int       n  = mem_n[ti*n_head + ih];
        for (int m = threadIdx.x; m < n; m += blockDim.x) {
            const int32_t pos = mt[m];
            const float   sum = far_h[pos];
            if (sum != 0.0f) {
                sc[pos]    = h2o_f32_to_bf16(h2o_bf16_to_f32(sc[pos]) + sum);
                far_h[pos] = 0.0f;
            }
        }
        __syncthreads();
    }
    float * acc_h = (float *) ((char *) acc + ih*nb_acc1);
    for (int m = threadIdx.x; m < M; m += blockDim.x) {
        acc_h[S + m] = 0.0f;
    }
}

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
    int select     = 0;         // ggml_h2o_select: 0 the seed rule, 1 query-aware (key bounds), 2 (mean keys), 3 hybrid,
                                // 4 (H2O_COV_SELECT) coverage
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
    size_t partial_floats; // scratch for the blocks' column sums (and the block scores of query-aware selection, the
                           // buffers of coverage selection: h2o_cov_layout)
    int    n_blocks_max;   // query-aware selection: blocks of H2O_SELECT_BLOCK positions in the cache
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
            return "query-aware selection and the dense tail serve head sizes up to 256";
        }
        if (a.H/H2O_SELECT_BLOCK + 2 > H2O_SELECT_MAX_PICK) {
            return "query-aware selection serves heavy budgets up to 8160 positions";
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
    // M_c after chunk c; query-aware and coverage memories are chosen when the next chunk's queries are there instead
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
                    a.D, a.n_head/a.n_head_kv, a.L, a.H, a.n_sink, a.p0, cs, i_begin, i_end, a.scale, a.select == 2,
                    a.select == 3, plan.n_blocks_max);
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
