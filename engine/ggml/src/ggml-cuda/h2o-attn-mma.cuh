#pragma once

#include "h2o-cuda-common.cuh"

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

// The n_slots slots of the memory set of head ih (tile b's with coverage selection) into mem_s, -1 where a slot
// cannot be read (before the chunk at cs). Returns whether every slot is readable and they fill whole key tiles:
// then no memory tile needs a mask.
static __device__ __forceinline__ bool h2o_mma_load_memory(int32_t * mem_s, const int32_t * mem, size_t nbm1,
        size_t nbm_tile, int ih, int b, int n_slots, int cs, bool has_memory, int tid) {
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
    return __syncthreads_and(memory_full) && n_slots % H2O_MMA_KEYS == 0;
}

// The block's query rows from tile_begin of head ih, scaled by scale·log2(e) (the softmax runs in base 2), as the sum
// of two F16 parts: Q·K^T as two products is then as exact as the CPU's F32 one, which keeps near-tied scores in the
// CPU's order far more often than F16 operands alone would (llama.cpp's flash attention rounds Q to F16). Rows
// outside [r_begin, q_end) are zero.
template <int D>
static __device__ __forceinline__ void h2o_mma_load_q(half * Qh, half * Ql, const char * q, size_t nbq1, size_t nbq2,
        int ih, int p0, int tile_begin, int r_begin, int q_end, float scale_log2, int tid) {
    constexpr int SD = h2o_mma_stride(D);
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
}

// Where a block's key tiles come from: n_intra tiles of the chunk at cs up to the block's last row i_last, then
// n_slots memory slots (mem_s), n_tiles in all, read once per sweep. Each thread copies the same 16-byte column
// (ld_ch) of every RPI-th row from ld_r0.
template <int D>
struct h2o_mma_tiles {
    static constexpr int KT  = H2O_MMA_KEYS;
    static constexpr int SD  = h2o_mma_stride(D);
    static constexpr int CPR = D/8;                             // 16-byte chunks per row
    static constexpr int RPI = H2O_MMA_WARPS*H2O_WARP_SIZE/CPR; // rows per pass of the block

    int             ld_ch;
    int             ld_r0;
    const char    * k_base; // this thread's column of the KV head's K and V
    const char    * v_base;
    size_t          nbk2;
    size_t          nbv2;
    const int32_t * mem_s;
    int32_t       * kpos;   // [2][KT]: position of each key row, -1 = masked
    half          * Ks;     // [2][KT][SD]
    half          * Vs;     // [2][KT][SD]
    int             cs;
    int             i_last;
    int             n_intra;
    int             n_slots;
    int             n_tiles;

    __device__ h2o_mma_tiles(const char * k, const char * v, int ikv, size_t nbk1, size_t nbk2, size_t nbv1,
            size_t nbv2, const int32_t * mem_s, int32_t * kpos, half * Ks, half * Vs, int cs, int i_last, int n_intra,
            int n_slots, int n_tiles, int tid) :
        ld_ch(tid%CPR), ld_r0(tid/CPR), k_base(k + (size_t) ikv*nbk1 + 16*ld_ch),
        v_base(v + (size_t) ikv*nbv1 + 16*ld_ch), nbk2(nbk2), nbv2(nbv2), mem_s(mem_s), kpos(kpos), Ks(Ks), Vs(Vs),
        cs(cs), i_last(i_last), n_intra(n_intra), n_slots(n_slots), n_tiles(n_tiles) {}

    // tile u of the two sweeps (u < n_tiles: sweep 1, K only; else sweep 2, K and V) into stage st
    __device__ __forceinline__ void load(int u, int st) const {
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
    }
};

// s = Q·K^T of the warp's 16 rows and the 64 keys of ks; k-steps outside, so that consecutive products go to the 8
// independent accumulators and overlap
template <int D>
static __device__ __forceinline__ void h2o_mma_logits(float (&s)[8][4], const half * Qh, const half * Ql,
        const half * ks, int warp, int lane) {
    constexpr int SD = h2o_mma_stride(D);
    constexpr int NK = D/16; // k-steps of Q·K^T
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
}

// the soft-cap of a tile's logits in base 2: c·log2(e)·tanh(x/(c·log2(e))) of the base-2 logit x
static __device__ __forceinline__ void h2o_mma_softcap(float (&s)[8][4], float softcap_log2) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nt][e] = h2o_softcap(s[nt][e], softcap_log2);
        }
    }
}

