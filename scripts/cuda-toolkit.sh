#!/usr/bin/env bash
# Installs CUDA 13's compiler, runtime and cuBLAS from PyPI into target/cuda-toolkit (once; about
# 1 GB unpacked, mostly cuBLAS) and prints the toolkit's root, nvidia/cu13. Used by
# cuda-compile-check.sh and cuda-cross-build.sh on machines with no CUDA install.
#
# NVIDIA publishes the CUDA 13 compiler as PyPI wheels (nvidia-cuda-nvcc, -crt, -runtime, nvvm,
# cccl, cublas) that unpack into one toolkit tree. The CUDA 12 wheels (nvidia-cuda-nvcc-cu12)
# ship ptxas but no nvcc driver or cicc, so they cannot compile anything; the CUDA 13 ones can.
#
# For linking as well as compiling, the tree gets what an installed toolkit has and the wheels
# lack: the unversioned library names (libcublas.so -> libcublas.so.13, ...) and a stub of the
# driver library (lib/stubs/libcuda.so) that exports every function cuda.h declares.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
toolkit_dir="$PWD/$target/cuda-toolkit"
cuda="$toolkit_dir/nvidia/cu13"

# exact versions, so that every machine compiles with the same toolkit
wheels=(
    nvidia-cuda-nvcc==13.5.37
    nvidia-cuda-crt==13.5.37
    nvidia-cuda-runtime==13.5.37
    nvidia-nvvm==13.5.37
    nvidia-cuda-cccl==13.3.5.0.6
    nvidia-cublas==13.10.0.20
)
if [ ! -x "$cuda/bin/nvcc" ] || [ ! -f "$toolkit_dir/.complete" ]; then
    echo "== installing the CUDA 13 compiler and headers from PyPI into $toolkit_dir" >&2
    rm -rf "$toolkit_dir"
    python3 -m pip install --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --target "$toolkit_dir" "${wheels[@]}"
    touch "$toolkit_dir/.complete"
fi

if [ ! -f "$cuda/lib/stubs/libcuda.so" ]; then
    for lib in "$cuda"/lib/lib*.so.*; do
        name=$(basename "$lib")
        ln -sf "$name" "$cuda/lib/${name%%.so.*}.so"
    done
    # the driver API's functions as cuda.h declares them after its macros (cuMemGetInfo is
    # cuMemGetInfo_v2, ...), each defined to fail: a stub to link against, never to run
    mkdir -p "$cuda/lib/stubs"
    echo '#include <cuda.h>' | gcc -E -P -I"$cuda/include" -x c - \
        | grep -oE '^(extern )?CUresult +cu[A-Za-z0-9_]+ *\(' \
        | sed -E 's/.*CUresult +(cu[A-Za-z0-9_]+).*/\1/' | sort -u \
        | awk '{print "int " $1 "(void) { return 999; }"}' > "$cuda/lib/stubs/libcuda-stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib/stubs/libcuda.so" "$cuda/lib/stubs/libcuda-stub.c"
fi
echo "$cuda"
