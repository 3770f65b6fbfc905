#!/bin/bash
# One call on the GPU machine, from the repository root after ../shared/tools/gpu-bundle:
#   bash tools/device_call.sh $OUT <sections...>
# Sections: ddp (kiln bench --distributed under kiln launch beside ddp_reference.py, DDP_NPROC ranks), cpus (NVRTC compiles pinned to each CPU), nvrtcclock (NVRTC wall against CPU and steal time around kiln's first processes), coldstart (a fresh machine's memory growth and first NVRTC compiles), wgmma (tools/gemm/run_wgmma.sh), nvrtc (NVRTC timing on logged kernels), compile (cold
# compile seconds, two passes), ncu (kernel durations and DRAM bytes per bench row), host (each
# row's host time per call, and copy times over four sizes), launch (tools/launch), chainsync (one dependency between small kernels in a graph: plain, PDL's wait, or a counter), emu (cuBLAS FP32
# emulation), rows (tools/rows cache-hint variants; needs kernels-*.log from nvrtc), lnrows (the compiled layer norm against the eager one), repeat (the pointwise and reduction rows in $REPEAT fresh processes, % of copy per run and the median), maps (tools/maps: the compiled bias + GELU kernel against variants), final
# (kiln and torch bench of $WORKLOADS, merged and compared), bf16log, tfc (transformer compile
# seconds and rehearsals), prof (kernel tables of $PROF_WORKLOADS, eager and compiled), rowprof
# (profiler tables and first trace events of one layernorm, softmax and bias_gelu call, eager and compiled), suite (every test binary with KILN_TEST_DEVICE=cuda), profconc (profiling beside other threads' GPU work, repeated), sanall (compute-sanitizer tools over every test, dealt to processes side by side: SANALL_JOBS), sanhelp (the sanitizer's filter options), logs (bench rows of $LOG_WORKLOADS under KILN_LOG=$LOG_TOPICS, the log's lines counted), stress (the compile tests twelve times), concurrency (the concurrency tests alone, repeated),
# load (the host's other activity), sweep (row-kernel threads and column-reduction chunks against % of copy), nvrtc (NVRTC option timings on the logged kernels of three rows), branches (the step rows with graph steps side by side against KILN_GRAPH_BRANCHES=0), sdpa (cuDNN's fused attention against kiln's kernels and PyTorch's backends), sdpashort (the same below MIN_KEYS, cuDNN forced), layout (channels-last tests on CUDA, the ResNet rows with the layout pass on and off), pair (kiln and torch rows of $WORKLOADS without warm-up, compared, with kiln's planned peaks), remat (the training rows with KILN_REMAT=0 and 1: times, peaks, planned peaks), pdl (the suite with KILN_PDL=1, then $PDL_WORKLOADS with it off and on), decode (the decode step's tests, its row as built, with layer norms as kernels of their own and with cuBLASLt products, its kernel table), ab ($AB_WORKLOAD as built and under each of $AB_SETTINGS: kernel lines and bench times), bins ($BINS_WORKLOAD with every .gpu/bin/kiln* build, in turn, with each build's graphs' longest chains and held memory), tf32 (kiln's TF32 products: their test, the TF32 transformer row with and without them, PyTorch's row), ncukern (ncu metrics of the kernels matching $NCU_KERNELS in $NCU_WORKLOAD), chain (each row's graph steps on the longest chain of waits).
OUT=$1
libs=/usr/local/cuda/lib64:/usr/local/cuda/extras/CUPTI/lib64
for d in $(python3 -c 'import nvidia, os; p=os.path.dirname(nvidia.__path__[0]+"/x"); print(" ".join(os.path.join(p,x,"lib") for x in os.listdir(p)))' 2>/dev/null); do libs="$libs:$d"; done
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
export PATH=/usr/local/cuda/bin:$PATH
compile_s() { python3 -c "import json,sys; d=json.load(open('$1'))['workloads']; [print(' ', k, {a.replace('_compile_s',''):round(b,3) for a,b in v.items() if 'compile_s' in a}) for k,v in d.items()]"; }
# ncu --csv output on stdin: each kernel's metrics on one line, by name (the last launch of
# each name), or with `each` one line per launch (ncu's ID first); stall names shortened.
ncu_table() { python3 -c "
import csv, sys, collections
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith('\"'))]
h = rows[0]; ki, mi, vi, ii = h.index('Kernel Name'), h.index('Metric Name'), h.index('Metric Value'), h.index('ID')
short = lambda n: n.replace('smsp__warp_issue_stalled_', 'st_').replace('_per_warp_active.pct', '')
d = collections.OrderedDict()
for r in rows[1:]: d.setdefault(r[ii] + ' ' + r[ki][:50] if sys.argv[1] == 'each' else r[ki][:60], {})[short(r[mi])] = r[vi]
for k, v in d.items(): print(k, v)
" "${1:-}"; }
# A bench JSON's rows with their times in ms, each line prefixed by $2.
bench_ms() { python3 -c "import json, sys; d=json.load(open(sys.argv[1]))['workloads']; [print(*sys.argv[2:], k, {a: round(b, 4) for a, b in v.items() if a.endswith('_ms')}) for k, v in d.items()]" "$@"; }
if [[ " $* " == *" load "* ]]; then
  # What else the host is doing (a device call's first minute has shown slow NVRTC compiles).
  uptime; top -bn1 | sed -n 7,16p
fi
if [[ " $* " == *" coldstart "* ]]; then
  # A fresh machine's memory and NVRTC: the time to touch newly allocated memory (the VM's memory
  # grows as it is used), a trivial NVRTC compile first in a process, and the machine's age.
  echo "uptime $(cut -d' ' -f1 /proc/uptime) s"; grep -E "MemTotal|MemFree|MemAvailable" /proc/meminfo | tr '\n' ' '; echo
  python3 -c "
import numpy as np, time
for i in range(4):
    t = time.perf_counter(); a = np.ones(1 << 28, dtype=np.float32); dt = time.perf_counter() - t; del a
    print('touch 1 GiB #%d: %.0f ms' % (i, dt * 1e3))
"
  for i in 1 2; do python3 -c "
