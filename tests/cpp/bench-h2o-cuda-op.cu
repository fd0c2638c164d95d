// The CUDA kernels of GGML_OP_H2O_ATTN on their own, without the rest of ggml-cuda (which takes minutes to
// build): a check of the tensor-core path against the first, F32 kernel that test-h2o-backends proved against
// the CPU, a check of the memory-set build against the rule written out on the host, the same two for coverage
// selection (both attention paths with each tile's memory; each tile's memory against the rule of
// src/research/reference/tiles.rs written out on the host in double), and the time of one layer-chunk per kernel, for the
// head shapes of the models we measure.
//
//   nvcc -std=c++17 -O3 -use_fast_math -arch=sm_90 -I<patched llama.cpp>/ggml/src/ggml-cuda \
//        tests/cpp/bench-h2o-cuda-op.cu -o bench-h2o-cuda-op
//   bench-h2o-cuda-op            # checks, then timings; exit 0 when every check passes
//   bench-h2o-cuda-op --profile  # one layer-chunk per shape and kernel, for ncu
//   bench-h2o-cuda-op --small    # a few small checks, for compute-sanitizer
//   bench-h2o-cuda-op --one      # exactly one layer-chunk with a memory (1.5B shape), for ncu --set full
//
// scripts/gpu-test.sh kernels builds and runs it.

#include "h2o-attn-kernels.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

int n_failed = 0;

#define CHECK(cond, ...) do { if (!(cond)) { ++n_failed; std::printf("FAIL %s:%d: ", __FILE__, __LINE__); std::printf(__VA_ARGS__); std::printf("\n"); } } while (0)

#define CUDA_OK(call) do { cudaError_t err_ = (call); if (err_ != cudaSuccess) { \
    std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); std::exit(1); } } while (0)

struct head_shape {
    const char * name;
    int D;
    int n_head;
    int n_head_kv;
};

const head_shape shapes[] = {
    {"SmolLM2-135M (D 64, 9/3 heads)",      64,  9, 3},
    {"Qwen2.5-1.5B (D 128, 12/2 heads)",   128, 12, 2},
    {"Llama-3-8B (D 128, 32/8 heads)",     128, 32, 8},
};

