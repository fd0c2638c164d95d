#include "h2o-decode.cuh"

// GGML_OP_H2O_DECODE on CUDA: the CPU op's six steps (ggml-cpu/ops.cpp, ggml_compute_forward_h2o_decode) as seven
// kernels on the op's stream, with every size the steps find (each query's open cells, the blocks sketched, the
// positions chosen) kept on the GPU, so that nothing returns to the host and the graph can be captured:
//   1. h2o_dec_extent:   each query's open cells, from its mask row
//   2. h2o_dec_sketch:   per stream and KV head, the channels where nothing is sketched yet, then the sketch of
//                        every block completed since the last call
//   3. h2o_dec_estimate: each query head's estimated logit at every candidate position, and each unit's maximum
//   4. h2o_dec_select:   per group (query token, KV head) the gaps, the positions coverage takes (where it is below 1),
//                        the n_take-th least gap by a radix select, and the positions attended to, ascending
//   5. h2o_dec_attend:   an exact partial softmax per part of a group's list (at most H2O_DEC_MAX_PARTS parts, each
//                        walked in chunks of H2O_DEC_CHUNK positions by online softmax)
//   6. h2o_dec_merge:    each query head's parts merged by online softmax, with the learned sink
//   7. h2o_dec_count:    the blocks sketched, for the next call
// The choice is the CPU's bit for bit: the channel energies are summed in the same order (F32 per block of 16
// positions, then double), keys and queries are quantized to 8 bits alike, the estimates are the same integer dot
// products and scalings as the CPU's, and the selection compares the same floats. Only the attention sums in another order.
// tests/cpp/test-h2o-backends.cpp compares the two, the sketches and the channels bit for bit.

#define H2O_DEC_B GGML_H2O_DECODE_BLOCK

// candidates per estimate block, threads of the selection, and the largest shapes these kernels hold in shared memory
static constexpr int H2O_DEC_EST_THREADS    = 256;
static constexpr int H2O_DEC_SELECT_THREADS = 1024;
static constexpr int H2O_DEC_MAX_D          = 256;
static constexpr int H2O_DEC_MAX_GQA        = 16;
static constexpr int H2O_DEC_MAX_DV         = 512;

// The attention: a group's list is cut into at most H2O_DEC_MAX_PARTS parts of whole chunks, one block each, so that
// a sparse step (a list of ~1,300 positions) and a step over a long context both fill the GPU with blocks that each
// walk a few chunks. A chunk's positions and mask values are staged in shared memory first, so that the loads of its
// keys and values do not wait on each other. Each thread accumulates H2O_DEC_OUT_PER_THREAD outputs (head, channel)
// in registers, which bounds n_gqa*Dv.
static constexpr int H2O_DEC_CHUNK          = 64;
static constexpr int H2O_DEC_MAX_PARTS      = 64;
static constexpr int H2O_DEC_ATTEND_THREADS = 256;
static constexpr int H2O_DEC_OUT_PER_THREAD = 8;
static constexpr int H2O_DEC_MAX_OUT        = H2O_DEC_ATTEND_THREADS*H2O_DEC_OUT_PER_THREAD;
// positions whose key rows a warp loads before it reduces their logits, and whose values a thread loads before it
// adds them: loads issued together wait for memory once, not once each
static constexpr int H2O_DEC_KEY_BATCH      = 4;
static constexpr int H2O_DEC_VALUE_BATCH    = 16;

struct h2o_dec_args {
    const char * q;
    const char * k;
    const char * v;
    const char * mask;
    char       * summ;
    int32_t    * summ_n;
    const float * sinks;
    char       * dst;
    float      * keys_read; // [n_stream], or null

    size_t nbq1, nbq2, nbq3;
    size_t nbk1, nbk2, nbk3;
    size_t nbv1, nbv2, nbv3;
    size_t nbm1, nbm3;
    size_t nbs1, nbs2, nbs3;
    size_t nbsn1;
    size_t nbd1, nbd2, nbd3;

    ggml_type type_k;
    ggml_type type_v;
    bool      mask_f16;

    int D, Dv, R;
    int n_head_kv, n_gqa, n_tokens, n_stream, n_kv;
    int n_summ_blocks;
    int n_summ_n; // values of a stream's row of summ_n
    int n_sink, n_local, n_budget;
    float scale, softcap;
    float coverage;

    // scratch, from ggml's pool
    int32_t * extent;     // [n_stream][n_tokens]
    int32_t * n_sketched; // [n_stream]
    float   * est;        // [group][n_gqa][n_kv]
    float   * stat;       // [group][n_units][n_gqa]
    float   * gap;        // [group][n_kv]
    int32_t * list;       // [group][n_kv]
    int32_t * taken;      // [group]: the candidates its list took
    float   * part;       // [group][n_parts][n_gqa][2 + Dv]
    int n_units, n_parts;
};

// one element of a K or V row of any type these kernels read, converted as the CPU's to_float does
static __device__ __forceinline__ float h2o_dec_elem(const char * row, int i, ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32:
            return ((const float *) row)[i];
        case GGML_TYPE_F16:
            return __half2float(((const half *) row)[i]);
        case GGML_TYPE_BF16:
            return __uint_as_float((uint32_t) ((const uint16_t *) row)[i] << 16);
        case GGML_TYPE_Q8_0: {
            const block_q8_0 * b = (const block_q8_0 *) row + i/QK8_0;
            return b->qs[i%QK8_0]*__half2float(b->d);
        }
        case GGML_TYPE_Q4_0: {
            const block_q4_0 * b = (const block_q4_0 *) row + i/QK4_0;
            const int j = i%QK4_0;
            const int x = j < QK4_0/2 ? (b->qs[j] & 0x0F) - 8 : (b->qs[j - QK4_0/2] >> 4) - 8;
            return x*__half2float(b->d);
        }
        default:
            return 0.0f; // refused by ggml_cuda_h2o_decode_supported
    }
}

