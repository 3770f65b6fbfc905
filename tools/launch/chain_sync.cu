// How long one dependency between two small kernels costs in a replayed CUDA graph, three ways:
//   plain  no programmatic dependent launch: the next kernel starts once this one has ended;
//   pdl    the next kernel starts at once (griddepcontrol.launch_dependents first) and waits
//          with griddepcontrol.wait for this one to end and flush (kiln's kernels today);
//   flag   the next kernel starts at once and waits instead on a counter this one's blocks
//          add to (release) once their outputs are stored: it spins (acquire) until every block
//          has, without waiting for the grid to end. A memset node zeroes the counters at the
//          graph's start.
// Each of CHAIN kernels has BLOCKS blocks of 256 threads; every block reads the whole vector of
// N floats the kernel before wrote (as a one-row product reads its row) and writes its slice of
// the next: a dependency of every block on every block, as between a decode step's products.
//   nvcc -O2 -arch=sm_90 tools/launch/chain_sync.cu -o chain_sync && ./chain_sync
#include <cstdio>
#include <cuda_runtime.h>

#define N 768
#define THREADS 256
#define CHAIN 60

enum Mode { PLAIN = 0, PDL = 1, FLAG = 2 };

__global__ void __launch_bounds__(THREADS) step(const float* in, float* out, unsigned int* counters, int i, int mode) {
  if (mode != PLAIN) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (mode == PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (mode == FLAG && i > 0) {
    if (threadIdx.x == 0) {
      unsigned int seen;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counters + i - 1) : "memory");
      } while (seen < gridDim.x);
    }
    __syncthreads();
  }
  // The whole row in, one value per thread per pass; a block sum; the block's slice out.
  float s = 0.f;
  for (int k = threadIdx.x; k < N; k += THREADS) s += __ldcg(in + k);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  __shared__ float part[THREADS / 32];
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < THREADS / 32; w++) total += part[w];
  const int per = (N + gridDim.x - 1) / gridDim.x;
  for (int k = blockIdx.x * per + threadIdx.x; k < min(N, (int)(blockIdx.x + 1) * per); k += THREADS) out[k] = in[k] * 0.9f + total * 1e-4f;
  if (mode == FLAG) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counters + i) : "memory");
  }
}

static float run(int mode, int blocks, float* bufs, unsigned int* counters, cudaStream_t st, int warm, int reps) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
  cudaMemsetAsync(counters, 0, CHAIN * sizeof(unsigned int), st);
  for (int i = 0; i < CHAIN; i++) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(THREADS);
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = mode == PLAIN || i == 0 ? 0 : 1;
    cudaLaunchKernelEx(&cfg, step, (const float*)(bufs + (i % 2) * N), bufs + ((i + 1) % 2) * N, counters, i, mode);
  }
  cudaStreamEndCapture(st, &g);
  cudaGraphInstantiate(&ge, g, 0);
  for (int w = 0; w < warm; w++) cudaGraphLaunch(ge, st);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, st);
  for (int r = 0; r < reps; r++) cudaGraphLaunch(ge, st);
  cudaEventRecord(b, st);
  cudaEventSynchronize(b);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, a, b);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) printf("error: %s\n", cudaGetErrorString(e));
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return ms * 1000.f / (reps * CHAIN);
}

int main() {
  float* bufs;
  unsigned int* counters;
  cudaMalloc(&bufs, 2 * N * sizeof(float));
  cudaMalloc(&counters, CHAIN * sizeof(unsigned int));
  cudaMemset(bufs, 0, 2 * N * sizeof(float));
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  const char* names[] = {"plain", "pdl", "flag"};
  printf("us per kernel in a graph of %d dependent kernels (256 threads a block)\n", CHAIN);
  const int grids[] = {32, 96, 132, 192};
  for (int blocks : grids) {
    printf("blocks %4d:", blocks);
    for (int mode = 0; mode < 3; mode++) printf("  %s %.2f", names[mode], run(mode, blocks, bufs, counters, st, 20, 200));
    printf("\n");
  }
  // The values agree across modes (same arithmetic, same order): a race would show here.
  float host[N], ref[N];
  for (int mode = 0; mode < 3; mode++) {
    cudaMemset(bufs, 0, 2 * N * sizeof(float));
    float init[N];
    for (int k = 0; k < N; k++) init[k] = (float)(k % 7);
    cudaMemcpy(bufs, init, sizeof(init), cudaMemcpyHostToDevice);
    run(mode, 132, bufs, counters, st, 0, 1);
    cudaMemcpy(host, bufs, sizeof(host), cudaMemcpyDeviceToHost);
    if (mode == 0) for (int k = 0; k < N; k++) ref[k] = host[k];
    int bad = 0;
    for (int k = 0; k < N; k++) bad += host[k] != ref[k];
    printf("%s: %d of %d values differ from plain\n", names[mode], bad, N);
  }
  return 0;
}