import ctypes, glob, time
lib = ctypes.CDLL(sorted(glob.glob('/usr/local/cuda/lib64/libnvrtc.so*'))[-1]); P = ctypes.c_void_p
def c(src):
    prog = P(); lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b'k.cu', 0, None, None)
    o = [b'--gpu-architecture=sm_90', b'--std=c++17', b'-default-device', b'--minimal']
    arr = (ctypes.c_char_p * len(o))(*o); t = time.perf_counter(); r = lib.nvrtcCompileProgram(prog, len(o), arr); return r, time.perf_counter() - t
k = 'extern \"C\" __global__ void t(float* y) { y[threadIdx.x] = sinf(y[threadIdx.x]); }\n'
print('NVRTC sinf kernel, first in process %.0f ms, second %.0f ms' % (c(k)[1] * 1e3, c(k + '//2')[1] * 1e3))
"; done
fi
if [[ " $* " == *" nvrtcclock "* ]]; then
  # NVRTC's wall time against its CPU time and the machine's steal time, before and after kiln's
  # first processes (kiln bench with kernel logs, timed by /usr/bin/time).
  python3 tools/nvrtc/wall_vs_cpu.py 12 0.3
  for w in pointwise reduction pointwise; do
    s=$(date +%s.%N)
    KILN_LOG=kernels KILN_CACHE_DIR=$(mktemp -d) .gpu/bin/kiln bench --only $w --out /tmp/nc.json 2> /tmp/nc.log > /dev/null
    echo "kiln bench $w: $(python3 -c "print('%.1f s' % ($(date +%s.%N) - $s))"), NVRTC ms: $(grep 'compiled by NVRTC' /tmp/nc.log | awk '{printf "%s ", $(NF-5)}')"
    compile_s /tmp/nc.json
    python3 tools/nvrtc/wall_vs_cpu.py 3 0.1
  done
fi
if [[ " $* " == *" cpus "* ]]; then
  # Whether some of the machine's CPUs are slower than others: the same NVRTC compiles pinned
  # to each CPU in turn, twice (the second pass some seconds later).
  for pass in 1 2; do for c in $(seq 0 $(($(nproc) - 1))); do
    echo "pass $pass cpu $c: $(taskset -c $c python3 tools/nvrtc/wall_vs_cpu.py 3 0 | sed 's/; machine.*//' | awk '{printf "%s %s | ", $5, $8}')"
  done; done
fi
if [[ " $* " == *" compile "* ]]; then
  for pass in 1 2; do for w in ${COMPILE_WORKLOADS:-pointwise reduction transformer.fwd.f32}; do
    KILN_LOG=kernels KILN_CACHE_DIR=$(mktemp -d) timeout 200 .gpu/bin/kiln bench --only $w --out $OUT/c$pass-$w.json 2> $OUT/log-$pass-$w.txt >/dev/null
    echo "pass $pass $w: $(grep -c 'compiled by NVRTC' $OUT/log-$pass-$w.txt) NVRTC compiles, $(grep 'compiled by NVRTC' $OUT/log-$pass-$w.txt | awk '{s+=$(NF-5)} END {print s}') ms summed; rehearsals: $(grep 'rehearsal' $OUT/log-$pass-$w.txt | sed 's/.*rehearsal: //' | tr '\n' ';' | cut -c1-300)"
    compile_s $OUT/c$pass-$w.json
  done; done
  grep -h "rehearsal stopped" $OUT/log-*.txt | sort | uniq -c | head
fi
if [[ " $* " == *" ncu "* ]]; then
  for w in reduction.layernorm reduction.softmax reduction.sum_dim0 pointwise.bias_gelu pointwise.add_relu; do
    echo "== $w"
    timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv -c 200 .gpu/bin/kiln bench --only $w --out $OUT/n.json 2>/dev/null | python3 tools/ncu_rows.py
  done
fi
if [[ " $* " == *" ncurows "* ]]; then
  # Why a row kernel runs below the copy rate: occupancy, registers and warp stalls of the
  # fused layer norm and softmax kernels.
  m=gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,smsp__warp_issue_stalled_drain_per_warp_active.pct,smsp__warp_issue_stalled_membar_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct,smsp__warp_issue_stalled_no_instruction_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,l1tex__t_sector_hit_rate.pct,smsp__inst_executed.sum
  for w in reduction.layernorm reduction.softmax reduction.sum_dim0; do
    timeout 150 ncu --clock-control none -k regex:"fused|layer_norm|softmax_f32|sum_f32" --metrics $m --csv -c 6 .gpu/bin/kiln bench --only $w --out /tmp/n.json 2>/dev/null | ncu_table
  done
fi
if [[ " $* " == *" ncukern "* ]]; then
  # Why named kernels take their time: ncu's duration, launch shape, occupancy, pipe use and
  # warp stalls for the first $NCU_COUNT (default 8) kernels matching $NCU_KERNELS (a regex)
  # in `kiln profile $NCU_WORKLOAD --compiled`, one line per kernel.
  m=gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fp64.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_wait_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct,lts__t_sector_hit_rate.pct
  KILN_CACHE_DIR=$(mktemp -d) timeout ${NCU_S:-200} ncu --clock-control none -k regex:"${NCU_KERNELS:-.}" --metrics $m --csv -c ${NCU_COUNT:-8} .gpu/bin/kiln profile ${NCU_WORKLOAD:-transformer.fwd.tf32.10x32x512} --compiled 2>/dev/null | ncu_table each | tee $OUT/ncukern.txt
fi
if [[ " $* " == *" tf32 "* ]]; then
  # kiln's TF32 products (KILN_TF32_GEMM=1): their test, then the TF32 transformer row with the
  # library's products and with kiln's (kernel lines and bench times), then PyTorch's row.
  KILN_TEST_DEVICE=cuda timeout 120 .gpu/tests/all-* compiled_f32_products_under 2>&1 | grep -E "test result|FAILED|panicked" | head -8
  AB_WORKLOAD=transformer.fwd.tf32.10x32x512 AB_SETTINGS="KILN_TF32_GEMM=1" AB_KERNELS="tf32_gemm|^total" bash $0 $OUT ab
  timeout 200 python3 .gpu/bench/torch_reference.py --only transformer.fwd.tf32 --out /tmp/tf32-torch.json > /dev/null 2>&1
  bench_ms /tmp/tf32-torch.json torch
