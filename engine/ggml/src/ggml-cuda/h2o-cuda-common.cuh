#pragma once

// What every CUDA kernel of GGML_OP_H2O_ATTN shares: warp reductions, BF16 scores and their sort keys, the
// tensor-core primitives (cp.async, ldmatrix, mma.sync m16n8k16), soft-capping and learned sinks. Like the
// kernels, it needs nothing but the CUDA runtime.

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
// tensor-core primitives
// ---------------------------------------------------------------------------------------------------------------

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
