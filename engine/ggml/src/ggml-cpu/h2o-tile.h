#pragma once

// The tiled attention that every policy of the sparse prefill (GGML_OP_H2O_ATTN) runs: query rows in tiles, keys
// in packed blocks, a tile's attention to its chunk and to a memory merged by online softmax, the dense tail, and
// the chunk's sums into the scores. h2o-attn.cpp (the seed rule, the hybrid) and
// h2o-coverage.cpp (coverage selection) include it.

#include "ggml-cpu-impl.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "h2o-common.h"
#include "simd-gemm.h"
#include "ggml.h"
#include "vec.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

// Query rows go in tiles of H2O_QT and keys in blocks of H2O_KB, so that the logits and the
// weighted V sums are small dense matrix products (simd_gemm), as in ops.cpp's tiled flash
// attention. With H2O_QT == H2O_KB the causal diagonal of a tile lies in one key block.
static constexpr int64_t H2O_QT = 64;
static constexpr int64_t H2O_KB = 64;
// keys per step of the dense tail (a multiple of H2O_KB)
static constexpr int64_t H2O_TAIL_SPAN = 16*H2O_KB;

static int64_t h2o_n_blocks(int64_t n) {
    return (n + H2O_KB - 1)/H2O_KB;
}

// How many rows ahead h2o_pack_k asks for a row's cache lines: the rows it gathers (a tile's candidates) lie apart in
// the cache, where the hardware prefetcher does not follow, and each would otherwise wait for memory
static constexpr int64_t H2O_PACK_AHEAD = 8;

// n K rows -> F32 blocks [block][D][H2O_KB]: keys contiguous, the GEMM's SIMD dimension;
// padding and rows for which k_row() gives none are zero
template <typename KRow>
static void h2o_pack_k(float * dst, int64_t n, int64_t D, KRow && k_row) {
    thread_local std::vector<float> row;
    row.resize(D);
    const auto zero_key = [&](int64_t j) {
        float * col = dst + (j/H2O_KB)*D*H2O_KB + j%H2O_KB;
        for (int64_t d = 0; d < D; ++d) {
            col[d*H2O_KB] = 0.0f;
        }
    };
    size_t row_bytes = 0; // of the rows' type, once a row is seen
    for (int64_t j = 0; j < n; ++j) {
        const h2o_row kr = k_row(j);
        if (kr.data == nullptr) {
            zero_key(j);
            continue;
        }
        if (row_bytes == 0) {
            row_bytes = ggml_row_size(kr.type->type, D);
        }
#if defined(__GNUC__)
        if (j + H2O_PACK_AHEAD < n) {
            const h2o_row ahead = k_row(j + H2O_PACK_AHEAD);
            for (size_t o = 0; ahead.data != nullptr && o < row_bytes; o += 64) {
                __builtin_prefetch((const char *) ahead.data + o);
            }
        }
#endif
        kr.type->to_f32(kr.data, row.data(), D);
        float * col = dst + (j/H2O_KB)*D*H2O_KB + j%H2O_KB;
        for (int64_t d = 0; d < D; ++d) {
            col[d*H2O_KB] = row[d];
        }
    }
    if (n % H2O_KB != 0) {
        float * last = dst + (n/H2O_KB)*D*H2O_KB;
        for (int64_t d = 0; d < D; ++d) {
            std::fill(last + d*H2O_KB + n%H2O_KB, last + (d + 1)*H2O_KB, 0.0f);
        }
    }
}

// n V rows -> F32 rows [h2o_n_blocks(n)*H2O_KB][Dv], zero where padded or v_row() gives none:
// a zero probability must never meet an uninitialised (possibly NaN) row
template <typename VRow>
static void h2o_pack_v(float * dst, int64_t n, int64_t Dv, VRow && v_row) {
    for (int64_t j = 0; j < h2o_n_blocks(n)*H2O_KB; ++j) {
        const h2o_row vr = j < n ? v_row(j) : h2o_row{};
        if (vr.data != nullptr) {
            vr.type->to_f32(vr.data, dst + j*Dv, Dv);
        } else {
            std::fill(dst + j*Dv, dst + (j + 1)*Dv, 0.0f);
        }
    }
}

