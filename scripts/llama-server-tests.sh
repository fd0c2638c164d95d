#!/usr/bin/env bash
# Runs llama.cpp's own server tests (pytest over HTTP, tools/server/tests/unit/ of a llama.cpp
# checkout) against h2o-server on the default model, unmodified: scripts/llama-server-wrapper.py
# maps llama-server's command line (the suite's tiny HuggingFace models give way to the default
# model). The tests are not part of this repository; give a checkout of ggml-org/llama.cpp:
#
#   scripts/llama-server-tests.sh ~/src/llama.cpp                 # the files docs/server.md counts
#   scripts/llama-server-tests.sh ~/src/llama.cpp unit/test_tool_call.py -k tiny_fast
#   H2O_SERVER_ARGS="--h2o-local 16 --h2o-heavy 16" scripts/llama-server-tests.sh ~/src/llama.cpp
#
# Copies tools/server/tests, models/templates and tools/mtmd/test-1.jpeg into OUT_DIR
# (target/llama-server-tests), as the suite reads the last two through ../../../; installs pytest,
# openai and wget into a virtual environment there; builds h2o-server (SERVER_BIN skips that);
# runs pytest without the slow tests, its summary on stdout and the whole log in OUT_DIR/pytest.log.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
upstream=${1:?"usage: $0 LLAMA_CPP_DIR [pytest arguments]"}
shift
[ -d "$upstream/tools/server/tests/unit" ] || {
    echo "$upstream has no tools/server/tests/unit: give a checkout of ggml-org/llama.cpp" >&2
    exit 2
}
out=${OUT_DIR:-$root/target/llama-server-tests}
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    files=(unit/test_basic.py unit/test_tokenize.py unit/test_completion.py
           unit/test_chat_completion.py unit/test_security.py unit/test_ctx_shift.py
           unit/test_tool_call.py)
fi

rm -rf "$out/tree"
mkdir -p "$out/tree/tools/server" "$out/tree/models" "$out/tree/tools/mtmd"
cp -r "$upstream/tools/server/tests" "$out/tree/tools/server/tests"
cp -r "$upstream/models/templates" "$out/tree/models/templates"
cp "$upstream/tools/mtmd/test-1.jpeg" "$out/tree/tools/mtmd/" 2>/dev/null || true

if [ ! -x "$out/venv/bin/python" ]; then
    echo "llama-server-tests: installing pytest, openai and wget into $out/venv" >&2
    python3 -m venv "$out/venv"
    "$out/venv/bin/pip" install -q pytest openai wget requests
fi

server=${SERVER_BIN:-}
if [ -z "$server" ]; then
    echo "llama-server-tests: building h2o-server" >&2
    cargo build --release -p h2o-server --manifest-path "$root/Cargo.toml" >&2
    server=$root/target/release/h2o-server
fi
server=$(realpath "$server") # the tests run from their own folder

cd "$out/tree/tools/server/tests"
echo "llama-server-tests: running ${files[*]} (log: $out/pytest.log)" >&2
status=0
H2O_SERVER=$server LLAMA_SERVER_BIN_PATH=$root/scripts/llama-server-wrapper.py \
    "$out/venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider -rfEs "${files[@]}" \
    >"$out/pytest.log" 2>&1 || status=$?
grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$out/pytest.log" || true
exit $status
