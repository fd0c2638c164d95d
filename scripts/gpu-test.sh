#!/usr/bin/env bash
# The GPU proof and speed runs of the CUDA backend, for a machine with an NVIDIA GPU, nvcc and cmake but no
# Rust (a GPU machine with nvcc, cmake and python). Here (needs cargo, pip):
#
#   scripts/gpu-test.sh pack [MODEL]  # the patched llama.cpp, the C++ tests and harnesses and the
#                                # synthetic-model script (h2o-gpu-src.tar.gz, ~6 MB), the default model's
#                                # tokenizer as a vocab-only GGUF (vocab.gguf, 1.7 MB), the gguf package's
#                                # wheel and the study texts (texts.tar.xz) into target/gpu; the default
#                                # model in two halves with its sha256, one in target/gpu-a and one in
#                                # target/gpu-b (47 MB each, so that each fits one 64 MiB transfer)
#   scripts/cuda-cross-build.sh  # h2o-cli with CUDA, for the GPU machine, into target/gpu-cli (the
#                                # end-to-end runs of scripts/gpu-e2e.sh need it)
#
# There (each step keeps what it made, and every file it was carried, in $TMPDIR/h2o-gpu, so that a later
# call of the same warm machine needs to carry only what it adds):
#
#   scripts/gpu-test.sh keep     # keeps what this call carried in $TMPDIR/h2o-gpu, for the calls after it
#   scripts/gpu-test.sh start    # at once: keeps what this call carried; checks that the carried h2o-cli
#                                # runs there; then in the background (it outlives the call) the op's
#                                # checks (`backends`, under memcheck, racecheck and synccheck, and
#                                # `kernels`, into $TMPDIR/h2o-gpu/op-checks.log) and the synthetic models
#                                # of the speed runs; `gpu-test.sh wait` waits for them
#   scripts/gpu-test.sh kernels  # nvcc alone, ~30 s: tests/cpp/bench-h2o-cuda-op.cu, the H2O kernels against
#                                # each other, the memory-set rule and (coverage selection) the tile-memory rule,
#                                # and their time per layer-chunk
#   scripts/gpu-test.sh build    # cmake: llama.cpp + ggml with CUDA for the native GPU (all cores, ~5 min on
#                                # 16), the three test programs and the prefill bench
#   scripts/gpu-test.sh backends [TOOL]
#                                # ggml alone with CUDA and no flash-attention kernels (a build of its own,
#                                # ~2 min on 16), then test-h2o-backends (no model, no llama); TOOL runs it
#                                # under compute-sanitizer: memcheck, racecheck, synccheck or initcheck;
#                                # `decode-speed` instead times the decode op (tests/cpp/bench-h2o-decode.cpp)
#   scripts/gpu-test.sh run      # build if needed, then
#        test-h2o-backends       #   GGML_OP_H2O_ATTN and GGML_OP_H2O_DECODE on CUDA against the CPU backend
#        test-h2o-offload MODEL  #   the H2O prefill with -ngl 99 against the CPU: placement, logits, memory
#                                #   sets (forced equal call by call, and the near-tie bound), N <= S
#        test-h2o-kv-cache MODEL #   the H2O state tests
#      MODEL is $H2O_MODEL, or the default model assembled from its two halves (sha256 checked)
#   scripts/gpu-test.sh bench SHAPE[:LAYERS] LENGTHS [OUT.json]
#                                # prefill speed and GPU memory, H2O against stock (H2O off, the same build),
#                                # -b 4096 -ub 1024, L = H = 256, -ngl 99, medians of 3: SHAPE is `default`
#                                # (the default model) or a synthetic shape of scripts/synthetic-model.py
#                                # (qwen2.5-1.5b, llama-3-8b; random F16 weights, made there in a minute)
#   scripts/gpu-test.sh model SHAPE[:LAYERS]
#                                # prints the path of that model, made first if needed (`default`: the
#                                # default model assembled from its halves)
#
# Where files reach the GPU machine in parts of at most 64 MiB, each kept only while the next command follows
# soon, three commands in a row (docs/development.md has them):
#   1. `start`, with target/gpu and target/gpu-cli copied over;  2. `keep`, with target/gpu-a;
#   3. `keep` and scripts/gpu-e2e.sh (which waits for the background checks), with target/gpu-b.
# Where Rust is available with the GPU, the end-to-end checks are the Rust tests and `h2o-cli bench -ngl 99`
# of a `cargo build --release --features cuda` build.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
gpu="$target/gpu"
work="${TMPDIR:-/tmp}/h2o-gpu"

