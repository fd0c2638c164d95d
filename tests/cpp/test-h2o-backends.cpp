// GGML_OP_H2O_ATTN on every GPU backend against the CPU backend, in the manner of llama.cpp's
// test-backend-ops (which the pinned source does not ship): the same inputs and state go to both, the op
// runs as one call over several chunks and as two calls that split a chunk, and the outputs, the BF16
// scores and the memory sets are compared after every call. A backend that does not support the op
// fails the test: the scheduler would otherwise run it on the CPU without a word.
//
//   test-h2o-backends            # exit 0; prints "skipped" when there is no GPU backend
//
// Tolerances: the GPU sums in another order, so outputs may differ by float rounding (checked to
// 1e-3 · max|V|) and scores by a BF16 rounding step (2^-7 relative). Memory sets are the same rule over
// those scores: they must agree except where a score difference of that size reorders two candidates,
// which the test counts and bounds.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

int n_failed = 0;

#define CHECK(cond, ...) do { if (!(cond)) { ++n_failed; std::printf("FAIL %s:%d: ", __FILE__, __LINE__); std::printf(__VA_ARGS__); std::printf("\n"); } } while (0)

struct shape {
    int64_t D         = 64;
    int64_t n_head    = 9;
    int64_t n_head_kv = 3;
    int64_t kv_size   = 1024;
    int32_t S         = 128;
    int32_t L         = 16;
    int32_t H         = 32;
};

// the op's persistent state and K/V, on one backend
struct state {
    ggml_context          * ctx = nullptr;
    ggml_backend_buffer_t   buf = nullptr;
    ggml_tensor * k       = nullptr;
    ggml_tensor * v       = nullptr;
    ggml_tensor * scores  = nullptr;
    ggml_tensor * mem_idx = nullptr;
    ggml_tensor * acc     = nullptr;

    state(ggml_backend_t backend, const shape & sh, const std::vector<ggml_fp16_t> & kv_k, const std::vector<ggml_fp16_t> & kv_v) {
        ggml_init_params ip = { 8*ggml_tensor_overhead(), nullptr, /*no_alloc=*/ true };
        ctx     = ggml_init(ip);
        k       = ggml_new_tensor_3d(ctx, GGML_TYPE_F16,  sh.D, sh.n_head_kv, sh.kv_size);
        v       = ggml_new_tensor_3d(ctx, GGML_TYPE_F16,  sh.D, sh.n_head_kv, sh.kv_size);
        scores  = ggml_new_tensor_2d(ctx, GGML_TYPE_BF16, sh.kv_size, sh.n_head);
        mem_idx = ggml_new_tensor_2d(ctx, GGML_TYPE_I32,  sh.L + sh.H, sh.n_head);
        acc     = ggml_new_tensor_2d(ctx, GGML_TYPE_F32,  sh.S + sh.L + sh.H, sh.n_head);
        buf     = ggml_backend_alloc_ctx_tensors(ctx, backend);
        ggml_backend_tensor_set(k, kv_k.data(), 0, ggml_nbytes(k));
        ggml_backend_tensor_set(v, kv_v.data(), 0, ggml_nbytes(v));
        ggml_backend_tensor_memset(scores,  0x00, 0, ggml_nbytes(scores));
        ggml_backend_tensor_memset(mem_idx, 0xff, 0, ggml_nbytes(mem_idx)); // -1: empty
        ggml_backend_tensor_memset(acc,     0x00, 0, ggml_nbytes(acc));
    }
    ~state() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
};

struct call_result {
    std::vector<float>       out;
    std::vector<ggml_bf16_t> scores;
    std::vector<int32_t>     mem;
    bool                     supported = true;
};

