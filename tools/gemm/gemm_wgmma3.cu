// FP32 matrix product on wgmma, 3xTF32 with partial sums promoted into FP32 registers every KC
// columns of K (see gemm_wgmma.cu for the arithmetic), with B split ahead of time:
//   - B's big and small TF32 parts are made once (`split_b`: a weight's parts can be kept while
//     the weight is unchanged) as [N, K] row-major arrays;
//   - raw FP32 tiles of A and the B parts arrive in shared memory by cp.async, STAGES chunks
//     ahead; B's 16-byte pieces land directly in the K-major core-matrix layout wgmma reads;
//   - each thread reads its A fragments from the staged tile and splits them in registers;
//   - K may be split over gridDim.z; `add_splits` adds the partial tiles in split order.
// C[M,N] = A[M,K] B (+ bias[N]) (then ReLU); A row-major (lda), B given as [N,K] (ldb).
// Needs K, lda, ldb multiples of 4 and 16-byte aligned A and B parts. One warpgroup per
// 64 x BN tile of C. Set before inclusion: KNAME, BN (64 or 128), STAGES, OVERLAP (two
// accumulators, products of one chunk running while the next is prepared). sm_90a.
#include <cuda_runtime.h>
#include <stdint.h>

#define BM 64
#define KC 32
#define NTH 128
#define KOFF 128  // bytes between core matrices adjacent along K (the descriptor's leading offset)
#define NOFF 256  // ... along N (its stride offset)
#define APAD 36   // staged A rows: 32 floats + 4 (conflict-free fragment reads)
#define STAGE_A (BM * APAD)
#define BSTEP (BN * 8)              // floats of one k8 step of one B part
#define BPART (BSTEP * (KC / 8))    // floats of one B part of a chunk
#define STAGE_F (STAGE_A + 2 * BPART)
#define SMEM_BYTES (STAGES * STAGE_F * 4)

namespace {

#include "wgmma_common.cuh"


__device__ __forceinline__ uint64_t smem_desc(const float* p) {
    const uint64_t a = (uint64_t)__cvta_generic_to_shared(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)(KOFF >> 4) << 16) | ((uint64_t)(NOFF >> 4) << 32);
}

// Where element (n, k) of a chunk of one B part sits (K-major core matrices).
__device__ __forceinline__ int slot(int n, int k) {
    return (k >> 3) * BSTEP + (n >> 3) * (NOFF / 4) + ((k >> 2) & 1) * (KOFF / 4) + (n & 7) * 4 + (k & 3);
}




// big = tf32(b), small = tf32(b - big), element by element ([N,K] in and out).
__global__ void split_b(const float* __restrict__ b, float* __restrict__ big, float* __restrict__ small, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint32_t hi = to_tf32(b[i]);
    big[i] = __uint_as_float(hi);
    small[i] = __uint_as_float(to_tf32(b[i] - __uint_as_float(hi)));
}


}  // namespace

