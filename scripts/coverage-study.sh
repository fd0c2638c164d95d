#!/usr/bin/env bash
# The headroom study of memory selection (`h2o-cli coverage`) on every kind of text of
# scripts/study-texts.sh, one JSON record per text and length in OUT (default
# docs/results/coverage). Usage: scripts/coverage-study.sh [OUT] [LENGTHS] [TEXTS]
#   LENGTHS  comma-separated token counts (default 8192)
#   TEXTS    space-separated kinds (default: fiction prose licence manual code techdoc)
# MODEL=gemma3-270m studies Gemma 3's global layers instead of the default model's layers
# 2, 8, 14, 20, 26.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/coverage}
lengths=${2:-8192}
texts=${3:-fiction prose licence manual code techdoc}
mkdir -p "$out"
[ -f target/texts/techdoc.txt ] || scripts/study-texts.sh target/texts >/dev/null
cargo build --release -q -p h2o-cli
model_args=(--layers 2,8,14,20,26)
tag=smollm2
if [ -n "${MODEL:-}" ]; then
    model_args=(-m "$MODEL")
    tag=$MODEL
fi
for n in ${lengths//,/ }; do
    for t in $texts; do
        echo "coverage: $tag $t $n ($(date -u +%H:%M))" >&2
        ./target/release/h2o-cli coverage -f "target/texts/$t.txt" -c "$n" "${model_args[@]}" \
            ${COVERAGE_ARGS:-} --json > "$out/$tag-$t-$n.json"
    done
done
