// Tests and benchmarks of the H2O state in llama_kv_cache, against the internal headers of
// the patched llama.cpp tree and the real model's shapes.
//
//   test-h2o-kv-cache MODEL.gguf            run the tests; exit status 0 when all pass
//   test-h2o-kv-cache MODEL.gguf --bench    run the benchmarks and print their figures (no pass/fail)
//
// Built by build/cpu.rs into $OUT_DIR/cpp-tests and run by tests/kv_cache_cpp.rs (tests) and
// benches/kv_cache.rs (benchmarks).

#include "llama.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

// ---------------------------------------------------------------------------------------------
// harness
// ---------------------------------------------------------------------------------------------

static int n_failed_checks = 0;
static const char * current_test = "";

#define CHECK(cond, ...) do {                                                         \
        if (!(cond)) {                                                                \
            ++n_failed_checks;                                                        \
            fprintf(stderr, "FAIL %s (%s:%d): %s: ", current_test, __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                             \
            fprintf(stderr, "\n");                                                    \
        }                                                                             \
    } while (0)

// llama.cpp's log, kept so that tests can look for the error a refused call printed
static std::string captured_log;

static void capture_log(ggml_log_level level, const char * text, void * /*user_data*/) {
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        captured_log += text;
    }
}

// BF16 keeps 8 significant bits: stored scores agree with F32 arithmetic to a relative 2^-8 (seed rule item 4)
static bool bf16_close(float stored, float expected) {
    return std::fabs(stored - expected) <= std::ldexp(1.0f, -8) * std::fabs(expected);
}

static float bf16_round(float x) {
    return ggml_bf16_to_fp32(ggml_fp32_to_bf16(x));
}

// ---------------------------------------------------------------------------------------------
// fixtures
// ---------------------------------------------------------------------------------------------

struct shape {
    uint32_t n_layer;
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t n_embd_head;
};

static shape model_shape(const llama_model & model) {
    return { model.hparams.n_layer(), model.hparams.n_head(0), model.hparams.n_head_kv(0), model.hparams.n_embd_head_k(0) };
}

static std::unique_ptr<llama_kv_cache> make_cache(const llama_model & model, uint32_t kv_size, uint32_t L, uint32_t H, uint32_t S = 1024) {
    const bool h2o = L + H > 0;
    return std::make_unique<llama_kv_cache>(
            model, model.hparams, GGML_TYPE_F16, GGML_TYPE_F16,
            /*v_trans  =*/ !h2o,
            /*offload  =*/ false,
            /*unified  =*/ true,
            kv_size,
            /*n_seq_max=*/ 1,
            /*n_pad    =*/ 1,
            /*n_swa    =*/ 0,
            h2o ? LLAMA_SWA_TYPE_H2O : LLAMA_SWA_TYPE_NONE,
            nullptr, nullptr, nullptr, nullptr, "", L, H, h2o ? S : 0);
}

static std::vector<float> read_scores(const llama_kv_cache & kv, int il, uint32_t ih, uint32_t pos0, uint32_t n) {
    std::vector<float> res(n);
    kv.h2o().read_scores(il, ih, pos0, n, res.data());
    return res;
}

static std::vector<int32_t> read_memory(const llama_kv_cache & kv, int il, uint32_t ih) {
    std::vector<int32_t> res(kv.h2o().n_memory());
    kv.h2o().read_memory_indices(il, ih, res.data());
    return res;
}

static std::vector<int32_t> valid_slots(const std::vector<int32_t> & mem) {
    std::vector<int32_t> res;
    for (int32_t p : mem) {
        if (p >= 0) {
            res.push_back(p);
        }
    }
    return res;
}

// colsum[ih][i] for a chunk of n positions, from a generator f(ih, i)
static std::vector<float> colsums(uint32_t n_head, uint32_t n, const std::function<float(uint32_t, uint32_t)> & f) {
    std::vector<float> res((size_t) n_head*n);
    for (uint32_t ih = 0; ih < n_head; ++ih) {
        for (uint32_t i = 0; i < n; ++i) {
            res[(size_t) ih*n + i] = f(ih, i);
        }
    }
    return res;
}

// the memory set seed rule item 5 asks for, written out plainly: Local = [end - L, end), candidates =
// (previous memory + [start, end)) \ Local, Heavy = the H best by (score desc, position asc), all sorted
static std::vector<int32_t> expected_memory(
        const std::function<float(int32_t)> & score, const std::vector<int32_t> & prev,
        uint32_t start, uint32_t end, uint32_t L, uint32_t H) {
    const int32_t local_start = end > L ? (int32_t) (end - L) : 0;

    std::set<int32_t> cand;
    for (int32_t p : prev) {
        if (p >= 0 && p < local_start) {
            cand.insert(p);
        }
    }
    for (int32_t p = start; p < local_start; ++p) {
        cand.insert(p);
    }

    std::vector<int32_t> order(cand.begin(), cand.end());
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score(a) > score(b); });

    std::vector<int32_t> res;
    for (size_t i = 0; i < order.size() && i < H; ++i) {
        res.push_back(order[i]);
    }
    for (int32_t p = local_start; p < (int32_t) end; ++p) {
        res.push_back(p);
    }
    std::sort(res.begin(), res.end());
    return res;
}

// ---------------------------------------------------------------------------------------------
// tests
// ---------------------------------------------------------------------------------------------

static const uint32_t S  = 1024; // chunk size used by the tests (-ub 1024)
static const uint32_t L  = 256;
static const uint32_t Hh = 256;
static const uint32_t M  = L + Hh;

// Metric 1: layout, names, buffers, initial contents
static void test_layout(const llama_model & model) {
    const shape sh = model_shape(model);
    const uint32_t kv_size = 4096;
    auto kv = make_cache(model, kv_size, L, Hh);

    CHECK(kv->h2o().enabled(), "H2O cache not enabled");
    CHECK(kv->h2o().n_memory() == M, "M = %u", kv->h2o().n_memory());
    CHECK(kv->get_layer_ids().size() == sh.n_layer, "%zu layers", kv->get_layer_ids().size());

    for (uint32_t il : kv->get_layer_ids()) {
        ggml_tensor * sc  = kv->h2o().get_scores(il);
        ggml_tensor * idx = kv->h2o().get_memory_indices(il);

        CHECK(sc->type == GGML_TYPE_BF16 && idx->type == GGML_TYPE_I32, "layer %u types", il);
        CHECK(ggml_is_contiguous(sc) && ggml_is_contiguous(idx), "layer %u contiguity", il);
        CHECK(sc->ne[0] == kv_size && sc->ne[1] == sh.n_head && sc->ne[2] == 1, "layer %u scores shape", il);
        CHECK(sc->nb[0] == sizeof(ggml_bf16_t) && sc->nb[1] == kv_size*sizeof(ggml_bf16_t), "layer %u scores strides", il);
        CHECK(idx->ne[0] == M && idx->ne[1] == sh.n_head, "layer %u index shape", il);
        CHECK(idx->nb[0] == sizeof(int32_t) && idx->nb[1] == M*sizeof(int32_t), "layer %u index strides", il);
        CHECK(sc->buffer == kv->get_k_storage(il)->buffer && idx->buffer == kv->get_k_storage(il)->buffer,
                "layer %u: H2O tensors not in the K/V buffer", il);
        CHECK(std::string(ggml_get_name(sc))  == "h2o_scores_l"  + std::to_string(il), "name %s", ggml_get_name(sc));
        CHECK(std::string(ggml_get_name(idx)) == "h2o_mem_idx_l" + std::to_string(il), "name %s", ggml_get_name(idx));

        for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
            const auto s = read_scores(*kv, il, ih, 0, kv_size);
            const auto m = read_memory(*kv, il, ih);
            CHECK(std::all_of(s.begin(), s.end(), [](float x) { return x == 0.0f; }), "layer %u head %u: scores not 0", il, ih);
            CHECK(std::all_of(m.begin(), m.end(), [](int32_t x) { return x == -1; }), "layer %u head %u: slots not empty", il, ih);
        }
    }

    const auto & st = kv->h2o().get_chunk_state();
    CHECK(st.current_chunk_idx == 0 && st.total_tokens_processed == 0 && st.chunk_boundaries == std::vector<uint32_t>{0},
            "initial chunk state");
    CHECK(!kv->h2o().is_memory_initialized(), "memory initialized at start");
    CHECK(sizeof(llama_kv_cache_h2o::chunk_state) < 128, "chunk state is %zu bytes", sizeof(llama_kv_cache_h2o::chunk_state));
}

