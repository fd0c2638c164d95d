// Prefill speed of H2O against stock attention in the same build, through the public llama.h /
// ggml-backend.h API only (so that it runs on GPU machines that have no Rust; scripts/gpu-test.sh builds
// it there with g++ against the static libs):
//
//   - the model is loaded once (-ngl layers offloaded);
//   - for each prompt length N, ascending, and each repetition, two configurations alternate, each on a
//     fresh context (n_ctx = N rounded up to a multiple of 256, n_seq_max 1): "stock", H2O off
//     (h2o_local = h2o_heavy = 0, bit-identical to pristine llama.cpp), and "h2o" (L/H from the flags);
//   - a prefill feeds N random tokens (fixed seed) in llama_decode calls of n_batch tokens, logits for
//     the last token only, and is timed from the first decode until the last one has returned and
//     llama_synchronize; tok/s = N / seconds. One untimed warm-up prefill per configuration at the
//     smallest N comes first (GPU kernels loading);
//   - GPU memory: with a GPU device, the device memory in use right after the prefill, while the context
//     still exists, above what was in use right after the model load (ggml_backend_dev_memory). The CUDA
//     pool keeps its peak until the context is freed, so this approximates the prefill's peak. Without a
//     GPU device it is reported as n/a (0 in the JSON).
//
//   bench-h2o-prefill MODEL.gguf [-p 1024,4096,...] [-r 3] [-b 4096] [-ub 1024] [--h2o-local 256]
//                     [--h2o-heavy 256] [-ngl 99] [-t N] [-fa on|off|auto] [--json FILE]
//
// Progress goes to stderr, a markdown table to stdout, and with --json FILE the results to FILE.
// Exit code 2 for bad input, 1 when a context cannot be created or a decode fails.

#include "llama.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

struct params {
    std::string           model;
    std::vector<int32_t>  n_prompt     = { 1024, 4096 };
    int32_t               reps         = 3;
    int32_t               n_batch      = 4096;
    int32_t               n_ubatch     = 1024;
    int32_t               h2o_local    = 256;
    int32_t               h2o_heavy    = 256;
    int32_t               n_gpu_layers = 99;
    int32_t               n_threads    = 0; // 0: the number of hardware threads
    llama_flash_attn_type fa           = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    std::string           json;
};

struct config {
    const char * name;
    int32_t      h2o_local;
    int32_t      h2o_heavy;
};

struct run_stats {
    double tps;
    double gpu_mib;   // < 0: no GPU device
    double state_mib; // H2O state (scores + memory indices), 0 without H2O
};

struct row {
    int32_t             n;
    std::vector<double> tps[2];
    double              gpu_mib[2]   = { -1.0, -1.0 };
    double              state_mib    = 0.0;
};

[[noreturn]] void usage_error(const char * fmt, const char * arg) {
    std::fprintf(stderr, "bench-h2o-prefill: ");
    std::fprintf(stderr, fmt, arg);
    std::fprintf(stderr, "\nusage: bench-h2o-prefill MODEL.gguf [-p 1024,4096,...] [-r 3] [-b 4096] [-ub 1024] "
            "[--h2o-local 256] [--h2o-heavy 256] [-ngl 99] [-t N] [-fa on|off|auto] [--json FILE]\n");
    std::exit(2);
}

// a whole decimal integer in [lo, hi], else exit 2
int32_t parse_int(const char * flag, const char * s, long lo, long hi) {
    errno = 0;
    char * end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || v < lo || v > hi) {
        std::fprintf(stderr, "bench-h2o-prefill: %s expects an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, s);
        std::exit(2);
    }
    return (int32_t) v;
}

