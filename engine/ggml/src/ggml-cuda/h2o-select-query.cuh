#pragma once

#include "h2o-attn-scores.cuh"

// ---------------------------------------------------------------------------------------------------------------
// h2o_select_query: the memory of chunk cs.. for one head per block under GGML_H2O_SELECT_HYBRID, chosen by the
// chunk's queries in this call (the rule of h2o_select_by_query in ggml-cpu/h2o-attn.cpp): Local [cs - L, cs), Sink
// [0, n_sink), the best blocks of H2O_SELECT_BLOCK positions of [n_sink, cs - L) for half of the budget and the best
// accumulated scores for the rest. A block is summarised per channel by the minimum and maximum of its keys; the
// sampled queries (the last H2O_SAMPLE_LAST rows, then up to H2O_SAMPLE_STRIDE spread over the rest) each give every
// block a bound logit, and a block's score is the sum over the queries of its share in the softmax over blocks.
// Each warp takes blocks in turn; the softmax runs in two sweeps (row maxima and sums, then shares), so nothing per
// (query, block) is stored. Block scores go to global scratch.
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

// the bound logits of every sampled query against block b, lane 0 of the warp holding them in x[]
static __device__ __forceinline__ void h2o_block_logits(float * x, const float * q_s, int n_q, const char * k,
        size_t nbk2, int D, int p_begin, int p_end) {
    const int lane = threadIdx.x%H2O_WARP_SIZE;
    float lo[H2O_SELECT_MAX_D/H2O_WARP_SIZE];
    float hi[H2O_SELECT_MAX_D/H2O_WARP_SIZE];
#pragma unroll
    for (int t = 0; t < H2O_SELECT_MAX_D/H2O_WARP_SIZE; ++t) {
        lo[t] =  INFINITY;
        hi[t] = -INFINITY;
    }
    for (int pos = p_begin; pos < p_end; ++pos) {
        const half * kr = (const half *) (k + pos*nbk2);
#pragma unroll
        for (int t = 0; t < H2O_SELECT_MAX_D/H2O_WARP_SIZE; ++t) {
            const int d = lane + t*H2O_WARP_SIZE;
            if (d < D) {
                const float v = __half2float(kr[d]);
                lo[t] = fminf(lo[t], v);
                hi[t] = fmaxf(hi[t], v);
            }
        }
    }
    for (int i = 0; i < n_q; ++i) {
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < H2O_SELECT_MAX_D/H2O_WARP_SIZE; ++t) {
            const int d = lane + t*H2O_WARP_SIZE;
            if (d < D) {
                const float qd = q_s[i*D + d];
                sum += fmaxf(qd*lo[t], qd*hi[t]);
            }
        }
        // every lane holds the sum; lane 0, which reads x[], writes it
        const float xi = h2o_warp_sum(sum);
        if (lane == 0) {
            x[i] = xi;
        }
    }
}

// a block's positions [pb, pe): block b0 + b of H2O_SELECT_BLOCK positions, clipped to the candidates
static __device__ __forceinline__ void h2o_select_block_range(int b, int b0, int cand_begin, int cand_end, int & pb,
        int & pe) {
    pb = max((b0 + b)*H2O_SELECT_BLOCK, cand_begin);
    pe = min((b0 + b + 1)*H2O_SELECT_BLOCK, cand_end);
}

// The sampled queries of rows i_begin .. i_end of head ih: the last H2O_SAMPLE_LAST rows, then up to
// H2O_SAMPLE_STRIDE spread over the rest; their rows into sample[], their queries, pre-scaled, into q_s [n_q][D].
// Returns n_q.
static __device__ __forceinline__ int h2o_select_sample(int * sample, float * q_s, const char * q, size_t nbq1,
        size_t nbq2, int ih, int D, int p0, int i_begin, int i_end, float scale) {
    const int tid    = threadIdx.x;
    const int last0  = max(i_begin, i_end - H2O_SAMPLE_LAST);
    const int n_rest = last0 - i_begin;
    const int n_more = min(n_rest, H2O_SAMPLE_STRIDE);
    const int n_q    = (i_end - last0) + n_more;
    for (int s = tid; s < n_q; s += blockDim.x) {
        sample[s] = s < i_end - last0 ? last0 + s : i_begin + (int) ((long long) (s - (i_end - last0))*n_rest/n_more);
    }
    __syncthreads();
    for (int e = tid; e < n_q*D; e += blockDim.x) {
        const int s = e/D;
        const int d = e%D;
        q_s[e] = ((const float *) (q + (size_t) (sample[s] - p0)*nbq2 + ih*nbq1))[d]*scale;
    }
    return n_q;
}

// every warp's running maximum and sum of every sampled query, before sweep 1
static __device__ __forceinline__ void h2o_select_reset_rows(float (*row_m)[H2O_SAMPLE_MAX],
        float (*row_l)[H2O_SAMPLE_MAX], int tid) {
    for (int i = tid; i < H2O_SELECT_WARPS*H2O_SAMPLE_MAX; i += blockDim.x) {
        row_m[i/H2O_SAMPLE_MAX][i%H2O_SAMPLE_MAX] = -INFINITY;
        row_l[i/H2O_SAMPLE_MAX][i%H2O_SAMPLE_MAX] = 0.0f;
    }
}

