// FP32 matrix product on tensor cores, to FP32 accuracy ("3xTF32"): each operand x is split as
// big + small with big = tf32(x) and small = tf32(x - big), and a*b is summed as
// big_a*small_b + small_a*big_b + big_a*big_b in FP32 (small*small, below FP32's rounding of the
// product, is left out). Products of tf32 values are exact in the FP32 accumulator, so the error
// is close to plain FP32's; the matrix units make it several times faster than CUDA-core FP32
// on products with few rows, where few output tiles leave most multiprocessors idle.
//
// C[M,N] = A[M,K] B (+ bias[N]) (then ReLU). A is row-major with leading dim lda; B is [K,N]
// row-major (B_NK 0) or [N,K] row-major (B_NK 1: a Linear's weight) with leading dim ldb; C is
// row-major with leading dim ldc. Needs K, lda, ldb (and N when B_NK is 0) multiples of 4 and
// 16-byte aligned A and B: tiles move by 16-byte asynchronous copies.
//
// Set before inclusion: KNAME, BM, BN (block tile), STAGES (copy pipeline depth), B_NK, EPI
// (0: none, 1: bias, 2: bias then ReLU). 128 threads: 2 x 2 warps, each a (BM/2) x (BN/2) tile.

#define BK 32
#define APAD (BK + 4)
#define WTM (BM / 2)
#define WTN (BN / 2)
#define MT (WTM / 16)
#define NT (WTN / 8)
#if B_NK
#define B_ROWS BN
#define BPAD (BK + 4)
#else
#define B_ROWS BK
#define BPAD (BN + 8)
#endif

__device__ __forceinline__ unsigned tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void split(float x, unsigned& big, unsigned& small) {
    big = tf32(x);
    small = tf32(x - __uint_as_float(big));
}

__device__ __forceinline__ void mma(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 16 bytes from global to shared memory, zeros where `ok` is false (the source is not read).
__device__ __forceinline__ void copy16(float* dst, const float* src, bool ok) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    int n = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(n));
}

extern "C" __global__ void __launch_bounds__(128) KNAME(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                                                        const float* __restrict__ bias, int M, int N, int K, int lda, int ldb, int ldc) {
    __shared__ __align__(16) float As[STAGES][BM][APAD];
    __shared__ __align__(16) float Bs[STAGES][B_ROWS][BPAD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 1) * WTM, wn = (warp & 1) * WTN;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tiles = (K + BK - 1) / BK;

    auto load = [&](int stage, int kt) {
        const int k0 = kt * BK;
#pragma unroll
        for (int i = tid; i < BM * BK / 4; i += 128) {
            int r = i / (BK / 4), c = (i % (BK / 4)) * 4;
            bool ok = m0 + r < M && k0 + c < K;
            copy16(&As[stage][r][c], ok ? A + (size_t)(m0 + r) * lda + k0 + c : A, ok);
        }
#if B_NK
#pragma unroll
        for (int i = tid; i < BN * BK / 4; i += 128) {
            int r = i / (BK / 4), c = (i % (BK / 4)) * 4;
            bool ok = n0 + r < N && k0 + c < K;
            copy16(&Bs[stage][r][c], ok ? B + (size_t)(n0 + r) * ldb + k0 + c : B, ok);
        }
#else
#pragma unroll
        for (int i = tid; i < BK * BN / 4; i += 128) {
            int r = i / (BN / 4), c = (i % (BN / 4)) * 4;
            bool ok = k0 + r < K && n0 + c < N;
            copy16(&Bs[stage][r][c], ok ? B + (size_t)(k0 + r) * ldb + n0 + c : B, ok);
        }
#endif
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < tiles) load(s, s);
        asm volatile("cp.async.commit_group;");
    }
    for (int kt = 0; kt < tiles; kt++) {
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
        __syncthreads();
        if (kt + STAGES - 1 < tiles) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        asm volatile("cp.async.commit_group;");
        const int st = kt % STAGES;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 8) {
            unsigned ab[MT][4], as[MT][4], bb[NT][2], bs[NT][2];
#pragma unroll
            for (int i = 0; i < MT; i++) {
                const int r = wm + i * 16 + g;
                split(As[st][r][kk + t], ab[i][0], as[i][0]);
                split(As[st][r + 8][kk + t], ab[i][1], as[i][1]);
                split(As[st][r][kk + t + 4], ab[i][2], as[i][2]);
                split(As[st][r + 8][kk + t + 4], ab[i][3], as[i][3]);
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int n = wn + j * 8 + g;
#if B_NK
                split(Bs[st][n][kk + t], bb[j][0], bs[j][0]);
                split(Bs[st][n][kk + t + 4], bb[j][1], bs[j][1]);
#else
                split(Bs[st][kk + t][n], bb[j][0], bs[j][0]);
                split(Bs[st][kk + t + 4][n], bb[j][1], bs[j][1]);
#endif
            }
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    mma(acc[i][j], as[i], bb[j]);
                    mma(acc[i][j], ab[i], bs[j]);
                    mma(acc[i][j], ab[i], bb[j]);
                }
        }
    }
    asm volatile("cp.async.wait_group 0;");

#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int m = m0 + wm + i * 16 + g + h * 8;
                if (m >= M) continue;
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int n = n0 + wn + j * 8 + 2 * t + q;
                    if (n >= N) continue;
                    float v = acc[i][j][h * 2 + q];
#if EPI >= 1
                    v += bias[n];
#endif
#if EPI == 2
                    v = v < 0.f ? 0.f : v; // NaN stays NaN, as torch.relu
#endif
                    C[(size_t)m * ldc + n] = v;
                }
            }
}