extern "C" __global__ void __launch_bounds__(NTH) KNAME(const float* __restrict__ A, const float* __restrict__ Bbig, const float* __restrict__ Bsmall, float* __restrict__ C, const float* __restrict__ bias, int M, int N, int K, int lda, int ldb, int ldc, float* __restrict__ part, int epi) {
    extern __shared__ __align__(128) float smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int chunks = (K + KC - 1) / KC, S = gridDim.z, z = blockIdx.z;
    const int c_lo = (int)((long long)chunks * z / S), c_hi = (int)((long long)chunks * (z + 1) / S);

    // Queues chunk c's copies (an empty group past the end keeps the group count even).
    auto issue = [&](int c) {
        if (c < c_hi) {
            float* sa = smem + (c % STAGES) * STAGE_F;
            float* sb = sa + STAGE_A;
            const int k0 = c * KC;
#pragma unroll
            for (int i = 0; i < BM * KC / 4 / NTH; i++) {
                const int v = i * NTH + tid, r = v >> 3, k4 = (v & 7) * 4;
                const bool ok = m0 + r < M && k0 + k4 < K;
                cp16(sa + r * APAD + k4, ok ? A + (long long)(m0 + r) * lda + k0 + k4 : A, ok);
            }
#pragma unroll
            for (int i = 0; i < BN * KC / 4 / NTH; i++) {
                const int v = i * NTH + tid, n = v >> 3, k4 = (v & 7) * 4;
                const bool ok = n0 + n < N && k0 + k4 < K;
                const long long off = (long long)(n0 + n) * ldb + k0 + k4;
                cp16(sb + slot(n, k4), ok ? Bbig + off : Bbig, ok);
                cp16(sb + BPART + slot(n, k4), ok ? Bsmall + off : Bsmall, ok);
            }
        }
        cp_commit();
    };

    float acc[BN / 2];
    const int ar = 16 * warp + (lane >> 2), ak = lane & 3;
    // This thread's A fragments of chunk c, split (from the staged tile).
    auto frags = [&](int c, uint32_t (&abig)[KC / 8][4], uint32_t (&asmall)[KC / 8][4]) {
        const float* sa = smem + (c % STAGES) * STAGE_F;
#pragma unroll
        for (int s = 0; s < KC / 8; s++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float x = sa[(ar + 8 * (j & 1)) * APAD + 8 * s + ak + 4 * (j >> 1)];
                abig[s][j] = to_tf32(x);
                asmall[s][j] = to_tf32(x - __uint_as_float(abig[s][j]));
            }
    };
    auto mma = [&](int c, float* d, const uint32_t (&abig)[KC / 8][4], const uint32_t (&asmall)[KC / 8][4]) {
        const float* sb = smem + (c % STAGES) * STAGE_F + STAGE_A;
        wg_fence();
#pragma unroll
        for (int s = 0; s < KC / 8; s++) {
            const uint64_t bb = smem_desc(sb + s * BSTEP), bs = smem_desc(sb + BPART + s * BSTEP);
            wgmma_rs(d, asmall[s], bb, s > 0);
            wgmma_rs(d, abig[s], bs, 1);
            wgmma_rs(d, abig[s], bb, 1);
        }
        wg_commit();
    };
#pragma unroll
    for (int i = 0; i < BN / 2; i++) acc[i] = 0.f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue(c_lo + s);
#if OVERLAP
    // Two accumulators: chunk c's products run while chunk c - 1's are added into acc, the
    // next copies are queued and chunk c + 1's fragments are split.
    float d0[BN / 2], d1[BN / 2];
    uint32_t ab0[KC / 8][4], as0[KC / 8][4], ab1[KC / 8][4], as1[KC / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d0[i] = d1[i] = 0.f;
    for (int c = c_lo; c < c_hi; c += 2) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int cc = c + half;
            if (cc >= c_hi) break;
            cp_wait<STAGES - 2>();
            __syncthreads();  // chunk cc staged by all
            if (half == 0) { frags(cc, ab0, as0); mma(cc, d0, ab0, as0); }
            else { frags(cc, ab1, as1); mma(cc, d1, ab1, as1); }
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // chunk cc - 1 done
            if (cc > c_lo) {
                float* dp = half == 0 ? d1 : d0;
#pragma unroll
                for (int i = 0; i < BN / 2; i++) acc[i] += dp[i];
            }
            __syncthreads();  // chunk cc - 1's stage read by every warp's products
            issue(cc + STAGES - 1);
        }
    }
    if (c_lo < c_hi) {
        wg_wait();
        float* dp = ((c_hi - 1 - c_lo) & 1) ? d1 : d0;
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] += dp[i];
    }
#else
    float d[BN / 2];
    uint32_t abig[KC / 8][4], asmall[KC / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
    for (int c = c_lo; c < c_hi; c++) {
        cp_wait<STAGES - 2>();
        if (c > c_lo) {
            wg_wait();  // chunk c - 1's products: its stage and A registers are free again
#pragma unroll
            for (int i = 0; i < BN / 2; i++) acc[i] += d[i];
        }
        __syncthreads();  // chunk c staged by all, chunk c - 1's stage read by all
        issue(c + STAGES - 1);
        frags(c, abig, asmall);
        mma(c, d, abig, asmall);
    }
    if (c_lo < c_hi) {
        wg_wait();
#pragma unroll
        for (int i = 0; i < BN / 2; i++) acc[i] += d[i];
    }
#endif
    cp_wait<0>();
    // Accumulator layout: per 8 columns j, (row r0, cols 2q, 2q+1) then (row r0 + 8, same).
    store_tile(acc, m0 + ar, n0, lane & 3, M, N, C, ldc, part, S, z, bias, epi);
}

#ifdef LAUNCHER
// B's parts are made on the first call for a B (as a weight's would be kept); K is split so
// that about SPLIT_TARGET CTAs run (at least two chunks per split).
extern "C" void LAUNCHER(const float* A, const float* B, float* C, const float* bias, int M, int N, int K, int lda, int ldb, int ldc, cudaStream_t st) {
    static float *part = nullptr, *bbig = nullptr, *bsmall = nullptr;
    static size_t bcap = 0;
    static const float* split_of = nullptr;
    static int split_n = 0, split_k = 0;
    static bool init = false;
    if (!init) { cudaFuncSetAttribute(KNAME, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES); init = true; }
    if (split_of != B || split_n != N || split_k != K) {
        const size_t nb = (size_t)N * ldb;
        if (nb > bcap) { cudaFree(bbig); cudaFree(bsmall); cudaMalloc(&bbig, nb * 4); cudaMalloc(&bsmall, nb * 4); bcap = nb; }
        split_b<<<(unsigned)((nb + 255) / 256), 256, 0, st>>>(B, bbig, bsmall, (long long)nb);
        split_of = B; split_n = N; split_k = K;
    }
    const int S = split_count(M, N, K, SPLIT_TARGET, &part);
    KNAME<<<dim3((N + BN - 1) / BN, (M + BM - 1) / BM, S), NTH, SMEM_BYTES, st>>>(A, bbig, bsmall, C, bias, M, N, K, lda, ldb, ldc, part, EPI);
    finish_splits(part, C, bias, M, N, ldc, S, EPI, st);
}
#endif
