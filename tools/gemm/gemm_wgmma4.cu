// FP32 matrix product on wgmma, 3xTF32 with partial sums promoted into FP32 registers every
// 32 columns of K, with no operand prepared ahead of time (B is a weight as it is now):
//   - every thread copies (cp.async) exactly the raw FP32 values it will itself split: its A
//     fragments and a quarter of a B column piece, so no barrier guards the raw stages;
//   - K is permuted inside each 32-column chunk (the same permutation for A and B, so the sum
//     is unchanged) such that a thread's A fragments are 8 consecutive columns of two rows:
//     logical column s * 8 + a + 4h of a chunk holds its column 8a + 2s + h;
//   - the thread splits its B values into big and small TF32 parts, stored into one of three
//     shared buffers in the K-major core-matrix layout wgmma reads; one barrier per chunk;
//   - chunk c + 1 is split while chunk c's twelve products run, then they are waited for and
//     added into the FP32 sum (two accumulators taking turns were serialized by ptxas: NOTES.md);
//   - K may be split over gridDim.z; the last split of a tile to finish (an atomic counter)
//     adds the partial tiles in split order (deterministic) and applies the epilogue.
// C[M,N] = A[M,K] B (+ bias[N]) (then ReLU); A row-major (lda), B given as [N,K] (ldb).
// Needs K, lda, ldb multiples of 4 and 16-byte aligned A and B. One warpgroup per 64 x 64
// tile, two CTAs per SM. Set before inclusion: KNAME, STAGES (raw chunks in flight).
#include <cuda_runtime.h>
#include <stdint.h>

#define BN 64
#define BM 64
#define KC 32
#define NTH 128
#define KOFF 128  // bytes between core matrices adjacent along K (the descriptor's leading offset)
#define NOFF 256  // ... along N (its stride offset)
#define RAW_F (2 * KC * BM)         // floats of one raw stage: A then B, 16 per thread each
#define BSTEP (BN * 8)              // floats of one k8 step of one B part
#define BPART (BSTEP * (KC / 8))    // floats of one B part of a chunk
#define SPLIT_F (2 * BPART)         // one split buffer: big then small
#define SMEM_BYTES ((STAGES * RAW_F + 3 * SPLIT_F) * 4)

namespace {

#include "wgmma_common.cuh"

__device__ __forceinline__ uint64_t smem_desc(const float* p) {
    const uint64_t a = (uint64_t)__cvta_generic_to_shared(p);
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)(KOFF >> 4) << 16) | ((uint64_t)(NOFF >> 4) << 32);
}

__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

}  // namespace

extern "C" __global__ void __launch_bounds__(NTH, 2) KNAME(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, const float* __restrict__ bias, int M, int N, int K, int lda, int ldb, int ldc, float* __restrict__ ws, unsigned int* __restrict__ counters) {
    extern __shared__ __align__(128) float smem[];
    float* raw = smem;
    float* split = smem + STAGES * RAW_F;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int chunks = (K + KC - 1) / KC, S = gridDim.z, z = blockIdx.z;
    const int c_lo = (int)((long long)chunks * z / S), c_hi = (int)((long long)chunks * (z + 1) / S);
    const int n_chunks = c_hi - c_lo;

    // This thread's A rows (r0, r0 + 8) and column group a = lane & 3 (8 columns of a chunk).
    const int r0 = 16 * warp + (lane >> 2), ga = lane & 3;
    // Its B pieces: q-th float4 is column n = 8 * (v >> 6) + (v & 7), chunk columns 8a + 4b.
    auto b_piece = [&](int q, int& n, int& a, int& b) {
        const int v = q * NTH + tid;
        n = 8 * (v >> 6) + (v & 7); a = (v >> 3) & 3; b = (v >> 5) & 1;
    };
    // Queues the raw copies of chunk c (an empty group past the end keeps the count even).
    auto issue = [&](int c) {
        if (c < c_hi) {
            float* st = raw + (c % STAGES) * RAW_F;
            const int k0 = c * KC;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = r0 + 8 * (q >> 1), k = k0 + 8 * ga + 4 * (q & 1);
                const bool ok = m0 + r < M && k < K;
                cp16(st + 4 * (q * NTH + tid), ok ? A + (long long)(m0 + r) * lda + k : A, ok);
            }
#pragma unroll
            for (int q = 0; q < 4; q++) {
                int n, a, b;
                b_piece(q, n, a, b);
                const int k = k0 + 8 * a + 4 * b;
                const bool ok = n0 + n < N && k < K;
                cp16(st + 4 * (4 * NTH + q * NTH + tid), ok ? B + (long long)(n0 + n) * ldb + k : B, ok);
            }
        }
        cp_commit();
    };
    // Splits raw chunk c (this thread's own copies): A fragments into registers, B into
    // split buffer `sb` at the permuted positions.
    auto split_chunk = [&](int c, uint32_t (&ab)[KC / 8][4], uint32_t (&as)[KC / 8][4], float* sb) {
        const float* st = raw + (c % STAGES) * RAW_F;
        float av[16];
#pragma unroll
        for (int q = 0; q < 4; q++) *(float4*)(av + 4 * q) = *(const float4*)(st + 4 * (q * NTH + tid));
#pragma unroll
        for (int s = 0; s < KC / 8; s++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float x = av[(j & 1) * 8 + 2 * s + (j >> 1)];
                ab[s][j] = to_tf32(x);
                as[s][j] = to_tf32(x - __uint_as_float(ab[s][j]));
            }
#pragma unroll
        for (int q = 0; q < 4; q++) {
            int n, a, b;
            b_piece(q, n, a, b);
            const float4 v = *(const float4*)(st + 4 * (4 * NTH + q * NTH + tid));
            const float x[4] = {v.x, v.y, v.z, v.w};
            const int base = (n >> 3) * (NOFF / 4) + (n & 7) * 4 + a;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                // chunk column 8a + 4b + e is logical column s * 8 + a + 4h
                const int s = 2 * b + (e >> 1), h = e & 1;
                const uint32_t hi = to_tf32(x[e]);
                float* p = sb + s * BSTEP + h * (KOFF / 4) + base;
                p[0] = __uint_as_float(hi);
                p[BPART] = __uint_as_float(to_tf32(x[e] - __uint_as_float(hi)));
            }
        }
    };
    auto mma = [&](float* d, const uint32_t (&ab)[KC / 8][4], const uint32_t (&as)[KC / 8][4], const float* sb) {
        wg_fence();
#pragma unroll
        for (int s = 0; s < KC / 8; s++) {
            const uint64_t bb = smem_desc(sb + s * BSTEP), bs = smem_desc(sb + BPART + s * BSTEP);
            wgmma_rs(d, as[s], bb, s > 0);
            wgmma_rs(d, ab[s], bs, 1);
            wgmma_rs(d, ab[s], bb, 1);
        }
        wg_commit();
    };

    float acc[BN / 2], d[BN / 2];
    uint32_t ab[2][KC / 8][4], as[2][KC / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) acc[i] = 0.f;
