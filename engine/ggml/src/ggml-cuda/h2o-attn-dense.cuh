#pragma once

#include "h2o-select-query.cuh"

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
