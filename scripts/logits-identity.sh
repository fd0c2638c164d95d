#!/usr/bin/env bash
# Proves that a change of the engine changes no result: the next-token logits after a prompt
# (`--logits-out`) and the greedy text of a sparse decode, for full attention and every
# selection policy, on three kinds of text (the first 9,000 bytes of each: about 2K tokens,
# four chunks of 512) and two models, written by one h2o-cli build and compared with another's.
#
#   scripts/logits-identity.sh run BIN OUTDIR    # write BIN's outputs into OUTDIR
#   scripts/logits-identity.sh compare DIR DIR   # cmp every output; exit 1 if any differs
#
# Typical use: keep a copy of target/release/h2o-cli before the change, build after it, `run`
# both, `compare`. The texts come from scripts/study-texts.sh (target/texts). About 7 minutes a
# run on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

texts=(techdoc code fiction)
models=(default gemma3-270m)

run() {
    local bin=$1 out=$2 model t
    [ -x "$bin" ] || { echo "logits-identity.sh: $bin is not an executable" >&2; exit 2; }
    [ -f target/texts/techdoc.txt ] || scripts/study-texts.sh target/texts
    mkdir -p "$out/texts"
    for t in "${texts[@]}"; do head -c 9000 "target/texts/$t.txt" >"$out/texts/$t.txt"; done
    local h2o=(--h2o-local 128 --h2o-heavy 128)
    for model in "${models[@]}"; do
        local m=()
        [ "$model" = default ] || m=(-m "$model")
        for t in "${texts[@]}"; do
            one() {
                local name=$1
                shift
                echo "== $model $t $name" >&2
                "$bin" "${m[@]}" -f "$out/texts/$t.txt" -c 4096 -b 4096 --ubatch-size 512 -t 2 --temp 0 \
                    --logits-out "$out/$model-$t-$name.logits" "$@" >"$out/$model-$t-$name.txt" 2>/dev/null \
                    || { echo "logits-identity.sh: $bin failed on $model $t $name" >&2; exit 1; }
            }
            one full -n 0
            one seed "${h2o[@]}" -n 0 --h2o-select h2o  # the seed rule by its old name, which every build takes
            one hybrid "${h2o[@]}" -n 0 --h2o-select hybrid
            one coverage "${h2o[@]}" -n 0 --h2o-select coverage
            one coverage-sketch "${h2o[@]}" -n 0 --h2o-select coverage --h2o-tile-sketch 4
            one decode "${h2o[@]}" -n 24 --h2o-select coverage --h2o-decode sparse --h2o-decode-budget 256
        done
    done
}

compare() {
    local a=$1 b=$2 n=0 bad=0 f name
    for f in "$a"/*.logits "$a"/*-decode.txt; do
        [ -e "$f" ] || continue
        name=$(basename "$f")
        n=$((n + 1))
        if ! cmp -s "$f" "$b/$name"; then
            echo "differs: $name" >&2
            bad=$((bad + 1))
        fi
    done
    [ "$n" -gt 0 ] || { echo "logits-identity.sh: no outputs in $a" >&2; exit 2; }
    echo "$n outputs compared, $bad differ"
    [ "$bad" = 0 ]
}

case ${1:-} in
    run) [ $# = 3 ] || { sed -n '2,12p' "$0" >&2; exit 2; }; run "$2" "$3" ;;
    compare) [ $# = 3 ] || { sed -n '2,12p' "$0" >&2; exit 2; }; compare "$2" "$3" ;;
    *) sed -n '2,12p' "$0" >&2; exit 2 ;;
esac