params parse_args(int argc, char ** argv) {
    params p;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "-h" || a == "--help") {
            usage_error("%s", "help");
        }
        if (a.size() > 1 && a[0] == '-') {
            if (i + 1 >= argc) {
                usage_error("%s needs a value", a.c_str());
            }
            const char * v = argv[++i];
            if (a == "-p") {
                p.n_prompt.clear();
                std::string list = v;
                size_t pos = 0;
                while (true) {
                    const size_t comma = list.find(',', pos);
                    const std::string item = list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
                    p.n_prompt.push_back(parse_int("-p", item.c_str(), 1, INT32_MAX - 256));
                    if (comma == std::string::npos) {
                        break;
                    }
                    pos = comma + 1;
                }
            } else if (a == "-r") {
                p.reps = parse_int("-r", v, 1, 1000);
            } else if (a == "-b") {
                p.n_batch = parse_int("-b", v, 1, INT32_MAX);
            } else if (a == "-ub") {
                p.n_ubatch = parse_int("-ub", v, 1, INT32_MAX);
            } else if (a == "--h2o-local") {
                p.h2o_local = parse_int("--h2o-local", v, 0, INT32_MAX/2);
            } else if (a == "--h2o-heavy") {
                p.h2o_heavy = parse_int("--h2o-heavy", v, 0, INT32_MAX/2);
            } else if (a == "-ngl") {
                p.n_gpu_layers = parse_int("-ngl", v, -1, INT32_MAX);
            } else if (a == "-t") {
                p.n_threads = parse_int("-t", v, 1, 4096);
            } else if (a == "-fa") {
                const std::string f = v;
                if (f == "on") {
                    p.fa = LLAMA_FLASH_ATTN_TYPE_ENABLED;
                } else if (f == "off") {
                    p.fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
                } else if (f == "auto") {
                    p.fa = LLAMA_FLASH_ATTN_TYPE_AUTO;
                } else {
                    usage_error("-fa expects on, off or auto, got '%s'", v);
                }
            } else if (a == "--json") {
                p.json = v;
            } else {
                usage_error("unknown option '%s'", a.c_str());
            }
        } else if (p.model.empty()) {
            p.model = a;
        } else {
            usage_error("unexpected argument '%s'", a.c_str());
        }
    }
    if (p.model.empty()) {
        usage_error("%s", "no model given");
    }
    std::sort(p.n_prompt.begin(), p.n_prompt.end());
    p.n_prompt.erase(std::unique(p.n_prompt.begin(), p.n_prompt.end()), p.n_prompt.end());
    if (p.n_threads == 0) {
        p.n_threads = std::max(1u, std::thread::hardware_concurrency());
    }
    return p;
}

uint32_t ctx_size(int32_t n) {
    return (uint32_t) ((n + 255)/256*256);
}

void quiet_log(ggml_log_level level, const char * text, void * /*user_data*/) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

// the GPU devices (GGML_BACKEND_DEVICE_TYPE_GPU); their memory is summed
std::vector<ggml_backend_dev_t> gpu_devices() {
    std::vector<ggml_backend_dev_t> devs;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU) {
            devs.push_back(dev);
        }
    }
    return devs;
}

// bytes in use on the GPU devices (total - free), summed
double gpu_used_bytes(const std::vector<ggml_backend_dev_t> & devs) {
    double used = 0.0;
    for (ggml_backend_dev_t dev : devs) {
        size_t free = 0;
        size_t total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        used += (double) total - (double) free;
    }
    return used;
}

// one prefill of tokens[0, n) on a fresh context; exit 1 on failure
run_stats prefill(llama_model * model, const params & p, const config & cfg, const std::vector<llama_token> & tokens,
        int32_t n, const std::vector<ggml_backend_dev_t> & gpus, double gpu_baseline) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = ctx_size(n);
    cp.n_batch         = (uint32_t) p.n_batch;
    cp.n_ubatch        = (uint32_t) p.n_ubatch;
    cp.n_seq_max       = 1;
    cp.n_threads       = p.n_threads;
    cp.n_threads_batch = p.n_threads;
    cp.flash_attn_type = p.fa;
    cp.h2o_local       = cfg.h2o_local;
    cp.h2o_heavy       = cfg.h2o_heavy;

    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        std::fprintf(stderr, "bench-h2o-prefill: N=%d %s: context creation failed\n", n, cfg.name);
        std::exit(1);
    }
    // llama.cpp clamps n_batch to n_ctx
    const int32_t n_batch = (int32_t) llama_n_batch(ctx);
    llama_batch batch = llama_batch_init(n_batch, 0, 1);

    const auto t0 = std::chrono::steady_clock::now();
    for (int32_t i0 = 0; i0 < n; i0 += n_batch) {
        const int32_t nb = std::min(n_batch, n - i0);
        for (int32_t j = 0; j < nb; ++j) {
            batch.token[j]     = tokens[i0 + j];
            batch.pos[j]       = i0 + j;
            batch.n_seq_id[j]  = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j]    = i0 + j == n - 1;
        }
        batch.n_tokens = nb;
        const int32_t status = llama_decode(ctx, batch);
        if (status != 0) {
            std::fprintf(stderr, "bench-h2o-prefill: N=%d %s: llama_decode returned %d at position %d\n",
                    n, cfg.name, status, i0);
            std::exit(1);
        }
    }
    llama_synchronize(ctx);
    const auto t1 = std::chrono::steady_clock::now();

    run_stats r;
    r.tps       = n / std::chrono::duration<double>(t1 - t0).count();
    r.gpu_mib   = gpus.empty() ? -1.0 : (gpu_used_bytes(gpus) - gpu_baseline)/(1024.0*1024.0);
    r.state_mib = 0.0;
    llama_h2o_info info {};
    if (llama_h2o_get_info(ctx, &info) == LLAMA_H2O_STATUS_OK) {
        r.state_mib = info.size_bytes/(1024.0*1024.0);
    }

    llama_batch_free(batch);
    llama_free(ctx);
    return r;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t m = v.size()/2;
    return v.size() % 2 ? v[m] : 0.5*(v[m - 1] + v[m]);
}