// The parts a query of a KV head attends to (the CPU's h2o_decode_shape): the positions of the first sink blocks,
// n_take chosen positions of the candidates [sink_end, recent_begin), and the positions from recent_begin up to n.
struct h2o_dec_shape {
    int64_t n;
    int64_t sink_end;
    int64_t recent_begin;
    int64_t n_cand;
    int64_t n_take;
    int64_t n_list;

    __device__ bool chooses() const { return n_take < n_cand; }
};

// group g: KV head g % n_head_kv of query token t of stream s, g / n_head_kv = s*n_tokens + t
static __device__ h2o_dec_shape h2o_dec_shape_of(const h2o_dec_args & a, int g) {
    const int64_t B  = H2O_DEC_B;
    const int     s  = g/(a.n_head_kv*a.n_tokens);
    const int64_t n  = a.extent[g/a.n_head_kv];
    const int64_t ns = a.n_sketched[s];
    // the stream's own sink and budget, the last two values of its row of summ_n (-1: the op's)
    const int32_t * row      = (const int32_t *) ((const char *) a.summ_n + s*a.nbsn1);
    const int64_t   n_sink   = row[a.n_summ_n - 2] >= 0 ? row[a.n_summ_n - 2] : a.n_sink;
    const int64_t   budget   = row[a.n_summ_n - 1] >= 0 ? row[a.n_summ_n - 1] : a.n_budget;
    const int64_t n_full       = min(n/B, ns);
    const int64_t sink_blocks  = min(max((n_sink + B - 1)/B, (int64_t) 1), n_full);
    const int64_t recent_block = max(min(max(n - a.n_local, (int64_t) 0)/B, n_full), sink_blocks);
    h2o_dec_shape sh;
    sh.n            = n;
    sh.sink_end     = sink_blocks*B;
    sh.recent_begin = recent_block*B;
    sh.n_cand       = sh.recent_begin - sh.sink_end;
    sh.n_take       = min(budget, sh.n_cand);
    sh.n_list       = sh.sink_end + sh.n_take + (n - sh.recent_begin);
    return sh;
}

// a group's shape once h2o_dec_select has chosen: n_take the candidates it took
static __device__ h2o_dec_shape h2o_dec_chosen_shape_of(const h2o_dec_args & a, int g) {
    h2o_dec_shape sh = h2o_dec_shape_of(a, g);
    sh.n_list += a.taken[g] - sh.n_take;
    sh.n_take  = a.taken[g];
    return sh;
}

static __device__ __forceinline__ int32_t * h2o_dec_count_of(const h2o_dec_args & a, int s) {
    return (int32_t *) ((char *) a.summ_n + s*a.nbsn1);
}

static __device__ __forceinline__ uint8_t * h2o_dec_sketch_of(const h2o_dec_args & a, int s, int ikv, int64_t b) {
    return (uint8_t *) (a.summ + ikv*a.nbs1 + b*a.nbs2 + s*a.nbs3);
}

// The 8-bit sketch of R values x (a key's or a pre-scaled query's on the sketch's channels), the CPU's
// h2o_sketch_quantize: q[c] = x[c]*(127/a) rounded to nearest even, a their largest magnitude, and the scale a/127
// returned; zeros (and values so small that 127/a overflows) take scale 0, values with a NaN or an infinity scale NaN,
// both q 0
template <typename F>
static __device__ float h2o_dec_quantize(int8_t * q, F x, int R) {
    float a      = 0.0f;
    bool  finite = true;
    for (int c = 0; c < R; ++c) {
        finite = finite && isfinite(x(c));
        a = fmaxf(a, fabsf(x(c)));
    }
    const float inv = __fdiv_rn(127.0f, a);
    if (!finite || isinf(inv)) {
        for (int c = 0; c < R; ++c) {
            q[c] = 0;
        }
        return finite ? 0.0f : NAN;
    }
    for (int c = 0; c < R; ++c) {
        q[c] = (int8_t) __float2int_rn(__fmul_rn(x(c), inv));
    }
    return __fdiv_rn(a, 127.0f);
}

// the exclusive prefix sum of x over the block's threads (a multiple of the warp size), and their total
template <typename T>
static __device__ T h2o_dec_block_scan(T x, T & total) {
    __shared__ T warp_sums[WARP_SIZE];
    __shared__ T block_total;
    const int lane    = threadIdx.x % WARP_SIZE;
    const int warp    = threadIdx.x / WARP_SIZE;
    const int n_warps = blockDim.x / WARP_SIZE;
    const T incl = warp_prefix_inclusive_sum(x);
    if (lane == WARP_SIZE - 1) {
        warp_sums[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        const T w  = lane < n_warps ? warp_sums[lane] : 0;
        const T wi = warp_prefix_inclusive_sum(w);
        if (lane < n_warps) {
            warp_sums[lane] = wi - w;
        }
        if (lane == WARP_SIZE - 1) {
            block_total = wi;
        }
    }
    __syncthreads();
    const T excl = warp_sums[warp] + incl - x;
    total = block_total;
    __syncthreads(); // before the next call writes them again
    return excl;
}

// 1. each query's open cells: [0, its last open cell]
static __global__ void h2o_dec_extent(const h2o_dec_args a) {
    const int st = blockIdx.x; // s*n_tokens + t
    const int s  = st/a.n_tokens;
    const int t  = st%a.n_tokens;
    const char * row = a.mask + t*a.nbm1 + s*a.nbm3;
    int last = -1;
    for (int j = threadIdx.x; j < a.n_kv; j += blockDim.x) {
        const float m = a.mask_f16 ? __half2float(((const half *) row)[j]) : ((const float *) row)[j];
        if (m != -INFINITY) {
            last = j;
        }
    }
    __shared__ int warp_last[WARP_SIZE];
    for (int offset = WARP_SIZE/2; offset > 0; offset >>= 1) {
        last = max(last, __shfl_xor_sync(0xffffffff, last, offset));
    }
    if (threadIdx.x % WARP_SIZE == 0) {
        warp_last[threadIdx.x/WARP_SIZE] = last;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int) (blockDim.x/WARP_SIZE); ++w) {
            last = max(last, warp_last[w]);
        }
        a.extent[st] = last + 1;
    }
}

