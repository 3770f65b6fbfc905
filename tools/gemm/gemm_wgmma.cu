// FP32 matrix product on Hopper's warpgroup tensor-core instructions (wgmma), to FP32 accuracy:
// 3xTF32 (each operand split as big = tf32(x) and small = tf32(x - big); a*b summed as
// small_a*big_b + big_a*small_b + big_a*big_b), with the tensor cores' partial sums promoted into
// FP32 registers every KC columns of K (the tensor cores truncate while they accumulate, so
// partial sums over short runs keep the error near plain FP32's).
//
// C[M,N] = A[M,K] B (+ bias[N]) (then ReLU). A row-major (lda); B [N,K] row-major (B_NK 1, a
// Linear's weight) or [K,N] row-major (B_NK 0), leading dim ldb; C row-major (ldc). Any sizes.
//
// One warpgroup (128 threads) per 64 x BN tile of C; A's fragments come from registers (loaded
// and split by each thread), B's big and small parts go through shared memory in the
// no-swizzle K-major layout of 8 x 16-byte core matrices. K may be split over gridDim.z: each
// split writes its partial tile to `part`, and a second kernel adds them in split order.
//
// Set before inclusion: KNAME, BN (64), B_NK, LAYOUT (0: the descriptor's leading offset is
// along K, 1: along N), PROMOTE (1: partial sums per KC columns added in FP32; 0: one long
// tensor-core accumulation). Built with -arch=sm_90a.
#include <cuda_runtime.h>
#include <stdint.h>

#define KC 32
#define NTH 128
// B's parts in shared memory: core matrices (8 rows of n x 4 columns of k, 16 bytes a row)
// KOFF bytes apart along K, NOFF along N. The descriptor names the two offsets "leading" (LBO)
// and "stride" (SBO); which is which for K-major operands is what LAYOUT chooses.
#define KOFF 128
#define NOFF 256
#if LAYOUT == 0
#define LBO KOFF
#define SBO NOFF
#else
#define LBO NOFF
#define SBO KOFF
#endif
// Floats of one part (big or small) of one k8 step of the B tile, and of a whole KC chunk.
#define STEP_F (BN * 8)
#define CHUNK_F (STEP_F * (KC / 8))

namespace {

#include "wgmma_common.cuh"

__device__ __forceinline__ uint64_t smem_desc(const float* p) {
    const uint64_t a = (uint64_t)__cvta_generic_to_shared(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)(LBO >> 4) << 16) | ((uint64_t)(SBO >> 4) << 32);
}

// Where B element (n, k) of a chunk sits in one part's buffer.
__device__ __forceinline__ int b_slot(int n, int k) {
    return (k >> 3) * STEP_F + (n >> 3) * (NOFF / 4) + ((k >> 2) & 1) * (KOFF / 4) + (n & 7) * 4 + (k & 3);
}


}  // namespace