template <typename T>
struct dev_buf {
    T *    ptr = nullptr;
    size_t n   = 0;
    explicit dev_buf(size_t count) : n(count) { CUDA_OK(cudaMalloc(&ptr, std::max<size_t>(n, 1)*sizeof(T))); }
    ~dev_buf() { cudaFree(ptr); }
    dev_buf(const dev_buf &) = delete;
    dev_buf & operator=(const dev_buf &) = delete;
    void upload(const std::vector<T> & h) { CUDA_OK(cudaMemcpy(ptr, h.data(), n*sizeof(T), cudaMemcpyHostToDevice)); }
    std::vector<T> download() const {
        std::vector<T> h(n);
        CUDA_OK(cudaMemcpy(h.data(), ptr, n*sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
};

float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t) h << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

// one layer's inputs (N tokens, contiguous as llama's views are: q [D, n_head, N], k/v [D, n_head_kv, kv_size])
// and the op's state
struct layer {
    head_shape sh;
    int S, L, H, N, kv_size;
    dev_buf<float>    q;
    dev_buf<half>     k, v;
    dev_buf<uint16_t> scores;
    dev_buf<int32_t>  mem;
    dev_buf<float>    acc, dst;
    std::vector<float> hq; // the host's copies of q and k (the coverage rule on the host reads them)
    std::vector<half>  hk;

    // the memory selection of every call (default: the seed rule)
    int   select     = 0;
    int   n_sink     = 0;
    int   tail_start = INT32_MAX;
    float coverage   = 1.0f;
    int   n_sample   = 4;

    layer(const head_shape & sh_, int S_, int L_, int H_, int N_, uint32_t seed) :
        sh(sh_), S(S_), L(L_), H(H_), N(N_), kv_size(N_),
        q((size_t) sh_.D*sh_.n_head*N_), k((size_t) sh_.D*sh_.n_head_kv*N_), v((size_t) sh_.D*sh_.n_head_kv*N_),
        scores((size_t) N_*sh_.n_head), mem((size_t) (L_ + H_)*sh_.n_head), acc((size_t) (S_ + L_ + H_)*sh_.n_head),
        dst((size_t) sh_.D*sh_.n_head*N_) {
        std::mt19937 rng(seed);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        // keys with a shared direction per KV head, so that attention is peaked as in a trained model
        hq.resize(q.n);
        for (auto & x : hq) {
            x = nd(rng)*1.5f;
        }
        q.upload(hq);
        hk.resize(k.n);
        std::vector<half> hv(v.n);
        for (size_t i = 0; i < hk.size(); ++i) {
            hk[i] = __float2half(nd(rng));
            hv[i] = __float2half(nd(rng));
        }
        k.upload(hk);
        v.upload(hv);
        reset();
    }

    void reset() {
        CUDA_OK(cudaMemset(scores.ptr, 0, scores.n*sizeof(uint16_t)));
        CUDA_OK(cudaMemset(mem.ptr, 0xff, mem.n*sizeof(int32_t)));
        CUDA_OK(cudaMemset(acc.ptr, 0, acc.n*sizeof(float)));
        CUDA_OK(cudaMemset(dst.ptr, 0xff, dst.n*sizeof(float))); // NaN: every row must be written
    }

    h2o_cuda_args args(int p0, int n_tokens, h2o_cuda_chunk_state st) const {
        const int D = sh.D;
        h2o_cuda_args a {};
        a.q      = (const char *) (q.ptr + (size_t) p0*D*sh.n_head);
        a.k      = (const char *) k.ptr;
        a.v      = (const char *) v.ptr;
        a.scores = scores.ptr;
        a.mem    = mem.ptr;
        a.acc    = acc.ptr;
        a.dst    = dst.ptr + (size_t) p0*D*sh.n_head;
        a.nbq1 = D*sizeof(float); a.nbq2 = (size_t) D*sh.n_head*sizeof(float);
        a.nbk1 = D*sizeof(half);  a.nbk2 = (size_t) D*sh.n_head_kv*sizeof(half);
        a.nbv1 = a.nbk1;          a.nbv2 = a.nbk2;
        a.nbd1 = a.nbq1;          a.nbd2 = a.nbq2;
        a.nb_scores1 = (size_t) kv_size*sizeof(uint16_t);
        a.nb_mem1    = (size_t) (L + H)*sizeof(int32_t);
        a.nb_acc1    = (size_t) (S + L + H)*sizeof(float);
        a.D = D; a.Dv = D; a.n_head = sh.n_head; a.n_head_kv = sh.n_head_kv;
        a.n_tokens = n_tokens; a.kv_size = kv_size;
        a.p0 = p0; a.S = S; a.L = L; a.H = H;
        a.mem_chunk = st.mem_chunk; a.acc_chunk = st.acc_chunk;
        a.scale = 1.0f/std::sqrt((float) D);
        a.select     = select;
        a.n_sink     = n_sink;
        a.tail_start = tail_start;
        a.coverage   = coverage;
        a.n_sample   = n_sample;
        int dev = 0;
        CUDA_OK(cudaGetDevice(&dev));
        int smpbo = 0;
        CUDA_OK(cudaDeviceGetAttribute(&smpbo, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
        a.smem_per_block = (size_t) smpbo;
        return a;
    }

    // the prefill of [0, N) in calls ending at the given positions (the last one N), with one kernel path
    void prefill(const std::vector<int> & ends, h2o_cuda_kernel kernel) {
        reset();
        h2o_cuda_chunk_state st = {-1, -1};
        int p0 = 0;
        for (int p1 : ends) {
            h2o_cuda_args a = args(p0, p1 - p0, st);
            h2o_cuda_plan plan;
            const char * err = h2o_cuda_make_plan(a, kernel, &plan);
            CHECK(err == nullptr, "%s: no plan: %s", sh.name, err ? err : "");
            if (err) {
                return;
            }
            dev_buf<float> partial(plan.partial_floats);
            st = h2o_cuda_run(a, plan, partial.ptr, 0);
            CUDA_OK(cudaGetLastError());
            CUDA_OK(cudaDeviceSynchronize());
            p0 = p1;
        }
    }
};

struct state_snapshot {
    std::vector<uint16_t> scores;
    std::vector<int32_t>  mem;
    std::vector<float>    acc;
    h2o_cuda_chunk_state  chunk;
};

state_snapshot save(const layer & ly, h2o_cuda_chunk_state chunk) {
    return {ly.scores.download(), ly.mem.download(), ly.acc.download(), chunk};
}

void restore(layer & ly, const state_snapshot & st) {
    ly.scores.upload(st.scores);
    ly.mem.upload(st.mem);
    ly.acc.upload(st.acc);
}

h2o_cuda_chunk_state run_call(layer & ly, int p0, int p1, h2o_cuda_chunk_state st, h2o_cuda_kernel kernel) {
    h2o_cuda_args a = ly.args(p0, p1 - p0, st);
    h2o_cuda_plan plan;
    const char * err = h2o_cuda_make_plan(a, kernel, &plan);
    CHECK(err == nullptr, "%s: no plan: %s", ly.sh.name, err ? err : "");
    if (err) {
        return st;
    }
    dev_buf<float> partial(plan.partial_floats);
    st = h2o_cuda_run(a, plan, partial.ptr, 0);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    return st;
}

// The tensor-core path against the F32 one, call by call: every call of the tensor-core path starts from the
// state the F32 path had before it (scores, memory sets, sums), so each call's arithmetic is compared on its
// own. Calls end on chunk boundaries, so a memory set built by a call is used by the next call only.
// Outputs must agree to F16-operand precision, scores to a BF16 step; a memory set may differ only where the
// two paths' scores reorder a near-tie: every differing position's score (F32 path) lies within 2·delta of the
// F32 path's selection threshold, delta being the largest score difference of that head.
void check_against_generic(const head_shape & sh, int S, int L, int H, int N) {
    layer ly(sh, S, L, H, N, 1234);
    std::vector<int> ends;
    for (int p = S; p < N; p += S) {
        ends.push_back(p);
    }
    ends.push_back(N);

    // the F32 path, keeping the state before every call and the outputs
    std::vector<state_snapshot> before;
    ly.reset();
    h2o_cuda_chunk_state st = {-1, -1};
    int p0 = 0;
    for (int p1 : ends) {
        before.push_back(save(ly, st));
        st = run_call(ly, p0, p1, st, H2O_CUDA_KERNEL_GENERIC);
        p0 = p1;
    }
    before.push_back(save(ly, st));
    const auto out_ref = ly.dst.download();

    const int M = L + H;
    double err2 = 0.0, ref2 = 0.0, max_abs = 0.0, max_rel = 0.0, max_delta = 0.0, worst_tie = 0.0;
    size_t n_nan = 0, n_diff_sc = 0, n_swapped = 0, n_outside = 0;
    CUDA_OK(cudaMemset(ly.dst.ptr, 0xff, ly.dst.n*sizeof(float)));
    p0 = 0;
    for (size_t call = 0; call < ends.size(); ++call) {
        const int p1 = ends[call];
        restore(ly, before[call]);
        const h2o_cuda_chunk_state got_st = run_call(ly, p0, p1, before[call].chunk, H2O_CUDA_KERNEL_AUTO);
        CHECK(got_st.mem_chunk == before[call + 1].chunk.mem_chunk && got_st.acc_chunk == before[call + 1].chunk.acc_chunk,
                "%s: chunk state after call %zu", sh.name, call);
        const auto sc  = ly.scores.download();
        const auto mem = ly.mem.download();
        const auto & sc_ref  = before[call + 1].scores;
        const auto & mem_ref = before[call + 1].mem;
        for (int ih = 0; ih < sh.n_head; ++ih) {
            double delta = 0.0;
            for (int p = 0; p < p1; ++p) {
                const size_t i = (size_t) ih*ly.kv_size + p;
                const float a = bf16_to_f32(sc[i]), b = bf16_to_f32(sc_ref[i]);
                if (sc[i] != sc_ref[i]) {
                    ++n_diff_sc;
                    max_rel = std::max(max_rel, (double) std::fabs(a - b)/std::max(std::fabs(b), 1e-30f));
                }
                delta = std::max(delta, (double) std::fabs(a - b));
            }
            max_delta = std::max(max_delta, delta);
            std::vector<int32_t> x(mem.begin() + (size_t) ih*M, mem.begin() + (size_t) (ih + 1)*M);
            std::vector<int32_t> y(mem_ref.begin() + (size_t) ih*M, mem_ref.begin() + (size_t) (ih + 1)*M);
            if (x == y) {
                continue;
            }
            // the F32 path's threshold: its lowest heavy score (Local is the last L slots, the same on both)
            double threshold = INFINITY;
            for (int m = 0; m < H; ++m) {
                if (y[m] >= 0) {
                    threshold = std::min(threshold, (double) bf16_to_f32(sc_ref[(size_t) ih*ly.kv_size + y[m]]));
                }
            }
            std::vector<int32_t> only;
            std::set_symmetric_difference(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(only));
            n_swapped += only.size()/2;
            for (int32_t pos : only) {
                const double gap = std::fabs(bf16_to_f32(sc_ref[(size_t) ih*ly.kv_size + pos]) - threshold);
                if (gap > 2.0*delta) {
                    ++n_outside;
                }
                worst_tie = std::max(worst_tie, delta > 0.0 ? gap/(2.0*delta) : INFINITY);
            }
        }
        p0 = p1;
    }
    const auto out = ly.dst.download();
    for (size_t i = 0; i < out.size(); ++i) {
        if (!std::isfinite(out[i])) {
            ++n_nan;
            continue;
        }
        const double d = (double) out[i] - out_ref[i];
        err2 += d*d;
        ref2 += (double) out_ref[i]*out_ref[i];
        max_abs = std::max(max_abs, std::fabs(d));
    }
    const double nmse = err2/std::max(ref2, 1e-30);
    std::printf("  %-34s S %4d L %3d H %3d N %5d, %zu calls: out NMSE %.2e max|d| %.2e, NaN %zu; scores %zu of %zu differ "
            "(max rel %.4f, max delta %.3g); memory slots swapped %zu, %zu outside the near-tie bound (worst at %.2f of 2 delta)\n",
            sh.name, S, L, H, N, ends.size(), nmse, max_abs, n_nan, n_diff_sc, (size_t) sh.n_head*N, max_rel, max_delta,
            n_swapped, n_outside, worst_tie);
    CHECK(n_nan == 0, "%s: %zu outputs not written or not finite", sh.name, n_nan);
    CHECK(nmse < 1e-5, "%s: output NMSE %.3e", sh.name, nmse);
    CHECK(max_rel <= 1.0/128, "%s: a score moved by %.4f relative, more than a BF16 step", sh.name, max_rel);
    CHECK(n_outside == 0, "%s: %zu memory-set differences are not near-ties", sh.name, n_outside);
}

// one prefill in calls that split chunks, both paths from the empty state: outputs written and finite, and
// equal to F16 precision unless a near-tie flipped a memory set (then the later chunks attend to other keys)
void check_split_calls(const head_shape & sh, int S, int L, int H, int N, const std::vector<int> & ends) {
    layer ly(sh, S, L, H, N, 4321);
    ly.prefill(ends, H2O_CUDA_KERNEL_GENERIC);
    const auto out_ref = ly.dst.download();
    const auto mem_ref = ly.mem.download();
    ly.prefill(ends, H2O_CUDA_KERNEL_AUTO);
    const auto out = ly.dst.download();
    const auto mem = ly.mem.download();
    double err2 = 0.0, ref2 = 0.0;
    size_t n_nan = 0;
    for (size_t i = 0; i < out.size(); ++i) {
        if (!std::isfinite(out[i])) {
            ++n_nan;
            continue;
        }
        err2 += ((double) out[i] - out_ref[i])*((double) out[i] - out_ref[i]);
        ref2 += (double) out_ref[i]*out_ref[i];
    }
    const double nmse = err2/std::max(ref2, 1e-30);
    const bool same_sets = mem == mem_ref;
    std::printf("  %-34s S %4d N %5d in %zu calls split inside chunks: out NMSE %.2e, NaN %zu, final memory sets %s\n",
            sh.name, S, N, ends.size(), nmse, n_nan, same_sets ? "identical" : "differ (near-tie)");
    CHECK(n_nan == 0, "%s: %zu outputs not written or not finite", sh.name, n_nan);
    CHECK(!same_sets || nmse < 1e-5, "%s: output NMSE %.3e with identical memory sets", sh.name, nmse);
}

// the memory-set rule on the host (ggml_h2o_build_memory_set): Local, then the best H candidates by float score
// with ties to the lower position and NaN last, ascending
std::vector<int32_t> build_rule(const std::vector<uint16_t> & sc, const std::vector<int32_t> & prev, int L, int H,
        int start, int end, bool has_previous) {
    const int M = L + H;
    const int local_start = std::max(end - L, 0);
    start = std::min(start, end);
    std::vector<int32_t> cand;
    if (has_previous) {
        for (int32_t p : prev) {
            if (p >= 0 && p < start && p < local_start) {
                cand.push_back(p);
            }
        }
    }
    for (int p = start; p < std::max(start, local_start); ++p) {
        cand.push_back(p);
    }
    std::stable_sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) {
        const float fa = bf16_to_f32(sc[a]), fb = bf16_to_f32(sc[b]);
        const bool na = std::isnan(fa), nb = std::isnan(fb);
        if (na != nb) {
            return nb;
        }
        if (!na && fa != fb) {
            return fa > fb;
        }
        return a < b;
    });
    const int n_best = std::min<int>(H, (int) cand.size());
    std::vector<int32_t> heavy(cand.begin(), cand.begin() + n_best);
    std::sort(heavy.begin(), heavy.end());
    std::vector<int32_t> out = heavy;
    for (int m = n_best; m < M; ++m) {
        const int p = local_start + (m - n_best);
        out.push_back(p < end ? p : -1);
    }
    return out;
}

void check_build(int n_cases) {
    std::mt19937 rng(99);
    int n_ok = 0;
    for (int tc = 0; tc < n_cases; ++tc) {
        const int S      = std::vector<int>{64, 128, 512, 1024, 4096}[rng() % 5];
        const int M      = 1 + rng() % (S - 1);
        const int L      = rng() % (M + 1);
        const int H      = M - L;
        const int c      = 1 + rng() % 3;
        const int n_head = 1 + rng() % 4;
        const int kv     = (c + 1)*S;
        const bool has_previous = rng() % 4 != 0;
        // scores with many ties (few distinct values), some NaN and signed zeros, or spread ones
        std::vector<uint16_t> sc((size_t) kv*n_head);
        const int kind = rng() % 3;
        for (auto & x : sc) {
            if (kind == 0) {
                x = (uint16_t) (0x3f80 + (rng() % 4)); // 4 values near 1.0
            } else if (kind == 1) {
                const uint16_t special[] = {0x0000, 0x8000, 0x7fc0, 0x3f80, 0x0001, 0x7f80};
                x = special[rng() % 6];
            } else {
                x = (uint16_t) (rng() & 0x7f7f);
            }
        }
        std::vector<int32_t> prev((size_t) M*n_head, -1);
        for (int ih = 0; ih < n_head; ++ih) {
            std::vector<int32_t> pool;
            for (int p = 0; p < c*S; ++p) {
                pool.push_back(p);
            }
            std::shuffle(pool.begin(), pool.end(), rng);
            std::vector<int32_t> pick(pool.begin(), pool.begin() + std::min<int>(M, (int) pool.size()));
            std::sort(pick.begin(), pick.end());
            std::copy(pick.begin(), pick.end(), prev.begin() + (size_t) ih*M);
        }
        dev_buf<uint16_t> d_sc(sc.size());
        dev_buf<int32_t>  d_mem(prev.size());
        d_sc.upload(sc);
        d_mem.upload(prev);
        const size_t smem = h2o_build_smem_bytes(S, M);
        CUDA_OK(cudaFuncSetAttribute(h2o_build, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        h2o_build<<<n_head, H2O_BUILD_THREADS, smem>>>(d_sc.ptr, d_mem.ptr, (size_t) kv*sizeof(uint16_t),
                (size_t) M*sizeof(int32_t), L, H, 0, c*S, (c + 1)*S, has_previous);
        CUDA_OK(cudaGetLastError());
        const auto got = d_mem.download();
        bool same = true;
        for (int ih = 0; ih < n_head && same; ++ih) {
            std::vector<uint16_t> sch(sc.begin() + (size_t) ih*kv, sc.begin() + (size_t) (ih + 1)*kv);
            std::vector<int32_t>  ph(prev.begin() + (size_t) ih*M, prev.begin() + (size_t) (ih + 1)*M);
            const auto want = build_rule(sch, ph, L, H, c*S, (c + 1)*S, has_previous);
            same = std::equal(want.begin(), want.end(), got.begin() + (size_t) ih*M);
            CHECK(same, "build case %d: S %d L %d H %d c %d head %d: the set differs from the rule", tc, S, L, H, c, ih);
        }
        n_ok += same;
    }
    std::printf("  memory-set build against the rule: %d of %d random cases identical\n", n_ok, n_cases);
}

// Coverage selection, both paths from the empty state, with the same calls: the tensor cores (the selection's logits
// and the attention) against F32 (the selection's logits on the CUDA cores, h2o_attn_generic). Both selections are as
// exact as F32 products, so the memory sets may differ only where a near-tie flips (slots counted and bounded as in
// test-h2o-backends); with identical sets outputs agree to F16 precision and scores to a BF16 step.
void check_coverage_paths(const head_shape & sh, int S, int L, int H, int N, const std::vector<int> & ends, int n_sink,
        int tail_start, float coverage, int n_sample) {
    layer ly(sh, S, L, H, N, 5678);
    ly.select     = H2O_COV_SELECT;
    ly.n_sink     = n_sink;
    ly.tail_start = tail_start;
    ly.coverage   = coverage;
    ly.n_sample   = n_sample;
    ly.prefill(ends, H2O_CUDA_KERNEL_GENERIC);
    const auto out_ref = ly.dst.download();
    const auto mem_ref = ly.mem.download();
    const auto sc_ref  = ly.scores.download();
    ly.prefill(ends, H2O_CUDA_KERNEL_AUTO);
    const auto out = ly.dst.download();
    const auto mem = ly.mem.download();
    const auto sc  = ly.scores.download();
    double err2 = 0.0, ref2 = 0.0, max_rel = 0.0;
    size_t n_nan = 0;
    for (size_t i = 0; i < out.size(); ++i) {
        if (!std::isfinite(out[i])) {
            ++n_nan;
            continue;
        }
        err2 += ((double) out[i] - out_ref[i])*((double) out[i] - out_ref[i]);
        ref2 += (double) out_ref[i]*out_ref[i];
    }
    for (size_t i = 0; i < sc.size(); ++i) {
        const float a = bf16_to_f32(sc[i]), b = bf16_to_f32(sc_ref[i]);
        max_rel = std::max(max_rel, (double) std::fabs(a - b)/std::max(std::fabs(b), 1e-30f));
    }
    size_t n_slots_diff = 0;
    for (size_t i = 0; i < mem.size(); ++i) {
        n_slots_diff += mem[i] != mem_ref[i];
    }
    const double nmse = err2/std::max(ref2, 1e-30);
    const bool   same = n_slots_diff == 0;
    std::printf("  %-34s S %4d L %3d H %3d N %5d in %zu calls, coverage %.2f, %d samples, %d sinks: tensor cores against F32: "
            "out NMSE %.2e, NaN %zu, scores max rel %.4f, memory slots differing %zu of %zu\n", sh.name, S, L, H, N,
            ends.size(), coverage, n_sample, n_sink, nmse, n_nan, max_rel, n_slots_diff, mem.size());
    CHECK(n_nan == 0, "%s: %zu outputs not written or not finite", sh.name, n_nan);
    CHECK(n_slots_diff <= mem.size()/50, "%s: coverage: %zu memory slots of the two paths differ", sh.name, n_slots_diff);
    CHECK(!same || nmse < 1e-5, "%s: coverage: output NMSE %.3e with identical memory sets", sh.name, nmse);
    CHECK(!same || max_rel <= 1.0/128, "%s: coverage: a score moved by %.4f relative with identical memory sets", sh.name, max_rel);
}

// the coverage rule on the host, in double (src/research/reference/tiles.rs): one unit's (head h, tile of rows [r0, r1) from t0)
// ranked candidates and its estimate after 0 .. n_steps budget steps
struct cov_unit {
    std::vector<int>    ranked;
    std::vector<double> est;
};

// the softmax of query row i of head h over the keys, as probabilities
std::vector<double> cov_softmax(const layer & ly, int h, int i, const std::vector<int> & keys) {
    const head_shape & sh = ly.sh;
    const int    D     = sh.D;
    const double scale = 1.0/std::sqrt((double) D);
    const float * qr = ly.hq.data() + ((size_t) i*sh.n_head + h)*D;
    std::vector<double> p(keys.size());
    double mx = -INFINITY;
    for (size_t m = 0; m < keys.size(); ++m) {
        const half * kr = ly.hk.data() + ((size_t) keys[m]*sh.n_head_kv + h/(sh.n_head/sh.n_head_kv))*D;
        double dot = 0.0;
        for (int d = 0; d < D; ++d) {
            dot += (double) qr[d]*(double) __half2float(kr[d]);
        }
        p[m] = dot*scale;
        mx = std::max(mx, p[m]);
    }
    double z = 0.0;
    for (double & x : p) {
        x = std::exp(x - mx);
        z += x;
    }
    for (double & x : p) {
        x /= z;
    }
    return p;
}

cov_unit coverage_unit_rule(const layer & ly, int h, int t0, int r0, int r1, int cs, const std::vector<int> & forced,
        int sink_end, int local_start, int n_rank, int n_steps) {
    const int every = H2O_COV_TILE/ly.n_sample;
    std::vector<int> samples;
    for (int i = r0; i < r1; ++i) {
        if ((i - t0) % every == every - 1) {
            samples.push_back(i);
        }
    }
    if (samples.empty()) {
        samples.push_back(r1 - 1);
    }
    // the proposal: the candidates by the samples' summed attention, ties to the lower position
    std::vector<std::pair<double, int>> score;
    for (int j = sink_end; j < local_start; ++j) {
        score.push_back({0.0, j});
    }
    for (int i : samples) {
        std::vector<int> keys(i + 1);
        for (int j = 0; j <= i; ++j) {
            keys[j] = j;
        }
        const auto p = cov_softmax(ly, h, i, keys);
        for (auto & sc : score) {
            sc.first += p[sc.second];
        }
    }
    std::sort(score.begin(), score.end(), [](const auto & x, const auto & y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
    });
    std::vector<int> proposed;
    for (int m = 0; m < n_rank; ++m) {
        proposed.push_back(score[m].second);
    }
    // every row over its chunk, the forced positions and the proposal
    std::vector<double> base(r1 - r0, 0.0);
    std::vector<std::vector<double>> pp(r1 - r0);
    for (int i = r0; i < r1; ++i) {
        std::vector<int> keys;
        for (int j = cs; j <= i; ++j) {
            keys.push_back(j);
        }
        keys.insert(keys.end(), forced.begin(), forced.end());
        keys.insert(keys.end(), proposed.begin(), proposed.end());
        const auto p = cov_softmax(ly, h, i, keys);
        const size_t n_base = keys.size() - proposed.size();
        for (size_t m = 0; m < n_base; ++m) {
            base[i - r0] += p[m];
        }
        pp[i - r0].assign(p.begin() + n_base, p.end());
    }
    // the ranking by the tile's summed attention, ties to the lower position, and the estimate
    std::vector<std::pair<double, int>> order;
    for (int m = 0; m < n_rank; ++m) {
        double sum = 0.0;
        for (const auto & p : pp) {
            sum += p[m];
        }
        order.push_back({sum, m});
    }
    std::sort(order.begin(), order.end(), [&](const auto & x, const auto & y) {
        return x.first > y.first || (x.first == y.first && proposed[x.second] < proposed[y.second]);
    });
    cov_unit u;
    for (const auto & o : order) {
        u.ranked.push_back(proposed[o.second]);
    }
    for (int g = 0; g <= n_steps; ++g) {
        double sum = 0.0;
        for (int r = 0; r < r1 - r0; ++r) {
            sum += base[r];
            for (int m = 0; m < std::min(g*H2O_COV_STEP, n_rank); ++m) {
                sum += pp[r][order[m].second];
            }
        }
        u.est.push_back(sum/(r1 - r0));
    }
    return u;
}

// the budget, one step at a time to the largest gain (ties to the lower unit), among units below the target
std::vector<int> coverage_spend(const std::vector<cov_unit> & units, int n_steps, size_t total, float coverage) {
    std::vector<int> given(units.size(), 0);
    for (; total > 0; --total) {
        int    best      = -1;
        double best_gain = 0.0;
        for (size_t u = 0; u < units.size(); ++u) {
            const auto & e = units[u].est;
            if (given[u] < n_steps && e[given[u]] < (double) coverage) {
                const double gain = e[given[u] + 1] - e[given[u]];
                if (best < 0 || gain > best_gain) {
                    best      = (int) u;
                    best_gain = gain;
                }
            }
        }
        if (best < 0) {
            break;
        }
        given[best]++;
    }
    return given;
}

// the memory of every tile of the call's rows [i_begin, i_end) of the chunk at cs, per head, ascending; kept[h]: the
// last tile's at the average budget, padded to L + H
std::vector<std::vector<std::vector<int32_t>>> coverage_rule(const layer & ly, int cs, int i_begin, int i_end,
        std::vector<std::vector<int32_t>> & kept) {
    const int L           = ly.L;
    const int H           = ly.H;
    const int local_start = std::max(cs - L, 0);
    const int sink_end    = std::min(ly.n_sink, local_start);
    const int heavy       = std::max(H - sink_end, 0);
    const int n_rank      = std::min(local_start - sink_end, H2O_COV_FACTOR*H);
    const int n_steps     = (n_rank + H2O_COV_STEP - 1)/H2O_COV_STEP;
    std::vector<int> forced;
    for (int p = 0; p < sink_end; ++p) {
        forced.push_back(p);
    }
    for (int p = local_start; p < cs; ++p) {
        forced.push_back(p);
    }
    const int t_first = cs + (i_begin - cs)/H2O_COV_TILE*H2O_COV_TILE;
    const int n_t     = (i_end - t_first + H2O_COV_TILE - 1)/H2O_COV_TILE;
    std::vector<cov_unit> units;
    for (int h = 0; h < ly.sh.n_head; ++h) {
        for (int ti = 0; ti < n_t; ++ti) {
            const int t0 = t_first + ti*H2O_COV_TILE;
            units.push_back(coverage_unit_rule(ly, h, t0, std::max(t0, i_begin), std::min(t0 + H2O_COV_TILE, i_end), cs,
                    forced, sink_end, local_start, n_rank, n_steps));
        }
    }
    const std::vector<int> given = coverage_spend(units, n_steps, units.size()*heavy/H2O_COV_STEP, ly.coverage);

    std::vector<std::vector<std::vector<int32_t>>> out(ly.sh.n_head);
    kept.assign(ly.sh.n_head, {});
    for (size_t u = 0; u < units.size(); ++u) {
        const int h  = (int) u/n_t;
        const int ti = (int) u%n_t;
        std::vector<int32_t> m(forced.begin(), forced.end());
        m.insert(m.end(), units[u].ranked.begin(), units[u].ranked.begin() + std::min(given[u]*H2O_COV_STEP, n_rank));
        std::sort(m.begin(), m.end());
        out[h].push_back(m);
        if (ti == n_t - 1) {
            std::vector<int32_t> k(forced.begin(), forced.end());
            k.insert(k.end(), units[u].ranked.begin(), units[u].ranked.begin() + std::min(heavy, n_rank));
            std::sort(k.begin(), k.end());
            k.resize(L + H, -1);
            kept[h] = k;
        }
    }
    return out;
}

// One call over rows [i_begin, i_end) of chunk c on the GPU, every tile's memory (read from the op's scratch) against the
// rule on the host. Float sums on the GPU against double ones on the host may rank a near-tie the other way, so a few
// tiles may differ; a wrong kernel makes most of them differ. kernel: AUTO, the selection's logits on the tensor cores
// (head sizes 64, 128); GENERIC, in F32.
void check_coverage_rule(const head_shape & sh, int S, int L, int H, int c, int i_begin, int i_end, int n_sink,
        float coverage, int n_sample, h2o_cuda_kernel kernel) {
    const int cs = c*S;
    layer ly(sh, S, L, H, (c + 1)*S, 2468 + c);
    ly.select   = H2O_COV_SELECT;
    ly.n_sink   = n_sink;
    ly.coverage = coverage;
    ly.n_sample = n_sample;
    h2o_cuda_args a = ly.args(i_begin, i_end - i_begin, {c - 1, i_begin > cs ? c : -1});
    h2o_cuda_plan plan;
    const char * err = h2o_cuda_make_plan(a, kernel, &plan);
    CHECK(err == nullptr, "%s: no plan: %s", sh.name, err ? err : "");
    if (err) {
        return;
    }
    dev_buf<float> partial(plan.partial_floats);
    h2o_cuda_run(a, plan, partial.ptr, 0);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    h2o_cov_scratch s;
    h2o_cov_layout(a, plan, (char *) partial.ptr, &s);
    const int n_t = (i_end - (cs + (i_begin - cs)/H2O_COV_TILE*H2O_COV_TILE) + H2O_COV_TILE - 1)/H2O_COV_TILE;
    const int Mt  = plan.cov_mem;
    std::vector<int32_t> mem_t((size_t) n_t*sh.n_head*Mt), mem_n((size_t) n_t*sh.n_head);
    CUDA_OK(cudaMemcpy(mem_t.data(), s.mem_t, mem_t.size()*sizeof(int32_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(mem_n.data(), s.mem_n, mem_n.size()*sizeof(int32_t), cudaMemcpyDeviceToHost));
    const auto kept_got = ly.mem.download();

    std::vector<std::vector<int32_t>> kept;
    const auto want = coverage_rule(ly, cs, i_begin, i_end, kept);
    int n_diff = 0, n_kept_diff = 0;
    size_t n_pos_diff = 0;
    for (int h = 0; h < sh.n_head; ++h) {
        for (int ti = 0; ti < n_t; ++ti) {
            const size_t u = (size_t) ti*sh.n_head + h;
            const std::vector<int32_t> got(mem_t.begin() + u*Mt, mem_t.begin() + u*Mt + mem_n[u]);
            if (got != want[h][ti]) {
                ++n_diff;
                std::vector<int32_t> only;
                std::set_symmetric_difference(got.begin(), got.end(), want[h][ti].begin(), want[h][ti].end(),
                        std::back_inserter(only));
                n_pos_diff += only.size();
            }
        }
        n_kept_diff += !std::equal(kept[h].begin(), kept[h].end(), kept_got.begin() + (size_t) h*(L + H));
    }
    const int n_units = sh.n_head*n_t;
    std::printf("  %-34s S %4d L %3d H %3d chunk %d rows [%d, %d), coverage %.2f, %d samples, %d sinks, logits %s: tile "
            "memories against the rule: %d of %d differ (%zu positions), kept sets %d of %d differ\n", sh.name, S, L, H, c,
            i_begin, i_end, coverage, n_sample, n_sink, plan.cov_dt ? "tensor cores" : "F32", n_diff, n_units, n_pos_diff,
            n_kept_diff, sh.n_head);
    CHECK(n_diff <= 1 + n_units/20, "%s: coverage: %d of %d tile memories differ from the rule", sh.name, n_diff, n_units);
    CHECK(n_kept_diff <= 1 + sh.n_head/10, "%s: coverage: %d of %d kept memory sets differ from the rule", sh.name,
            n_kept_diff, sh.n_head);
}

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size()/2];
}

// the device time of what launch() enqueues, in µs (CUDA events around it)
struct gpu_timer {
    cudaEvent_t e0, e1;
    gpu_timer()  { CUDA_OK(cudaEventCreate(&e0)); CUDA_OK(cudaEventCreate(&e1)); }
    ~gpu_timer() { cudaEventDestroy(e0); cudaEventDestroy(e1); }
    template <typename F>
    float us(F && launch) {
        CUDA_OK(cudaEventRecord(e0));
        launch();
        CUDA_OK(cudaEventRecord(e1));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        return ms*1000.0f;
    }
};

// one layer-chunk with a memory: the call over chunk 1 after chunk 0, per kernel and in all, in µs
void time_layer_chunk(const head_shape & sh, int S, int L, int H, bool generic_too, bool profile) {
    const int N = 2*S;
    layer ly(sh, S, L, H, N, 7);
    const int M = L + H;
    const int reps = profile ? 1 : 20;
    const int warmup = 2; // repetitions not counted (except under a profiler, which times each launch itself)
    gpu_timer timer;

    const auto run_chunk1 = [&](h2o_cuda_kernel kernel) {
        h2o_cuda_args a = ly.args(S, S, {0, -1});
        h2o_cuda_plan plan;
        h2o_cuda_make_plan(a, kernel, &plan);
        dev_buf<float> partial(plan.partial_floats);
        std::vector<float> t_all;
        for (int r = 0; r < reps + warmup; ++r) {
            // the same call again from the same state: chunk 0's memory set and scores first (not timed)
            ly.prefill({S}, kernel);
            const float t = timer.us([&] { h2o_cuda_run(a, plan, partial.ptr, 0); });
            if (r >= warmup || profile) {
                t_all.push_back(t);
            }
        }
        return median(t_all);
    };

    const float t_mma = run_chunk1(H2O_CUDA_KERNEL_AUTO);
    float t_gen = 0.0f;
    if (generic_too) {
        t_gen = run_chunk1(H2O_CUDA_KERNEL_GENERIC);
    }

    // each kernel alone, from the state after chunk 0
    h2o_cuda_args a = ly.args(S, S, {0, -1});
    h2o_cuda_plan plan;
    h2o_cuda_make_plan(a, H2O_CUDA_KERNEL_AUTO, &plan);
    dev_buf<float> partial(plan.partial_floats);
    std::vector<float> t_attn, t_red, t_build;
    CUDA_OK(cudaFuncSetAttribute(h2o_build, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) plan.build_smem));
    const int n_parts = (S + H2O_MMA_ROWS - 1)/H2O_MMA_ROWS;
    for (int r = 0; r < reps + warmup; ++r) {
        // the build overwrites M_0 with M_1: chunk 0's state again for every repetition
        ly.prefill({S}, H2O_CUDA_KERNEL_AUTO);
        const float ta = timer.us([&] {
            if (sh.D == 64) {
                h2o_cuda_launch_mma<64>(a, partial.ptr, S, S, 2*S, true, 0);
            } else {
                h2o_cuda_launch_mma<128>(a, partial.ptr, S, S, 2*S, true, 0);
            }
        });
        const float tr = timer.us([&] {
            h2o_reduce_settle<<<dim3((S + M + 255)/256, sh.n_head), 256>>>(partial.ptr, n_parts, S + M, a.acc, a.nb_acc1,
                    a.scores, a.nb_scores1, a.mem, a.nb_mem1, S, M, S, a.kv_size, false, true);
        });
        const float tb = timer.us([&] {
            h2o_build<<<sh.n_head, H2O_BUILD_THREADS, plan.build_smem>>>(a.scores, a.mem, a.nb_scores1, a.nb_mem1,
                    L, H, 0, S, 2*S, true);
        });
        if (r >= warmup || profile) {
            t_attn.push_back(ta);
            t_red.push_back(tr);
            t_build.push_back(tb);
        }
    }
    CUDA_OK(cudaGetLastError());

    // query-key pairs of the chunk: causal inside it, and all of M
    const double pairs = (double) S*(S + 1)/2 + (double) S*M;
    const double flops = 4.0*pairs*sh.D*sh.n_head; // Q·K^T and P·V, 2 flops a multiply-add
    std::printf("| %s | %d | %d | %.1f | %.1f | %.1f | %.1f | %.0f | %s |\n", sh.name, S, M,
            median(t_attn), median(t_red), median(t_build), t_mma, flops/(median(t_attn)*1e-6)/1e12,
            generic_too ? (std::to_string((int) t_gen) + " µs").c_str() : "-");
}


// one layer-chunk under coverage selection (4 sinks, 4 samples per tile): the call over chunk c, whose sampled queries
// attend to every earlier position (so the selection's cost grows with c), against the seed rule's call there
void time_coverage(const head_shape & sh, int S, int L, int H, int c, bool profile) {
    layer ly(sh, S, L, H, (c + 1)*S, 13);
    const int reps   = profile ? 1 : 10;
    const int warmup = 2;
    gpu_timer timer;
    float  t_select = 0.0f;
    size_t scratch  = 0;
    const auto time_call = [&](int select) {
        ly.select = select;
        ly.n_sink = select == H2O_COV_SELECT ? 4 : 0;
        h2o_cuda_args a = ly.args(c*S, S, {c - 1, -1});
        h2o_cuda_plan plan;
        const char * err = h2o_cuda_make_plan(a, H2O_CUDA_KERNEL_AUTO, &plan);
        CHECK(err == nullptr, "%s: no plan: %s", sh.name, err ? err : "");
        if (err) {
            return 0.0f;
        }
        dev_buf<float> partial(plan.partial_floats);
        h2o_cov_scratch s {};
        if (select == H2O_COV_SELECT) {
            h2o_cov_layout(a, plan, (char *) partial.ptr, &s);
            scratch = plan.partial_floats*sizeof(float);
        }
        std::vector<float> t_all, t_sel;
        for (int r = 0; r < reps + warmup; ++r) {
            const float t = timer.us([&] { h2o_cuda_run(a, plan, partial.ptr, 0); });
            if (select == H2O_COV_SELECT) {
                const float ts = timer.us([&] { h2o_cuda_cover_select(a, plan, s, c*S, c*S, (c + 1)*S, 0); });
                if (r >= warmup || profile) {
                    t_sel.push_back(ts);
                }
            }
            if (r >= warmup || profile) {
                t_all.push_back(t);
            }
        }
        CUDA_OK(cudaGetLastError());
        if (select == H2O_COV_SELECT) {
            t_select = median(t_sel);
        }
        return median(t_all);
    };
    const float t_seed = time_call(0);
    const float t_cov  = time_call(H2O_COV_SELECT);
    std::printf("| %s | %d | %d | %.1f | %.1f | %.1f | %.1f |\n", sh.name, S, c*S, t_seed, t_cov, t_select,
            scratch/1048576.0);
}

} // namespace

int main(int argc, char ** argv) {
    const bool profile = argc > 1 && std::strcmp(argv[1], "--profile") == 0;
    if (argc > 1 && std::strcmp(argv[1], "--one") == 0) {
        // chunk 0 of the Qwen2.5-1.5B head shape, then exactly one chunk-1 call (for ncu: the second h2o_attn_mma)
        layer ly(shapes[1], 1024, 256, 256, 2048, 7);
        ly.prefill({1024}, H2O_CUDA_KERNEL_AUTO);
        run_call(ly, 1024, 2048, {0, -1}, H2O_CUDA_KERNEL_AUTO);
        return 0;
    }
    if (argc > 1 && std::strcmp(argv[1], "--small") == 0) {
        // a few small cases, for compute-sanitizer (racecheck is slow)
        check_against_generic(shapes[1], 128, 32, 32, 2*128 + 40);
        check_build(10);
        check_coverage_paths(shapes[1], 128, 32, 32, 2*128 + 40, {100, 2*128 + 40}, 4, INT32_MAX, 1.0f, 4);
        check_coverage_rule(shapes[0], 128, 32, 32, 2, 2*128, 3*128, 4, 1.0f, 4, H2O_CUDA_KERNEL_AUTO);
        std::printf("%d failed\n", n_failed);
        return n_failed == 0 ? 0 : 1;
    }
    cudaDeviceProp prop {};
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, %d SMs, %zu KiB shared memory per block (opt-in)\n", prop.name, prop.multiProcessorCount,
            prop.sharedMemPerBlockOptin/1024);

    if (!profile) {
        std::printf("checks: tensor-core path against the F32 kernel\n");
        for (const auto & sh : shapes) {
            check_against_generic(sh, 128, 32, 32, 3*128 + 40);
            check_against_generic(sh, 1024, 256, 256, 3*1024 + 300);
            check_split_calls(sh, 128, 32, 32, 3*128 + 40, {100, 128 + 100, 3*128 + 40});
            check_split_calls(sh, 128, 32, 32, 3*128 + 40, {3*128 + 40});
        }
        check_against_generic(shapes[1], 4096, 256, 256, 2*4096 + 100);
        check_against_generic(shapes[0], 100, 20, 30, 450); // a chunk that is no multiple of 64
        check_build(300);

        std::printf("checks: coverage selection\n");
        for (const auto & sh : shapes) {
            check_coverage_paths(sh, 128, 32, 32, 3*128 + 40, {3*128 + 40}, 4, 3*128 + 16, 1.0f, 4);
            check_coverage_paths(sh, 128, 32, 32, 3*128 + 40, {100, 128 + 100, 3*128 + 40}, 0, INT32_MAX, 0.9f, 1);
        }
        check_coverage_paths(shapes[1], 1024, 256, 256, 3*1024 + 300, {3*1024 + 300}, 4, 3*1024 + 236, 1.0f, 4);
        check_coverage_paths(shapes[0], 100, 20, 30, 450, {450}, 4, INT32_MAX, 1.0f, 16); // chunks no multiple of 64
        // stage 1 choosing the proposals (4 H < the candidates), a call inside a chunk, every candidate proposed; both
        // ways of computing the selection's logits
        for (const h2o_cuda_kernel kernel : {H2O_CUDA_KERNEL_AUTO, H2O_CUDA_KERNEL_GENERIC}) {
            check_coverage_rule(shapes[0], 256, 64, 64, 3, 3*256, 4*256, 4, 1.0f, 4, kernel);
            check_coverage_rule(shapes[0], 256, 64, 64, 3, 3*256 + 100, 3*256 + 200, 0, 0.9f, 16, kernel);
            check_coverage_rule(shapes[1], 512, 128, 128, 2, 2*512, 3*512, 4, 1.0f, 4, kernel);
            check_coverage_rule(shapes[2], 256, 64, 64, 1, 256, 512, 4, 1.0f, 2, kernel);
        }
    }

    std::printf("\none layer-chunk with a memory (chunk 1 after chunk 0), µs, medians of 20:\n");
    std::printf("| heads | S | M | h2o_attn_mma | h2o_reduce_settle | h2o_build | whole call | attention TFLOP/s | first kernel, whole call |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const auto & sh : shapes) {
        time_layer_chunk(sh, 1024, 256, 256, !profile, profile);
    }
    if (!profile) {
        time_layer_chunk(shapes[1], 4096, 256, 256, false, false);
        time_layer_chunk(shapes[2], 4096, 256, 256, false, false);
        time_layer_chunk(shapes[1], 512, 128, 128, false, false);
    }

    std::printf("\ncoverage selection (4 sinks, 4 samples per tile): the call over the chunk at the given position, µs, "
            "medians of 10:\n");
    std::printf("| heads | S | chunk start | seed rule, whole call | coverage, whole call | coverage, selection alone | "
            "coverage scratch MiB |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
    for (const auto & sh : shapes) {
        time_coverage(sh, 1024, 256, 256, 1, profile);
    }
    if (!profile) {
        time_coverage(shapes[1], 1024, 256, 256, 7, false);
        time_coverage(shapes[1], 1024, 256, 256, 31, false);
    }

    std::printf("\n%d failed\n", n_failed);
    return n_failed == 0 ? 0 : 1;
}