// 2. per stream and KV head: where nothing is sketched yet, the R channels of most key energy over the complete
// blocks (ties to the lower channel, ascending); then the sketch of the blocks completed since the last call
static __global__ void h2o_dec_sketch(const h2o_dec_args a) {
    const int s   = blockIdx.x/a.n_head_kv;
    const int ikv = blockIdx.x%a.n_head_kv;
    const int64_t B = H2O_DEC_B;

    // the complete blocks: those of the stream's shortest query
    int64_t n = a.extent[s*a.n_tokens];
    for (int t = 1; t < a.n_tokens; ++t) {
        n = min(n, (int64_t) a.extent[s*a.n_tokens + t]);
    }
    const int32_t * count = h2o_dec_count_of(a, s);
    int32_t * chan = (int32_t *) count + 1 + ikv*a.R;
    const int64_t b0 = *count;
    const int64_t b1 = min(n/B, (int64_t) a.n_summ_blocks);
    if (ikv == 0 && threadIdx.x == 0) {
        a.n_sketched[s] = (int32_t) max(b0, b1); // h2o_dec_count writes it to the count after the other steps
    }
    const char * k_head = a.k + ikv*a.nbk1 + s*a.nbk3;

    __shared__ double  energy[H2O_DEC_MAX_D];
    __shared__ int     chosen[H2O_DEC_MAX_D];
    __shared__ int32_t chan_s[H2O_DEC_MAX_D/4];
    if (b0 == 0 && b1 > 0) {
        for (int d = threadIdx.x; d < a.D; d += blockDim.x) {
            double e = 0.0;
            for (int64_t p0 = 0; p0 < b1*B; p0 += B) {
                float part = 0.0f;
                for (int64_t p = p0; p < p0 + B; ++p) {
                    const float x = h2o_dec_elem(k_head + p*a.nbk2, d, a.type_k);
                    part = fmaf(x, x, part);
                }
                e += part;
            }
            energy[d] = e;
        }
        __syncthreads();
        // a channel's rank in a stable descending order
        for (int d = threadIdx.x; d < a.D; d += blockDim.x) {
            int rank = 0;
            for (int d2 = 0; d2 < a.D; ++d2) {
                rank += energy[d2] > energy[d] || (energy[d2] == energy[d] && d2 < d);
            }
            chosen[d] = rank < a.R;
        }
        __syncthreads();
        for (int d = threadIdx.x; d < a.D; d += blockDim.x) {
            if (chosen[d]) {
                int i = 0;
                for (int d2 = 0; d2 < d; ++d2) {
                    i += chosen[d2];
                }
                chan[i] = d;
            }
        }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < a.R; c += blockDim.x) {
        chan_s[c] = chan[c];
    }
    __syncthreads();
    // each block's sketch, one position a thread: [R/4 quads][B positions][4] bytes, each value plus 128, then the
    // B positions' F32 scales
    const int64_t n_pos = max(b1 - b0, (int64_t) 0)*B;
    for (int64_t e = threadIdx.x; e < n_pos; e += blockDim.x) {
        const int64_t b = b0 + e/B;
        const int     j = (int) (e%B);
        const char * krow = k_head + (b*B + j)*a.nbk2;
        int8_t q8[H2O_DEC_MAX_D/4];
        const float scale = h2o_dec_quantize(q8, [&](int c) { return h2o_dec_elem(krow, chan_s[c], a.type_k); }, a.R);
        uint8_t * sk = h2o_dec_sketch_of(a, s, ikv, b);
        for (int c = 0; c < a.R; ++c) {
            sk[(c/4)*B*4 + j*4 + c%4] = (uint8_t) (q8[c] + 128);
        }
        ((float *) (sk + a.R*B))[j] = scale;
    }
}

// 3. each query head's estimated logit at each candidate position (one thread each): the integer dot product of the
// head's 8-bit query on the sketch's channels with the position's sketch, times the query's scale, times the
// position's, as the CPU forms it; NaN becomes -inf. Each block's maximum per head goes to stat.
static __global__ void h2o_dec_estimate(const h2o_dec_args a) {
    const int g = blockIdx.y;
    const h2o_dec_shape sh = h2o_dec_shape_of(a, g);
    const int64_t j0 = (int64_t) blockIdx.x*H2O_DEC_EST_THREADS;
    if (!sh.chooses() || j0 >= sh.n_cand) {
        return;
    }
    const int ikv = g%a.n_head_kv;
    const int t   = (g/a.n_head_kv)%a.n_tokens;
    const int s   = g/(a.n_head_kv*a.n_tokens);
    const int32_t * chan = h2o_dec_count_of(a, s) + 1 + ikv*a.R;

    // each head's query on the sketch's channels, quantized (one thread a head), as quads of channels
    __shared__ int32_t qquad[H2O_DEC_MAX_GQA*H2O_DEC_MAX_D/16];
    __shared__ float   qscale[H2O_DEC_MAX_GQA];
    for (int r = threadIdx.x; r < a.n_gqa; r += blockDim.x) {
        const float * qrow = (const float *) (a.q + (ikv*a.n_gqa + r)*a.nbq1 + t*a.nbq2 + s*a.nbq3);
        int8_t q8[H2O_DEC_MAX_D/4];
        qscale[r] = h2o_dec_quantize(q8, [&](int c) { return __fmul_rn(qrow[chan[c]], a.scale); }, a.R);
        for (int cq = 0; cq < a.R/4; ++cq) {
            qquad[r*(a.R/4) + cq] = (int32_t) ((uint32_t) (uint8_t) q8[4*cq] | (uint32_t) (uint8_t) q8[4*cq + 1] << 8 |
                    (uint32_t) (uint8_t) q8[4*cq + 2] << 16 | (uint32_t) (uint8_t) q8[4*cq + 3] << 24);
        }
    }
    __syncthreads();

    const int64_t j = j0 + threadIdx.x;
    __shared__ float warp_max[H2O_DEC_EST_THREADS/WARP_SIZE];
    for (int r = 0; r < a.n_gqa; ++r) {
        float x = -INFINITY;
        if (j < sh.n_cand) {
            const uint8_t * sk = h2o_dec_sketch_of(a, s, ikv, sh.sink_end/H2O_DEC_B + j/H2O_DEC_B);
            const int jb = (int) (j%H2O_DEC_B);
            int32_t d = 0;
            for (int cq = 0; cq < a.R/4; ++cq) {
                // the stored values less 128: their bytes' top bits flipped
                const int32_t kq = *(const int32_t *) (sk + (cq*H2O_DEC_B + jb)*4) ^ (int32_t) 0x80808080u;
                d = __dp4a(kq, qquad[r*(a.R/4) + cq], d);
            }
            const float e = __fmul_rn(__fmul_rn((float) d, qscale[r]), ((const float *) (sk + a.R*H2O_DEC_B))[jb]);
            x = isnan(e) ? -INFINITY : e;
            a.est[((int64_t) g*a.n_gqa + r)*a.n_kv + j] = x;
        }
        x = warp_reduce_max(x);
        if (threadIdx.x % WARP_SIZE == 0) {
            warp_max[threadIdx.x/WARP_SIZE] = x;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float m = warp_max[0];
            for (int w = 1; w < H2O_DEC_EST_THREADS/WARP_SIZE; ++w) {
                m = fmaxf(m, warp_max[w]);
            }
            a.stat[((int64_t) g*a.n_units + blockIdx.x)*a.n_gqa + r] = m;
        }
        __syncthreads();
    }
}

