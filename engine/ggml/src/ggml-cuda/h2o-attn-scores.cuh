#pragma once

#include "h2o-cuda-common.cuh"

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

// The search every radix select here shares, for the first warp: hist counts one key byte of the keys still in the
// running, `above` keys rank above all of them, and n_best must not exceed `above` plus those counted. The one lane
// that holds the highest bin at which the count from the top reaches n_best returns true, with that bin in bin and
// the count above it in acc; the other lanes return false.
static __device__ __forceinline__ bool h2o_radix_find(const int * hist, int above, int n_best, int & bin, int & acc) {
    const int lane = threadIdx.x%H2O_WARP_SIZE;
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
    // n_best <= above + the keys counted, so some lane reaches it (the last one at the latest)
    const int first = reached ? __ffs(reached) - 1 : H2O_WARP_SIZE - 1;
    if (lane != first) {
        return false;
    }
    acc = above + incl - own;
    bin = 255 - 8*lane;
    for (int i = 0; i < 7 && acc + hist[bin] < n_best; ++i) {
        acc += hist[bin];
        --bin;
    }
    return true;
}

// one step of the radix select on 16-bit keys, for the first warp: from the histogram of a key byte (pass 0: high,
// pass 1: low, of the keys whose high byte is sel[0]), the highest bin at which the count from the top reaches
// n_best. Pass 0 leaves the bin in sel[0] and the count above it in sel[2]; pass 1 the threshold key in sel[1] and
// in sel[2] how many keys equal to it to take. n_best must not exceed the number of keys.
static __device__ __forceinline__ void h2o_radix_bin(const int * hist, int * sel, int pass, int n_best) {
    int bin;
    int acc;
    if (!h2o_radix_find(hist, pass == 0 ? 0 : sel[2], n_best, bin, acc)) {
        return;
    }
    if (pass == 0) {
        sel[0] = bin;
        sel[2] = acc;
    } else {
        sel[1] = (sel[0] << 8) | bin;
        sel[2] = n_best - acc;
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
// h2o_flush_memory_sums: a chunk that continues in this call under the hybrid gets a new memory;
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
