#!/usr/bin/env bash
# Compiles every generated kernel family with NVRTC on a machine without a GPU: fetches the
# NVRTC library from PyPI (the `nvidia-cuda-nvrtc` wheel of CUDA 13) into target/nvrtc once,
# then runs the sample check (src/backend/cuda/kernels/samples.rs) against it.
#   bash tools/nvrtc/local.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
lib=target/nvrtc
if [ ! -e "$lib/libnvrtc.so.13" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps -d "$tmp" "nvidia-cuda-nvrtc>=13,<14"
  mkdir -p "$lib"
  python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [open(sys.argv[2] + "/" + n.rsplit("/", 1)[1], "wb").write(z.read(n)) for n in z.namelist() if "/lib/libnvrtc" in n]' "$tmp"/*.whl "$lib"
  rm -rf "$tmp"
fi
LD_LIBRARY_PATH="$PWD/$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --lib kernels::samples -- --nocapture