fi
if [[ " $* " == *" chain "* ]]; then
  # Each row of $WORKLOADS: its replayed CUDA graphs' steps and the steps on their longest
  # chain of waits (what side-by-side steps cannot hide), then its bench times.
  for w in ${WORKLOADS:-gpt2.decode.bf16.bs1 transformer.fwd.tf32.10x32x512}; do
    echo "== $w"
    KILN_LOG=recompiles KILN_CACHE_DIR=$(mktemp -d) timeout 150 .gpu/bin/kiln bench --only $w --out /tmp/chain.json 2>&1 >/dev/null | grep -h "longest chain" | sort | uniq -c
    bench_ms /tmp/chain.json
  done
fi
if [[ " $* " == *" host "* ]]; then
  for w in reduction pointwise; do
    timeout 150 .gpu/bin/kiln bench --only $w --copy-fit --out $OUT/h-$w.json | grep copy
    python3 -c "import json; d=json.load(open('$OUT/h-$w.json')); print('copy', round(d['copy_GBps'])); [print(k, {a:round(b,4) for a,b in v.items() if a.endswith(('_us','_ms'))}) for k,v in d['workloads'].items()]"
  done
fi
if [[ " $* " == *" launch "* ]]; then
  d=$(mktemp -d); nvcc -O2 -arch=sm_90 tools/launch/params.cu -o $d/params -lcuda && $d/params
fi
if [[ " $* " == *" chainsync "* ]]; then
  d=$(mktemp -d); nvcc -O2 -arch=sm_90 tools/launch/chain_sync.cu -o $d/chain_sync && $d/chain_sync
fi
if [[ " $* " == *" emu "* ]]; then
  d=$(mktemp -d); nvcc -O2 -arch=sm_90 tools/gemm/emulation.cu -o $d/emu -lcublas && $d/emu
fi
if [[ " $* " == *" lnrows "* ]]; then
  # The compiled layer norm beside the eager one, and two variants of it (tools/rows/NOTES.md).
  KILN_LOG=kernels KILN_CACHE_DIR=$(mktemp -d) .gpu/bin/kiln bench --only reduction.layernorm --out /tmp/l.json 2> /tmp/ln.log > /dev/null
  (cd tools/rows && rm -rf build && python3 make_variants.py /tmp/ln.log rows && cd build && (ls *_*.cu | xargs -P 4 -I{} nvcc -O3 -arch=sm_90 -diag-suppress 177 -c {} -o {}.o) && nvcc -O3 -arch=sm_90 -diag-suppress 177,550 harness.cu *.o -o v && ./v)
fi
if [[ " $* " == *" rows "* ]]; then
  cat $OUT/kernels-*.log > /tmp/k.log; cd tools/rows && python3 make_variants.py /tmp/k.log && cd build && (ls *_*.cu | grep -v harness | xargs -P 12 -I{} nvcc -O3 -arch=sm_90 -c {} -o {}.o) && nvcc -O3 -arch=sm_90 harness.cu *.o -o v && ./v; cd ../../..
fi
if [[ " $* " == *" ddp "* ]]; then
  # kiln's data-parallel rows beside ddp_reference.py, DDP_NPROC ranks (1 on a one-GPU machine).
  export NCCL_NVLS_ENABLE=0
  n=${DDP_NPROC:-1}
  timeout ${DDP_KILN_S:-400} .gpu/bin/kiln launch --nproc-per-node $n --master-port 29631 -- .gpu/bin/kiln bench --distributed --device cuda --out $OUT/kiln-ddp.json > $OUT/kiln-ddp.txt 2>&1; echo "kiln rc $?"; tail -8 $OUT/kiln-ddp.txt
  (cd .gpu/bench && timeout ${DDP_TORCH_S:-400} python3 -m torch.distributed.run --nproc-per-node $n --master-port 29632 ddp_reference.py --out $OUT/torch-ddp.json > $OUT/torch-ddp.txt 2>&1; echo "torch rc $?"); tail -8 $OUT/torch-ddp.txt
fi
if [[ " $* " == *" final "* ]]; then
  # A fresh machine runs slowly for its first half minute or more: processes page the CUDA
  # libraries in and memory the machine has not used yet is slow to touch, so NVRTC's compiles
  # take 5-30x their CPU time (tools/nvrtc/wall_vs_cpu.py shows it). Measured runs start once a
  # fresh process compiles each pointwise row in under 20 ms, as on a machine in use (one row
  # alone was not enough: a later process still compiled slowly).
  for i in 1 2 3 4 5 6; do
    KILN_CACHE_DIR=$(mktemp -d) .gpu/bin/kiln bench --only pointwise --out /tmp/warm.json > /dev/null 2>&1
    c=$(python3 -c "import json; print(max(v['compiled_compile_s'] for v in json.load(open('/tmp/warm.json'))['workloads'].values()))")
    echo "warm-up $i at $(cut -d' ' -f1 /proc/uptime) s after boot: slowest pointwise row compiled in $c s"
    python3 -c "import sys; sys.exit(0 if $c < 0.02 else 1)" && break
  done
  # Larger kernels still compiled 5-10x slower in the next process (the decode step's cache
  # attention 950 ms against 97): one decode step compiled in a process of its own, cache empty.
  if [[ " $WORKLOADS " == *" gpt2.decode"* ]]; then
    KILN_CACHE_DIR=$(mktemp -d) timeout 120 .gpu/bin/kiln bench --only gpt2.decode.bf16.bs1 --out /tmp/warm.json > /dev/null 2>&1
    echo "warm-up decode: first compiled call $(python3 -c "import json; print(round(json.load(open('/tmp/warm.json'))['workloads']['gpt2.decode.bf16.bs1']['compiled_compile_s'], 3))" 2>/dev/null) s"
  fi
  # Both sides keep off CPU 0: in a fresh machine's first half minute, work pinned there ran
  # NVRTC 6x slower than on any other CPU (`cpus` section). It does not remove the spread of
  # host time between processes (tools/nvrtc/NOTES.md). PIN= runs unpinned.
  pin=${PIN-taskset -c 1-$(($(nproc) - 1))}
  for w in $WORKLOADS; do
    KILN_CACHE_DIR=$(mktemp -d) timeout 250 $pin .gpu/bin/kiln bench --only $w --out $OUT/k-$w.json > /dev/null 2>&1
    timeout 300 $pin python3 .gpu/bench/torch_reference.py --only $w --out $OUT/t-$w.json > /dev/null 2>&1
  done
  python3 - $OUT <<'PY'
