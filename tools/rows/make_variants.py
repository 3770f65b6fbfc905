"""Builds build/: each generated kernel (layernorm, softmax, bias_gelu as kiln emitted them, read
from a `KILN_LOG=kernels` log of `kiln bench --only reduction` and `--only pointwise.bias_gelu`)
as is, with streaming loads of its row-varying inputs (ld.global.cs), streaming stores
(st.global.cs), and both, in one harness timing them against cudaMemcpy. Usage on the
GPU machine: python3 make_variants.py kernels.log, then build/ with nvcc (see NOTES.md).
With a second argument `rows` it builds only the layer norms (from `--only reduction.layernorm`):
the eager one as generated, and the compiled one as generated, with `__launch_bounds__(512, 2)`
(ptxas's register budget, so the blocks per SM), with the output row's address computed once per
row (rowptr), with weight and bias read without a row offset (bcast), both, and both without
`__restrict__` (all3). The `lb1`, `rsqrt`, `norestrict` and `both2` tags of earlier runs
(tools/rows/NOTES.md) are still understood: edit the tag lists below to build them."""
import re, sys
HELP = r'''
template <class T> __device__ __forceinline__ T ldcs_(const T* p) { T v; const uint4* s = (const uint4*)p; uint4* d = (uint4*)&v;
  _Pragma("unroll") for (int i = 0; i < (int)(sizeof(T) / 16); i++) d[i] = __ldcs(s + i); return v; }
template <class T> __device__ __forceinline__ T ldlast_(const T* p) { T v; unsigned int* d = (unsigned int*)&v; const char* s = (const char*)p;
  _Pragma("unroll") for (int i = 0; i < (int)(sizeof(T) / 16); i++)
    asm("ld.global.L1::evict_last.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(d[4 * i]), "=r"(d[4 * i + 1]), "=r"(d[4 * i + 2]), "=r"(d[4 * i + 3]) : "l"(s + 16 * i));
  return v; }
template <class T> __device__ __forceinline__ T ldnc_(const T* p) { T v; unsigned int* d = (unsigned int*)&v; const char* s = (const char*)p;
  _Pragma("unroll") for (int i = 0; i < (int)(sizeof(T) / 16); i++)
    asm("ld.global.nc.L1::evict_last.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(d[4 * i]), "=r"(d[4 * i + 1]), "=r"(d[4 * i + 2]), "=r"(d[4 * i + 3]) : "l"(s + 16 * i));
  return v; }
template <class T> __device__ __forceinline__ void stcs_(T* p, const T& v) { uint4* d = (uint4*)p; const uint4* s = (const uint4*)&v;
  _Pragma("unroll") for (int i = 0; i < (int)(sizeof(T) / 16); i++) __stcs(d + i, s[i]); }
'''
def sources(path):
    """Kernel name -> source, from a KILN_LOG=kernels log."""
    out, cur = {}, None
    for line in open(path, errors="replace").read().splitlines():
        m = re.match(r"^\[kiln kernels\] (\S+) \((sm_\d+)\):$", line)
        if m:
            cur = m.group(1); out[cur] = []; continue
        if re.match(r"^\[kiln \w+\] ", line):
            cur = None; continue
        if cur is not None:
            out[cur].append(line)
    return {k: "\n".join(v) + "\n" for k, v in out.items()}

logged = sources(sys.argv[1])
def named(pattern):
    """The first logged kernel whose name matches `pattern` (names carry hashes and launch shapes)."""
    found = [k for k in logged if re.match(pattern, k)]
    if not found:
        sys.exit(f"no kernel matching {pattern} in the log: {sorted(logged)}")
    return found[0]
