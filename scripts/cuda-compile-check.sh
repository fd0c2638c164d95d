#!/usr/bin/env bash
# Compile-checks the CUDA side of engine/ and the hooks on a machine with no GPU and no CUDA install.
#
# The toolkit comes from PyPI (scripts/cuda-toolkit.sh, once: ~500 MB to download, 1 GB
# unpacked, in target/cuda-toolkit). This script adds engine/ and applies the hooks to the
# pinned llama.cpp in target/cuda-check/llama.cpp and compiles the CUDA translation units they
# add or change for the GPUs in CUDA_ARCHS (default 90: H100/H200), with the flags ggml's CMake
# uses. It runs nothing: the GPU run is scripts/gpu-test.sh on a machine with a GPU.
#
#   scripts/cuda-compile-check.sh          # h2o-attn.cu, h2o-decode.cu and ggml-cuda.cu: a few minutes
#   scripts/cuda-compile-check.sh --all    # every unit of ggml-cuda: hours on 2 cores
#   scripts/cuda-compile-check.sh --cubin DIR  # also the H2O units' device code as cubins in DIR
#   CUDA_ARCHS="80;90" scripts/cuda-compile-check.sh
#
# --cubin is for changes that should not change the machine code (a kernel split into functions, a
# header moved): run it before and after, then `cmp` the cubins; identical files run identically on
# every GPU of those architectures (docs/development.md).
#
# Not part of CI: it downloads the toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."

all=0
cubin_dir=""
while [ $# -gt 0 ]; do
    case "$1" in
    --all) all=1 ;;
    --cubin) [ $# -ge 2 ] || { echo "cuda-compile-check.sh: --cubin needs a directory" >&2; exit 2; }
             cubin_dir="$2"; shift ;;
    *) echo "cuda-compile-check.sh: unknown argument $1 (--all, --cubin DIR)" >&2; exit 2 ;;
    esac
    shift
done
target="${CARGO_TARGET_DIR:-target}"
cuda=$(scripts/cuda-toolkit.sh)
archs="${CUDA_ARCHS:-90}"

"$cuda/bin/nvcc" --version | tail -2 >&2

tree="$target/cuda-check/llama.cpp"
rm -rf "$tree"
mkdir -p "$(dirname "$tree")"
echo "== engine/ and the hooks onto the pinned llama.cpp in $tree" >&2
scripts/patches.sh apply "$tree" > /dev/null

gencode=()
IFS=';' read -ra arch_list <<< "$archs"
for a in "${arch_list[@]}"; do
    gencode+=("--generate-code=arch=compute_$a,code=[compute_$a,sm_$a]")
done

# what ggml/src/ggml-cuda/CMakeLists.txt passes for a default build
common=(
    -std=c++17 -O3 -DNDEBUG -use_fast_math -extended-lambda --compiler-options=-fPIC
    -DGGML_USE_CUDA -DGGML_CUDA_USE_GRAPHS -DGGML_CUDA_PEER_MAX_BATCH_SIZE=128
    -DGGML_SCHED_MAX_COPIES=4 -D_GNU_SOURCE -D_XOPEN_SOURCE=600
    -I"$tree/ggml/include" -I"$tree/ggml/src" -I"$tree/ggml/src/ggml-cuda"
)
flags=("${common[@]}" "${gencode[@]}")

units=("$tree/ggml/src/ggml-cuda/h2o-attn.cu" "$tree/ggml/src/ggml-cuda/h2o-decode.cu" "$tree/ggml/src/ggml-cuda/ggml-cuda.cu")
if [ "$all" = 1 ]; then
    mapfile -t units < <(find "$tree/ggml/src/ggml-cuda" -name '*.cu' | sort)
fi
out="$target/cuda-check/obj"
mkdir -p "$out"
n=0
for u in "${units[@]}"; do
    n=$((n + 1))
    echo "== [$n/${#units[@]}] nvcc ${u#"$tree/"} (sm_${archs//;/, sm_})" >&2
    start=$SECONDS
    "$cuda/bin/nvcc" "${flags[@]}" -c "$u" -o "$out/$(basename "$u").o"
    echo "   ok in $((SECONDS - start)) s" >&2
done
if [ -n "$cubin_dir" ]; then
    mkdir -p "$cubin_dir"
    for a in "${arch_list[@]}"; do
        for u in h2o-attn h2o-decode; do
            "$cuda/bin/nvcc" "${common[@]}" -arch="sm_$a" -cubin "$tree/ggml/src/ggml-cuda/$u.cu" \
                -o "$cubin_dir/$u.sm_$a.cubin"
            echo "   $cubin_dir/$u.sm_$a.cubin" >&2
        done
    done
fi
echo "== CUDA compile check passed: ${#units[@]} unit(s) for sm_${archs//;/, sm_}" >&2