import json, sys, glob
out = sys.argv[1]
for side in "kt":
    files = sorted(glob.glob(f"{out}/{side}-*.json"))
    merged = json.load(open(files[0]))
    for f in files[1:]:
        merged["workloads"].update(json.load(open(f))["workloads"])
    json.dump(merged, open(f"{out}/{'kiln' if side == 'k' else 'torch'}.json", "w"), indent=1)
PY
  rm -f $OUT/k-*.json $OUT/t-*.json  # (merged above; fewer files come back)
  python3 .gpu/bench/compare.py $OUT/torch.json $OUT/kiln.json | tee $OUT/compare.txt
  python3 -c "import json; d=json.load(open('$OUT/kiln.json')); cp=d['copy_GBps']; [print(k, {a:round(b,4) for a,b in v.items() if a.endswith(('_s','_us'))}, ('%.1f%% of copy' % (100*v['bytes']/(v['compiled_ms']/1e3)/1e9/cp)) if 'bytes' in v else '') for k,v in d['workloads'].items()]"
fi
if [[ " $* " == *" repeat "* ]]; then
  # The pointwise and reduction rows in $REPEAT fresh kiln processes (default 5), each row as %
  # of its own process's copy rate, then the median per row: the spread between processes
  # (host work per call moves between them, tools/nvrtc/NOTES.md) against the 95% bar.
  pin=${PIN-taskset -c 1-$(($(nproc) - 1))}
  mkdir -p $OUT/repeat
  for i in $(seq 1 ${REPEAT:-5}); do for w in pointwise reduction; do
    KILN_CACHE_DIR=$(mktemp -d) timeout 250 $pin .gpu/bin/kiln bench --only $w --out $OUT/repeat/$w-$i.json > /dev/null 2>&1
  done; done
  python3 - $OUT/repeat <<'PY'
import json, sys, glob, statistics
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    for k, v in d["workloads"].items():
        rows.setdefault(k, []).append((100 * v["bytes"] / (v["compiled_ms"] / 1e3) / 1e9 / d["copy_GBps"], d["copy_GBps"], v["compiled_ms"], v["compiled_host_us"], v["compiled_compile_s"]))
for k, rs in rows.items():
    pct = [r[0] for r in rs]
    print(f"{k:36s} median {statistics.median(pct):5.1f}% of copy | runs " + " ".join(f"{p:5.1f}" for p in pct)
          + " | copy GB/s " + " ".join(f"{r[1]:.0f}" for r in rs) + " | ms " + " ".join(f"{r[2]:.4f}" for r in rs) + " | host us " + " ".join(f"{r[3]:.1f}" for r in rs) + " | compile s " + " ".join(f"{r[4]:.3f}" for r in rs))
PY
fi
if [[ " $* " == *" maps "* ]]; then
  # The compiled bias + GELU map kernel against variants (tools/maps/bias_gelu.cu).
  d=$(mktemp -d); nvcc -O3 -arch=sm_90 tools/maps/bias_gelu.cu -o $d/bg && $d/bg
fi
if [[ " $* " == *" bf16log "* ]]; then
  KILN_CACHE_DIR=$(mktemp -d) .gpu/bin/kiln bench --only pointwise.add_relu --out /tmp/warm.json > /dev/null 2>&1
  KILN_LOG=kernels,recompiles KILN_CACHE_DIR=$(mktemp -d) timeout 250 .gpu/bin/kiln bench --only transformer.fwd.bf16amp --out $OUT/bf.json 2> $OUT/bf.log | tail -1 | cut -c1-400
  grep -n "rehearsal\|captured a CUDA\|no CUDA graph" $OUT/bf.log | cut -c1-200 | head -20
  first=$(grep -n "rehearsal:" $OUT/bf.log | head -1 | cut -d: -f1)
  echo "NVRTC compiles after the first rehearsal: $(tail -n +$first $OUT/bf.log | grep -c 'compiled by NVRTC')"
  tail -n +$first $OUT/bf.log | grep -B1 "compiled by NVRTC" | grep -v "^--" | cut -c1-160 | head -40
fi
if [[ " $* " == *" tfc "* ]]; then
  KILN_CACHE_DIR=$(mktemp -d) .gpu/bin/kiln bench --only pointwise.add_relu --out /tmp/warm.json > /dev/null 2>&1
  KILN_LOG=kernels KILN_CACHE_DIR=$(mktemp -d) timeout 250 .gpu/bin/kiln bench --only transformer --out $OUT/tf.json 2> $OUT/tf.log > /dev/null
  grep "rehearsal:" $OUT/tf.log
  python3 -c "import json; d=json.load(open('$OUT/tf.json')); [print(k, {a:round(b,4) for a,b in v.items() if a.endswith(('_s','_ms'))}) for k,v in d['workloads'].items()]"
fi
if [[ " $* " == *" prof "* ]]; then
  # `kiln profile` of each workload of $PROF_WORKLOADS (default: the transformer rows), eager and
  # compiled (PROF_COMPILED=1: compiled only): the kernel tables by device time and the peak
  # memory; the last compiled trace's kernels by kind (profiles/kiln_trace_kinds.py).
  modes="eager --compiled"; [ "${PROF_COMPILED:-0}" = 1 ] && modes=--compiled
  for w in ${PROF_WORKLOADS:-transformer.fwd.f32.10x32x512 transformer.fwd.bf16amp.10x32x512}; do for c in $modes; do
    [ $c = eager ] && c=
    KILN_CACHE_DIR=$(mktemp -d) timeout ${PROF_S:-200} .gpu/bin/kiln profile $w $c --trace /tmp/prof-trace.json 2>&1 | head -${PROF_LINES:-30} | cut -c1-220
  done; done
  python3 tools/profiles/kiln_trace_kinds.py /tmp/prof-trace.json --rows ${PROF_KIND_ROWS:-40} 2>&1 | cut -c1-200
fi
if [[ " $* " == *" rowprof "* ]]; then
  # Per call: the profiler's tables, then the trace's first events. `ts` counts µs from the
  # profiler's start, just before the call, so the first launch's `ts` is about the host's work
  # before it (the compiled layer norm spends about 2 µs more host time per call than eager).
  for w in reduction.layernorm.f32.8192x8192 reduction.softmax.f32.8192x8192 pointwise.bias_gelu.f32.8192x8192; do for c in "" --compiled; do
    timeout 100 .gpu/bin/kiln profile $w $c --trace /tmp/t.json 2>&1 | head -6
    python3 -c "
