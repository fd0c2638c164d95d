#!/usr/bin/env bash
# Fuzzes every parser that takes bytes from outside, each for a fixed budget, and keeps what it
# finds as regression cases that `cargo test` replays. Not part of CI (it installs cargo-fuzz and
# runs for minutes).
#
#   scripts/fuzz.sh [SECONDS] [TARGET ...]   # per target, default 300; all three targets by default
#
# Targets:
#   saved_state  libFuzzer (cargo-fuzz, nightly) on the readers of saved states and prompt caches
#                (fuzz/fuzz_targets/saved_state.rs); its corpus is fuzz/corpus/saved_state/, which
#                tests/fuzz_corpus.rs replays
#   server       random requests to every endpoint through the HTTP stack (h2o-server's
#                src/http/fuzz.rs), as many as fit in the budget; failing cases go to
#                h2o-server/tests/fuzz-corpus/
#   cli          random command lines through h2o-cli's flag parsing and checks (h2o-cli's
#                src/fuzz.rs); failing cases go to h2o-cli/tests/fuzz-corpus/
# The executions and findings of each run are printed at the end (docs/library.md, "Saved states").
set -euo pipefail
cd "$(dirname "$0")/.."
budget=${1:-300}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(saved_state server cli)
wanted() { [[ " ${targets[*]} " == *" $1 "* ]]; }
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

if wanted saved_state; then
    if ! cargo +nightly fuzz --version > /dev/null 2>&1; then
        echo "== installing cargo-fuzz" >&2
        cargo +nightly install cargo-fuzz --locked > /dev/null
    fi
    echo "== saved_state: libFuzzer for $budget s" >&2
    mkdir -p fuzz/corpus/saved_state
    # the C++ objects of the main build serve this one too
    export H2O_LLAMA_OBJ_CACHE="$PWD/target/h2o-llama-objcache"
    (cd fuzz && cargo +nightly fuzz run saved_state corpus/saved_state -- \
        -max_total_time="$budget" -max_len=4096 -timeout=5 -print_final_stats=1) \
        > "$log/saved_state.log" 2>&1 || echo "   saved_state: the fuzzer stopped with a finding (fuzz/artifacts/)" >&2
    (cd fuzz && cargo +nightly fuzz cmin saved_state corpus/saved_state) > /dev/null 2>&1 || true
fi

# the request and flag fuzzers run as tests with a case count; measure one batch first, then run
# as many as fit the budget
run_cases() {
    local name=$1 package=$2 test=$3 dir=$4 start cases seed
    mkdir -p "$dir"
    cargo test --release -q -p "$package" --bin "$package" --no-run > /dev/null 2>&1
    start=$(date +%s%N)
    H2O_FUZZ_CASES=2000 H2O_FUZZ_SEED=1 cargo test --release -q -p "$package" --bin "$package" "$test" \
        > /dev/null 2>&1 || true
    cases=$(python3 -c "print(max(2000, int($budget * 2000e9 / ($(date +%s%N) - $start))))")
    seed=$(date +%s)
    echo "== $name: $cases random cases (seed $seed)" >&2
    H2O_FUZZ_CASES=$cases H2O_FUZZ_SEED=$seed H2O_FUZZ_FINDINGS="$PWD/$dir" \
        cargo test --release -p "$package" --bin "$package" "$test" -- --nocapture \
        > "$log/$name.log" 2>&1 || echo "   $name: findings kept in $dir" >&2
}
wanted server && run_cases server h2o-server random_requests h2o-server/tests/fuzz-corpus
wanted cli && run_cases cli h2o-cli random_command_lines h2o-cli/tests/fuzz-corpus

echo "== results" >&2
if wanted saved_state; then
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|SUMMARY|deadly signal|panicked" \
        "$log/saved_state.log" | sed 's/^/saved_state: /' || true
    echo "saved_state: corpus $(ls fuzz/corpus/saved_state | wc -l) files, artifacts $(ls fuzz/artifacts/saved_state 2>/dev/null | wc -l)"
fi
cat "$log"/server.log "$log"/cli.log 2>/dev/null | grep -E "random (requests|command lines)" || true