std::string json_string(const std::string & s) {
    std::string out = "\"";
    for (const unsigned char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += (char) c;
        } else if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
        } else {
            out += (char) c;
        }
    }
    return out + "\"";
}

std::string tps_cell(const std::vector<double> & v) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "%.1f (%.1f–%.1f)", median(v),
            *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
    return buf;
}

std::string mib_cell(double mib) {
    if (mib < 0.0) {
        return "n/a";
    }
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.0f", mib);
    return buf;
}

} // namespace

int main(int argc, char ** argv) {
    const params p = parse_args(argc, argv);

    if (FILE * f = std::fopen(p.model.c_str(), "rb")) {
        std::fclose(f);
    } else {
        std::fprintf(stderr, "bench-h2o-prefill: cannot open model '%s': %s\n", p.model.c_str(), std::strerror(errno));
        return 2;
    }
    // the H2O memory must fit in every chunk: L + H < n_ubatch as llama.cpp clamps it (n_ubatch <= n_batch <= n_ctx)
    const int32_t n_memory = p.h2o_local + p.h2o_heavy;
    for (const int32_t n : p.n_prompt) {
        const int32_t ub = std::min({ p.n_ubatch, p.n_batch, (int32_t) ctx_size(n) });
        if (n_memory > 0 && n_memory >= ub) {
            std::fprintf(stderr, "bench-h2o-prefill: N=%d: h2o_local + h2o_heavy = %d must be smaller than the chunk "
                    "n_ubatch = %d (min of -ub, -b and n_ctx)\n", n, n_memory, ub);
            return 2;
        }
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    const std::vector<ggml_backend_dev_t> gpus = gpu_devices();
    const double gpu_before_load = gpus.empty() ? 0.0 : gpu_used_bytes(gpus);

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = p.n_gpu_layers;
    llama_model * model = llama_model_load_from_file(p.model.c_str(), mp);
    if (model == nullptr) {
        std::fprintf(stderr, "bench-h2o-prefill: cannot load model '%s'\n", p.model.c_str());
        llama_backend_free();
        return 2;
    }
    // the baseline: device memory in use with the model loaded, before any context
    const double gpu_baseline = gpus.empty() ? 0.0 : gpu_used_bytes(gpus);

    const int32_t n_ctx_train = llama_model_n_ctx_train(model);
    if (p.n_prompt.back() > n_ctx_train) {
        std::fprintf(stderr, "bench-h2o-prefill: N=%d is larger than the model's n_ctx_train = %d\n",
                p.n_prompt.back(), n_ctx_train);
        llama_model_free(model);
        llama_backend_free();
        return 2;
    }

    char desc[256];
    llama_model_desc(model, desc, sizeof(desc));
    const std::string device = gpus.empty() ? "CPU" : ggml_backend_dev_description(gpus[0]);
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    std::vector<llama_token> tokens(p.n_prompt.back());
    std::mt19937 rng(42);
    std::uniform_int_distribution<llama_token> dist(0, n_vocab - 1);
    for (llama_token & t : tokens) {
        t = dist(rng);
    }

    const config configs[2] = {
        { "stock", 0, 0 },
        { "h2o", p.h2o_local, p.h2o_heavy },
    };

    std::fprintf(stderr, "model %s (%s), device %s (model: %.0f MiB on the GPU), -ngl %d, -t %d, -b %d, -ub %d, L = %d, H = %d\n",
            p.model.c_str(), desc, device.c_str(), (gpu_baseline - gpu_before_load)/(1024.0*1024.0),
            p.n_gpu_layers, p.n_threads, p.n_batch, p.n_ubatch, p.h2o_local, p.h2o_heavy);

    for (const config & cfg : configs) {
        const run_stats w = prefill(model, p, cfg, tokens, p.n_prompt.front(), gpus, gpu_baseline);
        std::fprintf(stderr, "warm-up N=%d %s: %.1f tok/s\n", p.n_prompt.front(), cfg.name, w.tps);
    }

    std::vector<row> rows;
    for (const int32_t n : p.n_prompt) {
        row r;
        r.n = n;
        for (int32_t rep = 0; rep < p.reps; ++rep) {
            for (int c = 0; c < 2; ++c) {
                const run_stats s = prefill(model, p, configs[c], tokens, n, gpus, gpu_baseline);
                r.tps[c].push_back(s.tps);
                r.gpu_mib[c] = std::max(r.gpu_mib[c], s.gpu_mib);
                r.state_mib  = std::max(r.state_mib, s.state_mib);
                std::fprintf(stderr, "N=%d rep %d/%d %s: %.1f tok/s\n", n, rep + 1, p.reps, configs[c].name, s.tps);
            }
        }
        rows.push_back(r);
    }

    std::printf("| N | stock tok/s median (min–max) | H2O tok/s median (min–max) | H2O/stock | stock GPU MiB | H2O GPU MiB | H2O state MiB |\n");
    std::printf("|---:|---|---|---:|---:|---:|---:|\n");
    for (const row & r : rows) {
        std::printf("| %d | %s | %s | %.2f× | %s | %s | %.2f |\n", r.n, tps_cell(r.tps[0]).c_str(), tps_cell(r.tps[1]).c_str(),
                median(r.tps[1])/median(r.tps[0]), mib_cell(r.gpu_mib[0]).c_str(), mib_cell(r.gpu_mib[1]).c_str(),
                r.state_mib);
    }

    if (!p.json.empty()) {
        FILE * f = std::fopen(p.json.c_str(), "w");
        if (f == nullptr) {
            std::fprintf(stderr, "bench-h2o-prefill: cannot write %s: %s\n", p.json.c_str(), std::strerror(errno));
            llama_model_free(model);
            llama_backend_free();
            return 2;
        }
        std::fprintf(f, "{\n  \"model\": %s,\n  \"model_desc\": %s,\n  \"n_params\": %llu,\n  \"device\": %s,\n",
                json_string(p.model).c_str(), json_string(desc).c_str(),
                (unsigned long long) llama_model_n_params(model), json_string(device).c_str());
        std::fprintf(f, "  \"n_gpu_layers\": %d,\n  \"n_threads\": %d,\n  \"n_batch\": %d,\n  \"n_ubatch\": %d,\n"
                "  \"h2o_local\": %d,\n  \"h2o_heavy\": %d,\n  \"reps\": %d,\n  \"rows\": [",
                p.n_gpu_layers, p.n_threads, p.n_batch, p.n_ubatch, p.h2o_local, p.h2o_heavy, p.reps);
        for (size_t i = 0; i < rows.size(); ++i) {
            const row & r = rows[i];
            std::fprintf(f, "%s\n    {\"n\": %d", i ? "," : "", r.n);
            const char * keys[2] = { "stock_tps", "h2o_tps" };
            for (int c = 0; c < 2; ++c) {
                std::fprintf(f, ", \"%s\": [", keys[c]);
                for (size_t j = 0; j < r.tps[c].size(); ++j) {
                    std::fprintf(f, "%s%.3f", j ? ", " : "", r.tps[c][j]);
                }
                std::fprintf(f, "]");
            }
            std::fprintf(f, ", \"stock_median\": %.3f, \"h2o_median\": %.3f, \"ratio\": %.4f, "
                    "\"stock_gpu_mib\": %.1f, \"h2o_gpu_mib\": %.1f, \"h2o_state_mib\": %.3f}",
                    median(r.tps[0]), median(r.tps[1]), median(r.tps[1])/median(r.tps[0]),
                    std::max(r.gpu_mib[0], 0.0), std::max(r.gpu_mib[1], 0.0), r.state_mib);
        }
        std::fprintf(f, "\n  ]\n}\n");
        std::fclose(f);
    }

    llama_model_free(model);
    llama_backend_free();
    return 0;
}
