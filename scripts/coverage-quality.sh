#!/usr/bin/env bash
# Quality of coverage selection against the hybrid on the kinds of text of scripts/study-texts.sh:
# one window per text and length (-b = -c, so the dense tail is the window's last 64 tokens),
# S = 1024, L = H = 256, each configuration scored against full attention on the same window.
# One JSON record per text and length in OUT (default docs/results/coverage), then the table
# (scripts/quality-table.py) on stdout. Records already in OUT are kept, so an interrupted run
# resumes where it stopped.
#
#   scripts/coverage-quality.sh [OUT] [LENGTHS] [TEXTS]
#     LENGTHS  comma-separated token counts (default 4096,8192)
#     TEXTS    space-separated kinds (default: techdoc code manual licence prose fiction)
#   ABLATE=...   the configurations besides the hybrid (default: coverage with 4, 8, 16 samples)
#   MODEL=gemma3-270m   another model (records named after it)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/coverage}
lengths=${2:-4096,8192}
texts=${3:-techdoc code manual licence prose fiction}
ablate=${ABLATE:-256:256:coverage:4:64:4,256:256:coverage:4:64:8,256:256:coverage:4:64:16}
model_args=()
tag=smollm2
if [ -n "${MODEL:-}" ]; then
    model_args=(-m "$MODEL")
    tag=$(basename "$MODEL" .gguf)
fi
mkdir -p "$out"
[ -f target/texts/techdoc.txt ] || scripts/study-texts.sh target/texts >/dev/null
cargo build --release -q -p h2o-cli
records=()
for n in ${lengths//,/ }; do
    for t in $texts; do
        f="$out/ppl-$tag-$t-$n.json"
        records+=("$f")
        [ -s "$f" ] && continue
        echo "perplexity: $tag $t $n ($(date -u +%H:%M))" >&2
        ./target/release/h2o-cli perplexity -f "target/texts/$t.txt" "${model_args[@]}" -c "$n" -b "$n" \
            --ubatch-size 1024 --chunks 1 --h2o-local 256 --h2o-heavy 256 --ablate "$ablate" --json > "$f.tmp"
        mv "$f.tmp" "$f"
    done
done
scripts/quality-table.py "${records[@]}"