// Metric 2: O(1) access: element (pos, head) is at data + head*nb[1] + pos*nb[0]
static void test_access(const llama_model & model) {
    const shape sh = model_shape(model);
    const uint32_t kv_size = 2048;
    auto kv = make_cache(model, kv_size, L, Hh);

    const auto vals = colsums(sh.n_head, kv_size, [](uint32_t ih, uint32_t i) { return 0.25f*(i % 97) + ih; });
    kv->h2o().init_chunk_scores(3, 0, kv_size, vals.data());

    const ggml_tensor * sc = kv->h2o().get_scores(3);
    std::mt19937 rng(7);
    for (int k = 0; k < 10000; ++k) {
        const uint32_t ih  = rng() % sh.n_head;
        const uint32_t pos = rng() % kv_size;
        const ggml_bf16_t v = *(const ggml_bf16_t *) ((const char *) sc->data + ih*sc->nb[1] + pos*sc->nb[0]);
        const float expected = vals[(size_t) ih*kv_size + pos];
        if (ggml_bf16_to_fp32(v) != bf16_round(expected)) {
            CHECK(false, "head %u pos %u: %g != %g", ih, pos, ggml_bf16_to_fp32(v), expected);
            break;
        }
    }
}

// Metric 3: the H2O tensors cost < 5 % of the KV cache (default shapes, L = H = 256)
static void test_memory_overhead(const llama_model & model) {
    // scores grow with kv_size; memory indices and chunk sums are a fixed cost per layer
    for (uint32_t kv_size : { 4096u, 8192u }) {
        auto base = make_cache(model, kv_size, 0, 0);
        auto h2o  = make_cache(model, kv_size, L, Hh);

        size_t size_base = 0;
        size_t size_h2o  = 0;
        for (const auto & [_, n] : base->memory_breakdown()) size_base += n;
        for (const auto & [_, n] : h2o ->memory_breakdown()) size_h2o  += n;

        const double overhead = 100.0*(double) (size_h2o - size_base)/size_base;
        CHECK(size_h2o - size_base == h2o->h2o().size_bytes(), "kv_size %u: breakdown grew by %zu, H2O tensors are %zu",
                kv_size, size_h2o - size_base, h2o->h2o().size_bytes());
        CHECK(overhead < 5.0, "kv_size %u: overhead %.2f %%", kv_size, overhead);
        printf("  memory overhead, kv_size %5u: K+V %.2f MiB, H2O %.3f MiB = %.2f %%\n",
                kv_size, size_base/1048576.0, h2o->h2o().size_bytes()/1048576.0, overhead);
    }
}

// every slot is -1 or a position before chunk_end; valid slots strictly ascending
static void check_memory_bounds(const llama_kv_cache & kv, int il, uint32_t chunk_end, const char * what) {
    for (uint32_t ih = 0; ih < kv.h2o().get_scores(il)->ne[1]; ++ih) {
        const auto m = read_memory(kv, il, ih);
        bool seen_empty = false;
        for (size_t i = 0; i < m.size(); ++i) {
            CHECK(m[i] == -1 || (m[i] >= 0 && (uint32_t) m[i] < chunk_end), "%s: head %u slot %zu = %d", what, ih, i, m[i]);
            CHECK(!(seen_empty && m[i] != -1), "%s: head %u: valid slot after an empty one", what, ih);
            CHECK(i == 0 || m[i] == -1 || m[i] > m[i - 1], "%s: head %u: not ascending at %zu", what, ih, i);
            seen_empty |= m[i] == -1;
        }
    }
}

// Metric 4: index bounds for N = S, N = 2S - 1, N < L
static void test_index_bounds(const llama_model & model) {
    const shape sh = model_shape(model);
    const uint32_t kv_size = 4096;
    std::mt19937 rng(4);
    std::uniform_real_distribution<float> u(0.0f, 4.0f);

    {
        auto kv = make_cache(model, kv_size, L, Hh);
        const auto c0 = colsums(sh.n_head, S, [&](uint32_t, uint32_t) { return u(rng); });
        kv->h2o().init_chunk_scores(0, 0, S, c0.data());
        kv->h2o().build_memory_set(0, S);
        check_memory_bounds(*kv, 0, S, "N = S");
        for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
            CHECK(valid_slots(read_memory(*kv, 0, ih)).size() == M, "N = S: head %u memory not full", ih);
        }

        kv->h2o().next_chunk(S);
        const auto c1 = colsums(sh.n_head, S - 1, [&](uint32_t, uint32_t) { return u(rng); });
        kv->h2o().init_chunk_scores(0, S, S - 1, c1.data());
        kv->h2o().build_memory_set(0, 2*S - 1);
        check_memory_bounds(*kv, 0, 2*S - 1, "N = 2S - 1");
    }
    {
        auto kv = make_cache(model, kv_size, L, Hh);
        const uint32_t n = 100; // < L: the whole chunk is local, nothing is heavy
        const auto c0 = colsums(sh.n_head, n, [&](uint32_t, uint32_t) { return u(rng); });
        kv->h2o().init_chunk_scores(0, 0, n, c0.data());
        kv->h2o().build_memory_set(0, n);
        check_memory_bounds(*kv, 0, n, "N < L");
        for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
            const auto v = valid_slots(read_memory(*kv, 0, ih));
            CHECK(v.size() == n && v.front() == 0 && v.back() == (int32_t) n - 1, "N < L: head %u has %zu slots", ih, v.size());
        }
    }
    {
        // the last position of the cache
        auto kv = make_cache(model, S, L, Hh);
        const auto c0 = colsums(sh.n_head, S, [&](uint32_t, uint32_t) { return u(rng); });
        kv->h2o().init_chunk_scores(0, 0, S, c0.data());
        kv->h2o().build_memory_set(0, S);
        check_memory_bounds(*kv, 0, S, "N = kv_size");
    }
}

// Metric 5: scores of a chunk are its column sums of the intra-chunk attention
static void test_score_init(const llama_model & model) {
    const shape sh = model_shape(model);
    const uint32_t kv_size = 4096;
    const uint32_t n = 64;
    auto kv = make_cache(model, kv_size, 16, 16);

    // causal softmax rows over random logits, per head; s(j) = sum over i >= j of A(i, j)
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    std::vector<float> expected((size_t) sh.n_head*n, 0.0f);
    for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
        for (uint32_t i = 0; i < n; ++i) {
            std::vector<double> row(i + 1);
            double mx = -INFINITY, sum = 0.0;
            for (uint32_t j = 0; j <= i; ++j) { row[j] = nd(rng); mx = std::max(mx, row[j]); }
            for (uint32_t j = 0; j <= i; ++j) { row[j] = std::exp(row[j] - mx); sum += row[j]; }
            for (uint32_t j = 0; j <= i; ++j) { expected[(size_t) ih*n + j] += row[j]/sum; }
        }
    }

    const uint32_t start = 2*n; // a chunk that does not start at 0
    kv->h2o().init_chunk_scores(5, start, n, expected.data());

    float max_rel = 0.0f;
    for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
        const auto s = read_scores(*kv, 5, ih, 0, start + n + 8);
        for (uint32_t p = 0; p < start + n + 8; ++p) {
            if (p < start || p >= start + n) {
                CHECK(s[p] == 0.0f, "head %u pos %u outside the chunk changed to %g", ih, p, s[p]);
                continue;
            }
            const float e = expected[(size_t) ih*n + (p - start)];
            CHECK(bf16_close(s[p], e), "head %u pos %u: %g vs %g", ih, p, s[p], e);
            max_rel = std::max(max_rel, std::fabs(s[p] - e)/e);
        }
        // the column sums of a causal softmax add up to the number of rows
        double total = 0.0;
        for (uint32_t p = start; p < start + n; ++p) total += s[p];
        CHECK(std::fabs(total - n) < n*std::ldexp(1.0, -8), "head %u: column sums add up to %g, not %u", ih, total, n);
    }
    printf("  score init: max relative error %.2e (bound 2^-8 = %.2e)\n", max_rel, std::ldexp(1.0, -8));

    // other layers untouched
    CHECK(read_scores(*kv, 4, 0, start, n) == std::vector<float>(n, 0.0f), "layer 4 changed");
}

