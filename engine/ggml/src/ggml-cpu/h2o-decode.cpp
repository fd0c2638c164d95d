// GGML_OP_H2O_DECODE on the CPU: a decode step's exact softmax over its sinks, its window and
// the positions its 8-bit key sketches estimate it attends to most (see ggml_h2o_decode in ggml-h2o.h).

#include "ops.h"

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "h2o-common.h"
#include "ggml.h"
#include "vec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>

// ggml_compute_forward_h2o_decode

// the cells of a query's mask row that are open: [0, the last open one] (a sequence's own stream holds its positions
// from 0 on; the attention below still skips any closed cell inside)
static int64_t h2o_decode_extent(const ggml_tensor * mask, int64_t t, int64_t s) {
    const char * row = (const char *) mask->data + t*mask->nb[1] + s*mask->nb[3];
    for (int64_t j = mask->ne[0] - 1; j >= 0; --j) {
        const float m = mask->type == GGML_TYPE_F16 ? GGML_CPU_FP16_TO_FP32(((const ggml_fp16_t *) row)[j]) : ((const float *) row)[j];
        if (m != -INFINITY) {
            return j + 1;
        }
    }
    return 0;
}

static float h2o_decode_mask(const ggml_tensor * mask, int64_t t, int64_t s, int64_t j) {
    const char * row = (const char *) mask->data + t*mask->nb[1] + s*mask->nb[3];
    return mask->type == GGML_TYPE_F16 ? GGML_CPU_FP16_TO_FP32(((const ggml_fp16_t *) row)[j]) : ((const float *) row)[j];
}

// The parts a query of a KV head attends to, from its open extent n: the positions of the first sink_blocks
// blocks, n_take chosen positions of the candidates [sink_blocks*B, recent_block*B), and the positions from
// recent_block*B up to n. Only sketched blocks are candidates.
struct h2o_decode_shape {
    int64_t n;
    int64_t sink_end;
    int64_t recent_begin;
    int64_t n_cand; // positions to choose from
    int64_t n_take; // positions chosen (n_cand: no choice, all taken)
    int64_t n_list; // positions attended to

    h2o_decode_shape(int64_t n, int64_t n_sketched, int32_t n_sink, int32_t n_local, int32_t n_budget) : n(n) {
        const int64_t B      = GGML_H2O_DECODE_BLOCK;
        const int64_t n_full = std::min(n/B, n_sketched);
        const int64_t sink_blocks  = std::min(std::max<int64_t>((n_sink + B - 1)/B, 1), n_full);
        const int64_t recent_block = std::max(std::min(std::max<int64_t>(n - n_local, 0)/B, n_full), sink_blocks);
        sink_end     = sink_blocks*B;
        recent_begin = recent_block*B;
        n_cand       = recent_begin - sink_end;
        n_take       = std::min<int64_t>(n_budget, n_cand);
        n_list       = sink_end + n_take + (n - recent_begin);
    }

    bool chooses() const { return n_take < n_cand; }
};

// positions of one unit of the attention step, so that the threads share a KV head's keys whatever the number of
// heads; sketched blocks of one unit of the estimate step
static constexpr int64_t H2O_DECODE_SPAN     = 256;
static constexpr int64_t H2O_DECODE_EST_SPAN = 64;

// n items (a group's list, its candidate blocks) in as few runs of at most max_len as hold them, of equal length but
// the last, so that threads taking the runs in turn get about as much work each (runs of max_len and one short one
// left a thread waiting at the next barrier)
static int64_t h2o_decode_run_len(int64_t n, int64_t max_len) {
    const int64_t n_runs = std::max<int64_t>((n + max_len - 1)/max_len, 1);
    return std::max<int64_t>((n + n_runs - 1)/n_runs, 1);
}

// The values of v[0..n) whose bits [shift, shift + width) (of their pattern, a negative value's taken as 0) are b, in
// order, into out; returns their number. Without branches on the values, which fall in or out at random.
static int64_t h2o_bucket_values(float * out, const float * v, int64_t n, int shift, int width, uint32_t b) {
    const uint32_t mask = (1u << width) - 1;
    int64_t i     = 0;
    int64_t n_out = 0;
#if defined(__AVX512F__)
    const __m512i zero = _mm512_setzero_si512();
    const __m512i vm   = _mm512_set1_epi32((int) mask);
    const __m512i vb   = _mm512_set1_epi32((int) b);
    for (; i + 16 <= n; i += 16) {
        const __m512  f   = _mm512_loadu_ps(v + i);
        const __m512i u   = _mm512_castps_si512(f);
        const __m512i pos = _mm512_mask_mov_epi32(u, _mm512_cmplt_epi32_mask(u, zero), zero);
        const __mmask16 in = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_srli_epi32(pos, shift), vm), vb);
        _mm512_mask_compressstoreu_ps(out + n_out, in, f);
        n_out += _mm_popcnt_u32(in);
    }
#endif
    for (; i < n; ++i) {
        uint32_t u;
        memcpy(&u, v + i, sizeof(u));
        out[n_out] = v[i];
        n_out += (((u >> 31) ? 0u : u) >> shift & mask) == b;
    }
    return n_out;
}

// The buckets of the selection's first level: the leading 11 bits of a non-negative F32 pattern (the exponent and
// three bits of the mantissa: an eighth of an octave each)
static constexpr int H2O_GAP_SHIFT = 20;
static constexpr int H2O_GAP_WIDTH = 11;

// The histogram of v[0..m) by bits [shift, shift + width) of their patterns (a negative value's taken as 0), into
// hist[0 .. 2^width). Four interleaved histograms, summed at the end, so that a count does not wait for the last
// one's store when values share a bucket.
static void h2o_bits_histogram(int32_t * hist, const float * v, int64_t m, int shift, int width) {
    thread_local std::vector<int32_t> h4;
    const int nb = 1 << width;
    h4.assign(4*nb, 0);
    const auto key = [&](float f) {
        uint32_t u;
        memcpy(&u, &f, sizeof(u));
        return ((u >> 31) ? 0u : u) >> shift & (nb - 1);
    };
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        h4[0*nb + key(v[i + 0])]++;
        h4[1*nb + key(v[i + 1])]++;
        h4[2*nb + key(v[i + 2])]++;
        h4[3*nb + key(v[i + 3])]++;
    }
    for (; i < m; ++i) {
        h4[key(v[i])]++;
    }
    for (int j = 0; j < nb; ++j) {
        hist[j] = h4[j] + h4[nb + j] + h4[2*nb + j] + h4[3*nb + j];
    }
}