// The k-th least (1 <= k <= n) of n non-negative floats, exactly: their bit patterns order as the values do, so a
// radix select over 12, 10 and 10 bits finds its pattern, each pass counting only the values that share the bits
// found so far. Also gives how many values are less than it.
static __device__ float h2o_dec_kth_least(const float * x, int n, int k, int & n_less) {
    __shared__ int      hist[4096];
    __shared__ uint32_t found_bits;
    __shared__ int      found_below;
    const int shifts[3]    = { 20, 10, 0 };
    const int n_buckets[3] = { 4096, 1024, 1024 };
    uint32_t prefix = 0;
    uint32_t prefix_mask = 0;
    n_less = 0;
    for (int pass = 0; pass < 3; ++pass) {
        const int nb    = n_buckets[pass];
        const int shift = shifts[pass];
        for (int i = threadIdx.x; i < nb; i += blockDim.x) {
            hist[i] = 0;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const uint32_t u = __float_as_uint(x[i]);
            if ((u & prefix_mask) == prefix) {
                atomicAdd(&hist[(u >> shift) & (nb - 1)], 1);
            }
        }
        __syncthreads();
        // each thread's run of buckets, the block's prefix over the runs, and the run that holds the k-th
        const int per = (nb + blockDim.x - 1)/blockDim.x;
        const int r0  = min((int) threadIdx.x*per, nb);
        const int r1  = min(r0 + per, nb);
        int sum = 0;
        for (int b = r0; b < r1; ++b) {
            sum += hist[b];
        }
        int total;
        const int excl = h2o_dec_block_scan(sum, total);
        if (excl < k && k <= excl + sum) {
            int c = excl;
            for (int b = r0; b < r1; ++b) {
                if (c + hist[b] >= k) {
                    found_bits  = prefix | ((uint32_t) b << shift);
                    found_below = c;
                    break;
                }
                c += hist[b];
            }
        }
        __syncthreads();
        prefix       = found_bits;
        prefix_mask |= (uint32_t) (nb - 1) << shift;
        k           -= found_below;
        n_less      += found_below;
        __syncthreads();
    }
    return __uint_as_float(prefix);
}

// What a candidate of first-level bucket b (the leading 11 bits of its gap) weighs when the choice follows coverage,
// in units of 2^-24: the CPU's h2o_decode_bucket_weight (a product by 2^24 is exact, so a fused multiply-add rounds
// as the CPU's separate product and sum do)
static __device__ unsigned long long h2o_dec_bucket_weight(uint32_t b) {
    const uint32_t bits = b << 20;
    if (bits >= 0x7f800000u) {
        return 0;
    }
    return (unsigned long long) (exp(-(double) __uint_as_float(bits))*16777216.0 + 0.5);
}

// The candidates that coverage takes (the CPU's h2o_decode_coverage_take): the gaps counted in their first-level
// buckets, then whole buckets from the least gaps until their weight reaches the share; n when none weighs anything
static __device__ int h2o_dec_coverage_take(const float * gap, int n, float coverage) {
    constexpr int nb = 2048;
    __shared__ int hist[nb];
    __shared__ int taken;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) {
        hist[i] = 0;
    }
    if (threadIdx.x == 0) {
        taken = n;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const uint32_t u = __float_as_uint(gap[i]);
        atomicAdd(&hist[((u >> 31) ? 0u : u) >> 20 & (nb - 1)], 1);
    }
    __syncthreads();
    // each thread's run of buckets, the block's prefix of their weights and counts, and the run where the weight
    // reaches the share
    const int per = (nb + blockDim.x - 1)/blockDim.x;
    const int r0  = min((int) threadIdx.x*per, nb);
    const int r1  = min(r0 + per, nb);
    unsigned long long w_run = 0;
    int c_run = 0;
    for (int b = r0; b < r1; ++b) {
        w_run += (unsigned long long) hist[b]*h2o_dec_bucket_weight(b);
        c_run += hist[b];
    }
    unsigned long long w_total;
    int c_total;
    const unsigned long long w_before = h2o_dec_block_scan(w_run, w_total);
    const int c_before = h2o_dec_block_scan(c_run, c_total);
    if (w_total > 0) {
        const unsigned long long need = (unsigned long long) ceil((double) coverage*(double) w_total);
        if (w_before < need && need <= w_before + w_run) {
            unsigned long long held = w_before;
            int c = c_before;
            for (int b = r0; b < r1; ++b) {
                held += (unsigned long long) hist[b]*h2o_dec_bucket_weight(b);
                c    += hist[b];
                if (held >= need) {
                    taken = c;
                    break;
                }
            }
        }
    }
    __syncthreads();
    return taken;
}