# `rows`: only the layer norms, as generated (eager and compiled) and the compiled one with
# `1 / sqrtf` computed by `rsqrtf`, as the eager kernel does, without `__restrict__`, and both.
ONLY_ROWS = len(sys.argv) > 2 and sys.argv[2] == 'rows'
kernels = {  # file: (kernel name, streamed input pointer names, reused (broadcast) input pointer names, variants)
    'layernorm.cu': (named(r'fused_sum_div_sub_mul_sum\w*_r512x16x4'), ['r0'], ['r1', 'r2'], ['base', 'lb2', 'rowptr', 'bcast', 'rowptr_bcast', 'all3'] if ONLY_ROWS else ['base', 'ld', 'st', 'both', 'last', 'nc']),
    'lneager.cu': (named(r'layer_norm_f32_rows512x16x4'), [], [], ['base']),
}
if not ONLY_ROWS:
    kernels['softmax.cu'] = (named(r'fused_amax_sub_exp_sum_div\w*_r512x16x4'), ['r0'], [], ['base', 'ld', 'st', 'both', 'last', 'nc'])
    kernels['bias_gelu.cu'] = (named(r'fused_add_gelu\w*_f32_v8'), ['p0'], ['p1'], ['base', 'ld', 'st', 'both', 'last', 'nc'])
import os
os.makedirs('build', exist_ok=True)
decls = []
for f, (name, streamed, reused, tags) in kernels.items():
    src = logged[name]
    short = f.split('.')[0]
    for tag in tags:
        s = src.replace('struct __align__', HELP + 'struct __align__', 1)
        if tag in ('ld', 'both'):
            for p in streamed:
                s = re.sub(r'\*\(const (V\w+)\*\)\((' + p + r' \+ \w+)\)', r'ldcs_((const \1*)(\2))', s)
        if tag in ('st', 'both'):
            s = re.sub(r'\*\((VO\w+)\*\)\(([^;]*?)\) = (\w+);', r'stcs_((\1*)(\2), \3);', s)
        if tag in ('last', 'nc'):
            for p in reused:
                s = re.sub(r'\*\(const (V\w+)\*\)\((' + p + r' \+ \w+)\)', ('ldlast_' if tag == 'last' else 'ldnc_') + r'((const \1*)(\2))', s)
        if tag in ('rsqrt', 'both2'):
            s = re.sub(r'\(\(float\)1 / sqrtf\((\(\w+\))\)\)', r'rsqrtf(\1)', s)
        if tag in ('lb1', 'lb2'):
            s = s.replace('__launch_bounds__(512)', f'__launch_bounds__(512, {tag[2]})')
        if tag in ('rowptr', 'rowptr_bcast', 'all3'):
            # The output row's address once per row, as the eager kernel has it.
            s = s.replace('    float ax0[VPT];', '    float ax0[VPT];\n    float* __restrict__ yo0 = out0 + row * (long long)K;', 1)
            s = s.replace('*(VO0*)(out0 + row * (long long)K + k0) = o0;', '*(VO0*)(yo0 + k0) = o0;')
        if tag in ('bcast', 'rowptr_bcast', 'all3'):
            # Weight and bias (row stride 0 here) read without a row offset.
            s = s.replace('p1 + row * rs1', 'p1').replace('p2 + row * rs2', 'p2')
        if tag == 'all3':
            s = s.replace(' __restrict__', '')
        if tag in ('norestrict', 'both2'):
            s = s.replace(' __restrict__', '')
        s = s.replace(name, f'{short}_{tag}')
        # Helpers of the shared prelude stay private to each file.
        s = 'namespace {\n' + s + '\n}\n'
        s += f'\nvoid launch_{short}_{tag}(const void* a, unsigned grid, unsigned block) {{ {short}_{tag}<<<grid, block>>>(*(const LaunchArgs*)a); }}\n'
        open(f'build/{short}_{tag}.cu', 'w').write(s)
        decls.append(f'void launch_{short}_{tag}(const void* a, unsigned grid, unsigned block);')
