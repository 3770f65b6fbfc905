#!/bin/bash
# Builds and runs the wgmma 3xTF32 products (gemm_wgmma.cu, gemm_wgmma3.cu, gemm_wgmma4.cu) in the harness on the
# GPU machine, beside cuBLAS FP32 and a float64 reference:
#   bash tools/gemm/run_wgmma.sh OUTDIR
set -e
export PATH=/usr/local/cuda/bin:$PATH
out=${1:-/tmp/gemm}; mkdir -p $out; d=$(mktemp -d); here=$(cd $(dirname $0) && pwd)
echo "" > $d/configs.inc; list=""; n=0
# gemm_wgmma.cu (V1_CONFIGS): layout,nk,epi,promote
for cfg in ${V1_CONFIGS-0,1,0,1 0,1,0,0}; do set -- ${cfg//,/ }
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
# gemm_wgmma3.cu: bn stages split-target epi overlap (B [N,K] only)
for cfg in ${V3_CONFIGS-64,4,132,0,0 64,4,132,0,1 64,4,264,0,1 64,3,132,0,1 128,2,132,0,0 64,4,132,1,1}; do set -- ${cfg//,/ }
  name=v3_bn$1_s$2_t$3_e$4_o$5
  cat > $d/$name.cu <<EOT
#define KNAME k_$name
#define LAUNCHER launch_$name
#define BN $1
#define STAGES $2
#define SPLIT_TARGET $3
#define EPI $4
#define OVERLAP $5
#include "$here/gemm_wgmma3.cu"
EOT
  echo "extern \"C\" void launch_$name(const float*, const float*, float*, const float*, int, int, int, int, int, int, cudaStream_t);" >> $d/configs.inc
  list="$list{\"$name\", 64, $1, 1, $4, launch_$name},"; n=$((n+1))
done
# gemm_wgmma4.cu (V4_CONFIGS): stages,split-target,min-chunks-per-split,epi
for cfg in ${V4_CONFIGS-3,264,2,0 3,132,2,0 3,264,4,0 3,132,2,2}; do set -- ${cfg//,/ }
  name=v4_s$1_t$2_c$3_e$4
  cat > $d/$name.cu <<EOT
#define KNAME k_$name
#define LAUNCHER launch_$name
#define STAGES $1
#define SPLIT_TARGET $2
#define MIN_CHUNKS $3
#define EPI $4
#include "$here/gemm_wgmma4.cu"
EOT
  echo "extern \"C\" void launch_$name(const float*, const float*, float*, const float*, int, int, int, int, int, int, cudaStream_t);" >> $d/configs.inc
  list="$list{\"$name\", 64, 64, 1, $4, launch_$name},"; n=$((n+1))
done
echo "static Cfg cfgs[] = {$list}; static const int NCFG = $n;" >> $d/configs.inc
cp $here/harness.cu $d/
cd $d
ls *_*.cu | grep -v harness | xargs -P 16 -I{} nvcc -O3 -gencode arch=compute_90a,code=sm_90a -c {} -Xptxas -v -o {}.o 2> $out/ptxas.txt || { grep -v "^ptxas info" $out/ptxas.txt | head -40; exit 1; }
grep -E "registers|spill|wgmma|arning" $out/ptxas.txt | sort | uniq -c | head -20
nvcc -O3 -gencode arch=compute_90a,code=sm_90a harness.cu *_*.cu.o -lcublas -o harness
./harness | tee $out/gemm.txt
