// GGML_OP_H2O_ATTN on every GPU backend against the CPU backend, in the manner of llama.cpp's
// test-backend-ops (which the pinned source does not ship): the same inputs and state go to both, and the
// op runs as one call over several chunks, as two calls that split a chunk, as a prefill after decode
// completed two chunks (the op settles and builds them lazily) and as a call starting on a chunk boundary.
// The outputs, the BF16 scores and the memory sets are compared after every call. A backend that does not
// support the op fails the test: the scheduler would otherwise run it on the CPU without a word.
//
//   test-h2o-backends            # exit 0 when every GPU backend agrees with the CPU; with no GPU
//                                # backend it runs the cases on a 3-thread CPU backend instead and
//                                # prints "skipped" for the GPU comparison
//
// Tolerances: the GPU sums in another order, so outputs may differ by float rounding (checked to
// 1e-3 · max|V|) and scores by a BF16 rounding step (2^-7 relative). Memory sets are the same rule over
// those scores: they must agree except where a score difference of that size reorders two candidates,
// which the test counts and bounds.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
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

    // K and V of type_k, type_v: the F16 values converted (quantized, for q8_0 and the like)
    state(ggml_backend_t backend, const shape & sh, const std::vector<ggml_fp16_t> & kv_k, const std::vector<ggml_fp16_t> & kv_v,
            ggml_type type_k = GGML_TYPE_F16, ggml_type type_v = GGML_TYPE_F16) {
        ggml_init_params ip = { 8*ggml_tensor_overhead(), nullptr, /*no_alloc=*/ true };
        ctx     = ggml_init(ip);
        k       = ggml_new_tensor_3d(ctx, type_k, sh.D, sh.n_head_kv, sh.kv_size);
        v       = ggml_new_tensor_3d(ctx, type_v, sh.D, sh.n_head_kv, sh.kv_size);
        scores  = ggml_new_tensor_2d(ctx, GGML_TYPE_BF16, sh.kv_size, sh.n_head);
        mem_idx = ggml_new_tensor_2d(ctx, GGML_TYPE_I32,  sh.L + sh.H, sh.n_head);
        acc     = ggml_new_tensor_2d(ctx, GGML_TYPE_F32,  sh.S + sh.L + sh.H, sh.n_head);
        buf     = ggml_backend_alloc_ctx_tensors(ctx, backend);
        set_as(k, kv_k);
        set_as(v, kv_v);
        ggml_backend_tensor_memset(scores,  0x00, 0, ggml_nbytes(scores));
        ggml_backend_tensor_memset(mem_idx, 0xff, 0, ggml_nbytes(mem_idx)); // -1: empty
        ggml_backend_tensor_memset(acc,     0x00, 0, ggml_nbytes(acc));
    }
    ~state() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }

    // F16 values into a tensor of any type ggml quantizes to
    static void set_as(ggml_tensor * t, const std::vector<ggml_fp16_t> & values) {
        // every element from the values: a shorter vector would leave a stream to whatever the heap holds past it,
        // a different garbage for the reference and the backend under test
        GGML_ASSERT((int64_t) values.size() >= ggml_nelements(t));
        if (t->type == GGML_TYPE_F16) {
            ggml_backend_tensor_set(t, values.data(), 0, ggml_nbytes(t));
            return;
        }
        std::vector<float> f32(values.size());
        ggml_fp16_to_fp32_row(values.data(), f32.data(), (int64_t) f32.size());
        std::vector<char> data(ggml_nbytes(t));
        ggml_quantize_chunk(t->type, f32.data(), data.data(), 0, ggml_nrows(t), t->ne[0], nullptr);
        ggml_backend_tensor_set(t, data.data(), 0, data.size());
    }
};

// the inputs of the cases: queries of n_positions positions and the whole cache's K and V, all N(0, 1) from one seed
struct inputs {
    std::vector<float>       q;
    std::vector<ggml_fp16_t> kv_k;
    std::vector<ggml_fp16_t> kv_v;
    float                    max_v = 0.0f; // the largest |V|

    inputs(const shape & sh, int32_t n_positions, uint32_t seed)
        : q((size_t) n_positions*sh.n_head*sh.D), kv_k((size_t) sh.kv_size*sh.n_head_kv*sh.D), kv_v(kv_k.size()) {
        std::mt19937 rng(seed);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (float & x : q) { x = nd(rng); }
        for (auto & x : kv_k) { x = ggml_fp32_to_fp16(nd(rng)); }
        for (auto & x : kv_v) { const float f = nd(rng); x = ggml_fp32_to_fp16(f); max_v = std::max(max_v, std::fabs(f)); }
    }
};

// the attention logits of a call (ggml_h2o_attn_set_logits): a soft-cap, and learned sinks of every head
struct logit_opts {
    float                      softcap = 0.0f;
    const std::vector<float> * sinks   = nullptr;
};

struct call_result {
    std::vector<float>       out;
    std::vector<ggml_bf16_t> scores;
    std::vector<int32_t>     mem;
    bool                     supported = true;
};