// 4. per group: the gaps (how far each candidate's estimate stands below its head's best, the least over the heads
// that have one), then the positions attended to: the sinks, the n_take least gaps (ties to the earlier position), or
// fewer where coverage holds its share with fewer, and the recent window, ascending
static __global__ void __launch_bounds__(H2O_DEC_SELECT_THREADS) h2o_dec_select(const h2o_dec_args a) {
    const int g = blockIdx.x;
    const h2o_dec_shape sh = h2o_dec_shape_of(a, g);
    int32_t * list = a.list + (int64_t) g*a.n_kv;
    // the recent window after the n_take candidates taken
    const auto list_recent = [&](int64_t n_take) {
        for (int64_t p = sh.recent_begin + threadIdx.x; p < sh.n; p += blockDim.x) {
            list[sh.sink_end + n_take + (p - sh.recent_begin)] = (int32_t) p;
        }
    };

    for (int64_t p = threadIdx.x; p < sh.sink_end; p += blockDim.x) {
        list[p] = (int32_t) p;
    }
    if (!sh.chooses() || sh.n_take == 0) {
        // every candidate, or (a budget of 0) the sinks and the recent window alone
        const int64_t n_take = sh.chooses() ? 0 : sh.n_cand;
        for (int64_t p = sh.sink_end + threadIdx.x; p < sh.sink_end + n_take; p += blockDim.x) {
            list[p] = (int32_t) p;
        }
        list_recent(n_take);
        if (threadIdx.x == 0) {
            a.taken[g] = (int32_t) n_take;
        }
        return;
    }

    __shared__ float best[H2O_DEC_MAX_GQA];
    const int n_units = (int) ((sh.n_cand + H2O_DEC_EST_THREADS - 1)/H2O_DEC_EST_THREADS);
    if (threadIdx.x < (unsigned) a.n_gqa) {
        float m = -INFINITY;
        for (int u = 0; u < n_units; ++u) {
            m = fmaxf(m, a.stat[((int64_t) g*a.n_units + u)*a.n_gqa + threadIdx.x]);
        }
        best[threadIdx.x] = m;
    }
    __syncthreads();

    float * gap = a.gap + (int64_t) g*a.n_kv;
    for (int64_t j = threadIdx.x; j < sh.n_cand; j += blockDim.x) {
        float gj = INFINITY;
        for (int r = 0; r < a.n_gqa; ++r) {
            if (best[r] == -INFINITY) {
                continue; // a head with no estimate to go by adds nothing
            }
            const float d = best[r] - a.est[((int64_t) g*a.n_gqa + r)*a.n_kv + j];
            gj = d < gj ? d : gj; // std::min, as the CPU: a NaN difference leaves the gap as it was
        }
        gap[j] = gj;
    }
    __syncthreads();

    int n_take = (int) sh.n_take;
    if (a.coverage < 1.0f) {
        n_take = min(n_take, h2o_dec_coverage_take(gap, (int) sh.n_cand, a.coverage));
    }
    list_recent(n_take);
    if (threadIdx.x == 0) {
        a.taken[g] = n_take;
    }

    int n_less;
    const float cut = h2o_dec_kth_least(gap, (int) sh.n_cand, n_take, n_less);
    const int n_equal = n_take - n_less; // of the gaps equal to the cut, the first ones are taken
    // each thread's run of the candidates, in order: its gaps below the cut and equal to it, then two prefix sums over
    // the runs say which of its equal gaps are taken and where its positions go in the list
    const int64_t per = (sh.n_cand + blockDim.x - 1)/blockDim.x;
    const int64_t i0  = min((int64_t) threadIdx.x*per, sh.n_cand);
    const int64_t i1  = min(i0 + per, sh.n_cand);
    int n_lt = 0;
    int n_eq = 0;
    for (int64_t i = i0; i < i1; ++i) {
        const float gi = gap[i];
        n_lt += gi < cut;
        n_eq += gi == cut;
    }
    int eq_total;
    int eq_seen = h2o_dec_block_scan(n_eq, eq_total);
    const int eq_take = max(0, min(n_eq, n_equal - eq_seen));
    int take_total;
    int64_t j = sh.sink_end + h2o_dec_block_scan(n_lt + eq_take, take_total);
    for (int64_t i = i0; i < i1; ++i) {
        const float gi = gap[i];
        const bool take = gi < cut || (gi == cut && eq_seen < n_equal);
        eq_seen += gi == cut;
        if (take) {
            list[j++] = (int32_t) (sh.sink_end + i);
        }
    }
}

// the positions of a group's list that one part attends to: n_list over n_parts, rounded up to whole chunks (the
// last part shorter, the parts past the list empty)
static __device__ __forceinline__ int64_t h2o_dec_part_len(int64_t n_list, int n_parts) {
    const int64_t per = (n_list + n_parts - 1)/n_parts;
    return max((per + H2O_DEC_CHUNK - 1)/H2O_DEC_CHUNK, (int64_t) 1)*H2O_DEC_CHUNK;
}