// The k-th smallest of n non-negative values (1 <= k <= n), by their bit patterns
// (non-negative floats order as their bit patterns do): a histogram of the leading 11 bits (hist1, when the caller
// has it) finds the bucket that holds it, a histogram of the next 10 bits over that bucket's values the sub-bucket,
// whose few values are searched. No pass branches on the values: the values near the cut fall in a bucket at random,
// and branching on them was most of this function's time.
static float h2o_kth_smallest(const float * x, int64_t n, int64_t k, const int32_t * hist1) {
    thread_local std::vector<int32_t> hist;
    thread_local std::vector<float>   buf;
    buf.resize(2*n);
    float * lvl1 = buf.data();     // the bucket's values
    float * lvl2 = buf.data() + n; // the sub-bucket's
    // the bucket of v[0..m) by bits [shift, shift + width) that holds the k-th smallest: its values into out, returns
    // their number; k becomes the rank within it
    const auto narrow = [&](const float * v, int64_t m, int shift, int width, const int32_t * given, float * out) {
        const int32_t * h = given;
        if (h == nullptr) {
            hist.resize(1 << width);
            h2o_bits_histogram(hist.data(), v, m, shift, width);
            h = hist.data();
        }
        uint32_t b = 0;
        while (k > h[b]) {
            k -= h[b++];
        }
        return h2o_bucket_values(out, v, m, shift, width, b);
    };
    const int64_t n1 = narrow(x,    n,  H2O_GAP_SHIFT, H2O_GAP_WIDTH, hist1,   lvl1);
    const int64_t n2 = narrow(lvl1, n1, 10,            10,            nullptr, lvl2);
    std::nth_element(lvl2, lvl2 + (k - 1), lvl2 + n2);
    return lvl2[k - 1];
}

// The positions base + i of the gaps g[0..n) at most cut, ascending, into list; returns their number. Without branches
// on the gaps, which fall either side of the cut at random.
static int64_t h2o_positions_at_most(int32_t * list, const float * g, int64_t n, float cut, int32_t base) {
    int64_t i      = 0;
    int64_t n_list = 0;
#if defined(__AVX512F__)
    const __m512  vcut = _mm512_set1_ps(cut);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (; i + 16 <= n; i += 16) {
        const __mmask16 le = _mm512_cmp_ps_mask(_mm512_loadu_ps(g + i), vcut, _CMP_LE_OQ);
        _mm512_mask_compressstoreu_epi32(list + n_list, le, idx);
        n_list += _mm_popcnt_u32(le);
        idx = _mm512_add_epi32(idx, step);
    }
#endif
    for (; i < n; ++i) {
        list[n_list] = base + (int32_t) i;
        n_list += g[i] <= cut;
    }
    return n_list;
}

// The scratch the threads share (params->wdata), per group g of query heads (one query token, one KV head):
//   est   [g][n_gqa][max_pos]: each head's estimated logit of each candidate position
//   stat  [g][max_units][n_gqa]: each estimate unit's maximum per head
//   gap   [g][max_pos]:        each candidate's gap below the heads' best estimates (the least over the heads)
//   list  [g][max_pos]:        the positions attended to, ascending
//   part  [g][max_spans][n_gqa][2 + Dv]: each span's partial softmax per head (maximum, sum, weighted values)
struct h2o_decode_scratch {
    int64_t max_pos;
    int64_t max_units;
    int64_t max_spans;
    int64_t n_gqa;
    int64_t Dv;
    size_t  size;
    float   * est;
    float   * stat;
    float   * gap;
    int32_t * list;
    float   * part;
    int64_t * taken; // per group, the candidates its list took (h2o_decode_select)

    h2o_decode_scratch(const ggml_tensor * dst, void * wdata) {
        const ggml_tensor * q    = dst->src[0];
        const ggml_tensor * k    = dst->src[1];
        const ggml_tensor * v    = dst->src[2];
        const ggml_tensor * summ = dst->src[3];
        const int64_t n_groups = q->ne[3]*q->ne[2]*k->ne[1];
        max_pos   = std::max<int64_t>(summ->ne[2], 1)*GGML_H2O_DECODE_BLOCK;
        max_units = (std::max<int64_t>(summ->ne[2], 1) + H2O_DECODE_EST_SPAN - 1)/H2O_DECODE_EST_SPAN;
        max_spans = (max_pos + H2O_DECODE_SPAN - 1)/H2O_DECODE_SPAN;
        n_gqa     = q->ne[1]/k->ne[1];
        Dv        = v->ne[0];
        const size_t o_stat  = n_groups*n_gqa*max_pos*sizeof(float);
        const size_t o_gap   = o_stat + n_groups*max_units*n_gqa*sizeof(float);
        const size_t o_list  = o_gap + n_groups*max_pos*sizeof(float);
        const size_t o_part  = o_list + n_groups*max_pos*sizeof(int32_t);
        const size_t o_taken = o_part + n_groups*max_spans*n_gqa*(2 + Dv)*sizeof(float);
        size  = o_taken + n_groups*sizeof(int64_t);
        est   = (float *) wdata;
        stat  = wdata ? (float *)   ((char *) wdata + o_stat)  : nullptr;
        gap   = wdata ? (float *)   ((char *) wdata + o_gap)   : nullptr;
        list  = wdata ? (int32_t *) ((char *) wdata + o_list)  : nullptr;
        part  = wdata ? (float *)   ((char *) wdata + o_part)  : nullptr;
        taken = wdata ? (int64_t *) ((char *) wdata + o_taken) : nullptr;
    }

    float   * est_of(int64_t g)              const { return est + g*n_gqa*max_pos; }
    float   * stat_of(int64_t g, int64_t u)  const { return stat + (g*max_units + u)*n_gqa; }
    float   * gap_of(int64_t g)              const { return gap + g*max_pos; }
    int32_t * list_of(int64_t g)             const { return list + g*max_pos; }
    float   * part_of(int64_t g, int64_t sp) const { return part + (g*max_spans + sp)*n_gqa*(2 + Dv); }
};

size_t ggml_h2o_decode_work_size(const ggml_tensor * dst) {
    return h2o_decode_scratch(dst, nullptr).size;
}

// Asks for the cache lines of rows [p0, p1) of a KV head ahead of their use: the positions a step attends to lie
// apart in the cache, and the hardware prefetcher does not follow from one to the next
static void h2o_prefetch_rows(const char * head, size_t nb_row, size_t row_size, int64_t p0, int64_t p1) {
#if defined(__GNUC__)
    for (int64_t p = p0; p < p1; ++p) {
        for (size_t o = 0; o < row_size; o += 64) {
            __builtin_prefetch(head + p*nb_row + o);
        }
    }
#else
    GGML_UNUSED(head); GGML_UNUSED(nb_row); GGML_UNUSED(row_size); GGML_UNUSED(p0); GGML_UNUSED(p1);
#endif
}

// The R channels of a KV head's sketch: those whose keys over positions [0, n) hold the most energy (sum of
// squares), ties to the lower channel, ascending. A logit's bulk sits in few channels (rotary pairs of low
// frequency), so their products rank positions about as the whole key does, from a quarter of the reads.
static void h2o_decode_channels(int32_t * chan, int64_t R, const char * k_head, size_t nb_pos, const h2o_row_type & kt,
        int64_t D, int64_t n) {
    thread_local std::vector<float>   kf;
    thread_local std::vector<float>   part; // F32 sums of a block of positions, which the compiler vectorises
    thread_local std::vector<double>  energy;
    kf.resize(D);
    part.resize(D);
    energy.assign(D, 0.0);
    for (int64_t p0 = 0; p0 < n; p0 += GGML_H2O_DECODE_BLOCK) {
        std::fill(part.begin(), part.end(), 0.0f);
        for (int64_t p = p0; p < std::min<int64_t>(p0 + GGML_H2O_DECODE_BLOCK, n); ++p) {
            kt.to_f32(k_head + p*nb_pos, kf.data(), D);
            for (int64_t d = 0; d < D; ++d) {
                part[d] += kf[d]*kf[d];
            }
        }
        for (int64_t d = 0; d < D; ++d) {
            energy[d] += part[d];
        }
    }
    h2o_strongest_channels(chan, energy.data(), D, R);
}