// logits of `rows` (pre-scaled) query rows against n_blocks packed key blocks: x[block][row][H2O_KB]; with
// softcap > 0, soft-capped as ggml_flash_attn_ext does: x -> softcap*tanh(x/softcap)
static void h2o_logits(float * x, const float * q_tile, int64_t rows, int64_t D,
        const float * k_packed, int64_t n_blocks, float softcap) {
    for (int64_t b = 0; b < n_blocks; ++b) {
        float * xb = x + b*H2O_QT*H2O_KB;
        std::fill(xb, xb + rows*H2O_KB, 0.0f);
        simd_gemm(xb, q_tile, k_packed + b*D*H2O_KB, (int) rows, (int) D, (int) H2O_KB);
        if (softcap > 0.0f) {
            for (int64_t e = 0; e < rows*H2O_KB; ++e) {
                xb[e] = softcap*tanhf(xb[e]/softcap);
            }
        }
    }
}

// the weights of an output's parts (their row maxima m_a, m_b and sums l_a, l_b; l_b = 0: no second part) in one
// softmax, with the learned sink's logit in its denominator (the online-softmax merge)
static void h2o_merge_weights(float m_a, float l_a, float m_b, float l_b, float sink, float & w_a, float & w_b) {
    float mx = l_b > 0.0f ? std::max(m_a, m_b) : m_a;
    float ea = expf(m_a - mx);
    float eb = l_b > 0.0f ? expf(m_b - mx) : 0.0f;
    float l  = l_a*ea + l_b*eb;
    if (sink != -INFINITY) {
        const float m2 = std::max(mx, sink);
        const float f  = expf(mx - m2);
        l   = l*f + expf(sink - m2);
        ea *= f;
        eb *= f;
        mx  = m2;
    }
    w_a = ea/l;
    w_b = eb/l;
}

// row r of x: logits -> exp(x - max) in place over the first n_keys keys; returns (max, sum)
struct h2o_row_part {
    float m = -INFINITY; // row maximum of the scaled logits
    float l = 0.0f;      // sum of exp(x - m)
};

static h2o_row_part h2o_row_softmax(float * x, int64_t r, int64_t n_keys) {
    h2o_row_part part;
    const int64_t nb = h2o_n_blocks(n_keys);
    for (int64_t b = 0; b < nb; ++b) {
        part.m = std::max(part.m, h2o_max(x + b*H2O_QT*H2O_KB + r*H2O_KB, H2O_KB));
    }
    if (part.m == -INFINITY) {
        // no key: zero probabilities, so that the V product adds nothing
        for (int64_t b = 0; b < nb; ++b) {
            std::fill_n(x + b*H2O_QT*H2O_KB + r*H2O_KB, H2O_KB, 0.0f);
        }
        return part;
    }
    ggml_float l = 0.0;
    for (int64_t b = 0; b < nb; ++b) {
        float * xr = x + b*H2O_QT*H2O_KB + r*H2O_KB;
        l += ggml_vec_soft_max_f32((int) H2O_KB, xr, xr, part.m);
    }
    part.l = (float) l;
    return part;
}

// col[j] += w * (p of row r, key j) for the first n_keys keys
static void h2o_add_column_sums(float * col, const float * x, int64_t r, int64_t n_keys, float w) {
    for (int64_t b = 0; b < h2o_n_blocks(n_keys); ++b) {
        const int64_t n = std::min(H2O_KB, n_keys - b*H2O_KB);
        ggml_vec_mad_f32((int) n, col + b*H2O_KB, x + b*H2O_QT*H2O_KB + r*H2O_KB, w);
    }
}

// out[rows][Dv] += p[block][rows][H2O_KB] * v[block*H2O_KB .. ][Dv]
static void h2o_weighted_values(float * out, const float * p, int64_t rows, int64_t n_blocks,
        const float * v_packed, int64_t Dv) {
    for (int64_t b = 0; b < n_blocks; ++b) {
        simd_gemm(out, p + b*H2O_QT*H2O_KB, v_packed + b*H2O_KB*Dv, (int) rows, (int) H2O_KB, (int) Dv);
    }
}