// masked keys of tile t's logits (stage st) to -inf: those of kpos < 0 (empty memory slots, keys past the chunk's
// rows) and, in the chunk's own tiles (t < n_intra), those past the causal diagonal of the thread's rows row0, row1
static __device__ __forceinline__ void h2o_mma_mask(float (&s)[8][4], const int32_t * kpos, int st, int t, int n_intra,
        int row0, int row1, int c4) {
    const bool memory_tile = t >= n_intra;
    if (memory_tile) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int32_t pos = kpos[st*H2O_MMA_KEYS + 8*nt + 2*c4 + (e & 1)];
                s[nt][e] = pos >= 0 ? s[nt][e] : -INFINITY;
            }
        }
    } else {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int32_t pos = kpos[st*H2O_MMA_KEYS + 8*nt + 2*c4 + (e & 1)];
                s[nt][e] = pos < 0 || pos > (e < 2 ? row0 : row1) ? -INFINITY : s[nt][e];
            }
        }
    }
}

// sweep 1: the online maximum m_run and (this thread's share of the) sum l_run of row r's part in progress, over the
// row's 16 values of the tile in s
static __device__ __forceinline__ void h2o_mma_online(const float (&s)[8][4], int r, float & m_run, float & l_run) {
    // trees, not chains: the row's 16 values are independent
    float mx4[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        mx4[j] = fmaxf(fmaxf(s[2*j][2*r], s[2*j][2*r + 1]), fmaxf(s[2*j + 1][2*r], s[2*j + 1][2*r + 1]));
    }
    float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    if (m_new != -INFINITY) {
        float sum4[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            sum4[j] = (exp2f(s[2*j][2*r] - m_new) + exp2f(s[2*j][2*r + 1] - m_new)) +
                      (exp2f(s[2*j + 1][2*r] - m_new) + exp2f(s[2*j + 1][2*r + 1] - m_new));
        }
        const float prev = m_run == -INFINITY ? 0.0f : l_run*exp2f(m_run - m_new);
        l_run = prev + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
        m_run = m_new;
    }
}

// after sweep 1, for one row: the sums of both parts (intra: ma, la; memory: mb, lb) over the quad, then each part's
// maximum, 1/sum and merge weight for sweep 2. A learned sink's logit (sinks[ih], natural units; sinks == nullptr:
// none) joins the denominator of the merged softmax. Masked logits are -inf and 2^-inf = 0, so sweep 2 needs no
// masks: an empty memory part gets a finite maximum, and rows past the batch (!valid) a zero 1/l, so they add
// nothing to the column sums.
static __device__ __forceinline__ void h2o_mma_part_constants(float ma, float la, float mb, float lb, bool valid,
        const float * sinks, int ih, float (&m_part)[2], float (&inv_l)[2], float (&w_part)[2]) {
    la += __shfl_xor_sync(0xffffffff, la, 1);
    la += __shfl_xor_sync(0xffffffff, la, 2);
    lb += __shfl_xor_sync(0xffffffff, lb, 1);
    lb += __shfl_xor_sync(0xffffffff, lb, 2);
    const float sk = sinks != nullptr ? sinks[ih]*1.4426950408889634f : -INFINITY; // base 2
    const float mx = fmaxf(fmaxf(ma, mb), sk);
    const float ea = la*exp2f(ma - mx);
    const float eb = lb > 0.0f ? lb*exp2f(mb - mx) : 0.0f;
    const float es = sinks != nullptr ? exp2f(sk - mx) : 0.0f;
    m_part[0] = ma;
    m_part[1] = lb > 0.0f ? mb : 0.0f;
    inv_l[0]  = valid ? 1.0f/la : 0.0f;
    inv_l[1]  = valid && lb > 0.0f ? 1.0f/lb : 0.0f;
    w_part[0] = ea/(ea + eb + es);
    w_part[1] = eb/(ea + eb + es);
}

// sweep 2 of one tile, for both rows: the part's probabilities p = 2^(s - mp)/l (il = 1/l) into s, their sums over
// the thread's two rows into cols, and p times the part's merge weight wp and V (the tile in vs) into o
template <int D>
static __device__ __forceinline__ void h2o_mma_probs_values(float (&s)[8][4], float (&o)[D/8][4], float (&cols)[16],
        const float (&mp)[2], const float (&il)[2], const float (&wp)[2], const half * vs, int lane) {
    constexpr int SD = h2o_mma_stride(D);
    constexpr int ND = D/8; // n-tiles of the output
    uint32_t pa[4][4];
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
}