// builds chunk 0 of a cache with the given colsum generator and returns it
static void run_chunk0(llama_kv_cache & kv, int il, uint32_t n_head, const std::function<float(uint32_t, uint32_t)> & f) {
    const auto c0 = colsums(n_head, S, f);
    kv.h2o().init_chunk_scores(il, 0, S, c0.data());
    kv.h2o().build_memory_set(il, S);
    kv.h2o().next_chunk(S);
}

// Metric 6: accumulation adds to the memory positions only, never decreases, stays finite
static void test_score_accumulation(const llama_model & model) {
    const shape sh = model_shape(model);
    auto kv = make_cache(model, 4096, L, Hh);
    std::mt19937 rng(6);
    std::uniform_real_distribution<float> u(0.1f, 1.0f);

    run_chunk0(*kv, 0, sh.n_head, [&](uint32_t, uint32_t) { return u(rng); });

    std::vector<std::vector<float>> before(sh.n_head);
    for (uint32_t ih = 0; ih < sh.n_head; ++ih) before[ih] = read_scores(*kv, 0, ih, 0, S);

    std::uniform_real_distribution<float> du(0.05f, 0.5f);
    const auto inter = colsums(sh.n_head, M, [&](uint32_t, uint32_t) { return du(rng); });
    kv->h2o().accumulate_memory_scores(0, inter.data());

    for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
        const auto after = read_scores(*kv, 0, ih, 0, S);
        const auto mem   = read_memory(*kv, 0, ih);
        std::set<int32_t> in_mem(mem.begin(), mem.end());
        for (uint32_t p = 0; p < S; ++p) {
            CHECK(std::isfinite(after[p]), "head %u pos %u: %g", ih, p, after[p]);
            CHECK(after[p] >= before[ih][p], "head %u pos %u decreased: %g -> %g", ih, p, before[ih][p], after[p]);
            if (!in_mem.count(p)) {
                CHECK(after[p] == before[ih][p], "head %u pos %u not in memory but changed", ih, p);
            }
        }
        for (uint32_t m = 0; m < M; ++m) {
            const int32_t p = mem[m];
            const float e = before[ih][p] + inter[(size_t) ih*M + m];
            CHECK(bf16_close(after[p], e), "head %u pos %d: %g vs %g", ih, p, after[p], e);
        }
    }
}

// Metric 7: Heavy = exactly the top H of the candidates, ties to the lower position
static void test_heavy_selection(const llama_model & model) {
    const shape sh = model_shape(model);

    // a few distinct values, so that most of the selection is decided by ties
    for (int variant = 0; variant < 3; ++variant) {
        auto kv = make_cache(model, 4096, L, Hh);
        std::mt19937 rng(70 + variant);
        const auto f = [&](uint32_t, uint32_t) -> float {
            switch (variant) {
                case 0:  return (float) (rng() % 1000)/100.0f; // mostly distinct
                case 1:  return (float) (rng() % 4);            // heavy ties
                default: return 1.0f;                           // all equal: the lowest positions win
            }
        };
        const auto c0 = colsums(sh.n_head, S, f);
        kv->h2o().init_chunk_scores(2, 0, S, c0.data());
        kv->h2o().build_memory_set(2, S);

        for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
            const auto s = read_scores(*kv, 2, ih, 0, S);
            const auto e = expected_memory([&](int32_t p) { return s[p]; }, {}, 0, S, L, Hh);
            const auto got = valid_slots(read_memory(*kv, 2, ih));
            CHECK(got == e, "variant %d head %u: selection differs from the written-out rule", variant, ih);
            if (variant == 2) {
                CHECK(got.front() == 0 && got[Hh - 1] == (int32_t) Hh - 1, "all-equal scores: heavy should be [0, H)");
            }
        }
    }
}

// Metric 8: a high-scoring token of chunk 0 survives in M_1, M_2, M_3; a low one is evicted and stays out
static void test_cross_chunk(const llama_model & model) {
    const shape sh = model_shape(model);
    auto kv = make_cache(model, 8192, L, Hh);
    const int il = 0;
    const int32_t important = 42;

    std::mt19937 rng(8);
    std::uniform_real_distribution<float> u(0.5f, 1.5f);

    // chunk 0: position 42 gets a high score on every head
    run_chunk0(*kv, il, sh.n_head, [&](uint32_t, uint32_t i) { return i == (uint32_t) important ? 10.0f : u(rng); });

    std::vector<std::vector<int32_t>> prev(sh.n_head);
    for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
        prev[ih] = read_memory(*kv, il, ih);
        CHECK(std::count(prev[ih].begin(), prev[ih].end(), important), "head %u: token 42 not in M_0", ih);
    }

    for (uint32_t c = 1; c <= 3; ++c) {
        // inter pass: memory tokens gain a little; then the chunk's own intra scores
        const auto inter = colsums(sh.n_head, M, [&](uint32_t, uint32_t) { return 0.01f*u(rng); });
        kv->h2o().accumulate_memory_scores(il, inter.data());
        const auto intra = colsums(sh.n_head, S, [&](uint32_t, uint32_t) { return u(rng); });
        kv->h2o().init_chunk_scores(il, c*S, S, intra.data());
        kv->h2o().build_memory_set(il, (c + 1)*S);

        for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
            const auto mem = read_memory(*kv, il, ih);
            CHECK(std::count(mem.begin(), mem.end(), important), "chunk %u head %u: token 42 lost", c, ih);

            // the whole set equals the written-out rule over the stored scores
            const auto s = read_scores(*kv, il, ih, 0, (c + 1)*S);
            const auto e = expected_memory([&](int32_t p) { return s[p]; }, prev[ih], c*S, (c + 1)*S, L, Hh);
            CHECK(valid_slots(mem) == e, "chunk %u head %u: memory set differs from the rule", c, ih);

            // anything that left the memory never comes back: it is no longer a candidate
            for (int32_t p : mem) {
                CHECK(p >= (int32_t) (c*S) || std::count(prev[ih].begin(), prev[ih].end(), p),
                        "chunk %u head %u: position %d came back", c, ih, p);
            }
            prev[ih] = mem;
        }
        kv->h2o().next_chunk(S);
    }

    const auto & st = kv->h2o().get_chunk_state();
    CHECK(st.current_chunk_idx == 4 && st.total_tokens_processed == 4*S, "chunk state %u/%u", st.current_chunk_idx, st.total_tokens_processed);
    CHECK((st.chunk_boundaries == std::vector<uint32_t>{0, S, 2*S, 3*S, 4*S}), "chunk boundaries");
}

// Metric 9: heads select independently from their own scores
static void test_per_head(const llama_model & model) {
    const shape sh = model_shape(model);
    auto kv = make_cache(model, 4096, L, Hh);

    const auto c0 = colsums(sh.n_head, S, [](uint32_t ih, uint32_t pos) { return (float) ((pos*7 + ih*11) % 100)/100.0f; });
    kv->h2o().init_chunk_scores(1, 0, S, c0.data());
    kv->h2o().build_memory_set(1, S);

    uint32_t different = 0;
    for (uint32_t ih = 0; ih + 1 < sh.n_head; ++ih) {
        different += read_memory(*kv, 1, ih) != read_memory(*kv, 1, ih + 1);
    }
    CHECK(different > (sh.n_head - 1)/2, "only %u of %u adjacent head pairs differ", different, sh.n_head - 1);

    // changing one head's scores changes that head's memory only
    std::vector<std::vector<int32_t>> before(sh.n_head);
    for (uint32_t ih = 0; ih < sh.n_head; ++ih) before[ih] = read_memory(*kv, 1, ih);
    auto c1 = c0;
    for (uint32_t i = 0; i < S; ++i) c1[(size_t) 4*S + i] = (float) i; // head 4: later is better
    auto kv2 = make_cache(model, 4096, L, Hh);
    kv2->h2o().init_chunk_scores(1, 0, S, c1.data());
    kv2->h2o().build_memory_set(1, S);
    for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
        const bool same = read_memory(*kv2, 1, ih) == before[ih];
        CHECK(ih == 4 ? !same : same, "head %u: memory %s", ih, same ? "unchanged" : "changed");
    }
}