// 5. a part's exact partial softmax per query head of the group (maximum, sum, weighted values), chunk by chunk with
// the running maximum: a warp forms a position's logits for all the group's heads from one read of its key; closed
// cells take no probability and their values are not read (they may be anything)
static __global__ void __launch_bounds__(H2O_DEC_ATTEND_THREADS) h2o_dec_attend(const h2o_dec_args a) {
    const int g  = blockIdx.y;
    const int sp = blockIdx.x;
    const h2o_dec_shape sh = h2o_dec_chosen_shape_of(a, g);
    const int64_t len     = h2o_dec_part_len(sh.n_list, a.n_parts);
    const int64_t j_begin = sp*len;
    if (j_begin >= sh.n_list) {
        return;
    }
    const int64_t j_end = min(j_begin + len, sh.n_list);
    const int ikv = g%a.n_head_kv;
    const int t   = (g/a.n_head_kv)%a.n_tokens;
    const int s   = g/(a.n_head_kv*a.n_tokens);
    const int lane    = threadIdx.x % WARP_SIZE;
    const int warp    = threadIdx.x / WARP_SIZE;
    const int n_warps = blockDim.x / WARP_SIZE;
    const int n_out   = a.n_gqa*a.Dv;
    const int32_t * list = a.list + (int64_t) g*a.n_kv;
    const char * k_head = a.k + ikv*a.nbk1 + s*a.nbk3;
    const char * v_head = a.v + ikv*a.nbv1 + s*a.nbv3;
    const char * mrow   = a.mask + t*a.nbm1 + s*a.nbm3;

    __shared__ float   qf[H2O_DEC_MAX_GQA*H2O_DEC_MAX_D];
    __shared__ float   x[H2O_DEC_MAX_GQA][H2O_DEC_CHUNK];
    __shared__ int32_t pos[H2O_DEC_CHUNK];
    __shared__ float   mval[H2O_DEC_CHUNK]; // the mask's value; -inf: closed
    __shared__ float   m_run[H2O_DEC_MAX_GQA];
    __shared__ float   l_run[H2O_DEC_MAX_GQA];
    __shared__ float   rescale[H2O_DEC_MAX_GQA];
    for (int i = threadIdx.x; i < a.n_gqa*a.D; i += blockDim.x) {
        const int r = i/a.D;
        const float * qrow = (const float *) (a.q + (ikv*a.n_gqa + r)*a.nbq1 + t*a.nbq2 + s*a.nbq3);
        qf[i] = qrow[i%a.D]*a.scale;
    }
    if (threadIdx.x < (unsigned) a.n_gqa) {
        m_run[threadIdx.x] = -INFINITY;
        l_run[threadIdx.x] = 0.0f;
    }
    float acc[H2O_DEC_OUT_PER_THREAD];
#pragma unroll
    for (int k = 0; k < H2O_DEC_OUT_PER_THREAD; ++k) {
        acc[k] = 0.0f;
    }
    __syncthreads();

    for (int64_t c0 = j_begin; c0 < j_end; c0 += H2O_DEC_CHUNK) {
        const int nj = (int) min((int64_t) H2O_DEC_CHUNK, j_end - c0);
        if (threadIdx.x < (unsigned) nj) {
            const int32_t p = list[c0 + threadIdx.x];
            pos[threadIdx.x]  = p;
            mval[threadIdx.x] = a.mask_f16 ? __half2float(((const half *) mrow)[p]) : ((const float *) mrow)[p];
        }
        __syncthreads();

        // the logits, -inf at closed cells: warp w takes the chunk's positions w, w + n_warps, ..., loading the key rows
        // of H2O_DEC_KEY_BATCH of them before reducing any
        constexpr int per_lane = H2O_DEC_MAX_D/WARP_SIZE;
        for (int u0 = 0; warp + u0*n_warps < nj; u0 += H2O_DEC_KEY_BATCH) {
            float kd[H2O_DEC_KEY_BATCH][per_lane];
#pragma unroll
            for (int u = 0; u < H2O_DEC_KEY_BATCH; ++u) {
                const int  jj = warp + (u0 + u)*n_warps;
                const bool ok = jj < nj && mval[jj] != -INFINITY;
                const char * krow = k_head + (int64_t) (ok ? pos[jj] : 0)*a.nbk2;
#pragma unroll
                for (int i = 0; i < per_lane; ++i) {
                    const int d = lane + i*WARP_SIZE;
                    kd[u][i] = ok && d < a.D ? h2o_dec_elem(krow, d, a.type_k) : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < H2O_DEC_KEY_BATCH; ++u) {
                const int jj = warp + (u0 + u)*n_warps;
                if (jj >= nj) {
                    break;
                }
                const float mv = mval[jj];
                if (mv == -INFINITY) {
                    for (int r = lane; r < a.n_gqa; r += WARP_SIZE) {
                        x[r][jj] = -INFINITY;
                    }
                    continue;
                }
                for (int r = 0; r < a.n_gqa; ++r) {
                    float dot = 0.0f;
#pragma unroll
                    for (int i = 0; i < per_lane; ++i) {
                        const int d = lane + i*WARP_SIZE;
                        dot += d < a.D ? qf[r*a.D + d]*kd[u][i] : 0.0f;
                    }
                    dot = warp_reduce_sum(dot);
                    if (a.softcap > 0.0f) {
                        dot = a.softcap*tanhf(dot/a.softcap);
                    }
                    if (lane == 0) {
                        x[r][jj] = dot + mv;
                    }
                }
            }
        }
        __syncthreads();

        // per head: the running maximum, the factor for what came before, exp(x - max) and the running sum
        for (int r = warp; r < a.n_gqa; r += n_warps) {
            float cm = -INFINITY;
            for (int jj = lane; jj < nj; jj += WARP_SIZE) {
                cm = fmaxf(cm, x[r][jj]);
            }
            cm = warp_reduce_max(cm);
            const float m_old = m_run[r];
            const float m_new = fmaxf(m_old, cm);
            float l = 0.0f;
            for (int jj = lane; jj < nj; jj += WARP_SIZE) {
                const float e = mval[jj] == -INFINITY || m_new == -INFINITY ? 0.0f : expf(x[r][jj] - m_new);
                x[r][jj] = e;
                l += e;
            }
            l = warp_reduce_sum(l);
            __syncwarp(); // every lane has read m_run[r] before lane 0 writes it
            if (lane == 0) {
                const float f = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                rescale[r] = f;
                l_run[r]   = l_run[r]*f + l;
                m_run[r]   = m_new;
            }
        }
        __syncthreads();

        // the weighted values: a warp's threads read consecutive channels of one value row, H2O_DEC_VALUE_BATCH rows
        // before adding any (a closed cell's row is read, in the cache, but not added)
#pragma unroll
        for (int k = 0; k < H2O_DEC_OUT_PER_THREAD; ++k) {
            const int o = threadIdx.x + k*H2O_DEC_ATTEND_THREADS;
            if (o < n_out) {
                const int r = o/a.Dv;
                const int d = o%a.Dv;
                float sum = acc[k]*rescale[r];
                for (int j0 = 0; j0 < nj; j0 += H2O_DEC_VALUE_BATCH) {
                    float vb[H2O_DEC_VALUE_BATCH];
#pragma unroll
                    for (int u = 0; u < H2O_DEC_VALUE_BATCH; ++u) {
                        const int jj = j0 + u;
                        vb[u] = jj < nj ? h2o_dec_elem(v_head + (int64_t) pos[jj]*a.nbv2, d, a.type_v) : 0.0f;
                    }
#pragma unroll
                    for (int u = 0; u < H2O_DEC_VALUE_BATCH; ++u) {
                        const int jj = j0 + u;
                        if (jj < nj && mval[jj] != -INFINITY) {
                            sum = fmaf(x[r][jj], vb[u], sum);
                        }
                    }
                }
                acc[k] = sum;
            }
        }
        __syncthreads(); // before the next chunk overwrites pos, mval and x
    }

    float * part = a.part + ((int64_t) g*a.n_parts + sp)*a.n_gqa*(2 + a.Dv);
    if (threadIdx.x < (unsigned) a.n_gqa) {
        part[threadIdx.x*(2 + a.Dv) + 0] = m_run[threadIdx.x];
        part[threadIdx.x*(2 + a.Dv) + 1] = l_run[threadIdx.x];
    }
#pragma unroll
    for (int k = 0; k < H2O_DEC_OUT_PER_THREAD; ++k) {
        const int o = threadIdx.x + k*H2O_DEC_ATTEND_THREADS;
        if (o < n_out) {
            part[(o/a.Dv)*(2 + a.Dv) + 2 + o%a.Dv] = acc[k];
        }
    }
}

// 6. per query head (one warp each): its parts merged by online softmax, with the learned sink in the denominator
static __global__ void h2o_dec_merge(const h2o_dec_args a) {
    const int g    = blockIdx.x;
    const int r    = threadIdx.x/WARP_SIZE;
    const int lane = threadIdx.x%WARP_SIZE;
    const int ikv  = g%a.n_head_kv;
    const int t    = (g/a.n_head_kv)%a.n_tokens;
    const int s    = g/(a.n_head_kv*a.n_tokens);
    const int ih   = ikv*a.n_gqa + r;
    const h2o_dec_shape sh = h2o_dec_chosen_shape_of(a, g);
    const int64_t len  = h2o_dec_part_len(sh.n_list, a.n_parts);
    const int n_used  = (int) ((sh.n_list + len - 1)/len); // the parts h2o_dec_attend wrote
    const float * part = a.part + (int64_t) g*a.n_parts*a.n_gqa*(2 + a.Dv) + r*(2 + a.Dv);
    const int64_t stride = (int64_t) a.n_gqa*(2 + a.Dv); // from one part to the next

    float m = -INFINITY;
    for (int sp = 0; sp < n_used; ++sp) {
        m = fmaxf(m, part[sp*stride]);
    }
    float l = 0.0f;
    if (m != -INFINITY) {
        for (int sp = 0; sp < n_used; ++sp) {
            const float ms = part[sp*stride];
            l += ms == -INFINITY ? 0.0f : part[sp*stride + 1]*expf(ms - m);
        }
    }
    const float sink = a.sinks ? a.sinks[ih] : -INFINITY;
    if (sink != -INFINITY) {
        l += m == -INFINITY ? 1.0f : expf(sink - m);
    }
    const float inv = l > 0.0f ? 1.0f/l : 0.0f;
    float * out = (float *) (a.dst + ih*a.nbd1 + t*a.nbd2 + s*a.nbd3);
    for (int d = lane; d < a.Dv; d += WARP_SIZE) {
        float acc = 0.0f;
        if (m != -INFINITY) {
            for (int sp = 0; sp < n_used; ++sp) {
                const float ms = part[sp*stride];
                const float vd = part[sp*stride + 2 + d];
                acc += ms == -INFINITY ? 0.0f : vd*expf(ms - m);
            }
        }
        out[d] = acc*inv;
    }
}

// 7. the blocks sketched, once every step has read the count this call started from; and the positions a query head
// of each stream read, the mean over its groups
static __global__ void h2o_dec_count(const h2o_dec_args a) {
    for (int s = threadIdx.x; s < a.n_stream; s += blockDim.x) {
        *h2o_dec_count_of(a, s) = a.n_sketched[s];
        if (a.keys_read) {
            const int per_stream = a.n_tokens*a.n_head_kv;
            long long n_read = 0;
            for (int g = s*per_stream; g < (s + 1)*per_stream; ++g) {
                n_read += h2o_dec_chosen_shape_of(a, g).n_list;
            }
            a.keys_read[s] = (float) ((double) n_read/(double) per_stream);
        }
    }
}

static bool h2o_dec_readable(const ggml_tensor * t) {
    switch (t->type) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
            return t->nb[0] == ggml_type_size(t->type);
        default:
            return false;
    }
}