extern "C" __global__ void __launch_bounds__(NTH) KNAME(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, const float* __restrict__ bias, int M, int N, int K, int lda, int ldb, int ldc, float* __restrict__ part, int epi) {
    extern __shared__ __align__(128) float smem[];
    float* sbig = smem;
    float* ssmall = smem + CHUNK_F;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m0 = blockIdx.y * 64, n0 = blockIdx.x * BN;
    // This split's columns of K, in whole chunks.
    const int chunks = (K + KC - 1) / KC, S = gridDim.z, z = blockIdx.z;
    const int c_lo = (int)((long long)chunks * z / S), c_hi = (int)((long long)chunks * (z + 1) / S);

    // This thread's rows of A (its fragment rows) and its share of B's chunk.
    const int ar0 = m0 + 16 * warp + (lane >> 2), ar1 = ar0 + 8, ak = lane & 3;
    float ra[KC / 8][4];
    float rb[BN * KC / NTH];
    auto load = [&](int c) {
        const int k0 = c * KC;
#pragma unroll
        for (int s = 0; s < KC / 8; s++) {
            const int ka = k0 + 8 * s + ak, kb = ka + 4;
            ra[s][0] = (ar0 < M && ka < K) ? A[(long long)ar0 * lda + ka] : 0.f;
            ra[s][1] = (ar1 < M && ka < K) ? A[(long long)ar1 * lda + ka] : 0.f;
            ra[s][2] = (ar0 < M && kb < K) ? A[(long long)ar0 * lda + kb] : 0.f;
            ra[s][3] = (ar1 < M && kb < K) ? A[(long long)ar1 * lda + kb] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < BN * KC / NTH; i++) {
#if B_NK
            // consecutive threads along k (8 threads x 4 columns per row of B)
            const int e = i * NTH + tid, n = e / KC, k = e % KC;
            const int gn = n0 + n, gk = k0 + k;
            rb[i] = (gn < N && gk < K) ? B[(long long)gn * ldb + gk] : 0.f;
#else
            const int e = i * NTH + tid, k = e / BN, n = e % BN;
            const int gn = n0 + n, gk = k0 + k;
            rb[i] = (gn < N && gk < K) ? B[(long long)gk * ldb + gn] : 0.f;
#endif
        }
    };

    float acc[BN / 2];
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) acc[i] = d[i] = 0.f;
    if (c_lo < c_hi) load(c_lo);
    for (int c = c_lo; c < c_hi; c++) {
        __syncthreads();  // the previous chunk's products have read the buffers
#pragma unroll
        for (int i = 0; i < BN * KC / NTH; i++) {
#if B_NK
            const int e = i * NTH + tid, n = e / KC, k = e % KC;
#else
            const int e = i * NTH + tid, k = e / BN, n = e % BN;
#endif
            const uint32_t big = to_tf32(rb[i]);
            sbig[b_slot(n, k)] = __uint_as_float(big);
            ssmall[b_slot(n, k)] = __uint_as_float(to_tf32(rb[i] - __uint_as_float(big)));
        }
        uint32_t abig[KC / 8][4], asmall[KC / 8][4];
#pragma unroll
        for (int s = 0; s < KC / 8; s++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                abig[s][j] = to_tf32(ra[s][j]);
                asmall[s][j] = to_tf32(ra[s][j] - __uint_as_float(abig[s][j]));
            }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        wg_fence();
#pragma unroll
        for (int s = 0; s < KC / 8; s++) {
            const uint64_t db = smem_desc(sbig + s * STEP_F), ds = smem_desc(ssmall + s * STEP_F);
            wgmma_rs(d, asmall[s], db, PROMOTE ? s > 0 : 1);
            wgmma_rs(d, abig[s], ds, 1);
            wgmma_rs(d, abig[s], db, 1);
        }
        wg_commit();
        if (c + 1 < c_hi) load(c + 1);  // in flight while the products run
        wg_wait();
#if PROMOTE
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] += d[i];
#endif
    }
#if !PROMOTE
#pragma unroll
    for (int i = 0; i < BN / 2; i++) acc[i] = d[i];
#endif
    // Accumulator layout: per 8 columns j, (row r0, cols 2q, 2q+1) then (row r0 + 8, same).
    store_tile(acc, ar0, n0, lane & 3, M, N, C, ldc, part, S, z, bias, epi);
}

#ifdef LAUNCHER
// K split so that about one wave of tiles runs.
extern "C" void LAUNCHER(const float* A, const float* B, float* C, const float* bias, int M, int N, int K, int lda, int ldb, int ldc, cudaStream_t st) {
    static float* part = nullptr;
    const int S = split_count(M, N, K, 132, &part);
    KNAME<<<dim3((N + BN - 1) / BN, (M + 63) / 64, S), NTH, 2 * CHUNK_F * 4, st>>>(A, B, C, bias, M, N, K, lda, ldb, ldc, part, EPI);
    finish_splits(part, C, bias, M, N, ldc, S, EPI, st);
}
#endif