// Metric 10: valid indices strictly ascending per head (also checked by check_memory_bounds everywhere)
static void test_sorted(const llama_model & model) {
    const shape sh = model_shape(model);
    auto kv = make_cache(model, 4096, L, Hh);
    std::mt19937 rng(10);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    run_chunk0(*kv, 7, sh.n_head, [&](uint32_t, uint32_t) { return u(rng); });
    check_memory_bounds(*kv, 7, S, "sorted");
    for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
        const auto m = read_memory(*kv, 7, ih);
        CHECK(std::is_sorted(m.begin(), m.end()) && std::adjacent_find(m.begin(), m.end()) == m.end(), "head %u not strictly ascending", ih);
        // Local = [S - L, S) fills the last L slots, Heavy lies before it: Local ∩ Heavy = ∅
        bool local_tail = m[Hh - 1] < (int32_t) (S - L);
        for (uint32_t i = 0; i < L; ++i) local_tail &= m[Hh + i] == (int32_t) (S - L + i);
        CHECK(local_tail, "head %u: local window not at the tail", ih);
    }
}

// Metric 11: 16 chunks of accumulation stay finite, non-negative and < 1e6
static void test_long_run(const llama_model & model) {
    const shape sh = model_shape(model);
    const uint32_t n_chunks = 16;
    auto kv = make_cache(model, n_chunks*S, L, Hh);
    const auto half = colsums(sh.n_head, std::max(S, M), [](uint32_t, uint32_t) { return 0.5f; });

    for (uint32_t c = 0; c < n_chunks; ++c) {
        if (c > 0) {
            kv->h2o().accumulate_memory_scores(0, half.data());
        }
        kv->h2o().init_chunk_scores(0, c*S, S, half.data());
        kv->h2o().build_memory_set(0, (c + 1)*S);
        check_memory_bounds(*kv, 0, (c + 1)*S, "16 chunks");
        kv->h2o().next_chunk(S);
    }

    float mx = 0.0f;
    for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
        for (float s : read_scores(*kv, 0, ih, 0, n_chunks*S)) {
            CHECK(std::isfinite(s) && s >= 0.0f && s < 1e6f, "head %u: score %g", ih, s);
            mx = std::max(mx, s);
        }
    }
    // equal scores everywhere: the lowest positions are the heavy hitters, and they keep accumulating
    CHECK(bf16_close(mx, 0.5f + 0.5f*(n_chunks - 1)), "max score %g", mx);
    CHECK(kv->h2o().get_chunk_idx() == n_chunks && kv->h2o().get_total_tokens() == n_chunks*S, "chunk state");
}

// random chunk sizes, L, H, N and score distributions (ties, all equal, extremes): over every chunk of
// a multi-chunk run, the builder equals the written-out rule, slots stay in range and are unique
static void test_random_cases(const llama_model & model) {
    const shape sh = model_shape(model);
    std::mt19937 rng(2024);
    int n_cases = 0;

    for (int trial = 0; trial < 60; ++trial) {
        const uint32_t S_ = 8 + rng() % 200;
        const uint32_t M_ = 1 + rng() % (S_ - 1);      // 1 <= M < S
        const uint32_t L_ = rng() % (M_ + 1);
        const uint32_t H_ = M_ - L_;
        const uint32_t n_chunks = 1 + rng() % 5;
        const uint32_t N = (n_chunks - 1)*S_ + 1 + rng() % S_; // the last chunk may be partial
        const int mode = trial % 4;

        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        const auto draw = [&]() -> float {
            switch (mode) {
                case 0:  return u(rng);                                        // distinct
                case 1:  return (float) (rng() % 3);                           // many ties
                case 2:  return 0.25f;                                         // all equal
                default: {                                                     // extremes, NaN-free
                    const float e[] = { 0.0f, 1e-30f, 1e30f, 3.0e38f, 1.0f, 65504.0f };
                    return e[rng() % 6];
                }
            }
        };

        auto kv = make_cache(model, std::max<uint32_t>(N, M_ + 1), L_, H_, S_);
        const int il = rng() % sh.n_layer;
        std::vector<std::vector<int32_t>> prev(sh.n_head);

        for (uint32_t c = 0; c < n_chunks; ++c) {
            const uint32_t start = c*S_;
            const uint32_t end   = std::min(N, start + S_);
            if (c > 0) {
                const auto inter = colsums(sh.n_head, M_, [&](uint32_t, uint32_t) { return draw(); });
                kv->h2o().accumulate_memory_scores(il, inter.data());
            }
            const auto intra = colsums(sh.n_head, end - start, [&](uint32_t, uint32_t) { return draw(); });
            kv->h2o().init_chunk_scores(il, start, end - start, intra.data());
            kv->h2o().build_memory_set(il, end);
            ++n_cases;

            for (uint32_t ih = 0; ih < sh.n_head; ++ih) {
                const auto s   = read_scores(*kv, il, ih, 0, end);
                const auto mem = read_memory(*kv, il, ih);
                const auto e   = expected_memory([&](int32_t p) { return s[p]; }, prev[ih], start, end, L_, H_);
                if (valid_slots(mem) != e) {
                    CHECK(false, "trial %d (S %u L %u H %u N %u mode %d) chunk %u head %u: memory set differs from the rule",
                            trial, S_, L_, H_, N, mode, c, ih);
                    return;
                }
                for (int32_t p : mem) {
                    CHECK(p == -1 || (p >= 0 && (uint32_t) p < end), "trial %d: slot %d out of range", trial, p);
                }
                prev[ih] = mem;
            }
            kv->h2o().next_chunk(end - start);
        }
    }
    printf("  %d random chunk builds agree with the rule\n", n_cases);
}

// the state belongs to the sequence: clear and whole-sequence removal reset it
static void test_reset(const llama_model & model) {
    const shape sh = model_shape(model);
    auto kv = make_cache(model, 4096, L, Hh);
    run_chunk0(*kv, 0, sh.n_head, [](uint32_t, uint32_t i) { return 1.0f + i; });
    CHECK(kv->h2o().is_memory_initialized() && kv->h2o().get_chunk_idx() == 1, "state before clear");

    kv->clear(false);
    CHECK(!kv->h2o().is_memory_initialized() && kv->h2o().get_chunk_idx() == 0 && kv->h2o().get_total_tokens() == 0, "state after clear");
    CHECK(read_scores(*kv, 0, 0, 0, S) == std::vector<float>(S, 0.0f), "scores after clear");
    CHECK(read_memory(*kv, 0, 0) == std::vector<int32_t>(M, -1), "memory after clear");

    run_chunk0(*kv, 0, sh.n_head, [](uint32_t, uint32_t i) { return 1.0f + i; });
    CHECK(kv->seq_rm(0, -1, -1), "removing the whole (empty) sequence");
    CHECK(!kv->h2o().is_memory_initialized() && kv->h2o().get_chunk_idx() == 0, "state after seq_rm");
    CHECK(!kv->get_can_shift(), "an H2O cache must not claim K-shift support");
}