bool ggml_cuda_h2o_decode_supported(int device, const ggml_tensor * dst) {
    GGML_UNUSED(device);
    // As for the prefill op, a refusal makes llama refuse the context (llama_h2o_check_placement) rather than run the
    // op on the CPU against copies of the sketches; so refuse only what these kernels do not implement: K/V types
    // other than those h2o_dec_elem reads, and shapes beyond their shared memory or grids
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[5];
    const int64_t n_gqa    = q->ne[1]/k->ne[1];
    const int64_t n_groups = q->ne[3]*q->ne[2]*k->ne[1]; // gridDim.y of the estimate and attention kernels
    return n_groups <= 65535 && q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float) && h2o_dec_readable(k) && h2o_dec_readable(v) &&
        (mask->type == GGML_TYPE_F32 || mask->type == GGML_TYPE_F16) &&
        q->ne[0] <= H2O_DEC_MAX_D && v->ne[0] <= H2O_DEC_MAX_DV && n_gqa <= H2O_DEC_MAX_GQA &&
        n_gqa*v->ne[0] <= H2O_DEC_MAX_OUT &&
        (dst->src[6] == nullptr || dst->src[6]->type == GGML_TYPE_F32) &&
        (dst->src[7] == nullptr || dst->src[7]->type == GGML_TYPE_F32);
}