// the output of the thread's two rows (those in the batch, valid0 and valid1), already the softmax over both parts
template <int D>
static __device__ __forceinline__ void h2o_mma_store_rows(float * dst, const float (&o)[D/8][4], size_t nbd1,
        size_t nbd2, int ih, int p0, int row0, int row1, bool valid0, bool valid1, int c4) {
    constexpr int ND = D/8;
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
    const bool memory_full = h2o_mma_load_memory(mem_s, mem, nbm1, nbm_tile, ih, b, n_slots, cs, has_memory, tid);

    // this thread's two query rows (scalars: an array captured by the lambdas below would live in local memory)
    const int  row0   = tile_begin + 16*warp + g;
    const int  row1   = row0 + 8;
    const bool valid0 = row0 >= r_begin && row0 < q_end;
    const bool valid1 = row1 >= r_begin && row1 < q_end;

    // Q in base-2 units, as two F16 parts
    h2o_mma_load_q<D>(Qh, Ql, q, nbq1, nbq2, ih, p0, tile_begin, r_begin, q_end, scale_log2, tid);

    // the key tiles of both sweeps, by cp.async into two stages: each thread copies the same 16-byte column
    const h2o_mma_tiles<D> tiles(k, v, ikv, nbk1, nbk2, nbv1, nbv2, mem_s, kpos, Ks, Vs, cs, i_last, n_intra, n_slots,
            n_tiles, tid);

    // s = the logits of tile t in stage st (base 2, soft-capped), masked keys -inf
    float s[8][4];
    const auto logits = [&](int t, int st) {
        h2o_mma_logits<D>(s, Qh, Ql, Ks + st*KT*SD, warp, lane);
        if (softcap_log2 > 0.0f) {
            h2o_mma_softcap(s, softcap_log2);
        }
        // masks only where a tile needs them (warp-uniform): the causal diagonal and keys past the block's rows,
        // empty memory slots, a last partial memory tile
        const bool need_mask = t < n_intra ? cs + (t + 1)*KT - 1 > tile_begin + 16*warp : !memory_full;
        if (need_mask) {
            h2o_mma_mask(s, kpos, st, t, n_intra, row0, row1, c4);
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

    tiles.load(0, 0);
    for (int u = 0; u < 2*n_tiles; ++u) {
        const int st = u & 1;
        // tile u has landed, and every warp is done with tile u - 1, whose stage the next copy overwrites
        h2o_cp_async_wait<0>();
        __syncthreads();
        if (u + 1 < 2*n_tiles) {
            tiles.load(u + 1, st ^ 1);
        }
        flush_column_sums(st ^ 1);

        const int t = u < n_tiles ? u : u - n_tiles;
        logits(t, st);

        if (u < n_tiles) {
            // sweep 1: online maximum and sum of the current part
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                h2o_mma_online(s, r, m_run[r], l_run[r]);
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
                    h2o_mma_part_constants(m_intra[r], l_intra[r], m_run[r], l_run[r], r == 0 ? valid0 : valid1, sinks,
                            ih, m_part[r], inv_l[r], w_part[r]);
                }
            }
        } else {
            // sweep 2: each part's probabilities, their column sums, and P·V
            // this part's constants of both rows (selects, not a run-time index, keep them in registers)
            const bool  memory_part = t >= n_intra;
            const float mp[2] = {memory_part ? m_part[0][1] : m_part[0][0], memory_part ? m_part[1][1] : m_part[1][0]};
            const float il[2] = {memory_part ? inv_l[0][1]  : inv_l[0][0],  memory_part ? inv_l[1][1]  : inv_l[1][0]};
            const float wp[2] = {memory_part ? w_part[0][1] : w_part[0][0], memory_part ? w_part[1][1] : w_part[1][0]};
            float cols[16];
            h2o_mma_probs_values<D>(s, o, cols, mp, il, wp, Vs + st*KT*SD, lane);

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

    h2o_mma_store_rows<D>(dst, o, nbd1, nbd2, ih, p0, row0, row1, valid0, valid1, c4);
}
