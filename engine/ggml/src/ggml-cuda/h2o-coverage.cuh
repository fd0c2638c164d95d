#pragma once

#include "h2o-attn-mma.cuh"
#include "h2o-attn-scores.cuh"
#include "h2o-select-query.cuh"

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
// sel[0], the count above that bin to sel[1] (h2o_radix_bin with the count above carried, for any number of passes).
static __device__ __forceinline__ void h2o_radix_pick(const int * hist, int above, int n_best, int * sel) {
    int bin;
    int acc;
    if (h2o_radix_find(hist, above, n_best, bin, acc)) {
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

    // the next block of keys: positions pos_of(kb + kk) where kb + kk < n (-1 after) into kpos and their rows into
    // shared memory once every thread is done with the previous block, then this thread's logits against them
    template <typename pos_fn>
    __device__ __forceinline__ void next_logits(float (&x)[4][4], int * kpos, int kb, int n, pos_fn pos_of,
            const char * k_h, size_t nbk2) const {
        __syncthreads();
        if (threadIdx.x < H2O_COV_KEYS) {
            kpos[threadIdx.x] = kb + (int) threadIdx.x < n ? pos_of(kb + (int) threadIdx.x) : -1;
        }
        __syncthreads();
        load_keys(kpos, k_h, nbk2);
        __syncthreads();
        logits(x);
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
        float x[4][4];
        blk.next_logits(x, kpos, kb, k1, [](int pos) { return pos; }, k_h, nbk2);
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
        // (its first barrier also waits until every thread is done with the previous block's probabilities)
        float x[4][4];
        blk.next_logits(x, kpos, kb, k1, [](int pos) { return pos; }, k_h, nbk2);
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
        float x[4][4];
        blk.next_logits(x, kpos, kb, n, kpos_of, k_h, nbk2);
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
        float x[4][4];
        blk.next_logits(x, kpos, kb, n_b, b_pos, k_h, nbk2);
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