# the gguf package's wheel (scripts/synthetic-model.py pins the same version)
gguf_version=0.17.1
gguf_wheel=gguf-$gguf_version-py3-none-any.whl

# a file carried by this call (in target/gpu or target/gpu-b), or the copy an earlier call of this
# machine kept in $work/carried
carried() {
    local name=$1 dir
    for dir in "$gpu" "$target/gpu-a" "$target/gpu-b" "$target/gpu-cli"; do
        if [ -f "$dir/$name" ]; then
            mkdir -p "$work/carried"
            [ "$dir/$name" -ef "$work/carried/$name" ] || cp -p "$dir/$name" "$work/carried/$name"
        fi
    done
    [ -f "$work/carried/$name" ] && echo "$work/carried/$name"
}

default_model() {
    local aa ab sums
    aa=$(carried model.gguf.part-aa || true)
    ab=$(carried model.gguf.part-ab || true)
    sums=$(carried model.gguf.sha256 || true)
    if [ -n "${H2O_MODEL:-}" ]; then
        echo "$H2O_MODEL"
    elif [ -n "$aa" ] && [ -n "$ab" ] && [ -n "$sums" ]; then
        if [ ! -f "$work/model.gguf" ]; then
            cat "$aa" "$ab" > "$work/model.gguf.tmp"
            (cd "$work" && mv model.gguf.tmp model.gguf && sha256sum -c "$sums" > /dev/null) \
                || { rm -f "$work/model.gguf"; echo "gpu-test.sh: the assembled model does not match model.gguf.sha256: carry both halves from one 'pack'" >&2; exit 1; }
        fi
        echo "$work/model.gguf"
    fi
}

unpack() {
    local tarball stamp
    tarball=$(carried h2o-gpu-src.tar.gz || true)
    stamp="$work/unpacked"
    [ -n "$tarball" ] || { echo "gpu-test.sh: h2o-gpu-src.tar.gz not found: run 'scripts/gpu-test.sh pack' here first and carry $gpu" >&2; exit 1; }
    if [ ! -f "$stamp" ] || [ "$tarball" -nt "$stamp" ]; then
        rm -rf "$work/src" "$work/build" "$work/bin"
        mkdir -p "$work/src" "$work/bin"
        tar xzf "$tarball" -C "$work/src"
        touch "$stamp"
    fi
}