import json; d = json.load(open('/tmp/t.json')); ev = d['traceEvents'] if isinstance(d, dict) else d
for e in sorted((e for e in ev if e.get('ph') == 'X'), key=lambda e: e['ts'])[:6]: print('   ', e.get('cat'), e['name'][:50], 'ts %.2f us' % e['ts'], 'dur %.2f us' % e.get('dur', 0), e.get('args', {}))"
  done; done
fi
if [[ " $* " == *" sdpa "* ]]; then
  # cuDNN's fused attention (default) against kiln's kernels (KILN_CUDNN_ATTENTION=0) and
  # PyTorch's backends, on the unmasked shapes it may take (tools/attention/NOTES.md).
  # The machine's cuDNN, then the one PyTorch ships (cuDNN is loaded as libcudnn.so, which a
  # directory ahead on LD_LIBRARY_PATH points at the other library).
  pipdnn=$(python3 -c 'import nvidia, os; print(os.path.join(os.path.dirname(nvidia.__path__[0] + "/x"), "cudnn", "lib"))')
  mkdir -p /tmp/dnn && ln -sf $pipdnn/libcudnn.so.9 /tmp/dnn/libcudnn.so
  echo "== kiln, cuDNN allowed"; KILN_LOG=kernels .gpu/bin/attention_bench tools/attention/cudnn_shapes.txt 2> $OUT/sdpa.log; grep -i "cudnn" $OUT/sdpa.log | head
  echo "== kiln, PyTorch's cuDNN"; LD_LIBRARY_PATH=/tmp/dnn:$LD_LIBRARY_PATH KILN_LOG=kernels .gpu/bin/attention_bench tools/attention/cudnn_shapes.txt 2> $OUT/sdpa-pip.log; grep -i "cudnn" $OUT/sdpa-pip.log | head
  echo "== kiln, cuDNN off"; KILN_CUDNN_ATTENTION=0 .gpu/bin/attention_bench tools/attention/cudnn_shapes.txt
  echo "== torch"; python3 tools/attention/torch_sdpa.py tools/attention/cudnn_shapes.txt
fi
if [[ " $* " == *" sdpashort "* ]]; then
  # Short sequences: cuDNN's fused attention forced (KILN_CUDNN_MIN_KEYS=1) against the default
  # (kiln's kernels below sdpa.rs's MIN_KEYS), and PyTorch's backends.
  echo "== kiln, default"; .gpu/bin/attention_bench tools/attention/short_shapes.txt
  echo "== kiln, cuDNN from 1 key"; KILN_CUDNN_MIN_KEYS=1 KILN_LOG=kernels .gpu/bin/attention_bench tools/attention/short_shapes.txt 2> $OUT/sdpashort.log; grep -i "cudnn" $OUT/sdpashort.log | cut -c1-160 | head -20
  echo "== torch"; python3 tools/attention/torch_sdpa.py tools/attention/short_shapes.txt
fi
if [[ " $* " == *" nvrtc "* ]]; then
  for w in pointwise.exp_sin reduction.layernorm pointwise.bias_gelu; do
    KILN_LOG=kernels KILN_CACHE_DIR=$(mktemp -d) timeout 100 .gpu/bin/kiln bench --only $w --out /tmp/n.json 2> $OUT/kernels-$w.log > /dev/null
    grep "compiled by NVRTC" $OUT/kernels-$w.log | cut -c1-200 | head -5
  done
  cat $OUT/kernels-*.log > /tmp/k.log && timeout 200 python3 tools/nvrtc/compile_time.py /tmp/k.log
fi
if [[ " $* " == *" sweep "* ]]; then
  for t in ${SWEEP_THREADS:-256 512 1024}; do for w in reduction.layernorm reduction.softmax; do
    KILN_ROWS_THREADS=$t timeout 60 .gpu/bin/kiln bench --only $w --out /tmp/s.json > /dev/null 2>&1
    echo "threads $t $w: $(python3 -c "import json; d=json.load(open('/tmp/s.json')); cp=d['copy_GBps']; print(' '.join('%s %.4f ms (%.1f%%) eager %.4f' % (k.split('.')[1], v['compiled_ms'], 100*v['bytes']/(v['compiled_ms']/1e3)/1e9/cp, v['eager_ms']) for k,v in d['workloads'].items()))")"
  done; done
  for c in ${SWEEP_CHUNKS:-6 8 12}; do
    KILN_COLS_CHUNKS=$c timeout 60 .gpu/bin/kiln bench --only reduction.sum_dim0 --out /tmp/s.json > /dev/null 2>&1
    echo "chunks $c: $(python3 -c "import json; d=json.load(open('/tmp/s.json')); cp=d['copy_GBps']; print(' '.join('%s %.4f ms (%.1f%%)' % (k.split('.')[1], v['compiled_ms'], 100*v['bytes']/(v['compiled_ms']/1e3)/1e9/cp) for k,v in d['workloads'].items()))")"
  done
fi
if [[ " $* " == *" branches "* ]]; then
  KILN_CACHE_DIR=$(mktemp -d) .gpu/bin/kiln bench --only pointwise.add_relu --out /tmp/warm.json > /dev/null 2>&1
  for w in mlp transformer; do for b in 1 0; do
    KILN_GRAPH_BRANCHES=$b KILN_LOG=recompiles,graph KILN_CACHE_DIR=$(mktemp -d) timeout 250 .gpu/bin/kiln bench --only $w --out $OUT/br$b-$w.json 2> $OUT/br$b-$w.log > /dev/null
    echo "== $w branches=$b: $(grep -h 'longest chain' $OUT/br$b-$w.log | sed 's/.*CUDA graph: //' | sort | uniq -c | tr '\n' ';' | cut -c1-300)"
    python3 -c "import json; d=json.load(open('$OUT/br$b-$w.json')); [print(' ', k, {a:round(b,4) for a,b in v.items() if a.endswith(('_ms','_us'))}) for k,v in d['workloads'].items()]"
  done; done
  # The steps of the bs32 training step's graph and what each waits for.
  awk '/CUDA graph steps/{n++} n==3' $OUT/br1-mlp.log | grep -A30 "CUDA graph steps" | head -32
fi
if [[ " $* " == *" wgmma "* ]]; then
  # The wgmma 3xTF32 products beside cuBLAS (config lists: V1_CONFIGS, V3_CONFIGS, V4_CONFIGS).
  bash tools/gemm/run_wgmma.sh $OUT/gemm 2>&1 | tail -80