// one op call: queries of positions [p0, p0 + n) against the state
call_result run_call(ggml_backend_t backend, state & st, const shape & sh, const std::vector<float> & q_all,
        int32_t p0, int32_t n, int32_t mem_chunk, int32_t acc_chunk) {
    ggml_init_params ip = { 4*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc=*/ true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * q   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, sh.D, sh.n_head, n);
    ggml_tensor * out = ggml_h2o_attn(ctx, q, st.k, st.v, st.scores, st.mem_idx, st.acc,
            p0, sh.S, sh.L, sh.H, mem_chunk, acc_chunk, 1.0f/std::sqrt((float) sh.D));
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    call_result r;
    r.supported = ggml_backend_supports_op(backend, out);
    ggml_backend_buffer_t buf = nullptr;
    if (r.supported) {
        buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        ggml_backend_tensor_set(q, q_all.data() + (size_t) p0*sh.D*sh.n_head, 0, ggml_nbytes(q));
        CHECK(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS, "%s: graph compute failed", ggml_backend_name(backend));
        r.out.resize(ggml_nelements(out));
        r.scores.resize(ggml_nelements(st.scores));
        r.mem.resize(ggml_nelements(st.mem_idx));
        ggml_backend_tensor_get(out, r.out.data(), 0, ggml_nbytes(out));
        ggml_backend_tensor_get(st.scores, r.scores.data(), 0, ggml_nbytes(st.scores));
        ggml_backend_tensor_get(st.mem_idx, r.mem.data(), 0, ggml_nbytes(st.mem_idx));
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return r;
}

// compares one call's results; returns false when the backend cannot run the op
bool compare(const char * what, const char * name, const call_result & ref, const call_result & got, const shape & sh, float max_v) {
    if (!got.supported) {
        CHECK(false, "%s: %s does not support GGML_OP_H2O_ATTN: the scheduler would run it on the CPU", what, name);
        return false;
    }
    float max_out = 0.0f;
    for (size_t i = 0; i < ref.out.size(); ++i) {
        max_out = std::max(max_out, std::fabs(ref.out[i] - got.out[i]));
    }
    CHECK(max_out <= 1e-3f*std::max(1.0f, max_v), "%s: %s output differs by %g", what, name, max_out);

    float max_rel = 0.0f;
    for (size_t i = 0; i < ref.scores.size(); ++i) {
        const float a = ggml_bf16_to_fp32(ref.scores[i]);
        const float b = ggml_bf16_to_fp32(got.scores[i]);
        max_rel = std::max(max_rel, std::fabs(a - b)/std::max(std::fabs(a), 1e-6f));
    }
    CHECK(max_rel <= 1.0f/128, "%s: %s scores differ by %g relative", what, name, max_rel);

    // memory sets: slot by slot; a swap of two near-equal candidates changes two slots at most
    const int32_t M = sh.L + sh.H;
    int n_diff = 0;
    for (int64_t h = 0; h < sh.n_head; ++h) {
        for (int32_t m = 0; m < M; ++m) {
            n_diff += ref.mem[h*M + m] != got.mem[h*M + m];
        }
    }
    CHECK(n_diff <= (int) (sh.n_head*M/50), "%s: %s memory sets differ in %d of %d slots", what, name, n_diff, (int) (sh.n_head*M));
    std::printf("     %s on %s: max |Δout| %.3g, max score Δ %.3g relative, %d memory slots differ\n", what, name, max_out, max_rel, n_diff);
    return true;
}

} // namespace

int main() {
    ggml_backend_load_all();
    const shape sh;

    std::mt19937 rng(42);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int32_t n_tokens = 3*sh.S + 40;
    std::vector<float> q((size_t) n_tokens*sh.n_head*sh.D);
    std::vector<ggml_fp16_t> kv_k((size_t) sh.kv_size*sh.n_head_kv*sh.D);
    std::vector<ggml_fp16_t> kv_v(kv_k.size());
    float max_v = 0.0f;
    for (float & x : q) { x = nd(rng); }
    for (auto & x : kv_k) { x = ggml_fp32_to_fp16(nd(rng)); }
    for (auto & x : kv_v) { const float f = nd(rng); x = ggml_fp32_to_fp16(f); max_v = std::max(max_v, std::fabs(f)); }

    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    CHECK(cpu != nullptr, "no CPU backend");
    if (cpu == nullptr) {
        return 1;
    }

    int n_gpu = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU) {
            continue;
        }
        ++n_gpu;
        ggml_backend_t gpu = ggml_backend_dev_init(dev, nullptr);
        const char * name = ggml_backend_dev_name(dev);
        std::printf("%s (%s)\n", name, ggml_backend_dev_description(dev));

        // one call over four chunks (three complete, 40 tokens of the fourth)
        {
            state ref_st(cpu, sh, kv_k, kv_v);
            state gpu_st(gpu, sh, kv_k, kv_v);
            const call_result ref = run_call(cpu, ref_st, sh, q, 0, n_tokens, -1, -1);
            const call_result got = run_call(gpu, gpu_st, sh, q, 0, n_tokens, -1, -1);
            compare("one call, 3S + 40 tokens", name, ref, got, sh, max_v);
        }
        // two calls that split chunk 0 and end inside chunk 2: the partial sums carry over
        {
            state ref_st(cpu, sh, kv_k, kv_v);
            state gpu_st(gpu, sh, kv_k, kv_v);
            const int32_t n1 = 100;
            const int32_t n2 = 2*sh.S + 40 - n1;
            bool ok = compare("call 1 of 2, 100 tokens", name,
                    run_call(cpu, ref_st, sh, q, 0, n1, -1, -1), run_call(gpu, gpu_st, sh, q, 0, n1, -1, -1), sh, max_v);
            if (ok) {
                // after call 1: no memory set yet, chunk 0's sums in progress
                compare("call 2 of 2, continuing chunk 0", name,
                        run_call(cpu, ref_st, sh, q, n1, n2, -1, 0), run_call(gpu, gpu_st, sh, q, n1, n2, -1, 0), sh, max_v);
            }
        }
        ggml_backend_free(gpu);
    }
    ggml_backend_free(cpu);

    if (n_gpu == 0) {
        std::printf("skipped: no GPU backend in this build (build with --features cuda or scripts/gpu-test.sh)\n");
    }
    std::printf("%d GPU backend(s), %d failed\n", n_gpu, n_failed);
    return n_failed == 0 ? 0 : 1;
}