// one op call: queries of positions [p0, p0 + n) against the state
call_result run_call(ggml_backend_t backend, state & st, const shape & sh, const std::vector<float> & q_all,
        int32_t p0, int32_t n, int32_t mem_chunk, int32_t acc_chunk,
        ggml_h2o_select select = GGML_H2O_SELECT_SEED, int32_t n_sink = 0, int32_t tail_start = INT32_MAX,
        float coverage = 1.0f, int32_t n_sample = 4, logit_opts lo = {}, int32_t sketch = 1) {
    ggml_init_params ip = { 4*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc=*/ true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * q     = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, sh.D, sh.n_head, n);
    ggml_tensor * sinks = lo.sinks ? ggml_new_tensor_1d(ctx, GGML_TYPE_F32, sh.n_head) : nullptr;
    ggml_tensor * out   = ggml_h2o_attn(ctx, q, st.k, st.v, st.scores, st.mem_idx, st.acc,
            p0, sh.S, sh.L, sh.H, mem_chunk, acc_chunk, 1.0f/std::sqrt((float) sh.D));
    ggml_h2o_attn_set_select(out, select, n_sink, tail_start);
    ggml_h2o_attn_set_coverage(out, coverage, n_sample);
    ggml_h2o_attn_set_coverage_sketch(out, sketch);
    ggml_h2o_attn_set_logits(out, lo.softcap, sinks);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    call_result r;
    r.supported = ggml_backend_supports_op(backend, out);
    ggml_backend_buffer_t buf = nullptr;
    if (r.supported) {
        buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        ggml_backend_tensor_set(q, q_all.data() + (size_t) p0*sh.D*sh.n_head, 0, ggml_nbytes(q));
        if (sinks) {
            ggml_backend_tensor_set(sinks, lo.sinks->data(), 0, ggml_nbytes(sinks));
        }
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
// (exact: bit-identical, for the CPU against itself on another thread count)
bool compare(const char * what, const char * name, const call_result & ref, const call_result & got, const shape & sh, float max_v, bool exact) {
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
    CHECK(!exact || (max_out == 0.0f && max_rel == 0.0f && n_diff == 0), "%s: %s is not bit-identical to the reference", what, name);
    std::printf("     %s on %s: max |Δout| %.3g, max score Δ %.3g relative, %d memory slots differ\n", what, name, max_out, max_rel, n_diff);
    return true;
}

// every case on one backend against the CPU reference (the same inputs, fresh state each case)
void run_cases(ggml_backend_t cpu, ggml_backend_t other, const char * name, const shape & sh,
        const std::vector<float> & q, const std::vector<ggml_fp16_t> & kv_k, const std::vector<ggml_fp16_t> & kv_v, float max_v, bool exact) {
    const int32_t S = sh.S;

    // one call over four chunks (three complete, 40 tokens of the fourth)
    {
        state ref_st(cpu, sh, kv_k, kv_v);
        state got_st(other, sh, kv_k, kv_v);
        const int32_t n = 3*S + 40;
        compare("one call, 3S + 40 tokens", name,
                run_call(cpu, ref_st, sh, q, 0, n, -1, -1), run_call(other, got_st, sh, q, 0, n, -1, -1), sh, max_v, exact);
    }
    // two calls that split chunk 0 and end inside chunk 2: the partial sums carry over
    {
        state ref_st(cpu, sh, kv_k, kv_v);
        state got_st(other, sh, kv_k, kv_v);
        const int32_t n1 = 100;
        const int32_t n2 = 2*S + 40 - n1;
        if (compare("call 1 of 2, 100 tokens", name,
                    run_call(cpu, ref_st, sh, q, 0, n1, -1, -1), run_call(other, got_st, sh, q, 0, n1, -1, -1), sh, max_v, exact)) {
            // after call 1: no memory set yet, chunk 0's sums in progress
            compare("call 2 of 2, continuing chunk 0", name,
                    run_call(cpu, ref_st, sh, q, n1, n2, -1, 0), run_call(other, got_st, sh, q, n1, n2, -1, 0), sh, max_v, exact);
        }
    }
    // chunks completed by decode: a prefill of 100 tokens, then decode (full attention, outside the op)
    // runs on to position 2S + 10, and the next prefill starts there. That call must first settle chunk
    // 0's partial sums and build M_0, then build M_1 from M_0 and chunk 1 (whose tokens have no sums),
    // and only then attend
    {
        state ref_st(cpu, sh, kv_k, kv_v);
        state got_st(other, sh, kv_k, kv_v);
        const int32_t n1 = 100;
        const int32_t p2 = 2*S + 10;
        if (compare("prefill of 100 tokens before decode", name,
                    run_call(cpu, ref_st, sh, q, 0, n1, -1, -1), run_call(other, got_st, sh, q, 0, n1, -1, -1), sh, max_v, exact)) {
            compare("prefill after decode completed chunks 0 and 1", name,
                    run_call(cpu, ref_st, sh, q, p2, 50, -1, 0), run_call(other, got_st, sh, q, p2, 50, -1, 0), sh, max_v, exact);
        }
    }
    // a prefill that starts on a chunk boundary: the first call completes chunk 0, settles it and builds
    // M_0 (the bookkeeping then says mem_chunk 0, acc_chunk -1), and the next call attends to M_0
    {
        state ref_st(cpu, sh, kv_k, kv_v);
        state got_st(other, sh, kv_k, kv_v);
        if (compare("chunk 0 in one call", name,
                    run_call(cpu, ref_st, sh, q, 0, S, -1, -1), run_call(other, got_st, sh, q, 0, S, -1, -1), sh, max_v, exact)) {
            compare("chunk 1 in the next call", name,
                    run_call(cpu, ref_st, sh, q, S, S + 7, 0, -1), run_call(other, got_st, sh, q, S, S + 7, 0, -1), sh, max_v, exact);
        }
    }
    // memory selection: sinks under the seed rule; the hybrid with and without sinks, each with a dense tail
    const struct {
        const char    * what;
        ggml_h2o_select select;
        int32_t         n_sink;
        int32_t         tail_start;
    } policies[] = {
        { "one call, seed rule with 4 sinks",      GGML_H2O_SELECT_SEED,   4, INT32_MAX },
        { "one call, seed rule, tail of 24",       GGML_H2O_SELECT_SEED,   0, 3*S + 16  },
        { "one call, hybrid, no sinks, tail of 60", GGML_H2O_SELECT_HYBRID, 0, 3*S - 20  },
        { "one call, hybrid, 4 sinks, tail of 24", GGML_H2O_SELECT_HYBRID, 4, 3*S + 16  },
    };
    for (const auto & p : policies) {
        state ref_st(cpu, sh, kv_k, kv_v);
        state got_st(other, sh, kv_k, kv_v);
        const int32_t n = 3*S + 40;
        compare(p.what, name,
                run_call(cpu,   ref_st, sh, q, 0, n, -1, -1, p.select, p.n_sink, p.tail_start),
                run_call(other, got_st, sh, q, 0, n, -1, -1, p.select, p.n_sink, p.tail_start), sh, max_v, exact);
    }
    // the hybrid across two calls that split chunk 1: the second part chooses its blocks again, after the first
    // part's memory sums went to their scores (the state after call 1: mem_chunk 0, acc_chunk 1)
    {
        state ref_st(cpu, sh, kv_k, kv_v);
        state got_st(other, sh, kv_k, kv_v);
        const int32_t n1 = S + 50;
        const int32_t n2 = 2*S + 40 - n1;
        const ggml_h2o_select qs = GGML_H2O_SELECT_HYBRID;
        if (compare("hybrid, call 1 of 2 ending inside chunk 1", name,
                    run_call(cpu, ref_st, sh, q, 0, n1, -1, -1, qs, 4), run_call(other, got_st, sh, q, 0, n1, -1, -1, qs, 4),
                    sh, max_v, exact)) {
            compare("hybrid, call 2 of 2 continuing chunk 1", name,
                    run_call(cpu, ref_st, sh, q, n1, n2, 0, 1, qs, 4), run_call(other, got_st, sh, q, n1, n2, 0, 1, qs, 4),
                    sh, max_v, exact);
        }
    }
}

// GGML_H2O_SELECT_COVERAGE: every head's tiles estimate, then all threads (or GPU blocks) share one allocation. On
// the CPU with three threads against one it must be bit-identical (the barrier and the shared estimates at work). A
// GPU must agree with the CPU as the hybrid's cases do: its sums run in another order, so a near-tie may rank
// two candidates, or give a budget step, the other way. Five comparisons (tests/kv_cache_cpp.rs counts them) that
// cover both ways a chunk's candidates are proposed (S = 128, 4 H = 128: chunk 1 proposes all of them, chunks 2 and 3
// choose by the sampled queries), 4, 16 and 32 samples per tile and a tile whose rows hold no sampled one (one sample
// per tile, a call ending 50 rows into chunk 1), samples whose logits read a quarter of the key channels
// (h2o_tile_sketch), a coverage target below 1, sinks, a dense tail, and a call that continues a chunk inside a tile.
void run_coverage_cases(ggml_backend_t cpu, ggml_backend_t other, const char * name, const shape & sh,
        const std::vector<float> & q, const std::vector<ggml_fp16_t> & kv_k, const std::vector<ggml_fp16_t> & kv_v, float max_v, bool exact) {
    const int32_t S = sh.S;
    const ggml_h2o_select cov = GGML_H2O_SELECT_COVERAGE;
    const struct {
        const char * what;
        int32_t      n_sink;
        int32_t      tail_start;
        float        coverage;
        int32_t      n_sample;
        int32_t      sketch;
    } cases[] = {
        { "one call, coverage, 4 sinks, tail of 24",                         4, 3*S + 16,  1.0f, 4,  1 },
        { "one call, coverage target 0.9, 16 samples, no sink, no tail",     0, INT32_MAX, 0.9f, 16, 1 },
        { "one call, coverage, 32 samples on a quarter of the key channels", 4, 3*S + 16,  1.0f, 32, 4 },
    };
    for (const auto & c : cases) {
        state ref_st(cpu, sh, kv_k, kv_v);
        state got_st(other, sh, kv_k, kv_v);
        const int32_t n = 3*S + 40;
        compare(c.what, name,
                run_call(cpu,   ref_st, sh, q, 0, n, -1, -1, cov, c.n_sink, c.tail_start, c.coverage, c.n_sample, {}, c.sketch),
                run_call(other, got_st, sh, q, 0, n, -1, -1, cov, c.n_sink, c.tail_start, c.coverage, c.n_sample, {}, c.sketch),
                sh, max_v, exact);
    }
    // two calls that split chunk 1 inside a tile, one sample per tile: the second part's tiles choose again from their
    // own rows (the first call's last tile, rows S .. S + 49, holds no sampled row and samples its last)
    {
        state ref_st(cpu, sh, kv_k, kv_v);
        state got_st(other, sh, kv_k, kv_v);
        const int32_t n1 = S + 50;
        const int32_t n2 = 2*S + 40 - n1;
        const int32_t no_tail = INT32_MAX;
        if (compare("coverage, 1 sample, call 1 of 2 ending inside chunk 1", name,
                    run_call(cpu,   ref_st, sh, q, 0, n1, -1, -1, cov, 4, no_tail, 1.0f, 1),
                    run_call(other, got_st, sh, q, 0, n1, -1, -1, cov, 4, no_tail, 1.0f, 1), sh, max_v, exact)) {
            compare("coverage, 1 sample, call 2 of 2 continuing chunk 1", name,
                    run_call(cpu,   ref_st, sh, q, n1, n2, 0, 1, cov, 4, no_tail, 1.0f, 1),
                    run_call(other, got_st, sh, q, n1, n2, 0, 1, cov, 4, no_tail, 1.0f, 1), sh, max_v, exact);
        }
    }
}

// Gemma 3's global layers: heads of 256 channels, one KV head for four query heads, where a session's coverage
// selection takes 64 samples per tile on half the key channels (H2oConfig::recommended_tile_sketch). One comparison.
void run_wide_head_coverage_case(ggml_backend_t cpu, ggml_backend_t other, const char * name, bool exact) {
    shape sh;
    sh.D         = 256;
    sh.n_head    = 4;
    sh.n_head_kv = 1;
    const int32_t n = 3*sh.S + 40;
    const inputs in(sh, n, 7);
    state ref_st(cpu, sh, in.kv_k, in.kv_v);
    state got_st(other, sh, in.kv_k, in.kv_v);
    const ggml_h2o_select cov = GGML_H2O_SELECT_COVERAGE;
    compare("one call, coverage, 64 samples on half of 256 key channels", name,
            run_call(cpu,   ref_st, sh, in.q, 0, n, -1, -1, cov, 4, 3*sh.S + 16, 1.0f, 64, {}, 2),
            run_call(other, got_st, sh, in.q, 0, n, -1, -1, cov, 4, 3*sh.S + 16, 1.0f, 64, {}, 2), sh, in.max_v, exact);
}

// The model-specific attention arithmetic and cache types: a soft-cap that binds (logits
// here are about N(0, 1), the cap 1), learned sinks of every head (gpt-oss), and K/V caches of BF16 and quantized types,
// under the seed rule, the hybrid and coverage selection, one call each. Six comparisons.
void run_logit_and_cache_cases(ggml_backend_t cpu, ggml_backend_t other, const char * name, const shape & sh,
        const std::vector<float> & q, const std::vector<ggml_fp16_t> & kv_k, const std::vector<ggml_fp16_t> & kv_v, float max_v, bool exact) {
    const int32_t S = sh.S;
    std::vector<float> sinks(sh.n_head);
    for (int64_t h = 0; h < sh.n_head; ++h) {
        sinks[h] = 2.0f*std::sin(1.0f + (float) h); // within a few units of the logits: a visible share
    }
    const struct {
        const char    * what;
        ggml_h2o_select select;
        int32_t         tail_start;
        logit_opts      lo;
        ggml_type       type_k;
        ggml_type       type_v;
    } cases[] = {
        { "one call, seed rule, soft-cap 1",                        GGML_H2O_SELECT_SEED,      INT32_MAX, { 1.0f, nullptr }, GGML_TYPE_F16,  GGML_TYPE_F16  },
        { "one call, hybrid, learned sinks, tail of 24",            GGML_H2O_SELECT_HYBRID,   3*S + 16,  { 0.0f, &sinks  }, GGML_TYPE_F16,  GGML_TYPE_F16  },
        { "one call, coverage, soft-cap 1 and sinks, tail of 24",   GGML_H2O_SELECT_COVERAGE, 3*S + 16,  { 1.0f, &sinks  }, GGML_TYPE_F16,  GGML_TYPE_F16  },
        { "one call, seed rule, q8_0 K/V, tail of 24",              GGML_H2O_SELECT_SEED,      3*S + 16,  { 0.0f, nullptr }, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0 },
        { "one call, coverage, BF16 K/V",                           GGML_H2O_SELECT_COVERAGE, INT32_MAX, { 0.0f, nullptr }, GGML_TYPE_BF16, GGML_TYPE_BF16 },
        { "one call, hybrid, q4_0 K, q8_0 V, sinks",                GGML_H2O_SELECT_HYBRID,   INT32_MAX, { 0.0f, &sinks  }, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0 },
    };
    for (const auto & c : cases) {
        state ref_st(cpu,   sh, kv_k, kv_v, c.type_k, c.type_v);
        state got_st(other, sh, kv_k, kv_v, c.type_k, c.type_v);
        const int32_t n = 3*S + 40;
        compare(c.what, name,
                run_call(cpu,   ref_st, sh, q, 0, n, -1, -1, c.select, 4, c.tail_start, 1.0f, 4, c.lo),
                run_call(other, got_st, sh, q, 0, n, -1, -1, c.select, 4, c.tail_start, 1.0f, 4, c.lo), sh, max_v, exact);
    }
}

// The one coverage op a GPU backend refuses (its ranking sorts 4 H candidates per tile in shared memory, so heavy
// budgets beyond 2048 are not served): llama then refuses the context, naming the backend, instead of the scheduler
// running the op on the CPU against copies of the state. The same op under the seed rule must be accepted.
void check_coverage_refusal(ggml_backend_t gpu, const char * name) {
    ggml_init_params ip = { 8*ggml_tensor_overhead(), nullptr, /*no_alloc=*/ true };
    ggml_context * ctx = ggml_init(ip);
    const int64_t D = 64, kv = 8192;
    const int32_t S = 8192, L = 0, H = 4096;
    ggml_tensor * q      = ggml_new_tensor_3d(ctx, GGML_TYPE_F32,  D, 1, 8);
    ggml_tensor * k      = ggml_new_tensor_3d(ctx, GGML_TYPE_F16,  D, 1, kv);
    ggml_tensor * v      = ggml_new_tensor_3d(ctx, GGML_TYPE_F16,  D, 1, kv);
    ggml_tensor * scores = ggml_new_tensor_2d(ctx, GGML_TYPE_BF16, kv, 1);
    ggml_tensor * mem    = ggml_new_tensor_2d(ctx, GGML_TYPE_I32,  L + H, 1);
    ggml_tensor * acc    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32,  S + L + H, 1);
    ggml_tensor * op     = ggml_h2o_attn(ctx, q, k, v, scores, mem, acc, 0, S, L, H, -1, -1, 0.125f);
    ggml_h2o_attn_set_select(op, GGML_H2O_SELECT_COVERAGE, 0, INT32_MAX);
    const bool coverage = ggml_backend_supports_op(gpu, op);
    ggml_h2o_attn_set_select(op, GGML_H2O_SELECT_SEED, 0, INT32_MAX);
    const bool seed = ggml_backend_supports_op(gpu, op);
    CHECK(!coverage, "%s accepts coverage selection with H = %d, beyond what its kernels serve", name, H);
    CHECK(seed, "%s refuses the seed rule with H = %d", name, H);
    std::printf("     coverage selection with H = %d: %s by %s (the seed rule: %s)\n", H,
            coverage ? "accepted" : "refused", name, seed ? "accepted" : "refused");
    ggml_free(ctx);
}

// GGML_OP_H2O_DECODE (and its CUDA kernels): decode steps against the CPU on one backend state
// and one reference state, each carried from call to call as llama's KV cache carries it. The sketch state (each
// block's 8-bit sketch, each KV head's channels and the count of blocks sketched) must be bit-identical: the CUDA
// kernels sum the channel energies and form the estimates in the CPU's order, so they choose the same channels and the
// same positions. The outputs may differ by float rounding, as the prefill's.
struct decode_state {
    ggml_context          * ctx = nullptr;
    ggml_backend_buffer_t   buf = nullptr;
    ggml_tensor * k      = nullptr;
    ggml_tensor * v      = nullptr;
    ggml_tensor * summ   = nullptr;
    ggml_tensor * summ_n = nullptr;

    decode_state(ggml_backend_t backend, const shape & sh, int64_t n_stream, const std::vector<ggml_fp16_t> & kv_k,
            const std::vector<ggml_fp16_t> & kv_v, ggml_type type_k, ggml_type type_v) {
        const int64_t B = GGML_H2O_DECODE_BLOCK;
        const int64_t R = sh.D/4;
        ggml_init_params ip = { 8*ggml_tensor_overhead(), nullptr, /*no_alloc=*/ true };
        ctx    = ggml_init(ip);
        k      = ggml_new_tensor_4d(ctx, type_k, sh.D, sh.n_head_kv, sh.kv_size, n_stream);
        v      = ggml_new_tensor_4d(ctx, type_v, sh.D, sh.n_head_kv, sh.kv_size, n_stream);
        summ   = ggml_new_tensor_4d(ctx, GGML_TYPE_I8, GGML_H2O_DECODE_SKETCH_SIZE(sh.D), sh.n_head_kv, sh.kv_size/B, n_stream);
        summ_n = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 3 + R*sh.n_head_kv, n_stream);
        buf    = ggml_backend_alloc_ctx_tensors(ctx, backend);
        state::set_as(k, kv_k);
        state::set_as(v, kv_v);
        ggml_backend_tensor_memset(summ,   0x00, 0, ggml_nbytes(summ));
        ggml_backend_tensor_memset(summ_n, 0x00, 0, ggml_nbytes(summ_n));
        for (int64_t s = 0; s < n_stream; ++s) {
            set_own(s, -1, -1); // the op's
        }
    }
    // stream s's own sink and budget, the last two values of its row of summ_n (-1: the op's)
    void set_own(int64_t s, int32_t n_sink, int32_t n_budget) {
        const int32_t own[2] = { n_sink, n_budget };
        ggml_backend_tensor_set(summ_n, own, s*summ_n->nb[1] + (summ_n->ne[0] - 2)*sizeof(int32_t), sizeof(own));
    }
    ~decode_state() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
};

