#!/bin/bash
# On the GPU machine: bash tools/stream/run.sh
set -e
cd "$(dirname "$0")"; export PATH=/usr/local/cuda/bin:$PATH
d=$(mktemp -d)
nvcc -O3 -arch=sm_90 harness.cu -o $d/h && $d/h "$@"