// the C API: validation (seed rule items 7 and 10) and introspection through a real context
static void test_context_api(llama_model * model) {
    const auto try_ctx = [&](int32_t n_ubatch, int32_t L_, int32_t H_, uint32_t n_seq_max) {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx     = 4096;
        cp.n_batch   = 4096;
        cp.n_ubatch  = n_ubatch;
        cp.n_seq_max = n_seq_max;
        cp.kv_unified = true; // several sequences in one stream: refused
        cp.h2o_local = L_;
        cp.h2o_heavy = H_;
        captured_log.clear();
        return llama_init_from_model(model, cp);
    };

    struct refusal { int32_t ub, L, H; uint32_t n_seq; const char * says; };
    for (const refusal & r : {
            refusal{ 1024, 512, 512, 1, "must be smaller than the chunk size n_ubatch = 1024" },
            refusal{  512, 256, 256, 1, "must be smaller than the chunk size n_ubatch = 512" },
            refusal{ 1024,  -1, 256, 1, "must both be >= 0" },
            refusal{ 1024, 256,  -5, 1, "must both be >= 0" },
            refusal{ 1024, 256, 256, 2, "share a unified cache: set kv_unified = false" } }) {
        llama_context * ctx = try_ctx(r.ub, r.L, r.H, r.n_seq);
        CHECK(ctx == nullptr, "ub %d L %d H %d n_seq_max %u accepted", r.ub, r.L, r.H, r.n_seq);
        CHECK(captured_log.find(r.says) != std::string::npos, "error for ub %d L %d H %d n_seq_max %u does not say \"%s\": %s",
                r.ub, r.L, r.H, r.n_seq, r.says, captured_log.c_str());
        llama_free(ctx);
    }

    // settings that need H2O, and H2O where it cannot run, are refused before anything is built
    {
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx        = 4096;
        cp.h2o_undo_log = true;
        captured_log.clear();
        llama_context * ctx = llama_init_from_model(model, cp);
        CHECK(ctx == nullptr, "h2o_undo_log without H2O accepted");
        CHECK(captured_log.find("need H2O on") != std::string::npos, "h2o_undo_log without H2O: %s", captured_log.c_str());
        llama_free(ctx);

        cp = llama_context_default_params();
        cp.n_ctx          = 4096;
        cp.n_ubatch       = 1024;
        cp.h2o_local      = 256;
        cp.h2o_heavy      = 256;
        cp.attention_type = LLAMA_ATTENTION_TYPE_NON_CAUSAL;
        cp.embeddings     = true;
        captured_log.clear();
        ctx = llama_init_from_model(model, cp);
        CHECK(ctx == nullptr, "H2O with non-causal attention accepted");
        CHECK(captured_log.find("needs causal attention") != std::string::npos, "non-causal H2O: %s", captured_log.c_str());
        llama_free(ctx);
    }

    // H2O off: no state, the introspection says so
    {
        llama_context * ctx = try_ctx(1024, 0, 0, 1);
        CHECK(ctx != nullptr, "plain context refused");
        llama_h2o_info info;
        CHECK(llama_h2o_get_info(ctx, &info) == LLAMA_H2O_STATUS_DISABLED, "H2O info on a plain context");
        int32_t idx[4];
        CHECK(llama_h2o_get_memory_indices(ctx, 0, 0, idx, 4) == LLAMA_H2O_STATUS_DISABLED, "indices on a plain context");
        llama_free(ctx);
    }

    llama_context * ctx = try_ctx(1024, 256, 256, 1);
    CHECK(ctx != nullptr, "L = H = 256, ub = 1024 refused: %s", captured_log.c_str());
    if (!ctx) {
        return;
    }
    const shape sh = model_shape(*model);

    llama_h2o_info info;
    CHECK(llama_h2o_get_info(ctx, &info) == LLAMA_H2O_STATUS_OK, "info");
    CHECK(info.n_local == 256 && info.n_heavy == 256 && info.n_memory == 512 && info.n_chunk == 1024, "info parameters");
    CHECK(info.n_layer == (int32_t) sh.n_layer && info.n_head == (int32_t) sh.n_head && info.kv_size == 4096, "info shape");
    CHECK(info.n_chunks_done == 0 && info.n_tokens_done == 0 && !info.memory_initialized, "info state");
    CHECK(info.size_bytes == (size_t) sh.n_layer*sh.n_head*(4096*2 + 512*4 + (1024 + 512)*4), "info size %zu", info.size_bytes);

    std::vector<int32_t> idx(512);
    CHECK(llama_h2o_get_memory_indices(ctx, 0, 0, idx.data(), idx.size()) == 512, "indices");
    CHECK(idx == std::vector<int32_t>(512, -1), "fresh indices");
    CHECK(llama_h2o_get_memory_indices(ctx, sh.n_layer, 0, idx.data(), idx.size()) == LLAMA_H2O_STATUS_INVALID_LAYER, "layer bound");
    CHECK(llama_h2o_get_memory_indices(ctx, -1, 0, idx.data(), idx.size()) == LLAMA_H2O_STATUS_INVALID_LAYER, "negative layer");
    CHECK(llama_h2o_get_memory_indices(ctx, 0, sh.n_head, idx.data(), idx.size()) == LLAMA_H2O_STATUS_INVALID_HEAD, "head bound");
    CHECK(llama_h2o_get_memory_indices(ctx, 0, 0, idx.data(), 511) == LLAMA_H2O_STATUS_INVALID_RANGE, "short buffer");

    std::vector<float> sc(4096);
    CHECK(llama_h2o_get_scores(ctx, 3, 2, 0, 4096, sc.data()) == 4096, "scores");
    CHECK(llama_h2o_get_scores(ctx, 3, 2, 4000, 97, sc.data()) == LLAMA_H2O_STATUS_INVALID_RANGE, "score range");
    CHECK(llama_h2o_get_scores(ctx, 3, 2, -1, 1, sc.data()) == LLAMA_H2O_STATUS_INVALID_RANGE, "negative position");

    // the cache is position-addressed and refuses to cut into what its prompt batches scored
    llama_memory_t mem = llama_get_memory(ctx);
    std::vector<llama_token> tokens(300);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 100 + (int) i;
    llama_batch batch = llama_batch_get_one(tokens.data(), tokens.size());
    CHECK(llama_decode(ctx, batch) == 0, "decode");
    auto * kv = dynamic_cast<llama_kv_cache *>(llama_get_memory(ctx));
    CHECK(kv != nullptr, "not a llama_kv_cache");
    if (kv) {
        const auto & cells = kv->get_cells(0);
        bool addressed = true;
        for (uint32_t p = 0; p < 300; ++p) addressed &= !cells.is_empty(p) && cells.pos_get(p) == (llama_pos) p;
        CHECK(addressed, "token at position p not in cell p");
    }
    captured_log.clear();
    CHECK(!llama_memory_seq_rm(mem, 0, 200, -1), "cutting into prompt positions accepted");
    CHECK(captured_log.find("scored positions up to 300, so it can be removed whole or cut from position 300 on; with h2o_undo_log on") != std::string::npos,
            "cut refusal message: %s", captured_log.c_str());
    CHECK(llama_memory_seq_pos_max(mem, 0) == 299, "refused cut changed the cache");
    CHECK(!llama_memory_seq_rm(mem, 0, 100, 200), "removing a middle range accepted");

    // a decoded token never enters the H2O state, so it can be cut
    llama_token next = 42;
    llama_batch one = llama_batch_get_one(&next, 1);
    CHECK(llama_decode(ctx, one) == 0, "decode one token");
    CHECK(llama_memory_seq_pos_max(mem, 0) == 300, "decoded token not cached");
    CHECK(llama_memory_seq_rm(mem, 0, 300, -1), "cutting the decoded token refused");
    CHECK(llama_memory_seq_pos_max(mem, 0) == 299, "the decoded token is still cached");
    CHECK(llama_memory_seq_rm(mem, 0, -1, -1), "removing the whole sequence refused");
    CHECK(llama_memory_seq_pos_max(mem, 0) == -1, "sequence not removed");
    CHECK(!llama_memory_can_shift(mem), "can_shift");

    llama_free(ctx);
}

// the per-sequence state API (llama_state_seq_*) carries the H2O state: a sequence saved after
// prompt A and restored into a fresh context continues with B exactly as the saving context does; a context with
// other H2O settings, or none, refuses it
// a one-sequence H2O context with S = 128 (n_batch 512)
static llama_context * small_h2o_ctx(llama_model * model, int32_t L_, int32_t H_, bool undo_log = false, uint32_t n_seq = 1,
        llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_AUTO) {
    llama_context_params cp = llama_context_default_params();
    cp.flash_attn_type = fa;
    cp.n_ctx      = 1024*n_seq;
    cp.n_batch    = 512;
    cp.n_ubatch   = 128;
    cp.n_seq_max  = n_seq;
    cp.kv_unified = n_seq == 1;
    cp.n_threads = cp.n_threads_batch = 2;
    cp.h2o_local = L_;
    cp.h2o_heavy = H_;
    cp.h2o_undo_log = undo_log;
    return llama_init_from_model(model, cp);
}

// one llama_decode call of toks at positions pos0.. of sequence seq, logits for the last one
static int decode_at(llama_context * ctx, const std::vector<llama_token> & toks, llama_pos pos0, llama_seq_id seq = 0) {
    llama_batch batch = llama_batch_init(toks.size(), 0, 1);
    for (size_t i = 0; i < toks.size(); ++i) {
        batch.token[i]     = toks[i];
        batch.pos[i]       = pos0 + (llama_pos) i;
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i]    = i + 1 == toks.size();
    }
    batch.n_tokens = toks.size();
    const int rc = llama_decode(ctx, batch);
    llama_batch_free(batch);
    return rc;
}

// every score of positions [0, n_pos) and every memory set, as the C API reads them, and the chunk progress
static std::vector<float> h2o_snapshot(llama_context * ctx, int32_t n_pos) {
    llama_h2o_info info;
    llama_h2o_get_info(ctx, &info);
    std::vector<float> out;
    std::vector<float>   sc(n_pos);
    std::vector<int32_t> idx(info.n_memory);
    for (int32_t il = 0; il < info.n_layer; ++il) {
        for (int32_t ih = 0; ih < info.n_head; ++ih) {
            llama_h2o_get_scores(ctx, il, ih, 0, n_pos, sc.data());
            llama_h2o_get_memory_indices(ctx, il, ih, idx.data(), idx.size());
            out.insert(out.end(), sc.begin(), sc.end());
            out.insert(out.end(), idx.begin(), idx.end());
        }
    }
    out.push_back(info.n_chunks_done);
    out.push_back(info.n_tokens_done);
    return out;
}

