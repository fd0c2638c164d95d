#!/usr/bin/env bash
# End to end on a GPU machine: h2o-cli built with CUDA (scripts/cuda-cross-build.sh) with every layer
# offloaded, after `scripts/gpu-test.sh start` kept the carried files there (docs/cuda.md):
#
#   scripts/gpu-e2e.sh OUTDIR [STEP ...]     # STEPs, in this order by default:
#     quality  perplexity and KLD against full attention, -ngl 99: the default model, two texts, 4K and
#              8K, coverage selection (the main shape) and the seed rule (ablation)
#     bench    prefill speed, each H2O policy against full attention in the same build (bit-identical
#              to stock llama.cpp), interleaved: synthetic Qwen2.5-1.5B and Llama-3-8B (8 layers) shapes
#              and the default model
#     decode   decode steps/s after 8K, 32K and 128K prompts, full and sparse decode (Qwen2.5-1.5B shape)
#     offload  the next-token distribution offloaded against the CPU, for full attention and H2O at
#              several memory sizes M = L + H in chunks of S = 128, over several prompts
#
# Each step waits for the background checks of `start` to end first, except `quality` (whose results do
# not depend on timing). Records go to OUTDIR: quality.jsonl, bench-SHAPE.jsonl, decode.jsonl,
# offload.json, and the background's log as op-checks.log.
set -uo pipefail
cd "$(dirname "$0")/.."

out=${1:?usage: scripts/gpu-e2e.sh OUTDIR [quality|bench|decode|offload ...]}
shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(quality bench decode offload)
mkdir -p "$out"
work="${TMPDIR:-/tmp}/h2o-gpu"
gt="$work/gpu-test.sh"
[ -f "$gt" ] || { echo "gpu-e2e.sh: run 'scripts/gpu-test.sh start' first (in an earlier call of this machine)" >&2; exit 1; }
cli=$(bash "$gt" cli) || exit 1
default=$(bash "$gt" model default) || exit 1
threads=8
h2o=(--ubatch-size 1024 --h2o-local 256 --h2o-heavy 256)

# one JSON document from stdin as one line
compact() { python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))'; }

background_done() {
    if [ ! -f "$out/op-checks.log" ]; then
        echo "== waiting for the background checks" >&2
        bash "$gt" wait > "$out/op-checks.log" 2>&1
        grep -E "^== |rc=|failed|FAIL|SUMMARY" "$out/op-checks.log" >&2
    fi
}

quality() {
    local text n
    for text in techdoc fiction; do
        for n in 4096 8192; do
            echo "== perplexity $text $n" >&2
            timeout 300 "$cli" perplexity -m "$default" -f "$work/texts/$text.txt" -c $n -b $n --chunks 1 \
                -t $threads --n-gpu-layers 99 "${h2o[@]}" --h2o-select coverage --ablate 256:256:h2o --json \
                | compact >> "$out/quality.jsonl"
        done
    done
}

# bench SHAPE LENGTHS REPS POLICY...
bench_shape() {
    local spec=$1 lengths=$2 reps=$3 model policy
    shift 3
    model=$(bash "$gt" model "$spec") || return 1
    for policy in "$@"; do
        echo "== bench $spec $policy -p $lengths -r $reps" >&2
        timeout 400 "$cli" bench -m "$model" -p "$lengths" -r "$reps" -t $threads --n-gpu-layers 99 -b 4096 \
            "${h2o[@]}" --h2o-select "$policy" --json | compact >> "$out/bench-${spec//:/-}.jsonl"
    done
}

bench() {
    background_done
    bench_shape qwen2.5-1.5b 4096,32768,131072 2 coverage h2o
    bench_shape qwen2.5-1.5b 4096,32768,131072 1 hybrid
    bench_shape llama-3-8b:8 4096,32768,131072 1 coverage h2o
    bench_shape default 4096,8192 2 coverage h2o
}

decode() {
    background_done
    local model n mode
    model=$(bash "$gt" model qwen2.5-1.5b) || return 1
    for n in 8192 32768 130048; do
        for mode in full sparse; do
            echo "== decode after $n, $mode" >&2
            timeout 200 "$cli" -m "$model" --synthetic-prompt $n -c $((n + 1024)) -n 128 -t $threads \
                --n-gpu-layers 99 -b 4096 "${h2o[@]}" --h2o-decode $mode --json \
                | python3 -c 'import json, sys; r = json.load(sys.stdin); r.pop("text", None); r["decode"] = sys.argv[1]; print(json.dumps(r))' "$mode" \
                >> "$out/decode.jsonl"
        done
    done
}

