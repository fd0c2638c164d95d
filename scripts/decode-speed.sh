#!/usr/bin/env bash
# Decode speed after prompts of several lengths, full or sparse decode, interleaved in one run: for every
# repetition, each configuration runs once as a fresh `h2o-cli --synthetic-prompt N --json` process, in
# turn, so that the machine's drift hits all of them alike. Sparse decode after a long prompt is judged
# against full decode after the same prompt and against decode after a short one, measured in the same run.
#
# Usage: scripts/decode-speed.sh OUT.jsonl REPS CONFIG ...
#   CONFIG is PROMPT:MODE[:BUDGET[:COVERAGE]], e.g. 1024:full 16384:sparse:512 8192:sparse:2048:0.95
#   env: STEPS (tokens generated, default 256), H2O_CLI (default target/release/h2o-cli),
#        EXTRA (more h2o-cli flags, e.g. "-m gemma3-270m -b 2048")
# Each line of OUT.jsonl is {"rep", "prompt", "decode", "budget", "coverage", "decode_tokens_per_second",
# "decode_keys_per_step", "peak_rss_bytes"}; the table (median steps/s per configuration) goes to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:?usage: scripts/decode-speed.sh OUT.jsonl REPS PROMPT:MODE[:BUDGET[:COVERAGE]] ...}
reps=${2:?repetitions}
shift 2
[[ $# -gt 0 ]] || { echo "decode-speed: name at least one configuration, e.g. 1024:full 16384:sparse:1024" >&2; exit 1; }
bin=${H2O_CLI:-target/release/h2o-cli}
steps=${STEPS:-256}
[[ -x $bin ]] || { echo "decode-speed: no $bin; build it with cargo build --release -p h2o-cli" >&2; exit 1; }

: > "$out"
for rep in $(seq 1 "$reps"); do
    for cfg in "$@"; do
        IFS=: read -r prompt mode budget coverage <<< "$cfg"
        budget=${budget:-1024}
        coverage=${coverage:-1}
        echo "decode-speed: rep $rep/$reps, $cfg" >&2
        # shellcheck disable=SC2086 # EXTRA is words
        rec=$("$bin" --synthetic-prompt "$prompt" -c $((prompt + steps + 64)) -b 4096 --ubatch-size 1024 -t 2 \
            --h2o-local 256 --h2o-heavy 256 --h2o-decode "$mode" --h2o-decode-budget "$budget" \
            --h2o-decode-coverage "$coverage" -n "$steps" --temp 0 --json ${EXTRA:-} 2>/dev/null)
        python3 - "$rep" "$prompt" "$mode" "$budget" "$coverage" "$rec" >> "$out" <<'EOF'
import json, sys
rep, prompt, mode, budget, coverage, rec = sys.argv[1:]
r = json.loads(rec)
print(json.dumps({"rep": int(rep), "prompt": int(prompt), "decode": mode, "budget": int(budget),
                  "coverage": float(coverage), "decode_tokens_per_second": r["decode_tokens_per_second"],
                  "decode_keys_per_step": r.get("decode_keys_per_step"), "peak_rss_bytes": r.get("peak_rss_bytes")}))
EOF
    done
done

python3 - "$out" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
key = lambda r: (r["prompt"], r["decode"], r["budget"], r["coverage"])
print("| prompt | decode | budget | coverage | steps/s (each run) | median | keys a step |")
print("|---:|---|---:|---:|---|---:|---:|")
for k in dict.fromkeys(key(r) for r in runs):
    rs = [r for r in runs if key(r) == k]
    tps = [r["decode_tokens_per_second"] for r in rs]
    keys = rs[0]["decode_keys_per_step"]
    keys = "–" if keys is None else f"{keys:.0f}"
    budget = "–" if k[1] == "full" else k[2]
    cov = "–" if k[1] == "full" else k[3]
    runs_tps = ", ".join(f"{t:.1f}" for t in tps)
    print(f"| {k[0]} | {k[1]} | {budget} | {cov} | {runs_tps} | {statistics.median(tps):.1f} | {keys} |")
EOF
