#!/bin/bash
# On the GPU machine: bash tools/stream/run.sh  (the harness, then kiln's generated row and
# column kernels as generated and without their column bounds checks)
set -e
cd "$(dirname "$0")"; export PATH=/usr/local/cuda/bin:$PATH
d=$(mktemp -d)
nvcc -O3 -arch=sm_90 harness.cu -o $d/h
cat gen_cols.cu gen_main.inc > $d/c.cu && nvcc -O3 -arch=sm_90 -DCOLS $d/c.cu -o $d/c -lcuda
nochecks() { sed -e 's/if (k0 < K) {/if (true) {/' -e 's/if (KIDX(j) < K)/if (true)/' "$1"; }
cat gen_rows.cu gen_main.inc > $d/r.cu && nvcc -O3 -arch=sm_90 -DNAME='"eager layer_norm as generated"' $d/r.cu -o $d/r -lcuda
(nochecks gen_rows.cu; cat gen_main.inc) > $d/r1.cu && nvcc -O3 -arch=sm_90 -DNAME='"eager layer_norm, no bounds checks"' $d/r1.cu -o $d/r1 -lcuda
cat gen_fused_ln.cu gen_main.inc > $d/f.cu && nvcc -O3 -arch=sm_90 -DFUSED -DNAME='"fused layer_norm as generated"' $d/f.cu -o $d/f -lcuda
(nochecks gen_fused_ln.cu; cat gen_main.inc) > $d/f1.cu && nvcc -O3 -arch=sm_90 -DFUSED -DNAME='"fused layer_norm, no bounds checks"' $d/f1.cu -o $d/f1 -lcuda
for r in 1 2; do $d/c; $d/r; $d/r1; $d/f; $d/f1; done
$d/h | head -${HARNESS_LINES:-4}