void ggml_cuda_op_h2o_decode(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q      = dst->src[0];
    const ggml_tensor * k      = dst->src[1];
    const ggml_tensor * v      = dst->src[2];
          ggml_tensor * summ   = dst->src[3];
          ggml_tensor * summ_n = dst->src[4];
    const ggml_tensor * mask   = dst->src[5];

    GGML_ASSERT(ggml_cuda_h2o_decode_supported(ggml_cuda_get_device(), dst));

    h2o_dec_args a {};
    a.q      = (const char *) q->data;
    a.k      = (const char *) k->data;
    a.v      = (const char *) v->data;
    a.mask   = (const char *) mask->data;
    a.summ   = (char *) summ->data;
    a.summ_n = (int32_t *) summ_n->data;
    a.sinks  = dst->src[6] ? (const float *) dst->src[6]->data : nullptr;
    a.keys_read = dst->src[7] ? (float *) dst->src[7]->data : nullptr;
    a.dst    = (char *) dst->data;

    a.nbq1 = q->nb[1];      a.nbq2 = q->nb[2];      a.nbq3 = q->nb[3];
    a.nbk1 = k->nb[1];      a.nbk2 = k->nb[2];      a.nbk3 = k->nb[3];
    a.nbv1 = v->nb[1];      a.nbv2 = v->nb[2];      a.nbv3 = v->nb[3];
    a.nbm1 = mask->nb[1];   a.nbm3 = mask->nb[3];
    a.nbs1 = summ->nb[1];   a.nbs2 = summ->nb[2];   a.nbs3 = summ->nb[3];
    a.nbsn1 = summ_n->nb[1];
    a.nbd1 = dst->nb[1];    a.nbd2 = dst->nb[2];    a.nbd3 = dst->nb[3];

    a.type_k   = k->type;
    a.type_v   = v->type;
    a.mask_f16 = mask->type == GGML_TYPE_F16;

    a.D         = (int) q->ne[0];
    a.Dv        = (int) v->ne[0];
    a.R         = a.D/4;
    a.n_head_kv = (int) k->ne[1];
    a.n_gqa     = (int) (q->ne[1]/k->ne[1]);
    a.n_tokens  = (int) q->ne[2];
    a.n_stream  = (int) q->ne[3];
    a.n_kv      = (int) k->ne[2];
    a.n_summ_blocks = (int) summ->ne[2];
    a.n_summ_n      = (int) summ_n->ne[0];

    a.n_sink   = ggml_get_op_params_i32(dst, GGML_H2O_DECODE_SINK);
    a.n_local  = ggml_get_op_params_i32(dst, GGML_H2O_DECODE_LOCAL);
    a.n_budget = ggml_get_op_params_i32(dst, GGML_H2O_DECODE_BUDGET);
    a.scale    = ggml_get_op_params_f32(dst, GGML_H2O_DECODE_SCALE);
    a.softcap  = ggml_get_op_params_f32(dst, GGML_H2O_DECODE_SOFTCAP);
    a.coverage = ggml_get_op_params_f32(dst, GGML_H2O_DECODE_COVERAGE);

    const int n_groups = a.n_stream*a.n_tokens*a.n_head_kv;
    a.n_units = (a.n_kv + H2O_DEC_EST_THREADS - 1)/H2O_DEC_EST_THREADS;
    a.n_parts = std::min((a.n_kv + H2O_DEC_CHUNK - 1)/H2O_DEC_CHUNK, H2O_DEC_MAX_PARTS);

    // the scratch, one pool buffer in 16-byte aligned parts
    const auto aligned = [](size_t n) { return (n + 15) & ~(size_t) 15; };
    const size_t sz_extent = aligned((size_t) a.n_stream*a.n_tokens*sizeof(int32_t));
    const size_t sz_sk     = aligned((size_t) a.n_stream*sizeof(int32_t));
    const size_t sz_est    = aligned((size_t) n_groups*a.n_gqa*a.n_kv*sizeof(float));
    const size_t sz_stat   = aligned((size_t) n_groups*a.n_units*a.n_gqa*sizeof(float));
    const size_t sz_gap    = aligned((size_t) n_groups*a.n_kv*sizeof(float));
    const size_t sz_list   = aligned((size_t) n_groups*a.n_kv*sizeof(int32_t));
    const size_t sz_taken  = aligned((size_t) n_groups*sizeof(int32_t));
    const size_t sz_part   = aligned((size_t) n_groups*a.n_parts*a.n_gqa*(2 + a.Dv)*sizeof(float));
    ggml_cuda_pool_alloc<char> scratch(ctx.pool(), sz_extent + sz_sk + sz_est + sz_stat + sz_gap + sz_list + sz_taken + sz_part);
    char * p = scratch.ptr;
    a.extent     = (int32_t *) p; p += sz_extent;
    a.n_sketched = (int32_t *) p; p += sz_sk;
    a.est        = (float   *) p; p += sz_est;
    a.stat       = (float   *) p; p += sz_stat;
    a.gap        = (float   *) p; p += sz_gap;
    a.list       = (int32_t *) p; p += sz_list;
    a.taken      = (int32_t *) p; p += sz_taken;
    a.part       = (float   *) p;

    cudaStream_t stream = ctx.stream();
    h2o_dec_extent<<<a.n_stream*a.n_tokens, 1024, 0, stream>>>(a);
    h2o_dec_sketch<<<a.n_stream*a.n_head_kv, 256, 0, stream>>>(a);
    h2o_dec_estimate<<<dim3(a.n_units, n_groups), H2O_DEC_EST_THREADS, 0, stream>>>(a);
    h2o_dec_select<<<n_groups, H2O_DEC_SELECT_THREADS, 0, stream>>>(a);
    h2o_dec_attend<<<dim3(a.n_parts, n_groups), H2O_DEC_ATTEND_THREADS, 0, stream>>>(a);
    h2o_dec_merge<<<n_groups, a.n_gqa*WARP_SIZE, 0, stream>>>(a);
    h2o_dec_count<<<1, WARP_SIZE, 0, stream>>>(a);
    CUDA_CHECK(cudaGetLastError());
}