struct decode_result {
    std::vector<float>    out;
    std::vector<uint8_t>  summ;
    std::vector<int32_t>  summ_n;
    std::vector<float>    keys_read; // per stream, the positions a query head read (ggml_h2o_decode_set_keys_read)
    bool                  supported = true;
};

// one decode call: n_tokens queries per stream, query t of stream s seeing the cells [0, extents[s][t]) but the closed
// ones; of the budget, what coverage takes (1: all of it)
decode_result run_decode(ggml_backend_t backend, decode_state & st, const shape & sh,
        const std::vector<std::vector<int32_t>> & extents, int32_t n_sink, int32_t n_local, int32_t n_budget,
        logit_opts lo, bool mask_f16, int32_t closed_begin, int32_t closed_end, uint32_t seed, float coverage = 1.0f) {
    const int64_t n_stream = (int64_t) extents.size();
    const int64_t n_tokens = (int64_t) extents[0].size();
    ggml_init_params ip = { 8*ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, /*no_alloc=*/ true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * q     = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, sh.D, sh.n_head, n_tokens, n_stream);
    ggml_tensor * mask  = ggml_new_tensor_4d(ctx, mask_f16 ? GGML_TYPE_F16 : GGML_TYPE_F32, sh.kv_size, n_tokens, 1, n_stream);
    ggml_tensor * sinks = lo.sinks ? ggml_new_tensor_1d(ctx, GGML_TYPE_F32, sh.n_head) : nullptr;
    ggml_tensor * keys  = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_stream);
    ggml_tensor * out   = ggml_h2o_decode(ctx, q, st.k, st.v, mask, st.summ, st.summ_n, n_sink, n_local, n_budget,
            1.0f/std::sqrt((float) sh.D));
    ggml_h2o_attn_set_logits(out, lo.softcap, sinks);
    ggml_h2o_decode_set_coverage(out, coverage);
    ggml_h2o_decode_set_keys_read(out, keys);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    decode_result r;
    r.supported = ggml_backend_supports_op(backend, out);
    if (r.supported) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        std::mt19937 rng(seed);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> qv(ggml_nelements(q));
        for (float & x : qv) { x = nd(rng); }
        ggml_backend_tensor_set(q, qv.data(), 0, ggml_nbytes(q));
        std::vector<float> mv(ggml_nelements(mask));
        for (int64_t s = 0; s < n_stream; ++s) {
            for (int64_t t = 0; t < n_tokens; ++t) {
                for (int64_t j = 0; j < sh.kv_size; ++j) {
                    const bool open = j < extents[s][t] && (j < closed_begin || j >= closed_end);
                    mv[(s*n_tokens + t)*sh.kv_size + j] = open ? 0.0f : -INFINITY;
                }
            }
        }
        if (mask_f16) {
            std::vector<ggml_fp16_t> mh(mv.size());
            ggml_fp32_to_fp16_row(mv.data(), mh.data(), (int64_t) mv.size());
            ggml_backend_tensor_set(mask, mh.data(), 0, ggml_nbytes(mask));
        } else {
            ggml_backend_tensor_set(mask, mv.data(), 0, ggml_nbytes(mask));
        }
        if (sinks) {
            ggml_backend_tensor_set(sinks, lo.sinks->data(), 0, ggml_nbytes(sinks));
        }
        CHECK(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS, "%s: graph compute failed", ggml_backend_name(backend));
        r.out.resize(ggml_nelements(out));
        r.summ.resize(ggml_nelements(st.summ));
        r.summ_n.resize(ggml_nelements(st.summ_n));
        ggml_backend_tensor_get(out, r.out.data(), 0, ggml_nbytes(out));
        ggml_backend_tensor_get(st.summ, r.summ.data(), 0, ggml_nbytes(st.summ));
        ggml_backend_tensor_get(st.summ_n, r.summ_n.data(), 0, ggml_nbytes(st.summ_n));
        r.keys_read.resize(n_stream);
        ggml_backend_tensor_get(keys, r.keys_read.data(), 0, ggml_nbytes(keys));
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return r;
}

