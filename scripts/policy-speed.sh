#!/usr/bin/env bash
# Prefill speed of several H2O configurations against stock llama.cpp, interleaved in one run:
# for every repetition and prompt length, each configuration runs once as a fresh
# `h2o-cli --synthetic-prompt N --json` process, in turn, so that the machine's drift hits all
# of them alike. `h2o-cli bench` compares one configuration with stock; this compares several
# (the hybrid, coverage selection with a few sample counts) in the same minutes.
#
# Usage: scripts/policy-speed.sh OUT.jsonl "4096 8192" REPS [NAME=FLAGS ...]
#   default configurations: hybrid, coverage/4, coverage/8 (L = H = 256, S = 1024, -b 4096)
#   needs target/stock/release/h2o-cli (cargo build --release -p h2o-cli --features stock
#   --target-dir target/stock) and target/release/h2o-cli.
# Each line of OUT.jsonl is {"rep", "n", "cfg", "rec"} with h2o-cli's JSON record; the table
# (median tok/s per configuration and its ratio to stock) goes to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:?usage: scripts/policy-speed.sh OUT.jsonl \"N ...\" REPS [NAME=FLAGS ...]}
lengths=${2:?prompt lengths, e.g. \"4096 8192\"}
reps=${3:?repetitions}
shift 3
stock=target/stock/release/h2o-cli
h2o=target/release/h2o-cli
[[ -x $stock ]] || { echo "policy-speed: no $stock; build it with cargo build --release -p h2o-cli --features stock --target-dir target/stock" >&2; exit 1; }
[[ -x $h2o ]] || { echo "policy-speed: no $h2o; build it with cargo build --release -p h2o-cli" >&2; exit 1; }

mem="--h2o-local 256 --h2o-heavy 256"
configs=("$@")
if [[ ${#configs[@]} -eq 0 ]]; then
    configs=(
        "hybrid=$mem --h2o-select hybrid"
        "coverage/4=$mem --h2o-select coverage --h2o-tile-samples 4"
        "coverage/8=$mem --h2o-select coverage --h2o-tile-samples 8"
    )
fi

: > "$out"
for rep in $(seq 1 "$reps"); do
    for n in $lengths; do
        for cfg in "stock=" "${configs[@]}"; do
            name=${cfg%%=*}
            flags=${cfg#*=}
            bin=$h2o
            [[ $name == stock ]] && bin=$stock
            echo "policy-speed: rep $rep/$reps, N = $n, $name" >&2
            # shellcheck disable=SC2086 # flags are words
            rec=$("$bin" --synthetic-prompt "$n" -c "$n" -b 4096 --ubatch-size 1024 -t 2 -n 0 --json $flags 2>/dev/null)
            printf '{"rep":%d,"n":%d,"cfg":"%s","rec":%s}\n' "$rep" "$n" "$name" "$rec" >> "$out"
        done
    done
done

python3 - "$out" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
cfgs = list(dict.fromkeys(r["cfg"] for r in runs))
lengths = sorted({r["n"] for r in runs})
tps = lambda n, c: statistics.median(r["rec"]["prefill_tokens_per_second"] for r in runs if r["n"] == n and r["cfg"] == c)
print("| N | " + " | ".join(f"{c} tok/s" for c in cfgs) + " | " + " | ".join(f"{c} / stock" for c in cfgs if c != "stock") + " |")
print("|---:|" + "---:|" * (2 * len(cfgs) - 1))
for n in lengths:
    s = tps(n, "stock")
    print(f"| {n} | " + " | ".join(f"{tps(n, c):.1f}" for c in cfgs) + " | "
          + " | ".join(f"{tps(n, c) / s:.2f}x" for c in cfgs if c != "stock") + " |")
EOF
