#pragma once

// What the H2O ops share: reading the cache's K/V rows of any type, each head's logit parameters,
// a vectorisable maximum and the strongest channels of a key sketch. The prefill attention
// (h2o-attn.cpp, h2o-coverage.cpp and their h2o-tile.h) and the sparse decode (h2o-decode.cpp)
// include it.

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "ggml.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// The element type of the cache's K or V: F16 (the default), F32 and BF16 are read exactly, quantized types
// (q8_0, q4_0, ...) as ggml dequantizes them; a head's row is whole blocks (checked by ggml_h2o_attn).
// ggml's type traits have no to_float for F32, which is copied
struct h2o_row_type {
    ggml_type       type;
    ggml_to_float_t to_float;

    explicit h2o_row_type(ggml_type t) : type(t), to_float(ggml_get_type_traits(t)->to_float) {}

    void to_f32(const void * src, float * dst, int64_t n) const {
        if (type == GGML_TYPE_F16) {
#if defined(__AVX512F__) && defined(__F16C__)
            // inline for the rows of a head (64 or 128 values), which the ops convert one at a time
            if (n % 16 == 0) {
                const ggml_fp16_t * x = (const ggml_fp16_t *) src;
                for (int64_t i = 0; i < n; i += 16) {
                    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (x + i))));
                }
                return;
            }
#elif defined(__AVX__) && defined(__F16C__)
            // the same instruction as ggml_cpu_fp16_to_fp32 (the conversion is exact), without a call per row
            if (n % 8 == 0) {
                const ggml_fp16_t * x = (const ggml_fp16_t *) src;
                for (int64_t i = 0; i < n; i += 8) {
                    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i))));
                }
                return;
            }
#endif
            ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) src, dst, n);
        } else if (type == GGML_TYPE_F32) {
            memcpy(dst, src, n*sizeof(float));
        } else {
            to_float(src, dst, n);
        }
    }
};

// one K or V row of the cache (data nullptr: none)
struct h2o_row {
    const void         * data = nullptr;
    const h2o_row_type * type = nullptr;
};

// the logit parameters of one head (ggml_h2o_attn_set_logits): scale, soft-cap (0: none), learned sink (-INFINITY: none)
struct h2o_head_logits {
    float scale;
    float softcap;
    float sink;
};

static_assert(GGML_H2O_ATTN_SCALE == GGML_H2O_DECODE_SCALE && GGML_H2O_ATTN_SOFTCAP == GGML_H2O_DECODE_SOFTCAP,
              "h2o_logits_of reads either op's scale and soft-cap from the same slots");

static h2o_head_logits h2o_logits_of(const ggml_tensor * dst, int64_t ih) {
    const ggml_tensor * sinks = dst->src[6];
    return {
        ggml_get_op_params_f32(dst, GGML_H2O_ATTN_SCALE),
        ggml_get_op_params_f32(dst, GGML_H2O_ATTN_SOFTCAP),
        sinks ? ((const float *) sinks->data)[ih] : -INFINITY,
    };
}

// maximum of x[0..n) with independent lanes, so that the compiler can vectorise it (a single
// running maximum is a serial dependency chain)
static float h2o_max(const float * x, int64_t n) {
    constexpr int W = 16;
    float lane[W];
    std::fill_n(lane, W, -INFINITY);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        for (int l = 0; l < W; ++l) {
            lane[l] = std::max(lane[l], x[i + l]);
        }
    }
    float m = -INFINITY;
    for (; i < n; ++i) {
        m = std::max(m, x[i]);
    }
    for (int l = 0; l < W; ++l) {
        m = std::max(m, lane[l]);
    }
    return m;
}

// The R of D channels with the most key energy, ties to the lower channel, ascending: the key sketch of coverage
// selection's proposal and of sparse decode
static void h2o_strongest_channels(int32_t * chan, const double * energy, int64_t D, int64_t R) {
    thread_local std::vector<int32_t> order;
    order.resize(D);
    for (int64_t d = 0; d < D; ++d) {
        order[d] = (int32_t) d;
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return energy[a] > energy[b]; });
    std::sort(order.begin(), order.begin() + R);
    std::copy(order.begin(), order.begin() + R, chan);
}