// a sequence cut back to a chunk boundary inside its prompt holds the H2O state a prefill of the kept
// positions leaves, and continues as that prefill would; a cut between boundaries is refused and says where to cut
static void test_cut_to_chunk_boundary(llama_model * model) {
    std::vector<llama_token> a(300);
    for (size_t i = 0; i < a.size(); ++i) a[i] = 200 + (int) (i*7 % 5000);
    const std::vector<llama_token> head(a.begin(), a.begin() + 128), rest(a.begin() + 128, a.end());

    llama_context * ctx   = small_h2o_ctx(model, 32, 32, true);
    llama_context * fresh = small_h2o_ctx(model, 32, 32, true);
    CHECK(ctx && fresh, "contexts");
    if (!ctx || !fresh) {
        llama_free(ctx);
        llama_free(fresh);
        return;
    }
    llama_memory_t mem = llama_get_memory(ctx);
    CHECK(decode_at(ctx, a, 0) == 0, "decode A"); // ubatches 0..128, 128..256, 256..300
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const std::vector<float> logits_a(llama_get_logits_ith(ctx, -1), llama_get_logits_ith(ctx, -1) + n_vocab);
    const std::vector<float> after_a = h2o_snapshot(ctx, 300);

    captured_log.clear();
    CHECK(!llama_memory_seq_rm(mem, 0, 200, -1), "a cut between chunk boundaries accepted");
    CHECK(captured_log.find("to keep [0, 200), cut at 128 and evaluate the positions from there again") != std::string::npos,
            "cut refusal message: %s", captured_log.c_str());
    CHECK(h2o_snapshot(ctx, 300) == after_a && llama_memory_seq_pos_max(mem, 0) == 299, "a refused cut changed the cache");

    CHECK(llama_memory_seq_rm(mem, 0, 128, -1), "the cut at the chunk boundary 128 refused: %s", captured_log.c_str());
    CHECK(llama_memory_seq_pos_max(mem, 0) == 127, "positions kept");
    CHECK(decode_at(fresh, head, 0) == 0, "fresh prefill of [0, 128)");
    CHECK(h2o_snapshot(ctx, 300) == h2o_snapshot(fresh, 300), "the H2O state after the cut is not a prefill's of [0, 128)");

    // the same positions again, in the same ubatches: the same logits and state as before the cut
    CHECK(decode_at(ctx, rest, 128) == 0, "decode after the cut");
    CHECK(memcmp(llama_get_logits_ith(ctx, -1), logits_a.data(), n_vocab*sizeof(float)) == 0, "logits after the cut and A again");
    CHECK(h2o_snapshot(ctx, 300) == after_a, "H2O state after the cut and A again");

    // with one sequence, copying it onto itself and keeping it are no-ops, for the H2O state too
    llama_memory_seq_cp(mem, 0, 0, 0, -1);
    llama_memory_seq_keep(mem, 0);
    CHECK(h2o_snapshot(ctx, 300) == after_a && llama_memory_seq_pos_max(mem, 0) == 299, "seq_cp/seq_keep changed the cache");

    // back to the first boundary twice over: the log keeps every recorded boundary
    CHECK(llama_memory_seq_rm(mem, 0, 256, -1) && llama_memory_seq_rm(mem, 0, 128, -1), "two cuts in a row refused");
    CHECK(h2o_snapshot(ctx, 300) == h2o_snapshot(fresh, 300), "two cuts in a row: not a prefill's of [0, 128)");

    llama_free(fresh);
    llama_free(ctx);
}

static void test_seq_state(llama_model * model) {
    std::vector<llama_token> a(300), b(150);
    for (size_t i = 0; i < a.size(); ++i) a[i] = 200 + (int) (i*7 % 5000);
    for (size_t i = 0; i < b.size(); ++i) b[i] = 300 + (int) (i*11 % 5000);

    llama_context * src = small_h2o_ctx(model, 32, 32);
    CHECK(src && decode_at(src, a, 0) == 0, "decode A");
    if (!src) {
        return;
    }
    const std::vector<float> after_a = h2o_snapshot(src, 300);
    std::vector<uint8_t> state(llama_state_seq_get_size(src, 0));
    CHECK(llama_state_seq_get_data(src, state.data(), state.size(), 0) == state.size(), "seq state saved");

    llama_context * dst = small_h2o_ctx(model, 32, 32);
    CHECK(llama_state_seq_set_data(dst, state.data(), state.size(), 0) == state.size(), "seq state restored");
    CHECK(llama_memory_seq_pos_max(llama_get_memory(dst), 0) == 299, "restored positions");
    CHECK(h2o_snapshot(dst, 300) == after_a, "H2O state after the restore differs from the saved one");

    CHECK(decode_at(src, b, 300) == 0 && decode_at(dst, b, 300) == 0, "decode B");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const float * la = llama_get_logits_ith(src, -1);
    const float * lb = llama_get_logits_ith(dst, -1);
    CHECK(la && lb && memcmp(la, lb, n_vocab*sizeof(float)) == 0, "logits after B differ");
    CHECK(h2o_snapshot(src, 450) == h2o_snapshot(dst, 450), "H2O state after B differs");

    // refused before anything changes: the context keeps its sequence
    for (const auto & [L_, H_, says] : { std::tuple{ 32, 64, "h2o_heavy" }, std::tuple{ 0, 0, "saved with H2O on" } }) {
        llama_context * other = small_h2o_ctx(model, L_, H_);
        CHECK(other && decode_at(other, b, 0) == 0, "decode into the other context");
        captured_log.clear();
        CHECK(llama_state_seq_set_data(other, state.data(), state.size(), 0) == 0, "L %d H %d accepted the state", L_, H_);
        CHECK(captured_log.find(says) != std::string::npos, "refusal for L %d H %d does not say \"%s\": %s", L_, H_, says,
                captured_log.c_str());
        CHECK(llama_memory_seq_pos_max(llama_get_memory(other), 0) == 149, "a refused state changed the sequence");
        llama_free(other);
    }

    llama_free(dst);
    llama_free(src);
}

// the chunk progress and settings of sequence seq, as llama_h2o_get_seq_info reports them
static std::vector<int64_t> seq_info(llama_context * ctx, llama_seq_id seq) {
    llama_h2o_info info;
    if (llama_h2o_get_seq_info(ctx, seq, &info) != LLAMA_H2O_STATUS_OK) {
        return {};
    }
    return { info.n_chunks_done, info.n_tokens_done, info.memory_initialized, info.select, info.n_sink, info.n_dense_tail };
}

// the logits of the batch's last output, as a vector
static std::vector<float> last_logits(llama_context * ctx, int32_t i = -1) {
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    const float * l = llama_get_logits_ith(ctx, i);
    return l ? std::vector<float>(l, l + n_vocab) : std::vector<float>{};
}

// a decode step right after a prompt whose last ubatch held one token has that ubatch's shape: it must run full
// attention, not reuse the H2O prefill graph; the same step again, from a graph built for a decode,
// gives the same logits
static void test_decode_after_one_token_ubatch(llama_model * model) {
    std::vector<llama_token> p(129); // 128 + 1 with n_ubatch = 128
    for (size_t i = 0; i < p.size(); ++i) p[i] = 400 + (int) (i*13 % 5000);

    llama_context * ctx = small_h2o_ctx(model, 32, 32);
    CHECK(ctx && decode_at(ctx, p, 0) == 0, "decode the prompt");
    if (!ctx) {
        return;
    }
    CHECK(decode_at(ctx, { 1000 }, 129) == 0, "decode step after the prompt");
    const auto first = last_logits(ctx);
    CHECK(llama_memory_seq_rm(llama_get_memory(ctx), 0, 129, -1), "drop the decoded token");
    CHECK(decode_at(ctx, { 1000 }, 129) == 0, "the decode step again");
    CHECK(last_logits(ctx) == first, "the decode step after a one-token prompt ubatch ran another graph");
    llama_free(ctx);
}

