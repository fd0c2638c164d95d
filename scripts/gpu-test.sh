#!/usr/bin/env bash
# The GPU proof of the CUDA backend, for a machine with an NVIDIA GPU, nvcc and cmake but no Rust
# (the `device` machines). Here (needs cargo):
#
#   scripts/gpu-test.sh pack [MODEL]  # the patched llama.cpp and the C++ tests into
#                                # target/gpu/h2o-gpu-src.tar.gz (~6 MB), and the default model in
#                                # two halves, target/gpu/model.gguf.part-aa and -ab (47 MB each, so
#                                # that each fits one 64 MiB transfer), with its sha256
#
# There:
#
#   scripts/gpu-test.sh build    # cmake: llama.cpp + ggml with CUDA for the native GPU (all cores),
#                                # and the three test programs; kept in $TMPDIR/h2o-gpu, so a second
#                                # call only relinks
#   scripts/gpu-test.sh run      # build if needed, then run
#        test-h2o-backends       #   GGML_OP_H2O_ATTN on CUDA against the CPU backend, op by op
#                                #   (outputs, BF16 scores, memory sets); fails when the GPU backend
#                                #   does not support the op
#        test-h2o-offload MODEL  #   the H2O prefill with -ngl 99 against the CPU: every H2O op on the
#                                #   GPU, logits and memory sets, and N <= S against full attention
#        test-h2o-kv-cache MODEL #   the H2O state tests
#      MODEL is $H2O_MODEL, or target/gpu/model.gguf assembled from the two parts (sha256 checked);
#      without either, the two model tests are skipped and the run fails.
#
# With the device tool (each call carries at most 64 MiB, and files stay while the machine is warm):
#   run(command="bash scripts/gpu-test.sh build", carry=["target/gpu/h2o-gpu-src.tar.gz", "target/gpu/model.gguf.part-aa", "target/gpu/model.gguf.sha256"])
#   run(command="bash scripts/gpu-test.sh run", carry=["target/gpu/model.gguf.part-ab"])
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
    # the default model (same lookup as src/default_model.rs; fetched by `cargo test` or h2o-cli),
    # or $2, in two halves
    cache="${H2O_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/h2o-llama}"
    model="${2:-$cache/SmolLM2-135M-Instruct.Q4_1.gguf}"
    [ -f "$model" ] || { echo "gpu-test.sh: model not found at $model (run cargo test once to fetch the default model)" >&2; exit 1; }
    rm -f "$target"/gpu/model.gguf.part-*
    split -n 2 -d --additional-suffix= "$model" "$target/gpu/model.gguf.part-"
    mv "$target/gpu/model.gguf.part-00" "$target/gpu/model.gguf.part-aa"
    mv "$target/gpu/model.gguf.part-01" "$target/gpu/model.gguf.part-ab"
    (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") | awk '{print $1 "  model.gguf"}' > "$target/gpu/model.gguf.sha256"
    echo "split $(basename "$model") into $target/gpu/model.gguf.part-aa and -ab" >&2
    ;;
build|run)
    work="${TMPDIR:-/tmp}/h2o-gpu"
    tarball="$tarball_default"
    stamp="$work/unpacked"
    # unpack and configure once per tarball; the build itself is incremental, so a call cut off by a
    # time limit can simply be repeated
    if [ ! -f "$stamp" ] || { [ -f "$tarball" ] && [ "$tarball" -nt "$stamp" ]; }; then
        [ -f "$tarball" ] || { echo "gpu-test.sh: $tarball not found: run 'scripts/gpu-test.sh pack' first (and carry it)" >&2; exit 1; }
        command -v nvcc > /dev/null || { echo "gpu-test.sh: nvcc not found: this step needs the CUDA toolkit" >&2; exit 1; }
        command -v cmake > /dev/null || { echo "gpu-test.sh: cmake not found" >&2; exit 1; }
        rm -rf "$work"
        mkdir -p "$work/src"
        tar xzf "$tarball" -C "$work/src"
        cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
            -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native -DGGML_NATIVE=ON \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF > "$work/cmake.log"
        touch "$stamp"
    fi
    if [ ! -x "$work/test-h2o-offload" ] || [ "$stamp" -nt "$work/test-h2o-offload" ]; then
        jobs=$(nproc)
        echo "== cmake --build: llama.cpp + ggml with CUDA (-j $jobs)" >&2
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
        for t in test-h2o-backends test-h2o-kv-cache test-h2o-offload; do
            echo "== building $t" >&2
            g++ -std=c++17 -O2 "${includes[@]}" "$work/src/h2o-tests/$t.cpp" "${libs[@]}" -o "$work/$t"
        done
    fi
    [ "$1" = build ] && { echo "built in $work" >&2; exit 0; }

    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    model="${H2O_MODEL:-}"
    if [ -z "$model" ] && [ -f "$target/gpu/model.gguf.part-aa" ] && [ -f "$target/gpu/model.gguf.part-ab" ]; then
        model="$work/model.gguf"
        sums="$(cd "$target/gpu" && pwd)/model.gguf.sha256"
        cat "$target/gpu/model.gguf.part-aa" "$target/gpu/model.gguf.part-ab" > "$model"
        (cd "$work" && sha256sum -c "$sums" > /dev/null) \
            || { echo "gpu-test.sh: the assembled model does not match $target/gpu/model.gguf.sha256: carry both halves from one 'pack'" >&2; exit 1; }
    fi
    status=0
    echo "== test-h2o-backends" >&2
    "$work/test-h2o-backends" || status=1
    if [ -n "$model" ]; then
        echo "== test-h2o-offload $model" >&2
        "$work/test-h2o-offload" "$model" || status=1
        echo "== test-h2o-kv-cache $model" >&2
        "$work/test-h2o-kv-cache" "$model" || status=1
    else
        echo "== test-h2o-offload, test-h2o-kv-cache: no model (carry both halves from 'pack', or set H2O_MODEL=FILE.gguf)" >&2
        status=1
    fi
    exit $status
    ;;
*)
    sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
