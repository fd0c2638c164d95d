#include "common.cuh"

// GGML_OP_H2O_ATTN: the chunked sparse prefill attention of one layer (see ggml_h2o_attn in ggml-h2o.h)
void ggml_cuda_op_h2o_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_h2o_attn_supported(int device, const ggml_tensor * dst);