// several sequences in one context (kv_unified = false): each has its own stream and H2O state, and its prompt gives
// the same logits, bit for bit, as in a context of its own, whether it comes alone, after another sequence's prompt,
// or in one batch with it; so does a decode step of all sequences in one ubatch; a
// sequence's state moves to another sequence (state_seq get/set, seq_cp) whole; per-sequence policies
static void test_multi_seq(llama_model * model) {
    // flash attention off: with it, llama.cpp's CPU kernel at this pin gives one stream of a decode ubatch of several
    // streams other logits than alone (max |diff| 0.40 on SmolLM2, with H2O off as well); without it, bit-identical
    const llama_flash_attn_type no_fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;

    std::vector<llama_token> a(300), b(200), c(129);
    for (size_t i = 0; i < a.size(); ++i) a[i] = 200 + (int) (i*7 % 5000);
    for (size_t i = 0; i < b.size(); ++i) b[i] = 300 + (int) (i*11 % 5000);
    for (size_t i = 0; i < c.size(); ++i) c[i] = 400 + (int) (i*13 % 5000);

    // references: each prompt alone in a single-sequence context
    std::vector<std::vector<float>> ref;
    std::vector<std::vector<int64_t>> ref_info;
    for (const auto * p : { &a, &b, &c }) {
        llama_context * one = small_h2o_ctx(model, 32, 32, false, 1, no_fa);
        CHECK(one && decode_at(one, *p, 0) == 0, "single-sequence decode");
        if (!one) {
            return;
        }
        ref.push_back(last_logits(one));
        ref_info.push_back(seq_info(one, 0));
        llama_free(one);
    }

    llama_context * ctx = small_h2o_ctx(model, 32, 32, false, 3, no_fa);
    CHECK(ctx != nullptr, "a context of 3 H2O sequences: %s", captured_log.c_str());
    if (!ctx) {
        return;
    }

    // one prompt per llama_decode, in turn
    CHECK(decode_at(ctx, a, 0, 0) == 0, "decode A into seq 0");
    CHECK(last_logits(ctx) == ref[0], "seq 0: logits differ from A alone");
    CHECK(decode_at(ctx, b, 0, 1) == 0, "decode B into seq 1");
    CHECK(last_logits(ctx) == ref[1], "seq 1: logits differ from B alone");
    CHECK(seq_info(ctx, 0) == ref_info[0] && seq_info(ctx, 1) == ref_info[1], "chunk state differs from the prompts alone");
    CHECK(seq_info(ctx, 2) == std::vector<int64_t>({ 0, 0, 0, 0, 0, 0 }), "the untouched sequence has chunk state");

    // two prompts in one llama_decode: split one sequence per ubatch, each as alone
    llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
    {
        llama_batch batch = llama_batch_init(a.size() + c.size(), 0, 1);
        int n = 0;
        for (const auto & [toks, seq] : { std::pair{ &a, 0 }, std::pair{ &c, 2 } }) {
            for (size_t i = 0; i < toks->size(); ++i, ++n) {
                batch.token[n] = (*toks)[i];
                batch.pos[n] = i;
                batch.n_seq_id[n] = 1;
                batch.seq_id[n][0] = seq;
                batch.logits[n] = i + 1 == toks->size();
            }
        }
        batch.n_tokens = n;
        CHECK(llama_decode(ctx, batch) == 0, "decode A and C in one batch");
        CHECK(last_logits(ctx, a.size() - 1) == ref[0], "A in a batch with C: logits differ from A alone");
        CHECK(last_logits(ctx, n - 1) == ref[2], "C in a batch with A: logits differ from C alone");
        CHECK(seq_info(ctx, 0) == ref_info[0] && seq_info(ctx, 2) == ref_info[2], "chunk state after the shared batch");
        llama_batch_free(batch);
    }

    // a decode step of all three sequences in one ubatch: full attention per sequence
    {
        llama_batch batch = llama_batch_init(3, 0, 1);
        const llama_pos pos[3] = { (llama_pos) a.size(), (llama_pos) b.size(), (llama_pos) c.size() };
        for (int s = 0; s < 3; ++s) {
            batch.token[s] = 1000 + s;
            batch.pos[s] = pos[s];
            batch.n_seq_id[s] = 1;
            batch.seq_id[s][0] = s;
            batch.logits[s] = true;
        }
        batch.n_tokens = 3;
        CHECK(llama_decode(ctx, batch) == 0, "decode step of three sequences");
        const std::vector<llama_token> p[3] = { a, b, c };
        for (int s = 0; s < 3; ++s) {
            llama_context * one = small_h2o_ctx(model, 32, 32, false, 1, no_fa);
            CHECK(one && decode_at(one, p[s], 0) == 0 && decode_at(one, { 1000 + s }, pos[s]) == 0, "single decode step");
            const auto together = last_logits(ctx, s);
            const auto alone    = last_logits(one);
            CHECK(together == alone, "seq %d: the batched decode step gives other logits than alone", s);
            llama_free(one);
        }
        llama_batch_free(batch);
    }

    // the state of seq 1 saved and restored into seq 2: the same chunk state, the same next logits
    {
        std::vector<uint8_t> state(llama_state_seq_get_size(ctx, 1));
        CHECK(llama_state_seq_get_data(ctx, state.data(), state.size(), 1) == state.size(), "seq 1 state saved");
        CHECK(llama_state_seq_set_data(ctx, state.data(), state.size(), 2) == state.size(), "seq 1 state restored into seq 2");
        CHECK(seq_info(ctx, 2) == seq_info(ctx, 1), "seq 2 after the restore has another chunk state");
        std::vector<llama_token> d(130);
        for (size_t i = 0; i < d.size(); ++i) d[i] = 500 + (int) (i*3 % 5000);
        const llama_pos p1 = llama_memory_seq_pos_max(llama_get_memory(ctx), 1) + 1;
        CHECK(decode_at(ctx, d, p1, 1) == 0, "continue seq 1");
        const auto l1 = last_logits(ctx);
        CHECK(decode_at(ctx, d, p1, 2) == 0, "continue seq 2");
        CHECK(last_logits(ctx) == l1, "restored seq 2 continues differently from seq 1");
        CHECK(seq_info(ctx, 2) == seq_info(ctx, 1), "chunk state after continuing");

        // seq_cp to another stream copies the H2O state too
        llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
        llama_memory_seq_cp(llama_get_memory(ctx), 1, 0, -1, -1);
        CHECK(seq_info(ctx, 0) == seq_info(ctx, 1), "seq_cp: chunk state not copied");
        const llama_pos p2 = llama_memory_seq_pos_max(llama_get_memory(ctx), 1) + 1;
        CHECK(decode_at(ctx, d, p2, 1) == 0, "continue seq 1");
        const auto l_src = last_logits(ctx);
        CHECK(decode_at(ctx, d, p2, 0) == 0, "continue its copy, seq 0");
        CHECK(last_logits(ctx) == l_src, "the copy continues differently from seq 1");
        CHECK(seq_info(ctx, 0) == seq_info(ctx, 1), "chunk state of the copy after continuing");
    }

    // a policy per sequence, set while the sequence is empty; back to the context's when emptied
    {
        llama_memory_seq_rm(llama_get_memory(ctx), 2, -1, -1);
        CHECK(llama_h2o_set_seq_select(ctx, 1, LLAMA_H2O_SELECT_HYBRID, 4, 0) == LLAMA_H2O_STATUS_SEQ_NOT_EMPTY, "policy of a non-empty sequence changed");
        CHECK(llama_h2o_set_seq_select(ctx, 3, LLAMA_H2O_SELECT_HYBRID, 4, 0) == LLAMA_H2O_STATUS_INVALID_SEQ, "seq 3 of 3 accepted");
        CHECK(llama_h2o_set_seq_select(ctx, 2, LLAMA_H2O_SELECT_HYBRID, 40, 0) == LLAMA_H2O_STATUS_INVALID_SELECT, "a sink over h2o_heavy accepted");
        CHECK(llama_h2o_set_seq_select(ctx, 2, LLAMA_H2O_SELECT_HYBRID, 4, 8) == LLAMA_H2O_STATUS_OK, "set the policy of seq 2");
        CHECK(decode_at(ctx, a, 0, 2) == 0, "decode A into seq 2 with the hybrid");
        const auto hybrid = last_logits(ctx);
        CHECK(seq_info(ctx, 2)[3] == LLAMA_H2O_SELECT_HYBRID && seq_info(ctx, 1)[3] == LLAMA_H2O_SELECT_SEED, "policies per sequence");

        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 1024; cp.n_batch = 512; cp.n_ubatch = 128; cp.n_seq_max = 1;
        cp.n_threads = cp.n_threads_batch = 2;
        cp.flash_attn_type = no_fa;
        cp.h2o_local = 32; cp.h2o_heavy = 32; cp.h2o_select = LLAMA_H2O_SELECT_HYBRID; cp.h2o_sink = 4; cp.h2o_dense_tail = 8;
        llama_context * one = llama_init_from_model(model, cp);
        CHECK(one && decode_at(one, a, 0) == 0, "single-sequence hybrid");
        CHECK(last_logits(one) == hybrid, "seq 2 with the hybrid differs from a hybrid context");
        llama_free(one);

        llama_memory_seq_rm(llama_get_memory(ctx), 2, -1, -1);
        CHECK(seq_info(ctx, 2)[3] == LLAMA_H2O_SELECT_SEED, "an emptied sequence keeps its policy");
    }

    // a cut inside one sequence's prompt is refused and leaves the other sequences alone
    {
        const auto before = seq_info(ctx, 0);
        CHECK(!llama_memory_seq_rm(llama_get_memory(ctx), 1, 100, -1), "a cut into seq 1's prompt accepted");
        CHECK(seq_info(ctx, 0) == before, "a refused cut of seq 1 changed seq 0");
    }

    llama_free(ctx);
}

