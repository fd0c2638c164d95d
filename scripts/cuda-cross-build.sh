#!/usr/bin/env bash
# Builds h2o-cli with ggml's CUDA backend on a machine with no GPU and no CUDA install, for a GPU
# machine with no Rust (CUDA 13 driver, H100/H200):
#
#   scripts/cuda-cross-build.sh [ARCHS]   # ARCHS: CMake's CUDA architectures, default 90-real
#
# The toolkit comes from PyPI (scripts/cuda-toolkit.sh); the host code is built for x86-64-v3
# (AVX2), the GPU code as machine code for ARCHS, the CUDA runtime linked statically. The build
# goes to target/cuda (its own target directory: a CUDA build of ggml is hundreds of translation
# units, hours on 2 cores the first time, incremental afterwards), and the stripped program,
# compressed, to target/gpu-cli/h2o-cli.xz (what is copied to the GPU machine, with its sha256).
# There it needs the driver and cuBLAS 13: LD_LIBRARY_PATH=<the toolkit's lib64> ./h2o-cli.
set -euo pipefail
cd "$(dirname "$0")/.."

archs="${1:-90-real}"
cuda=$(scripts/cuda-toolkit.sh)
out=target/gpu-cli

CUDA_PATH="$cuda" PATH="$cuda/bin:$PATH" H2O_LLAMA_CUDA_ARCHS="$archs" H2O_LLAMA_MARCH=x86-64-v3 \
    NUM_JOBS="${NUM_JOBS:-$(nproc)}" \
    cargo build --release --features cuda -p h2o-cli --target-dir target/cuda
mkdir -p "$out"
strip -o "$out/h2o-cli" target/cuda/release/h2o-cli
xz -T0 -6 -c "$out/h2o-cli" > "$out/h2o-cli.xz"
(cd "$out" && sha256sum h2o-cli > h2o-cli.sha256 && rm h2o-cli)
echo "== $(du -h "$out/h2o-cli.xz" | cut -f1) in $out/h2o-cli.xz (CUDA archs $archs)" >&2