# KL(offloaded || CPU) of the next-token distribution after prompts of 3 chunks of S = 128 and 40 tokens
# more (the shape of test-h2o-offload), for full attention and for the seed rule at M = 64 (the test's),
# 96 and 120
offload() {
    background_done
    local dir="$work/offload" i text placement ngl cfg
    rm -rf "$dir"
    mkdir -p "$dir"
    # six prompts: the start of each text
    i=0
    for text in techdoc fiction prose licence manual code; do
        head -c 2000 "$work/texts/$text.txt" > "$dir/prompt$i.txt"
        i=$((i + 1))
    done
    for i in 0 1 2 3 4 5; do
        for placement in cpu gpu; do
            ngl=0
            [ $placement = gpu ] && ngl=99
            for cfg in 0:0 32:32 48:48 60:60; do
                echo "== offload prompt $i $placement $cfg" >&2
                timeout 60 "$cli" -m "$default" -f "$dir/prompt$i.txt" -c 1024 -b 1024 --ubatch-size 128 -n 0 \
                    -t $threads --n-gpu-layers $ngl --h2o-local "${cfg%:*}" --h2o-heavy "${cfg#*:}" \
                    --h2o-select seed --h2o-sink 0 --h2o-dense-tail 0 --logits-out "$dir/$i-$placement-$cfg.f32" \
                    --json > "$dir/$i-$placement-$cfg.json"
            done
        done
    done
    python3 - "$dir" > "$out/offload.json" <<'EOF'
import json, os, sys
import numpy as np

d = sys.argv[1]
def probs(path):
    x = np.fromfile(path, dtype=np.float32).astype(np.float64)
    x -= x.max()
    p = np.exp(x)
    return p / p.sum(), x
rows = []
for cfg in ["0:0", "32:32", "48:48", "60:60"]:
    kls, dmax, same = [], [], 0
    for i in range(6):
        a, b = f"{d}/{i}-gpu-{cfg}.f32", f"{d}/{i}-cpu-{cfg}.f32"
        if not (os.path.exists(a) and os.path.exists(b)):
            continue
        (pg, lg), (pc, lc) = probs(a), probs(b)
        kls.append(float(np.sum(pg * (np.log(np.maximum(pg, 1e-300)) - np.log(np.maximum(pc, 1e-300))))))
        dmax.append(float(np.abs(lg - lc).max()))
        same += int(pg.argmax() == pc.argmax())
    prompt_tokens = [json.load(open(f"{d}/{i}-cpu-{cfg}.json"))["prompt_tokens"] for i in range(6)
                     if os.path.exists(f"{d}/{i}-cpu-{cfg}.json")]
    rows.append({"local_heavy": cfg, "kl_offloaded_vs_cpu": kls, "max_abs_logit_delta": dmax,
                 "same_top1": same, "prompt_tokens": prompt_tokens})
# and each H2O shape against full attention on the CPU: how far the sparse prefill itself moves
for cfg in ["32:32", "48:48", "60:60"]:
    kls = []
    for i in range(6):
        a, b = f"{d}/{i}-cpu-{cfg}.f32", f"{d}/{i}-cpu-0:0.f32"
        if os.path.exists(a) and os.path.exists(b):
            (ph, _), (pf, _) = probs(a), probs(b)
            kls.append(float(np.sum(ph * (np.log(np.maximum(ph, 1e-300)) - np.log(np.maximum(pf, 1e-300))))))
    rows.append({"local_heavy": cfg, "kl_h2o_vs_full_on_cpu": kls})
print(json.dumps(rows, indent=1))
for r in rows:
    k = r.get("kl_offloaded_vs_cpu", r.get("kl_h2o_vs_full_on_cpu"))
    what = "offloaded vs CPU" if "kl_offloaded_vs_cpu" in r else "H2O vs full, CPU"
    print(f"{r['local_heavy']:>6} {what:17} KL mean {np.mean(k) if k else float('nan'):.3g} "
          f"max {max(k) if k else float('nan'):.3g} over {len(k)} prompts", file=sys.stderr)
EOF
}

for step in "${steps[@]}"; do
    case $step in
    quality | bench | decode | offload) "$step" ;;
    *) echo "gpu-e2e.sh: unknown step '$step' (quality, bench, decode, offload)" >&2; exit 2 ;;
    esac
done
background_done
echo "== records in $out: $(ls "$out" | tr '\n' ' ')" >&2