bool compare_decode(const char * what, const char * name, const decode_result & ref, const decode_result & got, float max_v,
        bool exact) {
    if (!got.supported) {
        CHECK(false, "%s: %s does not support GGML_OP_H2O_DECODE: the scheduler would run it on the CPU", what, name);
        return false;
    }
    float max_out = 0.0f;
    for (size_t i = 0; i < ref.out.size(); ++i) {
        max_out = std::max(max_out, std::fabs(ref.out[i] - got.out[i]));
    }
    CHECK(max_out <= 1e-3f*std::max(1.0f, max_v), "%s: %s output differs by %g", what, name, max_out);
    int n_summ = 0;
    for (size_t i = 0; i < ref.summ.size(); ++i) {
        n_summ += ref.summ[i] != got.summ[i];
    }
    int n_chan = 0;
    for (size_t i = 0; i < ref.summ_n.size(); ++i) {
        n_chan += ref.summ_n[i] != got.summ_n[i];
    }
    CHECK(n_summ == 0 && n_chan == 0, "%s: %s: %d sketch values and %d channels or counts differ from the CPU's", what, name,
            n_summ, n_chan);
    // the positions read follow from the choice, which must be the CPU's
    std::string keys;
    for (size_t s = 0; s < ref.keys_read.size(); ++s) {
        CHECK(ref.keys_read[s] == got.keys_read[s], "%s: %s read %g positions a head in stream %zu, the CPU %g", what, name,
                got.keys_read[s], s, ref.keys_read[s]);
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%s%g", s ? ", " : "", (double) got.keys_read[s]);
        keys += buf;
    }
    CHECK(!exact || max_out == 0.0f, "%s: %s is not bit-identical to the reference", what, name);
    std::printf("     %s on %s: max |Δout| %.3g, %d sketch values and %d channels or counts differ, positions read %s\n", what,
            name, max_out, n_summ, n_chan, keys.c_str());
    return true;
}