#pragma unroll
    for (int s = 0; s < STAGES; s++) issue(c_lo + s);
    if (n_chunks > 0) {
        cp_wait<STAGES - 1>();
        split_chunk(c_lo, ab[0], as[0], split);
        issue(c_lo + STAGES);
    }
    // One accumulator: chunk i + 1 is split while chunk i's products run, then they are
    // waited for and promoted (the other CTA on the SM keeps the tensor cores busy meanwhile).
    for (int i0 = 0; i0 < n_chunks; i0 += 2) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int i = i0 + h;
            if (i >= n_chunks) break;
            fence_async();
            __syncthreads();  // chunk i split by all; chunk i - 1's products done in every warp
            mma(d, ab[h], as[h], split + (i % 3) * SPLIT_F);
            if (i + 1 < n_chunks) {
                cp_wait<STAGES - 1>();
                split_chunk(c_lo + i + 1, ab[h ^ 1], as[h ^ 1], split + ((i + 1) % 3) * SPLIT_F);
                issue(c_lo + i + 1 + STAGES);
            }
            wg_wait();
#pragma unroll
            for (int e = 0; e < BN / 2; e++) acc[e] += d[e];
        }
    }
    cp_wait<0>();

    // Accumulator layout: per 8 columns j, (row r, cols 2q, 2q+1) then (row r + 8, same).
    const int q = lane & 3, row = m0 + r0;
    const long long plane = (long long)M * N;
    // Calls f(index into acc, row, column) for each of this thread's outputs inside C.
    auto each_output = [&](auto f) {
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int r = row + 8 * hh, n = n0 + 8 * j + 2 * q + e;
                    if (r < M && n < N) f(4 * j + 2 * hh + e, r, n);
                }
    };
    if (S > 1) {
        float* part = ws + (long long)z * plane;
        each_output([&](int i, int r, int n) { part[(long long)r * N + n] = acc[i]; });
        __shared__ int last;
        __threadfence();
        __syncthreads();
        unsigned int* ctr = counters + blockIdx.y * gridDim.x + blockIdx.x;
        if (tid == 0) last = atomicAdd(ctr, 1u) == (unsigned int)(S - 1);
        __syncthreads();
        if (!last) return;
        __threadfence();
        each_output([&](int i, int r, int n) {
            float s = 0.f;
            for (int p = 0; p < S; p++) s += __ldcg(ws + p * plane + (long long)r * N + n);
            acc[i] = s;
        });
        if (tid == 0) *ctr = 0u;
    }
    each_output([&](int i, int r, int n) {
        float v = acc[i];
#if EPI >= 1
        v += bias[n];
#endif
#if EPI == 2
        v = fmaxf(v, 0.f);
#endif
        C[(long long)r * ldc + n] = v;
    });
}

#ifdef LAUNCHER
// K is split so that about SPLIT_TARGET CTAs run (at least MIN_CHUNKS chunks per split).
extern "C" void LAUNCHER(const float* A, const float* B, float* C, const float* bias, int M, int N, int K, int lda, int ldb, int ldc, cudaStream_t st) {
    static float* ws = nullptr;
    static unsigned int* counters = nullptr;
    static size_t cap = 0;
    static bool init = false;
    if (!init) {
        cudaFuncSetAttribute(KNAME, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
        cudaMalloc(&counters, 65536 * 4);
        cudaMemset(counters, 0, 65536 * 4);
        init = true;
    }
    const int tiles = ((N + BN - 1) / BN) * ((M + BM - 1) / BM), chunks = (K + KC - 1) / KC;
    int S = (SPLIT_TARGET + tiles - 1) / tiles;
    if (S > chunks / MIN_CHUNKS) S = chunks / MIN_CHUNKS;
    if (S < 1) S = 1;
    const size_t need = (size_t)S * M * N;
    if (S > 1 && need > cap) { cudaFree(ws); cudaMalloc(&ws, need * 4); cap = need; }
    KNAME<<<dim3((N + BN - 1) / BN, (M + BM - 1) / BM, S), NTH, SMEM_BYTES, st>>>(A, B, C, bias, M, N, K, lda, ldb, ldc, ws, counters);
}
#endif
