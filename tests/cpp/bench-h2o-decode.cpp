// The time of one GGML_OP_H2O_DECODE call (one decode step of one layer) on every GPU backend: a sketched cache of
// N positions with random F16 K/V, one query token at the end, the sparse budget against a budget that covers the
// context (the same op then reads every position: full attention through the same kernels), and against stock
// attention without flash attention as llama.cpp builds it then (KQ = K*Q, soft_max_ext with the mask, V^T*KQ, V
// stored transposed). Medians of 20 calls (or as many as asked), wall time around ggml_backend_graph_compute, which
// waits for the device.
//
//   bench-h2o-decode            # SmolLM2-135M's and Llama-3-8B's heads at 8K, 32K and 128K positions
//   bench-h2o-decode cpu        # the same with the CPU backend too
//   bench-h2o-decode cpu 8192   # one length
//   bench-h2o-decode cpu 8192 500  # medians of 500 calls (default 20)

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

struct head_shape {
    const char * name;
    int64_t D;
    int64_t n_head;
    int64_t n_head_kv;
};

// random normal K (or V) and Q, F16 or F32, and an all-open F16 mask
void fill_normal(ggml_tensor * t, std::mt19937 & rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    if (t->type == GGML_TYPE_F16) {
        std::vector<ggml_fp16_t> x((size_t) ggml_nelements(t));
        for (auto & e : x) { e = ggml_fp32_to_fp16(nd(rng)); }
        ggml_backend_tensor_set(t, x.data(), 0, ggml_nbytes(t));
    } else {
        std::vector<float> x((size_t) ggml_nelements(t));
        for (auto & e : x) { e = nd(rng); }
        ggml_backend_tensor_set(t, x.data(), 0, ggml_nbytes(t));
    }
}

void set_open(ggml_tensor * mask) {
    std::vector<ggml_fp16_t> x((size_t) ggml_nelements(mask), ggml_fp32_to_fp16(0.0f));
    ggml_backend_tensor_set(mask, x.data(), 0, ggml_nbytes(mask));
}

// µs per call of gf: the median of n_rep calls after a first (which, for the decode op, sketches the cache)
double median_us(ggml_backend_t backend, ggml_cgraph * gf, int n_rep) {
    ggml_backend_graph_compute(backend, gf);
    std::vector<double> us;
    for (int i = 0; i < n_rep; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        ggml_backend_graph_compute(backend, gf);
        ggml_backend_synchronize(backend);
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    return us[n_rep/2];
}

// µs per call of the decode op
double time_decode(ggml_backend_t backend, const head_shape & sh, int64_t n_kv, int32_t n_budget, int n_rep) {
    const int64_t B = GGML_H2O_DECODE_BLOCK;
    const int64_t R = sh.D/4;
    ggml_init_params ip = { 16*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc=*/ true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * k      = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, sh.D, sh.n_head_kv, n_kv, 1);
    ggml_tensor * v      = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, sh.D, sh.n_head_kv, n_kv, 1);
    ggml_tensor * summ   = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, GGML_H2O_DECODE_SKETCH_SIZE(sh.D), sh.n_head_kv, n_kv/B, 1);
    ggml_tensor * summ_n = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 3 + R*sh.n_head_kv, 1);
    ggml_tensor * q      = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, sh.D, sh.n_head, 1, 1);
    ggml_tensor * mask   = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, 1, 1, 1);
    ggml_tensor * out    = ggml_h2o_decode(ctx, q, k, v, mask, summ, summ_n, 4, 256, n_budget, 1.0f/std::sqrt((float) sh.D));
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

    std::mt19937 rng(1);
    fill_normal(k, rng);
    fill_normal(v, rng);
    fill_normal(q, rng);
    set_open(mask);
    ggml_backend_tensor_memset(summ,   0x00, 0, ggml_nbytes(summ));
    ggml_backend_tensor_memset(summ_n, 0x00, 0, ggml_nbytes(summ_n));
    const int32_t own[2] = { -1, -1 }; // the stream's own sink and budget: the op's
    ggml_backend_tensor_set(summ_n, own, (summ_n->ne[0] - 2)*sizeof(int32_t), sizeof(own));

    const double us = median_us(backend, gf, n_rep);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return us;
}

// µs per call of stock attention over the same shapes
double time_stock(ggml_backend_t backend, const head_shape & sh, int64_t n_kv, int n_rep) {
    ggml_init_params ip = { 16*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc=*/ true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * k    = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, sh.D, sh.n_head_kv, n_kv);
    ggml_tensor * vt   = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, n_kv, sh.D, sh.n_head_kv);
    ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, sh.D, sh.n_head, 1);
    ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, 1);
    ggml_tensor * kq   = ggml_mul_mat(ctx, ggml_permute(ctx, k, 0, 2, 1, 3), ggml_permute(ctx, q, 0, 2, 1, 3));
    kq = ggml_soft_max_ext(ctx, kq, mask, 1.0f/std::sqrt((float) sh.D), 0.0f);
    ggml_tensor * out  = ggml_mul_mat(ctx, vt, kq);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    if (!ggml_backend_supports_op(backend, kq) || !ggml_backend_supports_op(backend, out)) {
        ggml_free(ctx);
        return NAN;
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

    std::mt19937 rng(1);
    fill_normal(k, rng);
    fill_normal(vt, rng);
    fill_normal(q, rng);
    set_open(mask);

    const double us = median_us(backend, gf, n_rep);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return us;
}

} // namespace

int main(int argc, char ** argv) {
    // `cpu`: the CPU backend too (its threads: the machine's cores), for a comparison on a machine without a GPU
    const bool with_cpu = argc > 1 && std::string(argv[1]) == "cpu";
    ggml_backend_load_all();
    const head_shape shapes[] = {
        { "SmolLM2-135M (D 64, 9/3 heads)",   64,  9, 3 },
        { "Llama-3-8B (D 128, 32/8 heads)",  128, 32, 8 },
    };
    // a third argument: one length instead of the three; a fourth: calls per median
    std::vector<int64_t> lengths = { 8192, 32768, 131072 };
    if (argc > 2) {
        lengths = { std::atoll(argv[2]) };
    }
    const int n_rep = argc > 3 ? std::max(1, std::atoi(argv[3])) : 20;
    const int32_t budget = 1024;
    int n_timed = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const bool gpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU;
        if (!gpu && !(with_cpu && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU)) {
            continue;
        }
        ++n_timed;
        ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
        if (!gpu) {
            ggml_backend_cpu_set_n_threads(backend, (int) std::thread::hardware_concurrency());
        }
        std::printf("%s (%s): one decode step of one layer, µs, medians of %d; sinks 16, window 256\n",
                ggml_backend_dev_name(dev), ggml_backend_dev_description(dev), n_rep);
        std::printf("| heads | positions | budget %d | budget = positions (every position) | stock attention | stock / budget %d |\n"
                "|---|---:|---:|---:|---:|---:|\n", budget, budget);
        for (const auto & sh : shapes) {
            for (const int64_t n : lengths) {
                const double sparse = time_decode(backend, sh, n, budget, n_rep);
                const double full   = time_decode(backend, sh, n, (int32_t) n, n_rep);
                const double stock  = time_stock(backend, sh, n, n_rep);
                std::printf("| %s | %lld | %.1f | %.1f | %.1f | %.2fx |\n", sh.name, (long long) n, sparse, full, stock,
                        stock/sparse);
                std::fflush(stdout);
            }
        }
        ggml_backend_free(backend);
    }
    if (n_timed == 0) {
        std::printf("no GPU backend in this build (`bench-h2o-decode cpu` times the CPU)\n");
    }
    return 0;
}