// Ten decode comparisons (tests/kv_cache_cpp.rs counts them): three steps on one state (the first after a prompt,
// which chooses the channels and sketches it; two tokens at once; a step that sketches four more blocks), two streams
// with a soft-cap and learned sinks under an F16 mask, three streams with sinks and budgets of their own (a
// budget of 0, the op's, one that covers the stream), q8_0 K/V with closed cells among the candidates, BF16 K with q4_0
// V and two sink blocks, a budget that covers the context (full attention), two streams whose choice follows coverage
// (fewer positions than the budget, a count each), and a budget that covers 6,000 positions.
void run_decode_cases(ggml_backend_t cpu, ggml_backend_t other, const char * name, const shape & sh, float max_v, bool exact) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<ggml_fp16_t> kv_k((size_t) 3*sh.kv_size*sh.n_head_kv*sh.D); // up to three streams
    std::vector<ggml_fp16_t> kv_v(kv_k.size());
    for (auto & x : kv_k) { x = ggml_fp32_to_fp16(nd(rng)); }
    for (auto & x : kv_v) { x = ggml_fp32_to_fp16(nd(rng)); }
    std::vector<float> sinks(sh.n_head);
    for (int64_t h = 0; h < sh.n_head; ++h) {
        sinks[h] = 2.0f*std::sin(1.0f + (float) h);
    }
    const int32_t none = 0;
    {
        decode_state ref_st(cpu,   sh, 1, kv_k, kv_v, GGML_TYPE_F16, GGML_TYPE_F16);
        decode_state got_st(other, sh, 1, kv_k, kv_v, GGML_TYPE_F16, GGML_TYPE_F16);
        const struct {
            const char *                      what;
            std::vector<std::vector<int32_t>> extents;
        } steps[] = {
            { "decode, first step after 700 tokens, budget 128",  { { 701 } } },
            { "decode, two tokens at once",                       { { 702, 703 } } },
            { "decode, a step that sketches four more blocks",    { { 760 } } },
        };
        uint32_t seed = 100;
        for (const auto & st : steps) {
            if (!compare_decode(st.what, name,
                        run_decode(cpu,   ref_st, sh, st.extents, 4, 64, 128, {}, false, none, none, seed),
                        run_decode(other, got_st, sh, st.extents, 4, 64, 128, {}, false, none, none, seed), max_v, exact)) {
                break;
            }
            ++seed;
        }
    }
    const struct {
        const char *                      what;
        std::vector<std::vector<int32_t>> extents;
        int32_t    n_sink, n_local, n_budget;
        logit_opts lo;
        bool       mask_f16;
        int32_t    closed_begin, closed_end;
        ggml_type  type_k, type_v;
        float      coverage = 1.0f;
    } cases[] = {
        { "decode, two streams, soft-cap 1 and sinks, F16 mask",   { { 300 }, { 900 } }, 0, 32, 64, { 1.0f, &sinks }, true,
            none, none, GGML_TYPE_F16, GGML_TYPE_F16 },
        { "decode, three streams with their own sinks and budgets", { { 300 }, { 900 }, { 700 } }, 4, 32, 64, {}, false,
            none, none, GGML_TYPE_F16, GGML_TYPE_F16 },
        { "decode, q8_0 K/V, closed cells among the candidates", { { 640 } }, 4, 64, 96, {}, false, 200, 230,
            GGML_TYPE_Q8_0, GGML_TYPE_Q8_0 },
        { "decode, BF16 K, q4_0 V, two sink blocks",             { { 500 } }, 20, 48, 64, {}, false, none, none,
            GGML_TYPE_BF16, GGML_TYPE_Q4_0 },
        { "decode, a budget that covers the context",            { { 400 } }, 4, 64, 1024, {}, false, none, none,
            GGML_TYPE_F16, GGML_TYPE_F16 },
        { "decode, two streams, coverage 0.3 of a budget of 512", { { 900, 901 }, { 800, 801 } }, 4, 64, 512, {}, false,
            none, none, GGML_TYPE_F16, GGML_TYPE_F16, 0.3f },
    };
    uint32_t seed = 200;
    for (const auto & c : cases) {
        const int64_t n_stream = (int64_t) c.extents.size();
        decode_state ref_st(cpu,   sh, n_stream, kv_k, kv_v, c.type_k, c.type_v);
        decode_state got_st(other, sh, n_stream, kv_k, kv_v, c.type_k, c.type_v);
        if (n_stream == 3) {
            // a budget of 0 with a sink of 20 (two blocks), the op's sink and budget, a budget that covers the stream
            for (decode_state * st : { &ref_st, &got_st }) {
                st->set_own(0, 20, 0);
                st->set_own(2, 4, 1024);
            }
        }
        const decode_result ref = run_decode(cpu, ref_st, sh, c.extents, c.n_sink, c.n_local, c.n_budget, c.lo, c.mask_f16,
                c.closed_begin, c.closed_end, seed, c.coverage);
        if (c.coverage < 1.0f) {
            // the case is one only if coverage takes fewer than the budget: sinks, budget and window bound what is read
            for (size_t s = 0; s < ref.keys_read.size(); ++s) {
                CHECK(ref.keys_read[s] < (float) (16 + c.n_budget + c.n_local + 16), "%s: stream %zu read %g positions a head: "
                        "the coverage took the whole budget", c.what, s, ref.keys_read[s]);
            }
        }
        compare_decode(c.what, name, ref,
                run_decode(other, got_st, sh, c.extents, c.n_sink, c.n_local, c.n_budget, c.lo, c.mask_f16, c.closed_begin,
                        c.closed_end, seed, c.coverage),
                max_v, exact);
        ++seed;
    }

    // a long context whose budget covers it: the CUDA attention then cuts the list into parts of several
    // chunks, and the closed cells close whole chunks between open ones
    {
        shape lsh = sh;
        lsh.kv_size = 6144;
        std::vector<ggml_fp16_t> long_k((size_t) lsh.kv_size*lsh.n_head_kv*lsh.D);
        std::vector<ggml_fp16_t> long_v(long_k.size());
        for (auto & x : long_k) { x = ggml_fp32_to_fp16(nd(rng)); }
        for (auto & x : long_v) { x = ggml_fp32_to_fp16(nd(rng)); }
        decode_state ref_st(cpu,   lsh, 1, long_k, long_v, GGML_TYPE_F16, GGML_TYPE_F16);
        decode_state got_st(other, lsh, 1, long_k, long_v, GGML_TYPE_F16, GGML_TYPE_F16);
        compare_decode("decode, 6000 positions, a budget that covers them, 200 closed", name,
                run_decode(cpu,   ref_st, lsh, { { 6000 } }, 4, 64, 6144, {}, false, 3000, 3200, seed),
                run_decode(other, got_st, lsh, { { 6000 } }, 4, 64, 6144, {}, false, 3000, 3200, seed), max_v, exact);
    }
}

} // namespace

