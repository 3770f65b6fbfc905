#!/bin/bash
# Builds and runs the 3xTF32 product harness on the GPU machine: bash tools/gemm/run.sh OUTDIR
set -e
out=${1:-/tmp/gemm}; mkdir -p $out; d=$(mktemp -d); here=$(cd $(dirname $0) && pwd)
src=$here/gemm_f32x3.cu
echo "" > $d/configs.inc; list=""; n=0
for tile in "32 32 3" "32 64 3" "64 64 2" "32 128 2"; do set -- $tile
  for nk in 1 0; do for epi in 0 1 2; do
    [ $epi -ne 0 ] && [ "$1x$2" != "32x64" ] && continue
    name=g_$1x$2_s$3_nk${nk}_e$epi
    cat > $d/$name.cu <<EOT
#define KNAME $name
#define BM $1
#define BN $2
#define STAGES $3
#define B_NK $nk
#define EPI $epi
#include "$src"
extern "C" void launch_$name(const float* A, const float* B, float* C, const float* bias, int M, int N, int K, int lda, int ldb, int ldc, cudaStream_t s) {
  $name<<<dim3((N + BN - 1) / BN, (M + BM - 1) / BM), 128, 0, s>>>(A, B, C, bias, M, N, K, lda, ldb, ldc);
}
EOT
    echo "extern \"C\" void launch_$name(const float*, const float*, float*, const float*, int, int, int, int, int, int, cudaStream_t);" >> $d/configs.inc
    list="$list{\"$name\", $1, $2, $nk, $epi, launch_$name},"; n=$((n+1))
  done; done
done
echo "static Cfg cfgs[] = {$list}; static const int NCFG = $n;" >> $d/configs.inc
cp $here/harness.cu $d/
cd $d
ls g_*.cu | xargs -P 16 -I{} nvcc -O3 -arch=sm_90 -c {} -Xptxas -v -o {}.o 2> $out/ptxas.txt || { cat $out/ptxas.txt; exit 1; }
grep -E "registers|spill" $out/ptxas.txt | sort | uniq -c | head -20
nvcc -O3 -arch=sm_90 harness.cu g_*.o -lcublas -o harness
./harness | tee $out/gemm.txt