fi
if [[ " $* " == *" stress "* ]]; then
  # The compile tests alone, twelve times: many threads capturing and replaying CUDA graphs at
  # once (before captures took turns, 1-3 runs in 12 aborted on a block the caching allocator
  # saw freed twice, and replay tests failed in others).
  for i in $(seq 1 12); do bash .gpu/run.sh /tmp/s$i ${STRESS_FILTER:-compile::} > /dev/null 2>&1
    echo "run $i: $(grep -E '^test result' /tmp/s$i/gpu-tests.log | head -1 | cut -c1-50) $(grep -E '^test .* FAILED' /tmp/s$i/gpu-tests.log | cut -c1-90 | tr '\n' ' ')"
    grep -h "freed twice" /tmp/s$i/gpu-tests.log | head -1
    grep -h -A3 "panicked at" /tmp/s$i/gpu-tests.log | cut -c1-300 | head -12; done
fi
if [[ " $* " == *" concurrency "* ]]; then
  # The concurrency tests of compile:: alone, each a few times (four threads inside each), the
  # graph ones also with captured order kept; then all of them side by side.
  bin=$(ls .gpu/tests/all-* | head -1)
  one() { out=$(KILN_TEST_DEVICE=cuda RUST_BACKTRACE=0 "$@" 2>&1); echo "  $(echo "$out" | grep -E '^test result' | cut -c1-40)"; echo "$out" | grep -E 'values differ|^thread .* (eager|compiled|captures|replays)|panicked' -A7 | grep -v "^note:" | cut -c1-200 | head -9; }
  for name in concurrent_eager concurrent_compiled; do echo "$name"; one $bin compile::$name --test-threads=1; done
  for knob in NONE=1 KILN_TEST_WORKERS=8 KILN_GRAPH_BRANCHES=0; do
    for i in 1 2 3; do echo "concurrent_captures $knob $i"; one env $knob $bin compile::concurrent_captures; done
  done
  KILN_TEST_DEVICE=cuda KILN_LOG=recompiles $bin compile::concurrent_captures > $OUT/captures-log.txt 2>&1
  grep -oE "no CUDA graph.*|copied around.*|captured a CUDA graph of [0-9]+ kernels" $OUT/captures-log.txt | cut -c1-150 | sort | uniq -c | sort -rn | head
  for i in 1 2; do echo "all concurrent_ $i"; one $bin concurrent_; done
fi
if [[ " $* " == *" profconc "* ]]; then
  # Profiling beside other threads' GPU work: the fixtures and profiler groups together, and the
  # test that profiles while four threads run eager, compiled and graphed work, $PROFCONC times each.
  bin=$(ls .gpu/tests/all-* | head -1); pass=0; pass2=0; n=${PROFCONC:-20}
  for i in $(seq $n); do
    out=$(KILN_TEST_DEVICE=cuda RUST_BACKTRACE=1 timeout 120 $bin fixtures profiler 2>&1); rc=$?
    if [ $rc = 0 ]; then pass=$((pass+1)); else echo "pair run $i: rc $rc"; echo "$out" | grep -E "panicked|FAILED|error|Segmentation" -A5 | head -12; fi
    KILN_TEST_DEVICE=cuda timeout 120 $bin holds_only_its_threads_work > $OUT/profconc-last.txt 2>&1 && pass2=$((pass2+1)) || { echo "profile-beside-work run $i failed"; grep -E "panicked|FAILED" -A5 $OUT/profconc-last.txt | head -10; }
  done
  echo "fixtures+profiler together: $pass of $n passed; profile beside concurrent work: $pass2 of $n passed"