// out of line, so that profiles show what selection costs on its own
#if defined(_MSC_VER)
#define H2O_NOINLINE __declspec(noinline)
#else
#define H2O_NOINLINE __attribute__((noinline))
#endif

// Chunk c is complete: its sums enter the BF16 scores, once (F32 until then, so that the result does not depend on
// how the chunk was split across calls): the intra sums acc_intra[0 .. S), and, when with_memory, the memory sums
// acc_intra[S .. S + M) of the memory set mem. Then all sums are zero.
static void h2o_settle(ggml_bf16_t * sc, float * acc_intra, const int32_t * mem, int32_t S, int32_t M, int64_t kv_size,
        int32_t c, bool with_memory) {
    const float * acc_inter = acc_intra + S;
    const int64_t cs = (int64_t) c*S;
    for (int32_t j = 0; j < S && cs + j < kv_size; ++j) {
        if (acc_intra[j] != 0.0f) {
            sc[cs + j] = GGML_FP32_TO_BF16(GGML_BF16_TO_FP32(sc[cs + j]) + acc_intra[j]);
        }
    }
    if (with_memory) {
        for (int32_t m = 0; m < M; ++m) {
            const int32_t pos = mem[m];
            if (pos >= 0 && pos < kv_size && acc_inter[m] != 0.0f) {
                sc[pos] = GGML_FP32_TO_BF16(GGML_BF16_TO_FP32(sc[pos]) + acc_inter[m]);
            }
        }
    }
    std::fill(acc_intra, acc_intra + S + M, 0.0f);
}

// Scratch of one thread for the attention of the tiles of query rows: the chunk's and the memory's K and V, packed
// once per chunk and head, and one tile's logits, parts and outputs.
struct h2o_tile_scratch {
    std::vector<float> k_chunk;  // K of the chunk, packed (h2o_pack_k)
    std::vector<float> v_chunk;  // V of the chunk, F32 (h2o_pack_v)
    std::vector<float> k_mem;    // K of the memory, packed
    std::vector<float> v_mem;    // V of the memory, F32
    std::vector<float> q_tile;   // [H2O_QT][D], pre-scaled
    std::vector<float> x_intra;  // logits, then probabilities: [block][H2O_QT][H2O_KB]
    std::vector<float> x_inter;
    std::vector<float> o_tile;   // [H2O_QT][Dv], intra part
    std::vector<float> o_mem;    // [H2O_QT][Dv], memory part
    std::vector<float> w_intra;  // per row: output weight of each part
    std::vector<float> w_inter;
    std::vector<h2o_row_part> part_intra; // per row: maximum and sum of each part's softmax
    std::vector<h2o_row_part> part_mem;

    void reserve(int64_t D, int64_t Dv, int64_t nb_chunk, int64_t nb_memory) {
        k_chunk.resize((size_t) nb_chunk*D*H2O_KB);
        v_chunk.resize((size_t) nb_chunk*H2O_KB*Dv);
        k_mem  .resize((size_t) nb_memory*D*H2O_KB);
        v_mem  .resize((size_t) nb_memory*H2O_KB*Dv);
        q_tile .resize((size_t) H2O_QT*D);
        x_intra.resize((size_t) nb_chunk*H2O_QT*H2O_KB);
        x_inter.resize(std::max(x_inter.size(), (size_t) nb_memory*H2O_QT*H2O_KB));
        o_tile .resize((size_t) H2O_QT*Dv);
        o_mem  .resize((size_t) H2O_QT*Dv);
        w_intra.resize((size_t) H2O_QT);
        w_inter.resize((size_t) H2O_QT);
        part_intra.resize((size_t) H2O_QT);
        part_mem  .resize((size_t) H2O_QT);
    }
};

