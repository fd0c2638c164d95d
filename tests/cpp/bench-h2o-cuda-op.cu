// The CUDA kernels of GGML_OP_H2O_ATTN on their own, without the rest of ggml-cuda (which takes minutes to
// build): a check of the tensor-core path against the first, F32 kernel that test-h2o-backends proved against
// the CPU, a check of the memory-set build against the rule written out on the host, and the time of one
// layer-chunk per kernel, for the head shapes of the models we measure.
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

    layer(const head_shape & sh_, int S_, int L_, int H_, int N_, uint32_t seed) :
        sh(sh_), S(S_), L(L_), H(H_), N(N_), kv_size(N_),
        q((size_t) sh_.D*sh_.n_head*N_), k((size_t) sh_.D*sh_.n_head_kv*N_), v((size_t) sh_.D*sh_.n_head_kv*N_),
        scores((size_t) N_*sh_.n_head), mem((size_t) (L_ + H_)*sh_.n_head), acc((size_t) (S_ + L_ + H_)*sh_.n_head),
        dst((size_t) sh_.D*sh_.n_head*N_) {
        std::mt19937 rng(seed);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        // keys with a shared direction per KV head, so that attention is peaked as in a trained model
        std::vector<float> hq(q.n);
        for (auto & x : hq) {
            x = nd(rng)*1.5f;
        }
        q.upload(hq);
        std::vector<half> hk(k.n), hv(v.n);
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
            h2o_reduce_settle<<<dim3((S + M + 255)/256, sh.n_head), 256>>>(partial.ptr, n_parts, a.acc, a.nb_acc1,
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

    std::printf("\n%d failed\n", n_failed);
    return n_failed == 0 ? 0 : 1;
}
