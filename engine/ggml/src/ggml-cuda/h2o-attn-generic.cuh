#pragma once

#include "h2o-cuda-common.cuh"

// ---------------------------------------------------------------------------------------------------------------
// h2o_attn_generic: any head size, one warp per query row, F32 arithmetic (the first CUDA kernel, kept for the
// head sizes h2o_attn_mma does not serve)
// ---------------------------------------------------------------------------------------------------------------

#define H2O_GENERIC_ROWS_PER_WARP 4

static __device__ __forceinline__ float h2o_dot_f16(const float * q, const half * k, int D) {
    float sum = 0.0f;
    for (int d = 0; d < D; ++d) {
        sum += q[d]*__half2float(k[d]);
    }
    return sum;
}

static size_t h2o_generic_smem_bytes(int n_warps, int S, int M, int D) {
    return ((size_t) (n_warps + 1)*(S + M) + (size_t) n_warps*D + 2*n_warps)*sizeof(float);
}

// one block per (tile of query rows, query head); one warp per row at a time
// shared memory: per warp, the row's logits (S + M) and its scaled query (D); per block, the column sums (S + M)
// and, per warp, the reciprocal sums of its row's two parts
static __global__ void h2o_attn_generic(
        const char * q, const char * k, const char * v, const int32_t * mem, float * dst, float * col_partial,
        size_t nbq1, size_t nbq2, size_t nbk1, size_t nbk2, size_t nbv1, size_t nbv2, size_t nbm1, size_t nbd1, size_t nbd2,
        int D, int Dv, int n_gqa, int S, int M, int p0, int cs, int i_begin, int r_begin, int q_end, int rows_per_tile,
        bool has_memory, size_t nbm_tile, float scale, float softcap, const float * sinks) {
    extern __shared__ float h2o_generic_smem[];

    const int n_warps = blockDim.x/H2O_WARP_SIZE;
    const int warp    = threadIdx.x/H2O_WARP_SIZE;
    const int lane    = threadIdx.x%H2O_WARP_SIZE;
    const int ih      = blockIdx.y;
    const int ikv     = ih/n_gqa;
    const int n_head  = gridDim.y;
    const int n_keys  = S + M;

    float * x_all   = h2o_generic_smem;                // [n_warps][S + M]
    float * q_all   = x_all + (size_t) n_warps*n_keys; // [n_warps][D]
    float * col_sum = q_all + (size_t) n_warps*D;      // [S + M]
    float * inv_l   = col_sum + n_keys;                // [n_warps][2]: 1/l of the intra and memory parts

    float * x  = x_all + (size_t) warp*n_keys;
    float * qs = q_all + (size_t) warp*D;

    for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
        col_sum[j] = 0.0f;
    }

    // the head's memory, or (coverage selection, nbm_tile != 0) that of the H2O_COV_TILE-row tile this block's rows
    // are in (rows_per_tile divides it); rows before r_begin belong to an earlier call
    const int32_t * mem_h = (const int32_t *) ((const char *) mem + ih*nbm1 +
            (size_t) (blockIdx.x*rows_per_tile/H2O_COV_TILE)*nbm_tile);
    const int tile_begin  = i_begin + blockIdx.x*rows_per_tile;
    const int tile_end    = min(tile_begin + rows_per_tile, q_end);

    // rounds: every warp takes one row; the column sums of a round are added in warp order
    for (int round0 = tile_begin; round0 < tile_end; round0 += n_warps) {
        const int  i     = round0 + warp;
        const bool valid = i >= r_begin && i < tile_end;
        float wa = 0.0f;
        float wb = 0.0f;
        float la = 1.0f;
        float lb = 0.0f;
        int   n_intra = 0;

        if (valid) {
            const float * qr = (const float *) (q + (size_t) (i - p0)*nbq2 + (size_t) ih*nbq1);
            for (int d = lane; d < D; d += H2O_WARP_SIZE) {
                qs[d] = qr[d]*scale;
            }
            __syncwarp();

            // intra: keys cs .. i of the chunk
            n_intra = i - cs + 1;
            float ma = -INFINITY;
            for (int j = lane; j < n_intra; j += H2O_WARP_SIZE) {
                const half * kr = (const half *) (k + (size_t) (cs + j)*nbk2 + (size_t) ikv*nbk1);
                x[j] = h2o_softcap(h2o_dot_f16(qs, kr, D), softcap);
                ma = fmaxf(ma, x[j]);
            }
            ma = h2o_warp_max(ma);
            float sa = 0.0f;
            for (int j = lane; j < n_intra; j += H2O_WARP_SIZE) {
                x[j] = expf(x[j] - ma);
                sa += x[j];
            }
            la = h2o_warp_sum(sa);

            // inter: the memory set M_{c-1}; empty slots (and, defensively, slots not before the chunk) are masked
            float mb = -INFINITY;
            if (has_memory) {
                for (int m = lane; m < M; m += H2O_WARP_SIZE) {
                    const int32_t pos = mem_h[m];
                    if (pos >= 0 && pos < cs) {
                        const half * kr = (const half *) (k + (size_t) pos*nbk2 + (size_t) ikv*nbk1);
                        x[S + m] = h2o_softcap(h2o_dot_f16(qs, kr, D), softcap);
                        mb = fmaxf(mb, x[S + m]);
                    } else {
                        x[S + m] = -INFINITY;
                    }
                }
                mb = h2o_warp_max(mb);
                float sb = 0.0f;
                for (int m = lane; m < M; m += H2O_WARP_SIZE) {
                    x[S + m] = mb == -INFINITY ? 0.0f : expf(x[S + m] - mb);
                    sb += x[S + m];
                }
                lb = h2o_warp_sum(sb);
            }

            // exact merge of the two parts through their row maxima, a learned sink's logit in
            // the denominator
            const float sk = h2o_sink_of(sinks, ih);
            wa = 1.0f/la;
            if ((has_memory && lb > 0.0f) || sk != -INFINITY) {
                const float mx = fmaxf(fmaxf(ma, lb > 0.0f ? mb : -INFINITY), sk);
                const float ea = expf(ma - mx);
                const float eb = lb > 0.0f ? expf(mb - mx) : 0.0f;
                const float l  = la*ea + lb*eb + (sk != -INFINITY ? expf(sk - mx) : 0.0f);
                wa = ea/l;
                wb = eb/l;
            }
            if (lane == 0) {
                inv_l[2*warp + 0] = 1.0f/la;
                inv_l[2*warp + 1] = lb > 0.0f ? 1.0f/lb : 0.0f;
            }
            __syncwarp();

            // out = wa·Σ p_intra·V + wb·Σ p_memory·V (unnormalised probabilities in x)
            float * out = (float *) ((char *) dst + (size_t) (i - p0)*nbd2 + (size_t) ih*nbd1);
            for (int d = lane; d < Dv; d += H2O_WARP_SIZE) {
                float oa = 0.0f;
                for (int j = 0; j < n_intra; ++j) {
                    oa += x[j]*__half2float(((const half *) (v + (size_t) (cs + j)*nbv2 + (size_t) ikv*nbv1))[d]);
                }
                float ob = 0.0f;
                if (wb != 0.0f) {
                    for (int m = 0; m < M; ++m) {
                        const int32_t pos = mem_h[m];
                        if (pos >= 0 && pos < cs) {
                            ob += x[S + m]*__half2float(((const half *) (v + (size_t) pos*nbv2 + (size_t) ikv*nbv1))[d]);
                        }
                    }
                }
                out[d] = oa*wa + ob*wb;
            }
        }
        __syncthreads();

        // column sums of this round's rows: each row's normalised probabilities (p·(1/l), as on the
        // CPU), added warp by warp so that the order never changes
        for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
            float sum = col_sum[j];
            for (int w = 0; w < n_warps && round0 + w < tile_end; ++w) {
                if (round0 + w < r_begin) {
                    continue;
                }
                const float * xw = x_all + (size_t) w*n_keys;
                if (j < S) {
                    if (j < round0 + w - cs + 1) {
                        sum += xw[j]*inv_l[2*w + 0];
                    }
                } else if (has_memory) {
                    sum += xw[j]*inv_l[2*w + 1];
                }
            }
            col_sum[j] = sum;
        }
        __syncthreads();
    }

    float * part = col_partial + ((size_t) blockIdx.x*n_head + ih)*n_keys;
    for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
        part[j] = col_sum[j];
    }
}