# the model of SHAPE[:LAYERS]: `default` (the default model from its halves), or a synthetic shape of
# synthetic-model.py with random F16 weights, written on first use
model_for() {
    local spec=$1 model shape layers vocab wheel
    if [ "$spec" = default ]; then
        model=$(default_model)
        [ -n "$model" ] || { echo "gpu-test.sh: no default model: carry both halves from 'pack'" >&2; return 1; }
        echo "$model"
        return
    fi
    shape=${spec%%:*}
    layers=${spec#*:}
    [ "$layers" = "$spec" ] && layers=""
    model="$work/${spec//:/-}.gguf"
    if [ ! -f "$model" ]; then
        unpack
        vocab=$(carried vocab.gguf || true)
        wheel=$(carried "$gguf_wheel" || true)
        [ -n "$vocab" ] && [ -n "$wheel" ] || { echo "gpu-test.sh: carry vocab.gguf and $gguf_wheel from 'pack'" >&2; return 1; }
        echo "== writing a $shape-shaped model${layers:+ ($layers layers)} with random weights" >&2
        GGUF_WHEEL="$wheel" python3 "$work/src/h2o-tests/synthetic-model.py" model "$shape" \
            --vocab "$vocab" -o "$model.tmp" ${layers:+--layers "$layers"}
        mv "$model.tmp" "$model"
    fi
    echo "$model"
}

# the carried h2o-cli (scripts/cuda-cross-build.sh), unpacked once, checked against its sha256, behind a
# wrapper that finds cuBLAS in the toolkit there (the program links the CUDA runtime statically)
h2o_cli() {
    local xz sums cuda_lib
    if [ ! -x "$work/cli/h2o-cli" ]; then
        xz=$(carried h2o-cli.xz || true)
        sums=$(carried h2o-cli.sha256 || true)
        [ -n "$xz" ] && [ -n "$sums" ] || { echo "gpu-test.sh: carry target/gpu-cli (scripts/cuda-cross-build.sh)" >&2; return 1; }
        mkdir -p "$work/cli"
        xz -dc "$xz" > "$work/cli/h2o-cli"
        (cd "$work/cli" && sha256sum -c --quiet "$sums") \
            || { rm -rf "$work/cli"; echo "gpu-test.sh: h2o-cli does not match h2o-cli.sha256" >&2; return 1; }
        mv "$work/cli/h2o-cli" "$work/cli/h2o-cli.bin"
        chmod +x "$work/cli/h2o-cli.bin"
        cuda_lib="$(dirname "$(dirname "$(command -v nvcc)")")/lib64"
        printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
            "$cuda_lib" "$work/cli/h2o-cli.bin" > "$work/cli/h2o-cli"
        chmod +x "$work/cli/h2o-cli"
    fi
    echo "$work/cli/h2o-cli"
}

case "${1:-}" in
pack)
    tree="$gpu/llama.cpp"
    rm -rf "$tree"
    mkdir -p "$gpu" "$target/gpu-b"
    scripts/patches.sh apply "$tree" > /dev/null
    mkdir -p "$tree/h2o-tests"
    cp tests/cpp/*.cpp tests/cpp/*.cu scripts/synthetic-model.py "$tree/h2o-tests/"
    tar czf "$gpu/h2o-gpu-src.tar.gz" -C "$tree" --exclude=.git \
        CMakeLists.txt cmake ggml src include vendor common h2o-tests
    rm -rf "$tree"
    echo "packed $(du -h "$gpu/h2o-gpu-src.tar.gz" | cut -f1) into $gpu/h2o-gpu-src.tar.gz" >&2
    # the default model (same lookup as src/models.rs; fetched by `cargo test` or h2o-cli), or $2, in two
    # halves: the first travels with the first call (in target/gpu), the second with the next (target/gpu-b)
    cache="${H2O_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/h2o-llama}"
    model="${2:-$cache/SmolLM2-135M-Instruct.Q4_1.gguf}"
    [ -f "$model" ] || { echo "gpu-test.sh: model not found at $model (run cargo test once to fetch the default model)" >&2; exit 1; }
    mkdir -p "$target/gpu-a"
    rm -f "$gpu"/model.gguf.part-* "$target"/gpu-[ab]/model.gguf.part-*
    split -n 2 -d --additional-suffix= "$model" "$gpu/model.gguf.part-"
    mv "$gpu/model.gguf.part-00" "$target/gpu-a/model.gguf.part-aa"
    mv "$gpu/model.gguf.part-01" "$target/gpu-b/model.gguf.part-ab"
    (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") | awk '{print $1 "  model.gguf"}' > "$gpu/model.gguf.sha256"
    echo "split $(basename "$model") into $target/gpu-a/model.gguf.part-aa and $target/gpu-b/model.gguf.part-ab" >&2
    # the texts of the quality runs (scripts/study-texts.sh)
    [ -f target/texts/techdoc.txt ] || scripts/study-texts.sh target/texts > /dev/null
    tar cJf "$gpu/texts.tar.xz" -C target texts
    # the tokenizer for synthetic models, and the gguf package that writes them (the GPU machine has no network)
    if [ ! -f "$gpu/$gguf_wheel" ]; then
        python3 -m pip download -q --no-deps --only-binary=:all: -d "$gpu" "gguf==$gguf_version"
        [ -f "$gpu/$gguf_wheel" ] || { echo "gpu-test.sh: pip did not fetch $gguf_wheel" >&2; exit 1; }
    fi
    [ -f "$gpu/vocab.gguf" ] || GGUF_WHEEL="$gpu/$gguf_wheel" python3 scripts/synthetic-model.py vocab "$model" "$gpu/vocab.gguf"
    du -ch "$gpu"/* | tail -1 | sed 's/total/in target\/gpu/' >&2
    ;;
kernels)
    unpack
    command -v nvcc > /dev/null || { echo "gpu-test.sh: nvcc not found: this step needs the CUDA toolkit" >&2; exit 1; }
    echo "== nvcc bench-h2o-cuda-op" >&2
    nvcc -std=c++17 -O3 -use_fast_math -gencode=arch=compute_90,code=sm_90 -I"$work/src/ggml/src/ggml-cuda" \
        "$work/src/h2o-tests/bench-h2o-cuda-op.cu" -o "$work/bin/bench-h2o-cuda-op"
    "$work/bin/bench-h2o-cuda-op"
    ;;
backends)
    # ggml alone, in a build of its own: the op's test needs neither llama nor ggml's flash-attention kernels,
    # which are most of a CUDA build's time (GGML_CUDA_FA=OFF)
    unpack
    command -v nvcc > /dev/null || { echo "gpu-test.sh: nvcc not found: this step needs the CUDA toolkit" >&2; exit 1; }
    command -v cmake > /dev/null || { echo "gpu-test.sh: cmake not found" >&2; exit 1; }
    if [ ! -f "$work/build-op/CMakeCache.txt" ]; then
        cmake -S "$work/src" -B "$work/build-op" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
            -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native -DGGML_NATIVE=ON -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF > "$work/cmake-op.log" \
            || { tail -30 "$work/cmake-op.log"; exit 1; }
    fi
    if [ ! -x "$work/bin/bench-h2o-decode" ] || [ "$work/unpacked" -nt "$work/bin/bench-h2o-decode" ]; then
        jobs=$(nproc)
        echo "== cmake --build: ggml with CUDA, no flash attention (-j $jobs)" >&2
        start=$SECONDS
        cmake --build "$work/build-op" -j "$jobs" --target ggml > "$work/build-op.log" 2>&1 \
            || { tail -40 "$work/build-op.log"; exit 1; }
        echo "   built in $((SECONDS - start)) s" >&2
        cuda_lib="$(dirname "$(dirname "$(command -v nvcc)")")/lib64"
        for t in test-h2o-backends bench-h2o-decode; do
            g++ -std=c++17 -O2 -I"$work/src/ggml/include" -I"$work/src/ggml/src" "$work/src/h2o-tests/$t.cpp" \
                "$work/build-op/ggml/src/libggml.a" "$work/build-op/ggml/src/ggml-cuda/libggml-cuda.a" \
                "$work/build-op/ggml/src/libggml-cpu.a" "$work/build-op/ggml/src/libggml-base.a" \
                -L"$cuda_lib" -L"$cuda_lib/stubs" -lcudart -lcublas -lcublasLt -lcuda -fopenmp -lpthread -ldl -lm \
                -o "$work/bin/$t"
        done
    fi
    if [ "${2:-}" = decode-speed ]; then
        exec "$work/bin/bench-h2o-decode"
    fi
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    echo "== test-h2o-backends" >&2
    case "${2:-}" in
    memcheck|racecheck|synccheck|initcheck)
        exec compute-sanitizer --tool "$2" --print-limit 100 "$work/bin/test-h2o-backends" ;;
    esac
    exec "$work/bin/test-h2o-backends"
    ;;
build|run)
    unpack
    if [ ! -f "$work/build/CMakeCache.txt" ]; then
        command -v nvcc > /dev/null || { echo "gpu-test.sh: nvcc not found: this step needs the CUDA toolkit" >&2; exit 1; }
        command -v cmake > /dev/null || { echo "gpu-test.sh: cmake not found" >&2; exit 1; }
        # no app/ in the packed tree (LLAMA_BUILD_APP), and no NCCL: one GPU, and the test programs are linked by
        # hand below
        cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
            -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native -DGGML_NATIVE=ON -DGGML_CUDA_NCCL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF > "$work/cmake.log" \
            || { tail -30 "$work/cmake.log"; exit 1; }
    fi
    if [ ! -x "$work/bin/bench-h2o-prefill" ] || [ "$work/unpacked" -nt "$work/bin/bench-h2o-prefill" ]; then
        jobs=$(nproc)
        echo "== cmake --build: llama.cpp + ggml with CUDA (-j $jobs)" >&2
        start=$SECONDS
        cmake --build "$work/build" -j "$jobs" --target llama > "$work/build.log" 2>&1 \
            || { tail -40 "$work/build.log"; exit 1; }
        echo "   built in $((SECONDS - start)) s" >&2
        cuda_lib="$(dirname "$(dirname "$(command -v nvcc)")")/lib64"
        libs=(
            "$work/build/src/libllama.a" "$work/build/ggml/src/libggml.a"
            "$work/build/ggml/src/ggml-cuda/libggml-cuda.a" "$work/build/ggml/src/libggml-cpu.a"
            "$work/build/ggml/src/libggml-base.a"
            -L"$cuda_lib" -L"$cuda_lib/stubs" -lcudart -lcublas -lcublasLt -lcuda -fopenmp -lpthread -ldl -lm
        )
        includes=(-I"$work/src/include" -I"$work/src/src" -I"$work/src/ggml/include" -I"$work/src/ggml/src")
        for t in test-h2o-backends test-h2o-kv-cache test-h2o-offload bench-h2o-prefill; do
            echo "== building $t" >&2
            g++ -std=c++17 -O2 "${includes[@]}" "$work/src/h2o-tests/$t.cpp" "${libs[@]}" -o "$work/bin/$t"
        done
    fi
    [ "$1" = build ] && { echo "built in $work" >&2; exit 0; }

    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    model=$(default_model)
    status=0
    echo "== test-h2o-backends" >&2
    "$work/bin/test-h2o-backends" || status=1
    if [ -n "$model" ]; then
        echo "== test-h2o-offload $model" >&2
        "$work/bin/test-h2o-offload" "$model" || status=1
        echo "== test-h2o-kv-cache $model" >&2
        "$work/bin/test-h2o-kv-cache" "$model" || status=1
    else
        echo "== test-h2o-offload, test-h2o-kv-cache: no model (carry both halves from 'pack', or set H2O_MODEL=FILE.gguf)" >&2
        status=1
    fi
    exit $status
    ;;
bench)
    spec="${2:?usage: gpu-test.sh bench SHAPE[:LAYERS] LENGTHS [OUT.json]}"
    lengths="${3:?usage: gpu-test.sh bench SHAPE[:LAYERS] LENGTHS [OUT.json]}"
    out="${4:-$work/bench-${spec//:/-}.json}"
    [ -x "$work/bin/bench-h2o-prefill" ] || { echo "gpu-test.sh: run 'gpu-test.sh build' first" >&2; exit 1; }
    model=$(model_for "$spec")
    echo "== bench-h2o-prefill $(basename "$model") -p $lengths" >&2
    "$work/bin/bench-h2o-prefill" "$model" -p "$lengths" -r 3 -b 4096 -ub 1024 --h2o-local 256 --h2o-heavy 256 \
        -ngl 99 -fa on --json "$out"
    ;;
model)
    model_for "${2:?usage: gpu-test.sh model SHAPE[:LAYERS]}"
    ;;
cli)
    h2o_cli
    ;;
keep | start)
    mkdir -p "$work"
    for name in h2o-gpu-src.tar.gz vocab.gguf "$gguf_wheel" model.gguf.sha256 texts.tar.xz h2o-cli.xz \
        h2o-cli.sha256 model.gguf.part-aa model.gguf.part-ab; do
        carried "$name" > /dev/null || true
    done
    echo "kept in $work/carried: $(ls "$work/carried" | tr '\n' ' ')" >&2
    [ "$1" = keep ] && exit 0
    cp -p "$0" "$work/gpu-test.sh"
    unpack
    if [ -f "$work/carried/h2o-cli.xz" ]; then
        # that the program runs there at all: a short prompt on the GPU with coverage selection and
        # sparse decode, on a small synthetic model
        cli=$(h2o_cli)
        "$cli" --version
        "$cli" -m "$(model_for smollm2-135m)" --synthetic-prompt 2100 -n 16 -c 4096 --n-gpu-layers 99 -v \
            --ubatch-size 1024 --h2o-local 256 --h2o-heavy 256 --h2o-select coverage --h2o-decode sparse --json \
            2> "$work/smoke.log" || { tail -20 "$work/smoke.log"; echo "gpu-test.sh: h2o-cli failed on the GPU" >&2; }
        grep -i "H2O attention ops\|CUDA0\|error" "$work/smoke.log" | head -5
    fi
    if [ -f "$work/carried/texts.tar.xz" ]; then
        tar xJf "$work/carried/texts.tar.xz" -C "$work"
    fi
    # in a session of their own, so that they outlive this call; the copy of this script in $work
    # serves later calls too
    rm -f "$work/background.done"
    setsid bash -c '
        cd "$1"
        {
            for tool in "" racecheck synccheck memcheck; do
                echo "== backends $tool"; CARGO_TARGET_DIR="$2" bash gpu-test.sh backends $tool; echo "rc=$?"
            done
            echo "== kernels"; CARGO_TARGET_DIR="$2" bash gpu-test.sh kernels; echo "rc=$?"
        } > op-checks.log 2>&1 &
        {
            for spec in qwen2.5-1.5b llama-3-8b:8; do
                CARGO_TARGET_DIR="$2" bash gpu-test.sh model "$spec"; echo "rc=$?"
            done
        } > models.log 2>&1 &
        wait
        touch background.done
    ' _ "$work" "$target" < /dev/null > /dev/null 2>&1 &
    echo "started in the background: the op checks ($work/op-checks.log) and the synthetic models ($work/models.log)" >&2
    ;;
wait)
    while [ ! -f "$work/background.done" ]; do sleep 2; done
    cat "$work/models.log"
    cat "$work/op-checks.log"
    ;;
*)
    sed -n '2,45p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