harness = r'''
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstring>
template <class F> float med(F f) {
  cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e); std::vector<float> t;
  for (int i = 0; i < 5; i++) f();
  for (int i = 0; i < 31; i++) { cudaEventRecord(s); for (int r = 0; r < 10; r++) f(); cudaEventRecord(e); cudaEventSynchronize(e); float ms; cudaEventElapsedTime(&ms, s, e); t.push_back(ms * 100); }
  std::sort(t.begin(), t.end()); return t[15];
}
// One call at a time with the device idle, on the same input each time (as the bench times).
template <class F> float alone(F f) {
  cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e); std::vector<float> t;
  for (int i = 0; i < 5; i++) f();
  for (int i = 0; i < 31; i++) { cudaDeviceSynchronize(); cudaEventRecord(s); f(); cudaEventRecord(e); cudaEventSynchronize(e); float ms; cudaEventElapsedTime(&ms, s, e); t.push_back(ms * 1000); }
  std::sort(t.begin(), t.end()); return t[15];
}
int main() {
  const long long M = 8192, K = 8192; float *x, *w, *b, *y;
  cudaMalloc(&x, M * K * 4); cudaMalloc(&y, M * K * 4); cudaMalloc(&w, K * 4); cudaMalloc(&b, K * 4);
  cudaMemset(x, 0x3c, M * K * 4); cudaMemset(w, 0x3c, K * 4); cudaMemset(b, 0x3c, K * 4);
  double bytes = 2.0 * M * K * 4;
  float tc = med([&] { cudaMemcpyAsync(y, x, M * K * 4, cudaMemcpyDeviceToDevice); });
  float tci = alone([&] { cudaMemcpyAsync(y, x, M * K * 4, cudaMemcpyDeviceToDevice); });
  printf("memcpy back to back %8.1f us, one call %8.1f us\n", tc, tci);
  LaunchArgs ln = {}; ln.w[0] = M; ln.w[1] = K; ln.w[2] = (u64)y; ln.w[3] = (u64)x; ln.w[4] = K; ln.w[5] = 1; ln.w[6] = (u64)w; ln.w[7] = 0; ln.w[8] = 1; ln.w[9] = (u64)b; ln.w[10] = 0; ln.w[11] = 1;
  LaunchArgs le = {}; le.w[0] = (u64)x; le.w[1] = (u64)y; le.w[2] = (u64)w; le.w[3] = (u64)b; le.w[4] = M; le.w[5] = K; double eps = 1e-5; memcpy(&le.w[6], &eps, 8);
  LaunchArgs sm = {}; sm.w[0] = M; sm.w[1] = K; sm.w[2] = (u64)y; sm.w[3] = (u64)x; sm.w[4] = K; sm.w[5] = 1;
  LaunchArgs bg = {}; bg.w[0] = M * K; bg.w[1] = (u64)y; bg.w[2] = (u64)x; bg.w[3] = (u64)b; bg.w[4] = 8192; bg.w[5] = 8192; bg.w[6] = 0; bg.w[7] = 1;
  struct V { const char* n; void (*k)(const void*, unsigned, unsigned); LaunchArgs* a; unsigned grid, block; } vs[] = {
@VS@
  };
  for (int rep = 0; rep < 2; rep++) for (auto& v : vs) {
    float t = med([&] { v.k(v.a, v.grid, v.block); });
    float ti = alone([&] { v.k(v.a, v.grid, v.block); });
    cudaError_t e = cudaGetLastError(); if (e != cudaSuccess) { printf("%s: %s\n", v.n, cudaGetErrorString(e)); return 1; }
    printf("%-24s back to back %8.1f us (%.1f%% of memcpy)   one call %8.1f us (%.1f%% of memcpy)\n", v.n, t, 100 * tc / t, ti, 100 * tci / ti);
  }
}
'''
vs = []
for f, (name, _, _, tags) in kernels.items():
    short = f.split('.')[0]
    args, grid, block = {'layernorm': ('&ln', 8192, 512), 'lneager': ('&le', 8192, 512), 'softmax': ('&sm', 8192, 512), 'bias_gelu': ('&bg', 32768, 256)}[short]
    vs += [f'    {{"{short} {tag}", launch_{short}_{tag}, {args}, {grid}, {block}}},' for tag in tags]
harness = harness.replace("@VS@", '\n'.join(vs))
open('build/harness.cu', 'w').write('typedef unsigned long long u64;\nstruct LaunchArgs { u64 w[64]; };\n' + '\n'.join(decls) + harness)