// Q of rows r0 .. r1 of head ih into q_tile [rows][D], pre-scaled, so that the products are the scaled logits
static void h2o_load_q(float * q_tile, const ggml_tensor * q, int64_t ih, int32_t p0, int64_t r0, int64_t r1, float scale) {
    const int64_t D = q->ne[0];
    for (int64_t r = 0; r < r1 - r0; ++r) {
        const float * qr = (const float *) ((const char *) q->data + (r0 + r - p0)*q->nb[2] + ih*q->nb[1]);
        ggml_vec_scale_f32((int) D, (float *) memcpy(q_tile + r*D, qr, D*sizeof(float)), scale);
    }
}

// The intra part of query rows r0 .. r1 (one tile, aligned to the chunk starting at cs) of head ih: Q pre-scaled into
// s.q_tile, the chunk's packed keys up to the diagonal, s.o_tile the unnormalised P·V and s.part_intra each row's
// softmax maximum and sum. Rows before tail_start add the column sums of this part's own softmax to acc_intra.
static void h2o_tile_intra(const ggml_tensor * q, int64_t ih, int32_t p0, int64_t cs, int64_t r0, int64_t r1, int64_t Dv,
        const h2o_head_logits & lg, int32_t tail_start, const float * k_chunk, const float * v_chunk,
        float * acc_intra, h2o_tile_scratch & s) {
    const int64_t D    = q->ne[0];
    const int64_t rows = r1 - r0;
    const int64_t nbi  = h2o_n_blocks(r1 - cs); // key blocks up to the diagonal

    h2o_load_q(s.q_tile.data(), q, ih, p0, r0, r1, lg.scale);
    h2o_logits(s.x_intra.data(), s.q_tile.data(), rows, D, k_chunk, nbi, lg.softcap);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r0 + r;
        // keys cs .. i of the chunk; later keys of the last block are masked
        const int64_t n_intra = i - cs + 1;
        for (int64_t j = n_intra; j < nbi*H2O_KB; ++j) {
            s.x_intra[(j/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + j%H2O_KB] = -INFINITY;
        }
        s.part_intra[r] = h2o_row_softmax(s.x_intra.data(), r, nbi*H2O_KB);
        // a dense-tail query is recomputed with full attention, and scores nothing
        if (i < tail_start) {
            h2o_add_column_sums(acc_intra, s.x_intra.data(), r, n_intra, 1.0f/s.part_intra[r].l);
        }
    }
    std::fill(s.o_tile.begin(), s.o_tile.begin() + rows*Dv, 0.0f);
    h2o_weighted_values(s.o_tile.data(), s.x_intra.data(), rows, nbi, v_chunk, Dv);
}

