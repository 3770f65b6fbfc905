#!/bin/bash
# Builds and runs the wgmma 3xTF32 product (gemm_wgmma.cu) in the harness on the GPU machine:
#   bash tools/gemm/run_wgmma.sh OUTDIR
set -e
export PATH=/usr/local/cuda/bin:$PATH
out=${1:-/tmp/gemm}; mkdir -p $out; d=$(mktemp -d); here=$(cd $(dirname $0) && pwd)
echo "" > $d/configs.inc; list=""; n=0
# layout nk epi promote
for cfg in "0 1 0 1" "1 1 0 1" "0 0 0 1" "1 0 0 1" "0 1 0 0" "0 1 1 1" "0 1 2 1"; do set -- $cfg
  name=w_l$1_nk$2_e$3_p$4
  cat > $d/$name.cu <<EOT
#define KNAME k_$name
#define LAUNCHER launch_$name
#define BN 64
#define LAYOUT $1
#define B_NK $2
#define EPI $3
#define PROMOTE $4
#include "$here/gemm_wgmma.cu"
EOT
  echo "extern \"C\" void launch_$name(const float*, const float*, float*, const float*, int, int, int, int, int, int, cudaStream_t);" >> $d/configs.inc
  list="$list{\"$name\", 64, 64, $2, $3, launch_$name},"; n=$((n+1))
done
echo "static Cfg cfgs[] = {$list}; static const int NCFG = $n;" >> $d/configs.inc
cp $here/harness.cu $d/
cd $d
ls w_*.cu | xargs -P 16 -I{} nvcc -O3 -gencode arch=compute_90a,code=sm_90a -c {} -Xptxas -v -o {}.o 2> $out/ptxas.txt || { grep -v "^ptxas info" $out/ptxas.txt | head -40; exit 1; }
grep -E "registers|spill" $out/ptxas.txt | sort | uniq -c | head -20
nvcc -O3 -gencode arch=compute_90a,code=sm_90a harness.cu w_*.o -lcublas -o harness
./harness | tee $out/gemm.txt
