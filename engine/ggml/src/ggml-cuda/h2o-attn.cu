#include "h2o-attn.cuh"
#include "h2o-attn-kernels.cuh"
#include "convert.cuh"

// GGML_OP_H2O_ATTN on CUDA. The op's state (BF16 scores, I32 memory sets, F32 partial column sums) lives in
// the KV cache's buffers, so on a GPU it stays on the GPU; h2o-attn-kernels.cuh has the kernels and the walk
// over the chunks, this file hands it the tensors and a scratch buffer from ggml's pool. The CPU kernel
// (ggml-cpu/ops.cpp) is the reference; tests/cpp/test-h2o-backends.cpp compares the two.

static_assert(H2O_COV_SELECT == GGML_H2O_SELECT_COVERAGE, "coverage selection: the policy's value");
static_assert(H2O_COV_TILE == GGML_H2O_TILE && H2O_COV_STEP == GGML_H2O_BUDGET_STEP &&
        H2O_COV_FACTOR == GGML_H2O_MAX_HEAVY_FACTOR, "coverage selection: the kernels' constants are ggml.h's");

bool ggml_cuda_h2o_attn_supported(int device, const ggml_tensor * dst) {
    GGML_UNUSED(device);
    // Refusing an op of the right types makes the scheduler run it on the CPU against copies of the state tensors,
    // and the updated scores and memory sets would never reach the GPU: llama refuses such a context, naming the
    // reason (llama_h2o_check_placement). So refuse only what these kernels do not implement: coverage selection with
    // heads larger than 256 or not a multiple of 4, or heavy budgets beyond H2O_COV_MAX_RANK/H2O_COV_FACTOR (its ranking
    // sorts 4 H candidates per tile in shared memory), or a proposal from a pool (ggml_h2o_attn_set_coverage_pool),
    // which only the CPU's kernels run. Shapes too large for shared memory are stopped in ggml_cuda_op_h2o_attn instead.
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    if (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SELECT) == GGML_H2O_SELECT_COVERAGE &&
        (ggml_get_op_params_i32(dst, GGML_H2O_ATTN_POOL) != 0 || q->ne[0] > H2O_SELECT_MAX_D || v->ne[0] > H2O_SELECT_MAX_D || q->ne[0] % 4 != 0 ||
         (int64_t) H2O_COV_FACTOR*ggml_get_op_params_i32(dst, GGML_H2O_ATTN_HEAVY) > H2O_COV_MAX_RANK)) {
        return false;
    }
    // K and V of another type than F16 are converted to F16 first (h2o_cuda_to_f16)
    const auto readable = [](const ggml_tensor * t) {
        return (t->type == GGML_TYPE_F16 || ggml_get_to_fp16_nc_cuda(t->type) != nullptr) && t->nb[0] == ggml_type_size(t->type);
    };
    return q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float) && readable(k) && readable(v);
}

// A K or V cache of another type than F16 (BF16, F32, q8_0, q4_0, ...): the kernels read F16 rows, so the positions
// this call reads, [0, n_pos) of every KV head, are converted into a pool buffer first, as llama.cpp's flash attention
// converts a quantized cache. Returns the rows to read and sets their strides.
static const char * h2o_cuda_to_f16(ggml_backend_cuda_context & ctx, const ggml_tensor * t, int64_t n_pos,
        ggml_cuda_pool_alloc<half> & buf, size_t & nb1, size_t & nb2) {
    if (t->type == GGML_TYPE_F16) {
        nb1 = t->nb[1];
        nb2 = t->nb[2];
        return (const char *) t->data;
    }
    const size_t ts = ggml_type_size(t->type);
    buf.alloc(t->ne[0]*t->ne[1]*n_pos);
    ggml_get_to_fp16_nc_cuda(t->type)(t->data, buf.ptr, t->ne[0], t->ne[1], n_pos, 1,
            t->nb[1]/ts, t->nb[2]/ts, t->nb[3]/ts, ctx.stream());
    nb1 = t->ne[0]*sizeof(half);
    nb2 = t->ne[1]*nb1;
    return (const char *) buf.ptr;
}

