"""Builds variants.cu: each generated kernel (layernorm, softmax, bias_gelu as kiln emitted them)
as is, with streaming loads of its row-varying inputs (ld.global.cs), streaming stores
(st.global.cs), and both, in one harness timing them against cudaMemcpy. Run by
tools/call.sh rows on the GPU machine."""
import re
HELP = r'''
template <class T> __device__ __forceinline__ T ldcs_(const T* p) { T v; const uint4* s = (const uint4*)p; uint4* d = (uint4*)&v;
  _Pragma("unroll") for (int i = 0; i < (int)(sizeof(T) / 16); i++) d[i] = __ldcs(s + i); return v; }
template <class T> __device__ __forceinline__ void stcs_(T* p, const T& v) { uint4* d = (uint4*)p; const uint4* s = (const uint4*)&v;
  _Pragma("unroll") for (int i = 0; i < (int)(sizeof(T) / 16); i++) __stcs(d + i, s[i]); }
'''
kernels = {  # file: (kernel name, streamed input pointer names)
    'layernorm.cu': ('fused_sum_div_sub_mul_sum_div_0_r512x16x4_vvv', ['r0']),
    'softmax.cu': ('fused_amax_sub_exp_sum_div_0_r512x16x4_v', ['r0']),
    'bias_gelu.cu': ('fused_add_gelu_0_f32_v8', ['p0']),
}
import os
os.makedirs('build', exist_ok=True)
decls = []
for f, (name, streamed) in kernels.items():
    src = open(f).read()
    short = f.split('.')[0]
    for tag in ['base', 'ld', 'st', 'both']:
        s = src.replace('struct __align__', HELP + 'struct __align__', 1)
        if tag in ('ld', 'both'):
            for p in streamed:
                s = re.sub(r'\*\(const (V\w+)\*\)\((' + p + r' \+ \w+)\)', r'ldcs_((const \1*)(\2))', s)
        if tag in ('st', 'both'):
            s = re.sub(r'\*\((VO\w+)\*\)\(([^;]*?)\) = (\w+);', r'stcs_((\1*)(\2), \3);', s)
        s = s.replace(name, f'{short}_{tag}')
        # Helpers of the shared prelude stay private to each file.
        s = 'namespace {\n' + s + '\n}\n'
        s += f'\nvoid launch_{short}_{tag}(const void* a, unsigned grid, unsigned block) {{ {short}_{tag}<<<grid, block>>>(*(const KArgs*)a); }}\n'
        open(f'build/{short}_{tag}.cu', 'w').write(s)
        decls.append(f'void launch_{short}_{tag}(const void* a, unsigned grid, unsigned block);')
harness = r'''
#include <cstdio>
#include <vector>
#include <algorithm>
template <class F> float med(F f) {
  cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e); std::vector<float> t;
  for (int i = 0; i < 5; i++) f();
  for (int i = 0; i < 31; i++) { cudaEventRecord(s); for (int r = 0; r < 10; r++) f(); cudaEventRecord(e); cudaEventSynchronize(e); float ms; cudaEventElapsedTime(&ms, s, e); t.push_back(ms * 100); }
  std::sort(t.begin(), t.end()); return t[15];
}
int main() {
  const long long M = 8192, K = 8192; float *x, *w, *b, *y;
  cudaMalloc(&x, M * K * 4); cudaMalloc(&y, M * K * 4); cudaMalloc(&w, K * 4); cudaMalloc(&b, K * 4);
  cudaMemset(x, 0x3c, M * K * 4); cudaMemset(w, 0x3c, K * 4); cudaMemset(b, 0x3c, K * 4);
  double bytes = 2.0 * M * K * 4;
  float tc = med([&] { cudaMemcpyAsync(y, x, M * K * 4, cudaMemcpyDeviceToDevice); });
  printf("memcpy               %8.1f us %6.0f GB/s\n", tc, bytes / tc / 1e3);
  KArgs ln = {}; ln.w[0] = M; ln.w[1] = K; ln.w[2] = (u64)y; ln.w[3] = (u64)x; ln.w[4] = K; ln.w[5] = 1; ln.w[6] = (u64)w; ln.w[7] = 0; ln.w[8] = 1; ln.w[9] = (u64)b; ln.w[10] = 0; ln.w[11] = 1;
  KArgs sm = {}; sm.w[0] = M; sm.w[1] = K; sm.w[2] = (u64)y; sm.w[3] = (u64)x; sm.w[4] = K; sm.w[5] = 1;
  KArgs bg = {}; bg.w[0] = M * K; bg.w[1] = (u64)y; bg.w[2] = (u64)x; bg.w[3] = (u64)b; bg.w[4] = 8192; bg.w[5] = 8192; bg.w[6] = 0; bg.w[7] = 1;
  struct V { const char* n; void (*k)(const void*, unsigned, unsigned); KArgs* a; unsigned grid, block; } vs[] = {
    {"layernorm base", launch_layernorm_base, &ln, 8192, 512}, {"layernorm ld", launch_layernorm_ld, &ln, 8192, 512}, {"layernorm st", launch_layernorm_st, &ln, 8192, 512}, {"layernorm both", launch_layernorm_both, &ln, 8192, 512},
    {"softmax base", launch_softmax_base, &sm, 8192, 512}, {"softmax ld", launch_softmax_ld, &sm, 8192, 512}, {"softmax st", launch_softmax_st, &sm, 8192, 512}, {"softmax both", launch_softmax_both, &sm, 8192, 512},
    {"bias_gelu base", launch_bias_gelu_base, &bg, 32768, 256}, {"bias_gelu ld", launch_bias_gelu_ld, &bg, 32768, 256}, {"bias_gelu st", launch_bias_gelu_st, &bg, 32768, 256}, {"bias_gelu both", launch_bias_gelu_both, &bg, 32768, 256},
  };
  for (int rep = 0; rep < 2; rep++) for (auto& v : vs) {
    float t = med([&] { v.k(v.a, v.grid, v.block); });
    cudaError_t e = cudaGetLastError(); if (e != cudaSuccess) { printf("%s: %s\n", v.n, cudaGetErrorString(e)); return 1; }
    printf("%-20s %8.1f us %6.0f GB/s  %.1f%% of memcpy\n", v.n, t, bytes / t / 1e3, 100 * tc / t);
  }
}
'''
open('build/harness.cu', 'w').write('typedef unsigned long long u64;\nstruct KArgs { u64 w[64]; };\n' + '\n'.join(decls) + harness)
