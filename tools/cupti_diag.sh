#!/bin/bash
# Profiling beside other threads' GPU work, taken apart: plain profiles, profiles collecting
# device kernels (CUPTI attached once and kept, collecting only while a profile asks), and a backtrace of the first crash of the fixtures and profiler groups.
#   bash tools/cupti_diag.sh $OUT [runs]
OUT=$1; n=${2:-3}
libs=/usr/local/cuda/lib64:/usr/local/cuda/extras/CUPTI/lib64
for d in $(python3 -c 'import nvidia, os; p=os.path.dirname(nvidia.__path__[0]+"/x"); print(" ".join(os.path.join(p,x,"lib") for x in os.listdir(p)))' 2>/dev/null); do libs="$libs:$d"; done
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}" PATH=/usr/local/cuda/bin:$PATH KILN_TEST_DEVICE=cuda
bin=$(ls .gpu/tests/all-* | head -1)
count() { # label, then the command; prints passes of n and the first failure's lines
  local label=$1; shift; local pass=0
  for i in $(seq $n); do
    if timeout 120 "$@" > $OUT/diag-run.txt 2>&1; then pass=$((pass+1)); else [ -f $OUT/diag-$label.txt ] || cp $OUT/diag-run.txt $OUT/diag-$label.txt; fi
  done
  echo "$label: $pass of $n passed"; [ -f $OUT/diag-$label.txt ] && grep -E "panicked at|Segmentation|CUDA_ERROR|rc [0-9]" -A2 $OUT/diag-$label.txt | head -6
}
count plain $bin profiler::a_profile_holds_only_its_threads_work_while_other_threads_use_the_gpu --exact
count cupti $bin profiler::a_profile_with_device_kernels_holds_only_its_threads_work_while_other_threads_use_the_gpu --exact
count pair $bin fixtures profiler
count pair-without-cupti-tests $bin fixtures profiler --skip device_kernels --skip each_launch_lists
if command -v gdb > /dev/null; then
  timeout 150 gdb -q -batch -ex run -ex "info threads" -ex "thread apply all bt 12" --args $bin fixtures profiler > $OUT/diag-gdb.txt 2>&1
  grep -E "SIGSEGV|received signal" -A14 $OUT/diag-gdb.txt | head -30
else echo "no gdb"; fi
timeout 200 compute-sanitizer --tool memcheck --print-limit 5 $bin profiler::a_profile_with_device_kernels_holds_only_its_threads_work_while_other_threads_use_the_gpu --exact > $OUT/diag-memcheck.txt 2>&1; echo "memcheck rc $?"
grep -E "^=========" $OUT/diag-memcheck.txt | head -14