// ---------------------------------------------------------------------------------------------
// benchmarks: figures, not asserts
// ---------------------------------------------------------------------------------------------

template <typename F>
static double median_us(int reps, F && f) {
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        f();
        t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size()/2];
}

static void run_benchmarks(const llama_model & model, uint32_t kv_size) {
    const shape sh = model_shape(model);
    printf("model shapes: %u layers, %u query heads, %u KV heads, head dim %u; kv_size %u, S %u, L %u, H %u\n",
            sh.n_layer, sh.n_head, sh.n_head_kv, sh.n_embd_head, kv_size, S, L, Hh);

    // 1: allocation of the whole cache (all layers) with and without H2O
    const double t_base = median_us(5, [&] { make_cache(model, kv_size, 0, 0); });
    const double t_h2o  = median_us(5, [&] { make_cache(model, kv_size, L, Hh); });
    printf("benchmark 1, allocation (all %u layers):       H2O cache %8.2f ms, plain cache %8.2f ms (target < 100 ms)\n",
            sh.n_layer, t_h2o/1e3, t_base/1e3);

    auto kv = make_cache(model, kv_size, L, Hh);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(0.0f, 2.0f);
    const uint32_t n_chunks = std::min<uint32_t>(kv_size/S, 8);
    std::vector<std::vector<float>> intra(n_chunks);
    for (auto & c : intra) c = colsums(sh.n_head, S, [&](uint32_t, uint32_t) { return u(rng); });
    const auto inter = colsums(sh.n_head, M, [&](uint32_t, uint32_t) { return 0.01f*u(rng); });

    // 2: memory-set build per layer, after chunk 0 (no previous memory) and in steady state (chunk >= 1)
    kv->h2o().init_chunk_scores(0, 0, S, intra[0].data());
    const double t_build0 = median_us(51, [&] {
        kv->h2o().reset(0);
        kv->h2o().init_chunk_scores(0, 0, S, intra[0].data());
        kv->h2o().build_memory_set(0, S);
    }) - median_us(51, [&] {
        kv->h2o().reset(0);
        kv->h2o().init_chunk_scores(0, 0, S, intra[0].data());
    });
    kv->h2o().reset(0);
    for (uint32_t c = 0; c + 1 < n_chunks; ++c) {
        kv->h2o().init_chunk_scores(0, c*S, S, intra[c].data());
        kv->h2o().build_memory_set(0, (c + 1)*S);
        kv->h2o().next_chunk(S);
    }
    kv->h2o().init_chunk_scores(0, (n_chunks - 1)*S, S, intra[n_chunks - 1].data());
    std::vector<int32_t> saved((size_t) M*sh.n_head);
    ggml_backend_tensor_get(kv->h2o().get_memory_indices(0), saved.data(), 0, saved.size()*sizeof(int32_t));
    const double t_build = median_us(201, [&] {
        ggml_backend_tensor_set(kv->h2o().get_memory_indices(0), saved.data(), 0, saved.size()*sizeof(int32_t));
        kv->h2o().build_memory_set(0, n_chunks*S);
    });
    printf("benchmark 2, memory-set build per layer:      %8.1f us in steady state (chunk %u), %8.1f us after chunk 0 (target < 1000 us); %u layers: %.2f ms per chunk\n",
            t_build, n_chunks - 1, t_build0, sh.n_layer, t_build*sh.n_layer/1e3);

    // 3: score update per call (one layer, all heads, M slots)
    const int n_calls = 1000;
    const double t_acc = median_us(7, [&] {
        for (int i = 0; i < n_calls; ++i) kv->h2o().accumulate_memory_scores(0, inter.data());
    })/n_calls;
    printf("benchmark 3, score update per call:            %8.2f us (%u heads x %u slots; target < 10 us)\n", t_acc, sh.n_head, M);

    // metric 2 as a figure: random score reads
    const ggml_tensor * sc = kv->h2o().get_scores(0);
    std::vector<uint32_t> probes(100000);
    for (auto & p : probes) p = (rng() % sh.n_head)*kv_size + rng() % kv_size;
    float sink = 0.0f;
    const double t_read = median_us(7, [&] {
        for (uint32_t p : probes) sink += ggml_bf16_to_fp32(((const ggml_bf16_t *) sc->data)[p]);
    })/probes.size();
    printf("metric 2, random score read:                   %8.4f us per access (target < 1 us) [%g]\n", t_read, sink > 0 ? 1.0 : 0.0);

    // init per call, for completeness
    const double t_init = median_us(101, [&] { kv->h2o().init_chunk_scores(0, 0, S, intra[0].data()); });
    printf("score init per call (S = %u, all heads):     %8.1f us\n", S, t_init);
}

// ---------------------------------------------------------------------------------------------

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [--bench [KV_SIZE]]\n", argv[0]);
        return 2;
    }
    const bool bench = argc >= 3 && std::string(argv[2]) == "--bench";

    llama_log_set(capture_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s:\n%s", argv[1], captured_log.c_str());
        return 2;
    }

    if (bench) {
        run_benchmarks(*model, argc >= 4 ? (uint32_t) atoi(argv[3]) : 8192);
        llama_model_free(model);
        return 0;
    }

    const std::pair<const char *, std::function<void()>> tests[] = {
        { "metric 1: layout",                [&] { test_layout(*model); } },
        { "metric 2: O(1) access",           [&] { test_access(*model); } },
        { "metric 3: memory overhead",       [&] { test_memory_overhead(*model); } },
        { "metric 4: index bounds",          [&] { test_index_bounds(*model); } },
        { "metric 5: score init",            [&] { test_score_init(*model); } },
        { "metric 6: score accumulation",    [&] { test_score_accumulation(*model); } },
        { "metric 7: heavy selection",       [&] { test_heavy_selection(*model); } },
        { "metric 8: cross-chunk survival",  [&] { test_cross_chunk(*model); } },
        { "metric 9: per-head independence", [&] { test_per_head(*model); } },
        { "metric 10: sorted indices",       [&] { test_sorted(*model); } },
        { "metric 11: 16-chunk stability",   [&] { test_long_run(*model); } },
        { "random cases vs the rule",        [&] { test_random_cases(*model); } },
        { "reset",                           [&] { test_reset(*model); } },
        { "C API",                           [&] { test_context_api(model); } },
        { "per-sequence state",              [&] { test_seq_state(model); } },
        { "cut to a chunk boundary",         [&] { test_cut_to_chunk_boundary(model); } },
        { "several sequences",               [&] { test_multi_seq(model); } },
        { "decode after a one-token ubatch", [&] { test_decode_after_one_token_ubatch(model); } },
    };

    int n_failed_tests = 0;
    for (const auto & [name, fn] : tests) {
        current_test = name;
        const int before = n_failed_checks;
        fn();
        const bool ok = n_failed_checks == before;
        n_failed_tests += !ok;
        printf("%s %s\n", ok ? "ok  " : "FAIL", name);
        fflush(stdout);
    }

    llama_model_free(model);
    llama_backend_free();

    printf("%zu tests, %d failed\n", std::size(tests), n_failed_tests);
    return n_failed_tests == 0 ? 0 : 1;
}