// The memory part of the tile whose Q h2o_tile_intra left in s.q_tile: nb_mem packed key blocks, except the slots in
// `masked`; s.o_mem the unnormalised P·V and s.part_mem each row's softmax maximum and sum. Rows before tail_start add
// the column sums of this part's own softmax to acc_mem (n_mem memory slots).
static void h2o_tile_memory(int64_t r0, int64_t rows, int64_t D, int64_t Dv, const h2o_head_logits & lg, int32_t tail_start,
        const float * k_mem, const float * v_mem, int64_t n_mem, int64_t nb_mem, const std::vector<int32_t> & masked,
        float * acc_mem, h2o_tile_scratch & s) {
    h2o_logits(s.x_inter.data(), s.q_tile.data(), rows, D, k_mem, nb_mem, lg.softcap);
    for (int64_t r = 0; r < rows; ++r) {
        // empty slots and padding are masked
        for (const int32_t m : masked) {
            s.x_inter[(m/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + m%H2O_KB] = -INFINITY;
        }
        const h2o_row_part b = h2o_row_softmax(s.x_inter.data(), r, nb_mem*H2O_KB);
        if (r0 + r < tail_start && b.l > 0.0f) {
            h2o_add_column_sums(acc_mem, s.x_inter.data(), r, n_mem, 1.0f/b.l);
        }
        s.part_mem[r] = b;
    }
    std::fill(s.o_mem.begin(), s.o_mem.begin() + rows*Dv, 0.0f);
    h2o_weighted_values(s.o_mem.data(), s.x_inter.data(), rows, nb_mem, v_mem, Dv);
}

// The exact merge of a tile's two parts through their row maxima into dst: the intra part's unnormalised output o_intra
// with its rows' softmax parts `intra`, and, with has_memory, the memory part in s.o_mem and s.part_mem.
static void h2o_tile_merge(ggml_tensor * dst, int64_t ih, int32_t p0, int64_t r0, int64_t rows, const h2o_head_logits & lg,
        const float * o_intra, const h2o_row_part * intra, bool has_memory, h2o_tile_scratch & s) {
    const int64_t Dv = dst->ne[0];
    for (int64_t r = 0; r < rows; ++r) {
        const h2o_row_part b = has_memory ? s.part_mem[r] : h2o_row_part{};
        h2o_merge_weights(intra[r].m, intra[r].l, b.m, b.l, lg.sink, s.w_intra[r], s.w_inter[r]);
    }
    for (int64_t r = 0; r < rows; ++r) {
        float * out = (float *) ((char *) dst->data + (r0 + r - p0)*dst->nb[2] + ih*dst->nb[1]);
        ggml_vec_scale_f32((int) Dv, (float *) memcpy(out, o_intra + r*Dv, Dv*sizeof(float)), s.w_intra[r]);
        if (has_memory && s.w_inter[r] != 0.0f) {
            ggml_vec_mad_f32((int) Dv, out, s.o_mem.data() + r*Dv, s.w_inter[r]);
        }
    }
}

// Query rows r0 .. r1 (one tile, aligned to the chunk starting at cs) of head ih: the intra part attends to the
// chunk's packed keys up to the diagonal; with k_mem, the memory part attends to nb_mem packed key blocks, except the
// slots in `masked`; the two are merged exactly into dst. Rows before tail_start add the column sums of each
// part's own softmax to acc_intra (chunk offsets) and acc_mem (n_mem memory slots).
static void h2o_attend_tile(ggml_tensor * dst, const ggml_tensor * q, int64_t ih, int32_t p0, int64_t cs,
        int64_t r0, int64_t r1, const h2o_head_logits & lg, int32_t tail_start,
        const float * k_chunk, const float * v_chunk,
        const float * k_mem, const float * v_mem, int64_t n_mem, int64_t nb_mem, const std::vector<int32_t> & masked,
        float * acc_intra, float * acc_mem, h2o_tile_scratch & s) {
    const int64_t D  = q->ne[0];
    const int64_t Dv = dst->ne[0];
    const bool has_memory = k_mem != nullptr;

    h2o_tile_intra(q, ih, p0, cs, r0, r1, Dv, lg, tail_start, k_chunk, v_chunk, acc_intra, s);
    if (has_memory) {
        h2o_tile_memory(r0, r1 - r0, D, Dv, lg, tail_start, k_mem, v_mem, n_mem, nb_mem, masked, acc_mem, s);
    }
    h2o_tile_merge(dst, ih, p0, r0, r1 - r0, lg, s.o_tile.data(), s.part_intra.data(), has_memory, s);
}

// Scratch of one thread for the dense tail, and for the sampled queries of GGML_H2O_SELECT_COVERAGE.
struct h2o_span_scratch {
    std::vector<float> k_all;  // K of H2O_TAIL_SPAN positions, packed
    std::vector<float> v_all;
    std::vector<float> x_all;  // [block][H2O_QT][H2O_KB]
    std::vector<float> tail_m; // per row, running maximum and sum of the online softmax
    std::vector<float> tail_l;

    void reserve(int64_t D, int64_t Dv) {
        k_all .resize((size_t) h2o_n_blocks(H2O_TAIL_SPAN)*D*H2O_KB);
        v_all .resize((size_t) h2o_n_blocks(H2O_TAIL_SPAN)*H2O_KB*Dv);
        x_all .resize((size_t) h2o_n_blocks(H2O_TAIL_SPAN)*H2O_QT*H2O_KB);
        tail_m.resize((size_t) H2O_QT);
        tail_l.resize((size_t) H2O_QT);
    }
};

// The dense tail of head ih: queries from tail_start on (in p0 .. p1) attend to every position up to their own,
// H2O_TAIL_SPAN keys at a time merged by online softmax, so that the scratch stays the same size at any prompt length.
template <typename KRow, typename VRow>
static void h2o_dense_tail(ggml_tensor * dst, const ggml_tensor * q, int64_t ih, int32_t p0, int32_t p1,
        int32_t tail_start, const h2o_head_logits & lg, KRow && k_row, VRow && v_row, h2o_tile_scratch & s, h2o_span_scratch & t) {
    const int64_t D  = q->ne[0];
    const int64_t Dv = dst->ne[0];
    for (int64_t t0 = std::max<int64_t>(p0, tail_start); t0 < p1; t0 += H2O_QT) {
        const int64_t t1   = std::min<int64_t>(t0 + H2O_QT, p1);
        const int64_t rows = t1 - t0;

        h2o_load_q(s.q_tile.data(), q, ih, p0, t0, t1, lg.scale);
        std::fill(s.o_tile.begin(), s.o_tile.begin() + rows*Dv, 0.0f);
        std::fill(t.tail_m.begin(), t.tail_m.begin() + rows, -INFINITY);
        std::fill(t.tail_l.begin(), t.tail_l.begin() + rows, 0.0f);

        for (int64_t s0 = 0; s0 < t1; s0 += H2O_TAIL_SPAN) {
            const int64_t n   = std::min<int64_t>(H2O_TAIL_SPAN, t1 - s0);
            const int64_t nbk = h2o_n_blocks(n);

            h2o_pack_k(t.k_all.data(), n, D,  [&](int64_t j) { return k_row(s0 + j); });
            h2o_pack_v(t.v_all.data(), n, Dv, [&](int64_t j) { return v_row(s0 + j); });
            h2o_logits(t.x_all.data(), s.q_tile.data(), rows, D, t.k_all.data(), nbk, lg.softcap);

            for (int64_t r = 0; r < rows; ++r) {
                for (int64_t j = std::max<int64_t>(t0 + r + 1 - s0, 0); j < nbk*H2O_KB; ++j) {
                    t.x_all[(j/H2O_KB)*H2O_QT*H2O_KB + r*H2O_KB + j%H2O_KB] = -INFINITY;
                }
                const h2o_row_part part = h2o_row_softmax(t.x_all.data(), r, nbk*H2O_KB);
                // rescale what the earlier spans gave this row, and weigh this span alike
                const float m = std::max(t.tail_m[r], part.m);
                const float a = t.tail_m[r] == -INFINITY ? 0.0f : expf(t.tail_m[r] - m);
                const float b = part.m      == -INFINITY ? 0.0f : expf(part.m      - m);
                ggml_vec_scale_f32((int) Dv, s.o_tile.data() + r*Dv, a);
                t.tail_m[r] = m;
                t.tail_l[r] = a*t.tail_l[r] + b*part.l;
                s.w_intra[r] = b;
            }
            std::fill(s.o_mem.begin(), s.o_mem.begin() + rows*Dv, 0.0f);
            h2o_weighted_values(s.o_mem.data(), t.x_all.data(), rows, nbk, t.v_all.data(), Dv);
            for (int64_t r = 0; r < rows; ++r) {
                ggml_vec_mad_f32((int) Dv, s.o_tile.data() + r*Dv, s.o_mem.data() + r*Dv, s.w_intra[r]);
            }
        }

        for (int64_t r = 0; r < rows; ++r) {
            float * out = (float *) ((char *) dst->data + (t0 + r - p0)*dst->nb[2] + ih*dst->nb[1]);
            float w, unused;
            h2o_merge_weights(t.tail_m[r], t.tail_l[r], -INFINITY, 0.0f, lg.sink, w, unused);
            ggml_vec_scale_f32((int) Dv, (float *) memcpy(out, s.o_tile.data() + r*Dv, Dv*sizeof(float)), w);
        }
    }
}

// GGML_OP_H2O_ATTN with coverage selection (h2o-coverage.cpp), to which ggml_compute_forward_h2o_attn hands it
void ggml_compute_forward_h2o_attn_coverage(const ggml_compute_params * params, ggml_tensor * dst);
