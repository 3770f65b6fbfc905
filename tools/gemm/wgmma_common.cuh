// Shared by gemm_wgmma.cu, gemm_wgmma3.cu and gemm_wgmma4.cu (inside their anonymous namespace):
// TF32 rounding, cp.async copies, the warpgroup product with A from registers (64 x BN, BN 64 or
// 128), its fences,
// the store of a finished tile, and split-K (how many splits, the in-order sum of partials).

__device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

#define D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// d (64 x BN, BN / 2 floats per thread) = a * b (+ d when acc != 0); a from registers.
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t b, int acc) {
#if BN == 64
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : D8(0), D8(8), D8(16), D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : D8(0), D8(8), D8(16), D8(24), D8(32), D8(40), D8(48), D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
#endif
}

// 16-byte asynchronous copies into shared memory (zeros when !ok), their groups and waits.
__device__ __forceinline__ void cp16(float* dst, const float* src, bool ok) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// C = the splits' partial tiles added in split order (+ bias, then ReLU).
__global__ void add_splits(const float* __restrict__ part, float* __restrict__ C, const float* __restrict__ bias, int M, int N, int ldc, int S, int epi) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= (long long)M * N) return;
    const int m = (int)(i / N), n = (int)(i % N);
    float v = part[i];
    for (int z = 1; z < S; z++) v += part[(long long)z * M * N + i];
    if (epi >= 1) v += bias[n];
    if (epi == 2) v = fmaxf(v, 0.f);
    C[(long long)m * ldc + n] = v;
}

// Stores this thread's share of a 64 x BN accumulator tile (rows r0 and r0 + 8, columns
// n0 + 8j + 2q + {0, 1}): into C with the epilogue, or, when K is split, into split z's partial.
__device__ __forceinline__ void store_tile(const float* acc, int r0, int n0, int q, int M, int N, float* C, int ldc, float* part, int S, int z, const float* bias, int epi) {
    float* out = S == 1 ? C : part + (long long)z * M * N;
    const int ld = S == 1 ? ldc : N;
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int r = r0 + 8 * h, n = n0 + 8 * j + 2 * q + e;
                if (r >= M || n >= N) continue;
                float v = acc[4 * j + 2 * h + e];
                if (S == 1) {
                    if (epi >= 1) v += bias[n];
                    if (epi == 2) v = fmaxf(v, 0.f);
                }
                out[(long long)r * ld + n] = v;
            }
}

// Splits of K so that about `target` CTAs run, each split at least two chunks; `part` (grown as
// needed) holds their partial tiles.
static int split_count(int M, int N, int K, int target, float** part) {
    static size_t cap = 0;
    const int tiles = ((N + BN - 1) / BN) * ((M + 63) / 64), chunks = (K + KC - 1) / KC;
    int S = (target + tiles - 1) / tiles;
    if (S > chunks / 2) S = chunks / 2;
    if (S < 1) S = 1;
    const size_t need = (size_t)S * M * N;
    if (S > 1 && need > cap) { cudaFree(*part); cudaMalloc(part, need * 4); cap = need; }
    return S;
}

static void finish_splits(const float* part, float* C, const float* bias, int M, int N, int ldc, int S, int epi, cudaStream_t st) {
    if (S > 1) add_splits<<<(unsigned)(((long long)M * N + 255) / 256), 256, 0, st>>>(part, C, bias, M, N, ldc, S, epi);
}
