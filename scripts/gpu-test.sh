#!/usr/bin/env bash
# The GPU proof of the CUDA backend, for a machine with an NVIDIA GPU, nvcc and cmake but no Rust
# (the `device` machines). Two steps:
#
#   scripts/gpu-test.sh pack            # here (needs cargo): the patched llama.cpp and the C++
#                                       # tests into target/gpu/h2o-gpu-src.tar.gz (~6 MB)
#   scripts/gpu-test.sh run [TARBALL]   # there: build llama.cpp + ggml with CUDA (cmake, all
#                                       # cores), then run
#        test-h2o-backends              #   GGML_OP_H2O_ATTN on CUDA against the CPU backend, op by
#                                       #   op (outputs, BF16 scores, memory sets); fails when the
#                                       #   GPU backend does not support the op
#        test-h2o-kv-cache MODEL        #   with H2O_MODEL=FILE.gguf: the H2O state tests
#
# With the device tool: run `scripts/gpu-test.sh pack`, then
#   run(command="bash scripts/gpu-test.sh run", carry=["target/gpu/h2o-gpu-src.tar.gz"])
# Where Rust is available with the GPU, the end-to-end checks are the Rust tests and
# `h2o-cli bench -ngl 99` of a `cargo build --release --features cuda` build (README, CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
tarball_default="$target/gpu/h2o-gpu-src.tar.gz"

case "${1:-}" in
pack)
    tree="$target/gpu/llama.cpp"
    rm -rf "$tree"
    mkdir -p "$target/gpu"
    scripts/patches.sh apply "$tree" > /dev/null
    mkdir -p "$tree/h2o-tests"
    cp tests/cpp/*.cpp "$tree/h2o-tests/"
    tar czf "$tarball_default" -C "$tree" --exclude=.git \
        CMakeLists.txt cmake ggml src include vendor common h2o-tests
    echo "packed $(du -h "$tarball_default" | cut -f1) into $tarball_default" >&2
    ;;
run)
    tarball="${2:-$tarball_default}"
    [ -f "$tarball" ] || { echo "gpu-test.sh: $tarball not found: run 'scripts/gpu-test.sh pack' first (and carry it)" >&2; exit 1; }
    command -v nvcc > /dev/null || { echo "gpu-test.sh: nvcc not found: this step needs the CUDA toolkit" >&2; exit 1; }
    command -v cmake > /dev/null || { echo "gpu-test.sh: cmake not found" >&2; exit 1; }
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    work="${TMPDIR:-/tmp}/h2o-gpu"
    rm -rf "$work"
    mkdir -p "$work/src"
    tar xzf "$tarball" -C "$work/src"
    jobs=$(nproc)
    echo "== cmake: llama.cpp + ggml with CUDA (-j $jobs)" >&2
    cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF > "$work/cmake.log"
    cmake --build "$work/build" -j "$jobs" --target llama > "$work/build.log" 2>&1 \
        || { tail -40 "$work/build.log"; exit 1; }
    cuda_lib="$(dirname "$(dirname "$(command -v nvcc)")")/lib64"
    libs=(
        "$work/build/src/libllama.a" "$work/build/ggml/src/libggml.a"
        "$work/build/ggml/src/ggml-cuda/libggml-cuda.a" "$work/build/ggml/src/libggml-cpu.a"
        "$work/build/ggml/src/libggml-base.a"
        -L"$cuda_lib" -L"$cuda_lib/stubs" -lcudart -lcublas -lcublasLt -lcuda -fopenmp -lpthread -ldl -lm
    )
    includes=(-I"$work/src/include" -I"$work/src/src" -I"$work/src/ggml/include" -I"$work/src/ggml/src")
    status=0
    for t in test-h2o-backends test-h2o-kv-cache; do
        echo "== building $t" >&2
        g++ -std=c++17 -O2 "${includes[@]}" "$work/src/h2o-tests/$t.cpp" "${libs[@]}" -o "$work/$t"
    done
    echo "== test-h2o-backends" >&2
    "$work/test-h2o-backends" || status=1
    if [ -n "${H2O_MODEL:-}" ]; then
        echo "== test-h2o-kv-cache $H2O_MODEL" >&2
        "$work/test-h2o-kv-cache" "$H2O_MODEL" || status=1
    else
        echo "== test-h2o-kv-cache: skipped (set H2O_MODEL=FILE.gguf)" >&2
    fi
    exit $status
    ;;
*)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
