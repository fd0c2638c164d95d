#include "common.cuh"

// GGML_OP_H2O_DECODE: H2O sparse decode attention of one layer (see ggml_h2o_decode in ggml-h2o.h)
void ggml_cuda_op_h2o_decode(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_h2o_decode_supported(int device, const ggml_tensor * dst);