void ggml_cuda_op_h2o_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q       = dst->src[0];
    const ggml_tensor * k       = dst->src[1];
    const ggml_tensor * v       = dst->src[2];
          ggml_tensor * scores  = dst->src[3];
          ggml_tensor * mem_idx = dst->src[4];
          ggml_tensor * acc     = dst->src[5];

    GGML_ASSERT(ggml_cuda_h2o_attn_supported(ggml_cuda_get_device(), dst));
    GGML_ASSERT(scores->type == GGML_TYPE_BF16 && mem_idx->type == GGML_TYPE_I32 && acc->type == GGML_TYPE_F32);

    h2o_cuda_args a {};
    // every position this call reads, as F16
    const int64_t n_pos = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_P0) + q->ne[2];
    ggml_cuda_pool_alloc<half> k_f16(ctx.pool());
    ggml_cuda_pool_alloc<half> v_f16(ctx.pool());

    a.q      = (const char *) q->data;
    a.k      = h2o_cuda_to_f16(ctx, k, n_pos, k_f16, a.nbk1, a.nbk2);
    a.v      = h2o_cuda_to_f16(ctx, v, n_pos, v_f16, a.nbv1, a.nbv2);
    a.scores = (uint16_t *) scores->data;
    a.mem    = (int32_t  *) mem_idx->data;
    a.acc    = (float    *) acc->data;
    a.dst    = (float    *) dst->data;

    a.nbq1 = q->nb[1];   a.nbq2 = q->nb[2];
    a.nbd1 = dst->nb[1]; a.nbd2 = dst->nb[2];
    a.nb_scores1 = scores->nb[1];
    a.nb_mem1    = mem_idx->nb[1];
    a.nb_acc1    = acc->nb[1];

    a.D         = (int) q->ne[0];
    a.Dv        = (int) v->ne[0];
    a.n_head    = (int) q->ne[1];
    a.n_head_kv = (int) k->ne[1];
    a.n_tokens  = (int) q->ne[2];
    a.kv_size   = (int) scores->ne[0];

    a.p0        = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_P0);
    a.S         = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_CHUNK);
    a.L         = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_LOCAL);
    a.H         = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_HEAVY);
    a.mem_chunk = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_MEM_CHUNK);
    a.acc_chunk = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_ACC_CHUNK);
    a.scale     = ggml_get_op_params_f32(dst, GGML_H2O_ATTN_SCALE);

    a.select     = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SELECT);
    a.n_sink     = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SINK);
    a.tail_start = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_TAIL_START);
    a.coverage   = ggml_get_op_params_f32(dst, GGML_H2O_ATTN_COVERAGE);
    a.n_sample   = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_N_SAMPLE);
    a.sketch     = ggml_get_op_params_i32(dst, GGML_H2O_ATTN_SKETCH);
    a.softcap    = ggml_get_op_params_f32(dst, GGML_H2O_ATTN_SOFTCAP);
    a.sinks      = dst->src[6] != nullptr ? (const float *) dst->src[6]->data : nullptr;

    a.smem_per_block = ggml_cuda_info().devices[ggml_cuda_get_device()].smpbo;

    h2o_cuda_plan plan;
    if (const char * err = h2o_cuda_make_plan(a, H2O_CUDA_KERNEL_AUTO, &plan)) {
        GGML_ABORT("H2O: %s: a chunk of %d tokens with a memory of %d, head size %d; use a smaller n_ubatch (-ub)",
                err, a.S, a.L + a.H, a.D);
    }

    ggml_cuda_pool_alloc<float> partial(ctx.pool(), plan.partial_floats);
    h2o_cuda_run(a, plan, partial.ptr, ctx.stream());
    CUDA_CHECK(cudaGetLastError());
}