// sweep 1: per sampled query, the maximum and the sum of exp over the bound logits of the nb blocks from b0, per warp
// (online, each warp taking blocks in turn), then over the warps into row_m[0] and row_l[0]
static __device__ __forceinline__ void h2o_select_row_stats(float (*row_m)[H2O_SAMPLE_MAX],
        float (*row_l)[H2O_SAMPLE_MAX], float (*x_w)[H2O_SAMPLE_MAX], const float * q_s, int n_q, const char * k_h,
        size_t nbk2, int D, int b0, int nb, int cand_begin, int cand_end, int tid, int lane, int warp) {
    for (int b = warp; b < nb; b += H2O_SELECT_WARPS) {
        int pb, pe;
        h2o_select_block_range(b, b0, cand_begin, cand_end, pb, pe);
        h2o_block_logits(x_w[warp], q_s, n_q, k_h, nbk2, D, pb, pe);
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
}

// sweep 2: each block's score, its share in the softmax of every sampled query (row_m[0], row_l[0]) summed over the
// queries in sample order; NaN as -inf
static __device__ __forceinline__ void h2o_select_block_scores(float * score, float (*x_w)[H2O_SAMPLE_MAX],
        const float (*row_m)[H2O_SAMPLE_MAX], const float (*row_l)[H2O_SAMPLE_MAX], const float * q_s, int n_q,
        const char * k_h, size_t nbk2, int D, int b0, int nb, int cand_begin, int cand_end, int lane, int warp) {
    for (int b = warp; b < nb; b += H2O_SELECT_WARPS) {
        int pb, pe;
        h2o_select_block_range(b, b0, cand_begin, cand_end, pb, pe);
        h2o_block_logits(x_w[warp], q_s, n_q, k_h, nbk2, D, pb, pe);
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
}

// the n picks in position order (one thread; insertion sort: a few dozen at most)
static __device__ __forceinline__ void h2o_select_sort_picks(int * pick_begin, int * pick_end, const int & n) {
    for (int i = 1; i < n; ++i) {
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

// The hybrid's other half: the candidates outside the picked blocks with the highest accumulated scores sc, ties to
// the lower position, as many as the budget leaves after the blocks, found by a two-pass radix select over their
// 16-bit keys (hist, sel) and compacted in position order into by_score_pos; their count into n_by_score.
static __device__ __forceinline__ void h2o_select_by_score(const uint16_t * sc, int cand_begin, int cand_end,
        int budget, const int * pick_begin, const int * pick_end, const int & n_pick, int * hist, int * sel,
        int * warp_sums, int32_t * by_score_pos, int & n_by_score) {
    const int tid = threadIdx.x;
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

// The memory set into mem_h (one thread: at most M slots): Sink, every candidate if they fit the budget, else the
// picked blocks (sorted) merged with the positions taken by score (ascending, outside the blocks), Local, then -1
static __device__ __forceinline__ void h2o_select_write_memory(int32_t * mem_h, int M, int sink_end, int cand_begin,
        int cand_end, int budget, int local_start, int cs, const int * pick_begin, const int * pick_end,
        const int & n_pick, const int32_t * by_score_pos, const int & n_by_score) {
    int m = 0;
    for (int pos = 0; pos < sink_end; ++pos) {
        mem_h[m++] = pos;
    }
    if (cand_end - cand_begin <= budget) {
        for (int pos = cand_begin; pos < cand_end; ++pos) {
            mem_h[m++] = pos;
        }
    } else {
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

// the blocks fill half of the budget; the other half goes to the positions outside them with the highest
// accumulated scores (ties to the lower position), found by the radix select of h2o_build over the cache.
static __global__ void h2o_select_query(const char * q, const char * k, int32_t * mem, float * block_scores,
        const uint16_t * scores, size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2, size_t nb_mem1, size_t nb_scores1,
        int D, int n_gqa, int L, int H, int n_sink, int p0, int cs, int i_begin, int i_end, float scale,
        int n_blocks_max) {
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
    const int by_score    = budget/2;

    const uint16_t * sc = (const uint16_t *) ((const char *) scores + ih*nb_scores1);
    int32_t * by_score_pos = (int32_t *) (h2o_select_smem + H2O_SAMPLE_MAX*D); // [H]

    if (tid == 0) {
        n_pick     = 0;
        n_by_score = 0;
    }
    if (cand_end - cand_begin > budget) {
        float * q_s = h2o_select_smem;
        const int n_q = h2o_select_sample(sample, q_s, q, nbq1, nbq2, ih, D, p0, i_begin, i_end, scale);
        h2o_select_reset_rows(row_m, row_l, tid);
        __syncthreads();

        const int b0 = cand_begin/H2O_SELECT_BLOCK;
        const int nb = (cand_end + H2O_SELECT_BLOCK - 1)/H2O_SELECT_BLOCK - b0;
        const auto block_range = [&](int b, int & pb, int & pe) {
            pb = max((b0 + b)*H2O_SELECT_BLOCK, cand_begin);
            pe = min((b0 + b + 1)*H2O_SELECT_BLOCK, cand_end);
        };
        h2o_select_row_stats(row_m, row_l, x_w, q_s, n_q, k_h, nbk2, D, b0, nb, cand_begin, cand_end, tid, lane, warp);
        h2o_select_block_scores(score, x_w, row_m, row_l, q_s, n_q, k_h, nbk2, D, b0, nb, cand_begin, cand_end, lane,
                warp);

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

        if (tid == 0) {
            h2o_select_sort_picks(pick_begin, pick_end, n_pick);
        }
        __syncthreads();

        if (by_score > 0) {
            h2o_select_by_score(sc, cand_begin, cand_end, budget, pick_begin, pick_end, n_pick, hist, sel, warp_sums,
                    by_score_pos, n_by_score);
        }
    }
    __syncthreads();

    if (tid == 0) {
        h2o_select_write_memory(mem_h, M, sink_end, cand_begin, cand_end, budget, local_start, cs, pick_begin, pick_end,
                n_pick, by_score_pos, n_by_score);
    }
}