// A vector of F32 lanes for the decode op's inner loops, which read keys, values and sketches as F16 and convert them
// in registers: AVX-512, or AVX2 with F16C and FMA. Other CPUs take the generic paths.
#if defined(__AVX512F__) && defined(__F16C__)
#define H2O_VF_LANES 16
typedef __m512 h2o_vf;
static inline h2o_vf h2o_vf_zero()                              { return _mm512_setzero_ps(); }
static inline h2o_vf h2o_vf_set1(float x)                       { return _mm512_set1_ps(x); }
static inline h2o_vf h2o_vf_load(const float * x)               { return _mm512_loadu_ps(x); }
static inline h2o_vf h2o_vf_load_f16(const ggml_fp16_t * x)     { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) x)); }
static inline void   h2o_vf_store(float * y, h2o_vf v)          { _mm512_storeu_ps(y, v); }
static inline h2o_vf h2o_vf_fma(h2o_vf acc, h2o_vf a, h2o_vf b) { return _mm512_fmadd_ps(a, b, acc); }
static inline float  h2o_vf_sum(h2o_vf v)                       { return _mm512_reduce_add_ps(v); }
static inline h2o_vf h2o_vf_max(h2o_vf a, h2o_vf b)             { return _mm512_max_ps(a, b); }
static inline float  h2o_vf_hmax(h2o_vf v)                      { return _mm512_reduce_max_ps(v); }
static inline h2o_vf h2o_vf_nan_to_ninf(h2o_vf v) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, _mm512_set1_ps(-INFINITY));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define H2O_VF_LANES 8
typedef __m256 h2o_vf;
static inline h2o_vf h2o_vf_zero()                              { return _mm256_setzero_ps(); }
static inline h2o_vf h2o_vf_set1(float x)                       { return _mm256_set1_ps(x); }
static inline h2o_vf h2o_vf_load(const float * x)               { return _mm256_loadu_ps(x); }
static inline h2o_vf h2o_vf_load_f16(const ggml_fp16_t * x)     { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) x)); }
static inline void   h2o_vf_store(float * y, h2o_vf v)          { _mm256_storeu_ps(y, v); }
static inline h2o_vf h2o_vf_fma(h2o_vf acc, h2o_vf a, h2o_vf b) { return _mm256_fmadd_ps(a, b, acc); }
static inline float  h2o_vf_sum(h2o_vf v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline h2o_vf h2o_vf_nan_to_ninf(h2o_vf v) {
    return _mm256_blendv_ps(v, _mm256_set1_ps(-INFINITY), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
static inline h2o_vf h2o_vf_max(h2o_vf a, h2o_vf b) { return _mm256_max_ps(a, b); }
static inline float  h2o_vf_hmax(h2o_vf v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif

// The decode op's vector loops keep their sums in registers, which takes loops of compile-time bounds (with a bound
// known only at run time the compiler kept them on the stack, a load and a store around every fused multiply-add):
// each is a template over the query heads it takes at once, at most H2O_DECODE_HEADS, and h2o_decode_heads runs it
// over a group's heads.
#if defined(H2O_VF_LANES)
static constexpr int H2O_DECODE_HEADS = H2O_VF_LANES == 16 ? 4 : 2; // 32 vector registers, or 16

template <template <int> class F, typename... Args>
static inline void h2o_decode_heads(int64_t n_gqa, Args... args) {
    int64_t r = 0;
    for (; r + H2O_DECODE_HEADS <= n_gqa; r += H2O_DECODE_HEADS) {
        F<H2O_DECODE_HEADS>::run(r, args...);
    }
    switch (n_gqa - r) {
        case 3: F<3>::run(r, args...); break;
        case 2: F<2>::run(r, args...); break;
        case 1: F<1>::run(r, args...); break;
        default: break;
    }
}
#endif

// The 8-bit sketch of R values x (a key's, or a pre-scaled query's, on the sketch's channels): q[c] = x[c]*(127/a)
// rounded to nearest even, for a their largest magnitude, and the scale a/127 returned, so that x[c] ~ q[c]*scale
// (|q[c]| <= 127, since |x[c]| <= a). Zeros (and values so small that 127/a overflows) take scale 0 and q 0; values
// with a NaN or an infinity scale NaN (their estimates are -inf) and q 0. The CUDA kernels quantize alike
// (h2o_dec_quantize), so that both backends choose the same.
static float h2o_sketch_quantize(int8_t * q, const float * x, int64_t R) {
    float a      = 0.0f;
    bool  finite = true;
    for (int64_t c = 0; c < R; ++c) {
        finite = finite && std::isfinite(x[c]);
        a = std::max(a, std::fabs(x[c]));
    }
    const float inv = 127.0f/a;
    if (!finite || std::isinf(inv)) {
        std::fill(q, q + R, 0);
        return finite ? 0.0f : NAN;
    }
    for (int64_t c = 0; c < R; ++c) {
        q[c] = (int8_t) std::nearbyint(x[c]*inv);
    }
    return a/127.0f;
}

// A group's queries on the sketch's channels, 8 bits each (h2o_sketch_quantize): per head its channels in quads, the
// four of a quad in one int32 (byte c%4, the layout of the key sketch's quads), 128 times the sum of its values (the
// key sketch stores each value plus 128, for the unsigned-by-signed dot products) and its scale
struct h2o_sketch_queries {
    std::vector<int32_t> quad;   // [n_gqa][R/4]
    std::vector<int32_t> offset; // [n_gqa]
    std::vector<float>   scale;  // [n_gqa]
    std::vector<int8_t>  q8;     // one head's values, while they are set

    void set(const float * qr, int64_t n_gqa, int64_t R) {
        quad.resize(n_gqa*R/4);
        offset.resize(n_gqa);
        scale.resize(n_gqa);
        q8.resize(R);
        for (int64_t r = 0; r < n_gqa; ++r) {
            scale[r] = h2o_sketch_quantize(q8.data(), qr + r*R, R);
            memcpy(quad.data() + r*R/4, q8.data(), R);
            int32_t sum = 0;
            for (int64_t c = 0; c < R; ++c) {
                sum += q8[c];
            }
            offset[r] = 128*sum;
        }
    }
};

// Where position j's channel c and its scale lie in a block's sketch ([R/4 quads][B positions][4] bytes, each value
// plus 128, then B F32 scales)
static inline size_t h2o_sketch_at(int64_t c, int64_t j)  { return (c/4)*GGML_H2O_DECODE_BLOCK*4 + j*4 + c%4; }
static inline size_t h2o_sketch_scale_at(int64_t R, int64_t j) { return R*GGML_H2O_DECODE_BLOCK + j*sizeof(float); }

// The estimated logits of nb sketched blocks (block i's sketch at sk + i*sk_stride bytes) for the group's n_gqa heads:
// est[r*stride + i*B + j] = ((float) d*sq)*sk for d the integer dot product of head r's 8-bit query with position j's
// sketch, sq and sk their scales, the product the CUDA kernel forms too, so that both choose the same positions; NaN
// becomes -inf. mx[r] takes head r's maximum of them. AVX-512 VNNI sums four channels a lane per instruction (the
// sketch's values plus 128, unsigned, by the query's, signed, less 128 times the query's sum); AVX2 sums them in
// pairs of 16-bit products (the values signed, at most 2*127*127 a pair); several blocks at once keep several sums
// going.
static constexpr int64_t H2O_DECODE_EST_AT_ONCE = 4; // blocks, at most
#if defined(H2O_VF_LANES) && ((defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX2__))
#define H2O_SKETCH_SIMD
template <int NB>
struct h2o_estimate_tile {
    template <int NH>
    struct heads {
        static void run(int64_t r0, float * est, size_t stride, float * mx, const h2o_sketch_queries & qs, int64_t R,
                const uint8_t * sk, size_t sk_stride) {
            constexpr int B = GGML_H2O_DECODE_BLOCK;
            const int64_t n_quad = R/4;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
            static_assert(B == 16, "a block of positions is one vector of int32 lanes");
            __m512i acc[NH][NB];
            for (int h = 0; h < NH; ++h) {
                for (int v = 0; v < NB; ++v) {
                    acc[h][v] = _mm512_setzero_si512();
                }
            }
            for (int64_t cq = 0; cq < n_quad; ++cq) {
                __m512i kv[NB];
                for (int v = 0; v < NB; ++v) {
                    kv[v] = _mm512_loadu_si512((const void *) (sk + v*sk_stride + cq*B*4));
                }
                for (int h = 0; h < NH; ++h) {
                    const __m512i qv = _mm512_set1_epi32(qs.quad[(r0 + h)*n_quad + cq]);
                    for (int v = 0; v < NB; ++v) {
                        acc[h][v] = _mm512_dpbusd_epi32(acc[h][v], kv[v], qv);
                    }
                }
            }
            for (int h = 0; h < NH; ++h) {
                const __m512i off = _mm512_set1_epi32(qs.offset[r0 + h]);
                const __m512  sq  = _mm512_set1_ps(qs.scale[r0 + h]);
                __m512 m = _mm512_set1_ps(-INFINITY);
                for (int v = 0; v < NB; ++v) {
                    const __m512 skv = _mm512_loadu_ps((const float *) (sk + v*sk_stride + h2o_sketch_scale_at(R, 0)));
                    const __m512 d   = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[h][v], off));
                    const __m512 e   = h2o_vf_nan_to_ninf(_mm512_mul_ps(_mm512_mul_ps(d, sq), skv));
                    _mm512_storeu_ps(est + (r0 + h)*stride + v*B, e);
                    m = _mm512_max_ps(m, e);
                }
                mx[r0 + h] = std::max(mx[r0 + h], _mm512_reduce_max_ps(m));
            }
#else
            constexpr int NV = B/8; // vectors of 8 positions a block
            __m256i acc[NH][NB*NV];
            for (int h = 0; h < NH; ++h) {
                for (int v = 0; v < NB*NV; ++v) {
                    acc[h][v] = _mm256_setzero_si256();
                }
            }
            const __m256i bias = _mm256_set1_epi8((char) 0x80);
            const __m256i ones = _mm256_set1_epi16(1);
            for (int64_t cq = 0; cq < n_quad; ++cq) {
                __m256i kv[NB*NV];
                for (int v = 0; v < NB*NV; ++v) {
                    const __m256i u = _mm256_loadu_si256((const __m256i *) (sk + (v/NV)*sk_stride + cq*B*4 + (v%NV)*32));
                    kv[v] = _mm256_xor_si256(u, bias); // the signed values
                }
                for (int h = 0; h < NH; ++h) {
                    const __m256i qv = _mm256_set1_epi32(qs.quad[(r0 + h)*n_quad + cq]);
                    const __m256i qa = _mm256_sign_epi8(qv, qv);
                    for (int v = 0; v < NB*NV; ++v) {
                        const __m256i p = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(kv[v], qv));
                        acc[h][v] = _mm256_add_epi32(acc[h][v], _mm256_madd_epi16(p, ones));
                    }
                }
            }
            for (int h = 0; h < NH; ++h) {
                const __m256 sq = _mm256_set1_ps(qs.scale[r0 + h]);
                __m256 m = _mm256_set1_ps(-INFINITY);
                for (int v = 0; v < NB*NV; ++v) {
                    const __m256 skv = _mm256_loadu_ps((const float *) (sk + (v/NV)*sk_stride + h2o_sketch_scale_at(R, (v%NV)*8)));
                    const __m256 d   = _mm256_cvtepi32_ps(acc[h][v]);
                    __m256 e = _mm256_mul_ps(_mm256_mul_ps(d, sq), skv);
                    e = _mm256_blendv_ps(e, _mm256_set1_ps(-INFINITY), _mm256_cmp_ps(e, e, _CMP_UNORD_Q));
                    _mm256_storeu_ps(est + (r0 + h)*stride + (v/NV)*B + (v%NV)*8, e);
                    m = _mm256_max_ps(m, e);
                }
                __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
                x = _mm_max_ps(x, _mm_movehl_ps(x, x));
                x = _mm_max_ss(x, _mm_movehdup_ps(x));
                mx[r0 + h] = std::max(mx[r0 + h], _mm_cvtss_f32(x));
            }
#endif
        }
    };
};
#endif

static void h2o_estimate_blocks(float * est, size_t stride, float * mx, const h2o_sketch_queries & qs,
        const uint8_t * sk, size_t sk_stride, int64_t nb, int64_t n_gqa, int64_t R) {
    constexpr int64_t B = GGML_H2O_DECODE_BLOCK;
#if defined(H2O_SKETCH_SIMD)
    int64_t i = 0;
    for (; i + H2O_DECODE_EST_AT_ONCE <= nb; i += H2O_DECODE_EST_AT_ONCE) {
        h2o_decode_heads<h2o_estimate_tile<H2O_DECODE_EST_AT_ONCE>::template heads>(n_gqa, est + i*B, stride, mx,
                std::cref(qs), R, sk + i*sk_stride, sk_stride);
    }
    for (; i < nb; ++i) {
        h2o_decode_heads<h2o_estimate_tile<1>::template heads>(n_gqa, est + i*B, stride, mx, std::cref(qs), R,
                sk + i*sk_stride, sk_stride);
    }
#else
    for (int64_t i = 0; i < nb; ++i) {
        const uint8_t * blk = sk + i*sk_stride;
        for (int64_t r = 0; r < n_gqa; ++r) {
            const int8_t * q8 = (const int8_t *) (qs.quad.data() + r*R/4);
            for (int64_t j = 0; j < B; ++j) {
                int32_t d = 0;
                for (int64_t c = 0; c < R; ++c) {
                    d += q8[c]*((int32_t) blk[h2o_sketch_at(c, j)] - 128);
                }
                float skj;
                memcpy(&skj, blk + h2o_sketch_scale_at(R, j), sizeof(skj));
                const float e = ((float) d*qs.scale[r])*skj;
                est[r*stride + i*B + j] = std::isnan(e) ? -INFINITY : e;
                mx[r] = std::max(mx[r], est[r*stride + i*B + j]);
            }
        }
    }
#endif
}

#if defined(H2O_VF_LANES)
// The logits of one F16 key row for heads r0.. of the group, pre-scaled queries qg [n_gqa][D]: x[r*stride]
template <int NH>
struct h2o_decode_dots_f16 {
    static void run(int64_t r0, float * x, size_t stride, const float * qg, const ggml_fp16_t * krow, int64_t D) {
        h2o_vf acc[NH];
        for (int h = 0; h < NH; ++h) {
            acc[h] = h2o_vf_zero();
        }
        for (int64_t d = 0; d < D; d += H2O_VF_LANES) {
            const h2o_vf kv = h2o_vf_load_f16(krow + d);
            for (int h = 0; h < NH; ++h) {
                acc[h] = h2o_vf_fma(acc[h], h2o_vf_load(qg + (r0 + h)*D + d), kv);
            }
        }
        for (int h = 0; h < NH; ++h) {
            x[(r0 + h)*stride] = h2o_vf_sum(acc[h]);
        }
    }
};

// channels of a value row that the weighted sum takes at once, per head (their accumulators stay in registers)
static constexpr int64_t H2O_DECODE_DV_TILE = 4*H2O_VF_LANES;

// The weighted sum of the F16 value rows of nk positions for heads r0.. of the group, channels [d0, d0 + tile):
// out[r*out_stride + d] = sum over j of w[r*w_stride + j] * v(rows[j])[d]
template <int NH>
struct h2o_decode_values_f16 {
    static void run(int64_t r0, float * out, size_t out_stride, const float * w, size_t w_stride, const int32_t * rows,
            int64_t nk, const char * v_head, size_t nb_row, int64_t d0) {
        constexpr int NV = H2O_DECODE_DV_TILE/H2O_VF_LANES;
        h2o_vf acc[NH][NV];
        for (int h = 0; h < NH; ++h) {
            for (int v = 0; v < NV; ++v) {
                acc[h][v] = h2o_vf_zero();
            }
        }
        for (int64_t j = 0; j < nk; ++j) {
            const ggml_fp16_t * vrow = (const ggml_fp16_t *) (v_head + rows[j]*nb_row) + d0;
            h2o_vf vv[NV];
            for (int v = 0; v < NV; ++v) {
                vv[v] = h2o_vf_load_f16(vrow + v*H2O_VF_LANES);
            }
            for (int h = 0; h < NH; ++h) {
                const h2o_vf wv = h2o_vf_set1(w[(r0 + h)*w_stride + j]);
                for (int v = 0; v < NV; ++v) {
                    acc[h][v] = h2o_vf_fma(acc[h][v], wv, vv[v]);
                }
            }
        }
        for (int h = 0; h < NH; ++h) {
            for (int v = 0; v < NV; ++v) {
                h2o_vf_store(out + (r0 + h)*out_stride + d0 + v*H2O_VF_LANES, acc[h][v]);
            }
        }
    }
};
#endif

// the group's queries, pre-scaled, [n_gqa][D], then on the sketch's channels [n_gqa][R]
static void h2o_decode_queries(float * qg, const ggml_tensor * dst, const int32_t * chan, int64_t ikv, int64_t t,
        int64_t s) {
    const ggml_tensor * q = dst->src[0];
    const int64_t D     = q->ne[0];
    const int64_t R     = D/4;
    const int64_t n_gqa = q->ne[1]/dst->src[1]->ne[1];
    for (int64_t r = 0; r < n_gqa; ++r) {
        const int64_t ih = ikv*n_gqa + r;
        const float scale = h2o_logits_of(dst, ih).scale;
        const float * qrow = (const float *) ((const char *) q->data + ih*q->nb[1] + t*q->nb[2] + s*q->nb[3]);
        for (int64_t d = 0; d < D; ++d) {
            qg[r*D + d] = qrow[d]*scale;
        }
        for (int64_t c = 0; c < R; ++c) {
            qg[n_gqa*D + r*R + c] = qrow[chan[c]]*scale;
        }
    }
}

// What a candidate of the first-level bucket b weighs when the choice follows coverage: exp(-x) for x the least gap
// of the bucket (the share of its best head's best candidate's attention), in units of 2^-24, so that the sums are
// integers that every backend adds up alike (the CUDA kernel's h2o_dec_bucket_weight); 0 for infinite gaps (a group
// with no estimate) and beyond
static uint64_t h2o_decode_bucket_weight(uint32_t b) {
    const uint32_t bits = b << H2O_GAP_SHIFT;
    if (bits >= 0x7f800000u) {
        return 0;
    }
    float x;
    memcpy(&x, &bits, sizeof(x));
    return (uint64_t) (std::exp(-(double) x)*16777216.0 + 0.5);
}

// The candidates that coverage takes, from the first-level histogram of a group's gaps: whole buckets from the least
// gaps until their weight reaches the share `coverage` of all candidates' (ggml_h2o_decode_set_coverage); all of them
// when no candidate weighs anything
static int64_t h2o_decode_coverage_take(const int32_t * hist1, int64_t n_cand, float coverage) {
    static const std::vector<uint64_t> weight = [] {
        std::vector<uint64_t> w(1 << H2O_GAP_WIDTH);
        for (uint32_t b = 0; b < w.size(); ++b) {
            w[b] = h2o_decode_bucket_weight(b);
        }
        return w;
    }();
    uint64_t total = 0;
    for (size_t b = 0; b < weight.size(); ++b) {
        total += (uint64_t) hist1[b]*weight[b];
    }
    if (total == 0) {
        return n_cand;
    }
    const uint64_t need = (uint64_t) std::ceil((double) coverage*(double) total);
    uint64_t held  = 0;
    int64_t  taken = 0;
    for (size_t b = 0; b < weight.size(); ++b) {
        held  += (uint64_t) hist1[b]*weight[b];
        taken += hist1[b];
        if (held >= need) {
            break;
        }
    }
    return taken;
}

// One group's list of the positions it attends to, ascending: the sinks, the n_take least gaps (ties to the earlier
// position), or fewer where coverage < 1 holds its share with fewer, and the recent window; returns the positions taken
// from the candidates
static int64_t h2o_decode_select(int32_t * list, const float * gap, const h2o_decode_shape & sh, float coverage) {
    thread_local std::vector<int32_t> hist1;
    int64_t n_list = 0;
    int64_t n_take = sh.chooses() ? sh.n_take : sh.n_cand;
    for (int64_t p = 0; p < sh.sink_end; ++p) {
        list[n_list++] = (int32_t) p;
    }
    if (sh.chooses() && sh.n_take > 0) {
        hist1.resize(1 << H2O_GAP_WIDTH);
        h2o_bits_histogram(hist1.data(), gap, sh.n_cand, H2O_GAP_SHIFT, H2O_GAP_WIDTH);
        if (coverage < 1.0f) {
            n_take = std::min(n_take, h2o_decode_coverage_take(hist1.data(), sh.n_cand, coverage));
        }
        // every gap at most the n_take-th least, then, where more equal it than are taken, the last of those equal to
        // it dropped
        const float cut = h2o_kth_smallest(gap, sh.n_cand, n_take, hist1.data());
        int64_t n_at_most = h2o_positions_at_most(list + n_list, gap, sh.n_cand, cut, (int32_t) sh.sink_end);
        for (int64_t j = n_list + n_at_most - 1, extra = n_at_most - n_take; extra > 0; --j) {
            if (gap[list[j] - sh.sink_end] == cut) {
                memmove(list + j, list + j + 1, (n_list + n_at_most - j - 1)*sizeof(int32_t));
                --n_at_most;
                --extra;
            }
        }
        n_list += n_at_most;
    } else if (!sh.chooses()) {
        for (int64_t p = sh.sink_end; p < sh.recent_begin; ++p) {
            list[n_list++] = (int32_t) p;
        }
    }
    for (int64_t p = sh.recent_begin; p < sh.n; ++p) {
        list[n_list++] = (int32_t) p;
    }
    GGML_ASSERT(n_list == sh.n_list - sh.n_take + n_take);
    return n_take;
}

// One call of the decode op: its tensors, shapes and scratch, and the stages that the threads run one after another,
// a barrier between each (ggml_compute_forward_h2o_decode): 1. sketch the blocks completed since the last call,
// 2. estimate each candidate's logit from the sketches, 3. each candidate's gap below its heads' best, 4. choose the
// positions each group attends to, 5. attend to them in spans, 6. merge the spans per query head.
struct h2o_decode_step {
    const ggml_compute_params * params;
    ggml_tensor * dst;

    const ggml_tensor * q;
    const ggml_tensor * k;
    const ggml_tensor * v;
          ggml_tensor * summ;
          ggml_tensor * summ_n;
    const ggml_tensor * mask;

    int32_t n_sink;
    int32_t n_local;
    int32_t n_budget;
    float   coverage;

    int64_t B;
    int64_t D;
    int64_t R;
    int64_t Dv;
    int64_t n_head;
    int64_t n_tokens;
    int64_t n_stream;
    int64_t n_head_kv;
    int64_t n_gqa;
    int64_t n_groups;

    h2o_row_type kt;
    h2o_row_type vt;

    h2o_decode_scratch scratch;

    // every thread finds each query's open cells, [n_stream][n_tokens], and each stream's blocks sketched once step 1
    // is done, [n_stream], read before thread 0 updates the count (buffers of the thread, kept across calls)
    std::vector<int64_t> & extent;
    std::vector<int64_t> & n_sketched;

    // the estimate's units (runs of a group's candidate blocks), each thread a range of them in order, so that it
    // reads the sketches of its run of units as one stream; step 3 takes the same units, whose estimates its thread
    // holds
    int64_t n_est_units = 0;

    h2o_decode_step(const ggml_compute_params * params, ggml_tensor * dst) :
        params(params), dst(dst),
        q(dst->src[0]), k(dst->src[1]), v(dst->src[2]), summ(dst->src[3]), summ_n(dst->src[4]), mask(dst->src[5]),
        n_sink  (ggml_get_op_params_i32(dst, GGML_H2O_DECODE_SINK)),
        n_local (ggml_get_op_params_i32(dst, GGML_H2O_DECODE_LOCAL)),
        n_budget(ggml_get_op_params_i32(dst, GGML_H2O_DECODE_BUDGET)),
        coverage(ggml_get_op_params_f32(dst, GGML_H2O_DECODE_COVERAGE)),
        B(GGML_H2O_DECODE_BLOCK), D(q->ne[0]), R(D/4), Dv(v->ne[0]), n_head(q->ne[1]), n_tokens(q->ne[2]),
        n_stream(q->ne[3]), n_head_kv(k->ne[1]), n_gqa(n_head/n_head_kv), n_groups(n_stream*n_tokens*n_head_kv),
        kt(k->type), vt(v->type),
        scratch(dst, params->wdata),
        extent(thread_buffer<0>()), n_sketched(thread_buffer<1>()) {
        extent.resize(n_stream*n_tokens);
        for (int64_t s = 0; s < n_stream; ++s) {
            for (int64_t t = 0; t < n_tokens; ++t) {
                extent[s*n_tokens + t] = h2o_decode_extent(mask, t, s);
            }
        }
        n_sketched.resize(n_stream);
        for (int64_t s = 0; s < n_stream; ++s) {
            n_sketched[s] = std::max<int64_t>(*sketched(s), n_complete(s));
        }
        for (int64_t g = 0; g < n_groups; ++g) {
            const h2o_decode_shape sh = shape_of(g);
            if (sh.chooses()) {
                const int64_t n_cb = sh.n_cand/B;
                n_est_units += est_units_of(n_cb, h2o_decode_run_len(n_cb, H2O_DECODE_EST_SPAN));
            }
        }
    }

    template <int tag>
    static std::vector<int64_t> & thread_buffer() {
        thread_local std::vector<int64_t> buf;
        return buf;
    }

    // per stream: blocks sketched, then each KV head's channels, then the stream's own sink and budget (-1: the op's)
    int32_t * sketched(int64_t s) const { return (int32_t *) ((char *) summ_n->data + s*summ_n->nb[1]); }
    int32_t * channels(int64_t s, int64_t ikv) const { return sketched(s) + 1 + ikv*R; }
    int32_t sink_of(int64_t s) const {
        const int32_t own = sketched(s)[summ_n->ne[0] - 2];
        return own >= 0 ? own : n_sink;
    }
    int32_t budget_of(int64_t s) const {
        const int32_t own = sketched(s)[summ_n->ne[0] - 1];
        return own >= 0 ? own : n_budget;
    }

    // each stream's complete blocks: those of its shortest query
    int64_t n_complete(int64_t s) const {
        int64_t n = extent[s*n_tokens];
        for (int64_t t = 1; t < n_tokens; ++t) {
            n = std::min(n, extent[s*n_tokens + t]);
        }
        return std::min<int64_t>(n/B, summ->ne[2]);
    }

    // group g: KV head g % n_head_kv of query token t of stream s, g / n_head_kv = s*n_tokens + t
    h2o_decode_shape shape_of(int64_t g) const {
        const int64_t s = g/(n_head_kv*n_tokens);
        return h2o_decode_shape(extent[g/n_head_kv], n_sketched[s], sink_of(s), n_local, budget_of(s));
    }

    uint8_t * sketch_of(int64_t s, int64_t ikv, int64_t b) const {
        return (uint8_t *) summ->data + ikv*summ->nb[1] + b*summ->nb[2] + s*summ->nb[3];
    }

    static int64_t est_units_of(int64_t n_cb, int64_t len) { return (n_cb + len - 1)/len; }

    bool est_unit_mine(int64_t unit) const {
        return unit >= params->ith*n_est_units/params->nth && unit < (params->ith + 1)*n_est_units/params->nth;
    }

    // the length of a group's list, once chosen
    int64_t listed(int64_t g) const {
        const h2o_decode_shape sh = shape_of(g);
        return sh.n_list - sh.n_take + scratch.taken[g];
    }

    // 1. sketch the blocks completed since the last call, per stream and KV head, after choosing the channels
    // where nothing is sketched yet
    void sketch_new_blocks() const {
        thread_local std::vector<float> kf;
        thread_local std::vector<float> xs; // a key on the sketch's channels
        thread_local std::vector<int8_t> x8;
        kf.resize(D);
        xs.resize(R);
        x8.resize(R);
        for (int64_t w = params->ith; w < n_stream*n_head_kv; w += params->nth) {
            const int64_t s   = w/n_head_kv;
            const int64_t ikv = w%n_head_kv;
            const char * k_head = (const char *) k->data + ikv*k->nb[1] + s*k->nb[3];
            const int64_t b0 = *sketched(s);
            const int64_t b1 = n_complete(s);
            if (b0 == 0 && b1 > 0) {
                h2o_decode_channels(channels(s, ikv), R, k_head, k->nb[2], kt, D, b1*B);
            }
            const int32_t * chan = channels(s, ikv);
            for (int64_t b = b0; b < b1; ++b) {
                uint8_t * sk = sketch_of(s, ikv, b);
                for (int64_t j = 0; j < B; ++j) {
                    kt.to_f32(k_head + (b*B + j)*k->nb[2], kf.data(), D);
                    for (int64_t c = 0; c < R; ++c) {
                        xs[c] = kf[chan[c]];
                    }
                    const float scale = h2o_sketch_quantize(x8.data(), xs.data(), R);
                    for (int64_t c = 0; c < R; ++c) {
                        sk[h2o_sketch_at(c, j)] = (uint8_t) (x8[c] + 128);
                    }
                    memcpy(sk + h2o_sketch_scale_at(R, j), &scale, sizeof(scale));
                }
            }
        }
    }

    // 2. each query head's estimate of its logit at every candidate position, from the sketch: for a block, the
    // integer products of the group's 8-bit queries on the sketch's channels with the block's sketch, scaled
    void estimate() const {
        thread_local std::vector<float> qg; // [n_gqa][D], then [n_gqa][R]
        qg.resize(n_gqa*(D + R));
        thread_local h2o_sketch_queries qs;
        int64_t unit = 0;
        for (int64_t g = 0; g < n_groups; ++g) {
            const h2o_decode_shape sh = shape_of(g);
            if (!sh.chooses()) {
                continue;
            }
            const int64_t ikv = g%n_head_kv;
            const int64_t t   = (g/n_head_kv)%n_tokens;
            const int64_t s   = g/(n_head_kv*n_tokens);
            const int64_t blk0 = sh.sink_end/B;
            const int64_t n_cb = sh.n_cand/B;
            bool have_q = false;
            const int64_t len  = h2o_decode_run_len(n_cb, H2O_DECODE_EST_SPAN);
            for (int64_t i0 = 0; i0 < n_cb; i0 += len, ++unit) {
                if (!est_unit_mine(unit)) {
                    continue;
                }
                if (!have_q) {
                    h2o_decode_queries(qg.data(), dst, channels(s, ikv), ikv, t, s);
                    qs.set(qg.data() + n_gqa*D, n_gqa, R);
                    have_q = true;
                }
                const int64_t i1 = std::min(i0 + len, n_cb);
                const size_t sk_stride = summ->nb[2]; // bytes from one block's sketch to the next
                // the unit's maximum per head, for the gaps
                float * mx = scratch.stat_of(g, i0/len);
                std::fill(mx, mx + n_gqa, -INFINITY);
                for (int64_t i = i0; i < i1; i += H2O_DECODE_EST_AT_ONCE) {
                    for (int64_t ip = i + 2*H2O_DECODE_EST_AT_ONCE; ip < std::min(i + 3*H2O_DECODE_EST_AT_ONCE, i1); ++ip) {
                        h2o_prefetch_rows((const char *) sketch_of(s, ikv, blk0 + ip), 0, summ->ne[0], 0, 1);
                    }
                    h2o_estimate_blocks(scratch.est_of(g) + i*B, scratch.max_pos, mx, qs,
                            sketch_of(s, ikv, blk0 + i), sk_stride, std::min(H2O_DECODE_EST_AT_ONCE, i1 - i), n_gqa, R);
                }
            }
        }
    }

    // 3. each candidate's gap, in the same units: how far its estimate stands below its head's best, the least over
    // the group's heads, so that a position any head points at counts and a head with small logits counts as much
    // as one with large ones
    void gaps() const {
        int64_t unit = 0;
        for (int64_t g = 0; g < n_groups; ++g) {
            const h2o_decode_shape sh = shape_of(g);
            if (!sh.chooses()) {
                continue;
            }
            const int64_t n_cb    = sh.n_cand/B;
            const int64_t len     = h2o_decode_run_len(n_cb, H2O_DECODE_EST_SPAN);
            const int64_t n_units = est_units_of(n_cb, len);
            for (int64_t iu = 0; iu < n_units; ++iu, ++unit) {
                if (!est_unit_mine(unit)) {
                    continue;
                }
                const int64_t j0 = iu*len*B;
                const int64_t nu = std::min(len*B, sh.n_cand - j0);
                float * gap = scratch.gap_of(g) + j0;
                std::fill(gap, gap + nu, INFINITY);
                for (int64_t r = 0; r < n_gqa; ++r) {
                    float m = -INFINITY;
                    for (int64_t v = 0; v < n_units; ++v) {
                        m = std::max(m, scratch.stat_of(g, v)[r]);
                    }
                    if (m == -INFINITY) {
                        continue; // a head with no estimate to go by adds nothing
                    }
                    const float * u = scratch.est_of(g) + r*scratch.max_pos + j0;
                    for (int64_t j = 0; j < nu; ++j) {
                        gap[j] = std::min(gap[j], m - u[j]);
                    }
                }
            }
        }
    }

    // 4. per group, the positions it attends to: the n_take least gaps (ties to the earlier position), with the
    // sinks and the recent window, ascending
    void choose() const {
        if (params->ith == 0) {
            for (int64_t s = 0; s < n_stream; ++s) {
                *sketched(s) = (int32_t) n_sketched[s];
            }
        }
        for (int64_t g = params->ith; g < n_groups; g += params->nth) {
            scratch.taken[g] = h2o_decode_select(scratch.list_of(g), scratch.gap_of(g), shape_of(g), coverage);
        }
    }

    // the positions each stream read, the mean over its KV heads (llama_h2o_decode_keys), once chosen
    void report_keys_read() const {
        if (dst->src[7] != nullptr && params->ith == 0) {
            for (int64_t s = 0; s < n_stream; ++s) {
                int64_t n_read = 0;
                for (int64_t g = s*n_tokens*n_head_kv; g < (s + 1)*n_tokens*n_head_kv; ++g) {
                    n_read += listed(g);
                }
                ((float *) dst->src[7]->data)[s] = (float) ((double) n_read/(double) (n_tokens*n_head_kv));
            }
        }
    }

    // 5. the attention, in spans of at most H2O_DECODE_SPAN positions of a group's list: each K and V row is read once
    // for all the group's heads, asked for 16 positions ahead, and each span keeps an exact partial softmax per head.
    // F16 keys and values (llama's default cache) take the vector loops, which convert rows in registers and keep
    // the heads' sums there; other types are converted row by row
    void attend() const {
        thread_local std::vector<float> qg; // [n_gqa][D], then [n_gqa][R]
        thread_local std::vector<float> kf;
        thread_local std::vector<float> vf;
        qg.resize(n_gqa*(D + R));
        kf.resize(D);
        vf.resize(Dv);
        thread_local std::vector<float> x; // [n_gqa][H2O_DECODE_SPAN]
        x.resize(n_gqa*H2O_DECODE_SPAN);
        thread_local std::vector<int32_t> open; // the span's open positions
        open.resize(H2O_DECODE_SPAN);
        thread_local std::vector<float> mv_open; // their mask values
        mv_open.resize(H2O_DECODE_SPAN);
#if defined(H2O_VF_LANES)
        const bool vector_f16 = k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16 && D % H2O_VF_LANES == 0 &&
            Dv % H2O_DECODE_DV_TILE == 0;
#else
        const bool vector_f16 = false;
#endif
        constexpr int64_t ahead = 16;
        const size_t k_row = ggml_row_size(k->type, D);
        const size_t v_row = ggml_row_size(v->type, Dv);
        int64_t unit = 0;
        for (int64_t g = 0; g < n_groups; ++g) {
            const int64_t ikv = g%n_head_kv;
            const int64_t t   = (g/n_head_kv)%n_tokens;
            const int64_t s   = g/(n_head_kv*n_tokens);
            const int32_t * list = scratch.list_of(g);
            const char * k_head = (const char *) k->data + ikv*k->nb[1] + s*k->nb[3];
            const char * v_head = (const char *) v->data + ikv*v->nb[1] + s*v->nb[3];
            const float softcap = h2o_logits_of(dst, ikv*n_gqa).softcap; // the op's, the same for every head
            bool have_q = false;
            const int64_t n_list = listed(g);
            const int64_t len = h2o_decode_run_len(n_list, H2O_DECODE_SPAN);
            for (int64_t sp = 0; sp*len < n_list; ++sp, ++unit) {
                if (unit % params->nth != params->ith) {
                    continue;
                }
                if (!have_q) {
                    h2o_decode_queries(qg.data(), dst, channels(s, ikv), ikv, t, s);
                    have_q = true;
                }
                const int64_t j0 = sp*len;
                const int64_t j1 = std::min(j0 + len, n_list);
                float * part = scratch.part_of(g, sp);

                // logits: the mask's value on open cells; closed cells take no probability
                for (int64_t j = j0; j < std::min(j0 + ahead, j1); ++j) {
                    h2o_prefetch_rows(k_head, k->nb[2], k_row, list[j], list[j] + 1);
                    h2o_prefetch_rows(v_head, v->nb[2], v_row, list[j], list[j] + 1);
                }
                int64_t nk = 0;
                for (int64_t j = j0; j < j1; ++j) {
                    if (j + ahead < j1) {
                        h2o_prefetch_rows(k_head, k->nb[2], k_row, list[j + ahead], list[j + ahead] + 1);
                        h2o_prefetch_rows(v_head, v->nb[2], v_row, list[j + ahead], list[j + ahead] + 1);
                    }
                    const int64_t p = list[j];
                    const float mv = h2o_decode_mask(mask, t, s, p);
                    if (mv == -INFINITY) {
                        continue;
                    }
#if defined(H2O_VF_LANES)
                    if (vector_f16) {
                        h2o_decode_heads<h2o_decode_dots_f16>(n_gqa, x.data() + nk, (size_t) H2O_DECODE_SPAN, (const float *) qg.data(),
                                (const ggml_fp16_t *) (k_head + p*k->nb[2]), D);
                    } else
#endif
                    {
                        kt.to_f32(k_head + p*k->nb[2], kf.data(), D);
                        for (int64_t r = 0; r < n_gqa; ++r) {
                            ggml_vec_dot_f32((int) D, x.data() + r*H2O_DECODE_SPAN + nk, 0, qg.data() + r*D, 0, kf.data(), 0, 1);
                        }
                    }
                    mv_open[nk] = mv;
                    open[nk++]  = (int32_t) p;
                }
                for (int64_t r = 0; r < n_gqa; ++r) {
                    float * xr = x.data() + r*H2O_DECODE_SPAN;
                    for (int64_t j = 0; j < nk; ++j) {
                        const float dot = softcap > 0.0f ? softcap*tanhf(xr[j]/softcap) : xr[j];
                        xr[j] = dot + mv_open[j];
                    }
                }
                // per head: its maximum, exp(x - max) and their sum (a head with no finite logit takes no value)
                for (int64_t r = 0; r < n_gqa; ++r) {
                    float * pr = part + r*(2 + Dv);
                    float * xr = x.data() + r*H2O_DECODE_SPAN;
                    const float m = nk > 0 ? h2o_max(xr, nk) : -INFINITY;
                    pr[0] = m;
                    pr[1] = m == -INFINITY ? 0.0f : (float) ggml_vec_soft_max_f32((int) nk, xr, xr, m);
                    if (m == -INFINITY) {
                        std::fill(xr, xr + nk, 0.0f);
                    }
                }
                // then the weighted values
#if defined(H2O_VF_LANES)
                if (vector_f16) {
                    for (int64_t d0 = 0; d0 < Dv; d0 += H2O_DECODE_DV_TILE) {
                        h2o_decode_heads<h2o_decode_values_f16>(n_gqa, part + 2, (size_t) (2 + Dv), (const float *) x.data(),
                                (size_t) H2O_DECODE_SPAN, (const int32_t *) open.data(), nk, v_head, (size_t) v->nb[2], d0);
                    }
                    continue;
                }
#endif
                for (int64_t r = 0; r < n_gqa; ++r) {
                    std::fill(part + r*(2 + Dv) + 2, part + (r + 1)*(2 + Dv), 0.0f);
                }
                for (int64_t j = 0; j < nk; ++j) {
                    vt.to_f32(v_head + open[j]*v->nb[2], vf.data(), Dv);
                    for (int64_t r = 0; r < n_gqa; ++r) {
                        if (part[r*(2 + Dv)] != -INFINITY) {
                            ggml_vec_mad_f32((int) Dv, part + r*(2 + Dv) + 2, vf.data(), x[r*H2O_DECODE_SPAN + j]);
                        }
                    }
                }
            }
        }
    }

    // 6. per query head: its spans merged by online softmax, with the learned sink in the denominator
    void merge() const {
        for (int64_t w = params->ith; w < n_groups*n_gqa; w += params->nth) {
            const int64_t g   = w/n_gqa;
            const int64_t r   = w%n_gqa;
            const int64_t ikv = g%n_head_kv;
            const int64_t t   = (g/n_head_kv)%n_tokens;
            const int64_t s   = g/(n_head_kv*n_tokens);
            const int64_t ih  = ikv*n_gqa + r;
            const int64_t n_list  = listed(g);
            const int64_t len     = h2o_decode_run_len(n_list, H2O_DECODE_SPAN);
            const int64_t n_spans = (n_list + len - 1)/len;

            float m = -INFINITY;
            for (int64_t sp = 0; sp < n_spans; ++sp) {
                m = std::max(m, scratch.part_of(g, sp)[r*(2 + Dv)]);
            }
            float * out = (float *) ((char *) dst->data + ih*dst->nb[1] + t*dst->nb[2] + s*dst->nb[3]);
            std::fill(out, out + Dv, 0.0f);
            float l = 0.0f;
            if (m != -INFINITY) {
                for (int64_t sp = 0; sp < n_spans; ++sp) {
                    const float * pr = scratch.part_of(g, sp) + r*(2 + Dv);
                    if (pr[0] == -INFINITY) {
                        continue;
                    }
                    const float e = expf(pr[0] - m);
                    l += pr[1]*e;
                    ggml_vec_mad_f32((int) Dv, out, pr + 2, e);
                }
            }
            const float sink = h2o_logits_of(dst, ih).sink;
            if (sink != -INFINITY) {
                l += m == -INFINITY ? 1.0f : expf(sink - m);
            }
            const float inv = l > 0.0f ? 1.0f/l : 0.0f;
            for (int64_t d = 0; d < Dv; ++d) {
                out[d] *= inv;
            }
        }
    }
};

void ggml_compute_forward_h2o_decode(const ggml_compute_params * params, ggml_tensor * dst) {
    GGML_ASSERT(params->wsize >= ggml_h2o_decode_work_size(dst));
    const h2o_decode_step step(params, dst);

    step.sketch_new_blocks();
    ggml_barrier(params->threadpool);
    step.estimate();
    ggml_barrier(params->threadpool);
    step.gaps();
    ggml_barrier(params->threadpool);
    step.choose();
    ggml_barrier(params->threadpool);
    step.report_keys_read();
    step.attend();
    ggml_barrier(params->threadpool);
    step.merge();
}
