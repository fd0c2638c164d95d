// The seed rule's memory set of one head (ggml_h2o_build_memory_set in ggml.h), shared by the
// CPU op and the KV cache so that both choose the same positions.

#include "ggml-impl.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

void ggml_h2o_build_memory_set(
        const ggml_bf16_t * scores,
        int32_t           * memory,
        int32_t             n_local,
        int32_t             n_heavy,
        int32_t             n_sink,
        int32_t             chunk_start,
        int32_t             chunk_end,
        bool                has_previous) {
    const int32_t n_memory    = n_local + n_heavy;
    const int32_t local_start = std::max(chunk_end - n_local, 0);
    const int32_t sink_end    = std::min(n_sink, local_start); // sinks inside Local are Local's

    chunk_start = std::min(chunk_start, chunk_end);

    const auto score = [&](int32_t pos) {
        const float s = GGML_BF16_TO_FP32(scores[pos]);
        return std::isnan(s) ? -INFINITY : s; // keeps the ordering strict
    };

    // (score, position); the better candidate has the higher score, ties go to the lower position
    thread_local std::vector<std::pair<float, int32_t>> cand;
    thread_local std::vector<int32_t> result;
    cand.clear();
    result.clear();

    // M_{c-1} \ (Local + Sink) (it precedes the chunk)
    if (has_previous) {
        for (int32_t m = 0; m < n_memory; ++m) {
            const int32_t pos = memory[m];
            if (pos >= sink_end && pos < chunk_start && pos < local_start) {
                cand.emplace_back(score(pos), pos);
            }
        }
    }

    // C_c \ (Local + Sink)
    for (int32_t pos = std::max(chunk_start, sink_end); pos < std::max(chunk_start, local_start); ++pos) {
        cand.emplace_back(score(pos), pos);
    }

    // the sinks take their places out of the heavy budget
    for (int32_t pos = 0; pos < sink_end; ++pos) {
        result.push_back(pos);
    }

    const size_t n_best = std::min<size_t>(std::max(n_heavy - sink_end, 0), cand.size());
    if (n_best < cand.size()) {
        std::nth_element(cand.begin(), cand.begin() + n_best, cand.end(),
                [](const std::pair<float, int32_t> & a, const std::pair<float, int32_t> & b) {
                    return a.first > b.first || (a.first == b.first && a.second < b.second);
                });
    }

    for (size_t i = 0; i < n_best; ++i) {
        result.push_back(cand[i].second);
    }
    for (int32_t pos = local_start; pos < chunk_end; ++pos) {
        result.push_back(pos);
    }

    // Local, Sink and Heavy are disjoint: the sorted set has no duplicates
    std::sort(result.begin(), result.end());

    for (int32_t m = 0; m < n_memory; ++m) {
        memory[m] = m < (int32_t) result.size() ? result[m] : -1;
    }
}