fi
if [[ " $* " == *" sanall "* ]]; then
  # compute-sanitizer over the test binaries, each job "TOOL@REGEX@PROCS[@SKIP[@ENV]]" of $SANALL_JOBS
  # (default: memcheck over every test in 8 processes) running the tests whose names match
  # REGEX (or are listed in the file of REGEX "file=PATH") and not SKIP, dealt round-robin to PROCS processes side by side (each at most $SANITIZE_S
  # seconds); all jobs run at once. Racecheck skips the vendor libraries' kernels (their
  # shared-memory protocols are theirs, and they dominate its time). Per process: the summary
  # line, tests finished, failures, first reports.
  lib_kernels="--kernel-name-exclude kns=nvjet --kernel-name-exclude kns=xmma --kernel-name-exclude kns=cudnn --kernel-name-exclude kns=cutlass --kernel-name-exclude kns=sm90 --kernel-name-exclude kns=gemm --kernel-name-exclude kns=splitK --kernel-name-exclude kns=convolve --kernel-name-exclude kns=winograd --kernel-name-exclude kns=fft"
  j=0
  for job in ${SANALL_JOBS:-memcheck@.@8}; do
    j=$((j + 1))
    # A fifth field sets environment variables for the job's processes (VAR=V,VAR2=V2).
    IFS=@ read tool regex procs skip envs <<< "$job"
    extra=""; [ $tool = racecheck ] && extra="$lib_kernels"
    for bin in .gpu/tests/*; do
      names=$($bin --list 2>/dev/null | grep ': test$' | sed 's/: test$//' | grep -vE "${skip:-^$}")
      # REGEX "file=PATH": the tests named in PATH, one per line.
      if [[ $regex == file=* ]]; then names=$(echo "$names" | grep -xFf "${regex#file=}"); else names=$(echo "$names" | grep -E "$regex"); fi
      [ -z "$names" ] && continue
      for p in $(seq 0 $((procs - 1))); do
        mine=$(echo "$names" | awk -v p=$p -v n=$procs 'NR % n == p')
        [ -z "$mine" ] && continue
        echo "$mine" > $OUT/san-$tool-j$j-$(basename $bin)-$p.list
        env ${envs//,/ } KILN_TEST_DEVICE=cuda timeout ${SANITIZE_S:-400} compute-sanitizer --tool $tool --target-processes all --print-limit 20 $SANITIZE_ARGS $extra $bin --test-threads=1 --exact $mine > $OUT/san-$tool-j$j-$(basename $bin)-$p.txt 2>&1 &
      done
    done
  done
  wait
  for f in $OUT/san-*.txt; do
    echo "== $(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1); $(grep -E '^test result' $f | tail -1 | cut -c1-60); finished $(grep -cE '^test .* (ok|FAILED)$' $f) of $(grep -E '^running [0-9]+ test' $f | head -1 | awk '{print $2}'); failed: $(grep -E '^test .* FAILED$' $f | head -5 | tr '\n' ' ')"
    # The tests a timed-out process never reached.
    left=$(grep -vxFf <(grep -oE '^test .* (ok|FAILED)$' $f | sed -E 's/^test (.*) \.\.\. (ok|FAILED)$/\1/') ${f%.txt}.list | head -12 | tr '\n' ' ')
    [ -n "$left" ] && echo "   not finished: $left"
    grep -E "^=========" $f | grep -vE "SUMMARY|COMPUTE-SANITIZER|Target application returned|^=========\s*$" | head -${SAN_LINES:-14} | cut -c1-220
    grep -A3 "^---- " $f | grep -vE "^--$|^$|stack backtrace" | head -8 | cut -c1-220
  done
  rm -f $OUT/san-*.list; gzip -f $OUT/san-*.txt
fi
if [[ " $* " == *" logs "* ]]; then
  # One bench run per workload of $LOG_WORKLOADS with KILN_LOG=$LOG_TOPICS (default recompiles,breaks):
  # the log's distinct lines with counts, and the row.
  for w in $LOG_WORKLOADS; do
    KILN_LOG=${LOG_TOPICS:-recompiles,breaks} timeout ${LOG_S:-200} .gpu/bin/kiln bench --only $w --out $OUT/log-$w.json 2> $OUT/log-$w.txt > /dev/null
    echo "== $w (rc $?)"; sed -E 's/[0-9]+(\.[0-9]+)? (ms|us|s|MiB|kernels)/N \2/g' $OUT/log-$w.txt | sort | uniq -c | sort -rn | head -${LOG_LINES:-25} | cut -c1-300
    python3 -c "import json; [print(' ', k, {a: (round(b, 3) if isinstance(b, float) else b) for a, b in v.items()}) for k, v in json.load(open('$OUT/log-$w.json'))['workloads'].items()]" 2>&1 | tail -5
  done
  gzip -f $OUT/log-*.txt
fi
if [[ " $* " == *" sanhelp "* ]]; then compute-sanitizer --version | tail -1; compute-sanitizer --help | grep -B1 -A5 -E "kernel-name|racecheck-" | head -60; fi
if [[ " $* " == *" layout "* ]]; then
  # Channels-last on the GPU: its tests on CUDA (conversions, convolutions through cuDNN's NHWC
  # descriptors, batch norm, pooling, DDP buckets, compiled steps), then the ResNet rows with the
  # compiler's layout pass on (the default for channels-last inputs) and off, beside PyTorch.
  KILN_TEST_DEVICE=cuda NCCL_NVLS_ENABLE=0 timeout 400 $(ls .gpu/tests/all-* | head -1) channels_last ddp::channels_last compile::a_compiled_resnet 2>&1 | grep -E "^test |panicked|test result" | head -30
  for cl in 1 0; do
    KILN_CHANNELS_LAST=$cl timeout 250 .gpu/bin/kiln bench --only resnet50 --out $OUT/k-cl$cl.json > /dev/null 2>&1
  done
  timeout 300 python3 .gpu/bench/torch_reference.py --only resnet50 --out $OUT/t-resnet.json > /dev/null 2>&1
  for cl in 1 0; do echo "KILN_CHANNELS_LAST=$cl"; python3 .gpu/bench/compare.py $OUT/t-resnet.json $OUT/k-cl$cl.json; done | tee $OUT/compare-layout.txt
fi
if [[ " $* " == *" bins "* ]]; then
  # Builds side by side on one machine: $BINS_WORKLOAD (default the decode row) with every
  # .gpu/bin/kiln* binary, $BINS_ROUNDS rounds (default 2) in turn. Variant binaries are built
  # here from a patch and copied in beside the bundle's kiln: `git apply P && cargo build
  # --release --bin kiln && cp target/release/kiln .gpu/bin/kiln-NAME && git apply -R P`.
  # A build whose bench fails says so (never an earlier build's row under its name). Each
  # build's CUDA graphs are described in its first round: steps on the longest chain of waits,
  # and the memory each holds.
  w=${BINS_WORKLOAD:-gpt2.decode.bf16.bs1}
  KILN_CACHE_DIR=$(mktemp -d) .gpu/bin/kiln bench --only pointwise --out /tmp/warm.json > /dev/null 2>&1
  for round in $(seq 1 ${BINS_ROUNDS:-2}); do for b in .gpu/bin/kiln*; do
    rm -f /tmp/bins.json
    KILN_LOG=recompiles,memory KILN_CACHE_DIR=$(mktemp -d) timeout 150 taskset -c 1-$(($(nproc) - 1)) $b bench --only $w --out /tmp/bins.json 2> /tmp/bins.log > /dev/null
    [ $round = 1 ] && grep -hE "longest chain|it holds" /tmp/bins.log | sed "s/^/  $(basename $b): /"
    [ -f /tmp/bins.json ] && bench_ms /tmp/bins.json "round $round $(basename $b)" || echo "round $round $(basename $b): no result"
  done; done
fi
if [[ " $* " == *" ab "* ]]; then
  # $AB_WORKLOAD (default gpt2.train) as built and under each switch setting of $AB_SETTINGS
  # (space-separated settings, each NAME=VALUE or several joined by +; " " for none; default:
  # the cross-entropy kernel's column values computed with 4-value loads, or in 512-thread
  # blocks, and 512-thread blocks alone): each one's compiled kernel table lines matching
  # $AB_KERNELS, then its bench row's times.
  w=${AB_WORKLOAD:-gpt2.train.bf16amp.8x1024}
  for s in default ${AB_SETTINGS:-KILN_ROW_COLUMNS=1+KILN_ROW_VEC=4 KILN_ROW_COLUMNS=1+KILN_ROW_LOOP_THREADS=512 KILN_ROW_LOOP_THREADS=512}; do
    e=; [ $s != default ] && e=${s//+/ }
    env $e KILN_CACHE_DIR=$(mktemp -d) timeout 120 .gpu/bin/kiln profile $w --compiled 2>&1 | grep -E "${AB_KERNELS:-amax_to_dtype|^total}" | cut -c1-160 | sed "s/^/$s: /"
    env $e KILN_CACHE_DIR=$(mktemp -d) timeout 150 taskset -c 1-$(($(nproc) - 1)) .gpu/bin/kiln bench --only $w --out /tmp/ab.json > /dev/null 2>&1
    bench_ms /tmp/ab.json "$s"
  done
fi
if [[ " $* " == *" pair "* ]]; then
  # kiln and torch bench of each workload of $WORKLOADS, no warm-up (the suite ran first),
  # each side's rows merged, then compared; KILN_LOG=memory's planned peaks of the kiln runs.
  for w in $WORKLOADS; do
    KILN_LOG=memory KILN_CACHE_DIR=$(mktemp -d) timeout ${PAIR_KILN_S:-200} .gpu/bin/kiln bench --only $w --out $OUT/k-$w.json > /dev/null 2> $OUT/mem-$w.log
    grep -h "planned peak" $OUT/mem-$w.log | sort | uniq -c | sort -rn | head -4 | cut -c1-400
    timeout ${PAIR_TORCH_S:-200} python3 .gpu/bench/torch_reference.py --only $w --out $OUT/t-$w.json > /dev/null 2>&1
  done
  python3 - $OUT <<'PY'
import json, sys, glob
out = sys.argv[1]
for side in "kt":
    files = sorted(glob.glob(f"{out}/{side}-*.json"))
    if not files: continue
    merged = json.load(open(files[0]))
    for f in files[1:]:
        merged["workloads"].update(json.load(open(f))["workloads"])
    json.dump(merged, open(f"{out}/{'kiln' if side == 'k' else 'torch'}.json", "w"), indent=1)
    for k, v in merged["workloads"].items(): print(side, k, {a: (round(b, 3) if isinstance(b, float) else b) for a, b in v.items()})
PY
  rm -f $OUT/k-*.json $OUT/t-*.json $OUT/mem-*.log
  python3 .gpu/bench/compare.py $OUT/torch.json $OUT/kiln.json | tee $OUT/compare.txt
fi
if [[ " $* " == *" pdl "* ]]; then
  # The GPU suite with programmatic dependent launch, then the rows of $PDL_WORKLOADS with it
  # off and on (kernels per call and time).
  KILN_PDL=1 KILN_BIN=$PWD/.gpu/bin/kiln bash .gpu/run.sh $OUT/pdl-suite 2>&1 | tail -3; grep -E "FAILED|panicked" $OUT/pdl-suite/gpu-tests.log | head -20
  for w in ${PDL_WORKLOADS:-gpt2.decode transformer.fwd mlp}; do for p in 0 1; do
    KILN_PDL=$p KILN_CACHE_DIR=$(mktemp -d) timeout ${PAIR_KILN_S:-200} .gpu/bin/kiln bench --only $w --out /tmp/pdl.json > /dev/null 2>&1
    python3 -c "import json; [print('KILN_PDL=$p', k, {a: round(b, 3) for a, b in v.items() if a.endswith('_ms')}) for k, v in json.load(open('/tmp/pdl.json'))['workloads'].items()]"
  done; done
fi
if [[ " $* " == *" decode "* ]]; then
  # The decode step's kernels: the tests of one-row products, row kernels and the language
  # models (unless DECODE_TESTS=0, after a whole suite); the decode row as built, with its layer
  # norms as kernels of their own (KILN_ROW_PROLOGUE=0), and with cuBLASLt's products
  # (KILN_GEMV=0); then its kernel table.
  if [ "${DECODE_TESTS:-1}" != 0 ]; then bash .gpu/run.sh $OUT/decode-suite lm:: ops_matmul:: attention:: layer_norm softmax one_row 2>&1 | tail -3; grep -E "FAILED|panicked" $OUT/decode-suite/gpu-tests.log | head -20; fi
  for e in "KILN_PDL=1" "KILN_GRAPH_BRANCHES=0" "KILN_ROW_PROLOGUE=0" "KILN_GEMV=0"; do
    env $e KILN_CACHE_DIR=$(mktemp -d) timeout ${PAIR_KILN_S:-200} .gpu/bin/kiln bench --only gpt2.decode --out /tmp/dec.json > /dev/null 2>&1
    python3 -c "import json; [print('$e', k, {a: round(b, 3) for a, b in v.items() if a.endswith('_ms') or a.endswith('_kernels')}) for k, v in json.load(open('/tmp/dec.json'))['workloads'].items()]"
  done
  # Each kernel's own time: without PDL, a kernel's span would include its wait for the one before.
  KILN_PDL=0 timeout 100 .gpu/bin/kiln profile gpt2.decode.bf16.bs1 --compiled --trace /tmp/t.json 2>&1 | sed -n '/kernels the GPU ran/,$p' | head -24 | cut -c1-140
fi
if [[ " $* " == *" remat "* ]]; then
  # The training rows of $REMAT_WORKLOADS (default: ResNet-50's and GPT-2's) with
  # rematerialisation off and on: time per call and peak memory of each mode, and the planned peaks.
  for w in ${REMAT_WORKLOADS:-resnet50.train gpt2.train}; do for r in 0 1; do
    KILN_REMAT=$r KILN_LOG=memory KILN_CACHE_DIR=$(mktemp -d) timeout ${PAIR_KILN_S:-200} .gpu/bin/kiln bench --only $w --out /tmp/remat.json > /dev/null 2> /tmp/remat.log
    echo "KILN_REMAT=$r $w: $(grep -h 'planned peak' /tmp/remat.log | sort -u | head -2 | cut -c1-260 | tr '\n' ' ')"
    python3 -c "import json; [print('   ', k, {a: round(b, 2) for a, b in v.items() if a.endswith('_ms') or a.startswith('peak')}) for k, v in json.load(open('/tmp/remat.json'))['workloads'].items()]"
  done; done
fi
if [[ " $* " == *" suite "* ]]; then KILN_BIN=$PWD/.gpu/bin/kiln bash .gpu/run.sh $OUT 2>&1 | tail -12; grep -E "FAILED|panicked|failed" $OUT/gpu-tests.log | head -20; fi
if [[ " $* " == *" cudnnlog "* ]]; then
  # How PyTorch's cudnn-frontend builds cuDNN's attention backward graph here (its logs).
  for kind in ${CUDNN_LOG_KINDS:-full causal mask}; do
    CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=$OUT/cudnn-$kind.log CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=$OUT/fe-$kind.log python3 tools/attention/cudnn_bwd_log.py $kind
  done
  gzip $OUT/cudnn-*.log
fi