int main() {
    ggml_backend_load_all();
    const shape sh;

    const inputs in(sh, 3*sh.S + 40, 42);
    const std::vector<float> & q = in.q;
    const std::vector<ggml_fp16_t> & kv_k = in.kv_k;
    const std::vector<ggml_fp16_t> & kv_v = in.kv_v;
    const float max_v = in.max_v;

    // the reference: the CPU backend on one thread
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    CHECK(cpu != nullptr, "no CPU backend");
    if (cpu == nullptr) {
        return 1;
    }
    ggml_backend_cpu_set_n_threads(cpu, 1);

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
        run_cases(cpu, gpu, name, sh, q, kv_k, kv_v, max_v, false);
        run_coverage_cases(cpu, gpu, name, sh, q, kv_k, kv_v, max_v, false);
        run_wide_head_coverage_case(cpu, gpu, name, false);
        run_logit_and_cache_cases(cpu, gpu, name, sh, q, kv_k, kv_v, max_v, false);
        run_decode_cases(cpu, gpu, name, sh, max_v, false);
        check_coverage_refusal(gpu, name);
        ggml_backend_free(gpu);
    }

    if (n_gpu == 0) {
        // no GPU: run the same cases on the CPU with three threads against one, so that the cases and
        // the comparisons are exercised. Heads are split across threads and each head's work is
        // sequential, so here the results must be bit-identical
        ggml_backend_t cpu3 = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
        ggml_backend_cpu_set_n_threads(cpu3, 3);
        std::printf("CPU, 3 threads (stands in for a GPU)\n");
        run_cases(cpu, cpu3, "CPU x3", sh, q, kv_k, kv_v, max_v, true);
        run_coverage_cases(cpu, cpu3, "CPU x3", sh, q, kv_k, kv_v, max_v, true);
        run_wide_head_coverage_case(cpu, cpu3, "CPU x3", true);
        run_logit_and_cache_cases(cpu, cpu3, "CPU x3", sh, q, kv_k, kv_v, max_v, true);
        run_decode_cases(cpu, cpu3, "CPU x3", sh, max_v, true);
        ggml_backend_free(cpu3);
        std::printf("skipped: no GPU backend in this build (build with --features cuda or scripts/gpu-test.sh)\n");
    }
    ggml_backend_free(cpu);

    std::printf("%d GPU backend(s), %d failed\n", n_gpu, n_failed);
    return n_failed == 0 ? 0 : 1;
}
