// Max pooling (`ops::pool`), a thread per window or per input position (channels-last: VEC
// channels of one). MAXPOOL_FWD stores each window's maximum; MAXPOOL_ARG its position
// y * W + x in the plane (int); MAXPOOL_BWD each input
// position's gradient: the sum, in window order, of the gradients of the windows whose position
// (from MAXPOOL_ARG, in `at`) it is. After the prelude, the argument struct and the #defines of
// `maxpool.rs`: NAME, IDX (int, or long long for large tensors), T (storage type), ACC (compute
// type), LD / ST (element load and store as ACC).

// The maxima of window (oh, ow) of NV channels (a.xs[1] apart) of the plane at `x + base`:
// channel v's in m[v], its position y * W + x in at[v]; a larger value or a NaN takes over, as
// PyTorch's.
template <int NV>
__device__ __forceinline__ void kwindow_max(const MaxPoolArgs& a, const T* x, IDX base, IDX oh, IDX ow, ACC* m, IDX* at) {
  const IDX hs = oh * (IDX)a.sh - (IDX)a.ph, ws = ow * (IDX)a.sw - (IDX)a.pw;
  const IDX H = (IDX)a.h, W = (IDX)a.w, cs = (IDX)a.xs[1];
#pragma unroll
  for (int v = 0; v < NV; v++) { at[v] = -1; m[v] = 0; }
  for (IDX i = 0; i < (IDX)a.kh; i++) {
    const IDX y = hs + i * (IDX)a.dh;
    if (y < 0 || y >= H) continue;
    for (IDX j = 0; j < (IDX)a.kw; j++) {
      const IDX c = ws + j * (IDX)a.dw;
      if (c < 0 || c >= W) continue;
      const T* p = x + base + y * (IDX)a.xs[2] + c * (IDX)a.xs[3];
#pragma unroll
      for (int v = 0; v < NV; v++) {
        const ACC e = LD(p[v * cs]);
        if (at[v] < 0 || e > m[v] || isnan(e)) { m[v] = e; at[v] = y * W + c; }
      }
    }
  }
}

// The first window along a dim whose span reaches position `pos` (PyTorch's p_start).
__device__ __forceinline__ IDX kfirst_window(IDX pos, IDX pad, IDX k, IDX dil, IDX stride) {
  const IDX span = (k - 1) * dil + 1;
  return pos + pad < span ? 0 : (pos + pad - span) / stride + 1;
}

// With NHWC defined, outputs (maxima, positions, gradients) are stored in [N, H, W, C] order and
// consecutive threads take consecutive channels (channels-last tensors read and written in
// whole rows); else in [N, C, H, W] order.
extern "C" __global__ void NAME(const MaxPoolArgs a) {
  KILN_AFTER_PREVIOUS();
  const T* __restrict__ x = (const T*)a.x;
  const IDX step = (IDX)gridDim.x * blockDim.x;
  const IDX OH = (IDX)a.oh, OW = (IDX)a.ow, C = (IDX)a.c;
#ifndef MAXPOOL_BWD
#ifdef NHWC
  // A thread takes VEC consecutive channels of one window: the index arithmetic (integer
  // divisions and the window's bounds, the bulk of this kernel's work) once for all of them.
  const IDX CV = C / VEC;
  const IDX total = (IDX)a.planes / C * OH * OW * CV;
#else
  const IDX total = (IDX)a.planes * OH * OW;
#endif
  for (IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x; i < total; i += step) {
#ifdef NHWC
    const IDX ch = (i % CV) * VEC, t = i / CV, ow = t % OW, t2 = t / OW, oh = t2 % OH, n = t2 / OH;
    ACC m[VEC];
    IDX at[VEC];
    kwindow_max<VEC>(a, x, n * (IDX)a.xs[0] + ch * (IDX)a.xs[1], oh, ow, m, at);
#pragma unroll
    for (int v = 0; v < VEC; v++) {
#ifdef MAXPOOL_FWD
      ((T*)a.out)[i * VEC + v] = ST(m[v]);
#else
      ((int*)a.out)[i * VEC + v] = (int)at[v];
#endif
    }
#else
    const IDX ow = i % OW, t = i / OW, oh = t % OH, p = t / OH, n = p / C, ch = p % C;
    ACC m;
    IDX at;
    kwindow_max<1>(a, x, n * (IDX)a.xs[0] + ch * (IDX)a.xs[1], oh, ow, &m, &at);
#ifdef MAXPOOL_FWD
    ((T*)a.out)[i] = ST(m);
    (void)at;
#else
    ((int*)a.out)[i] = (int)at;
#endif
#endif
  }
#else
  const T* __restrict__ dy = (const T*)a.dy;
  const int* __restrict__ pos = (const int*)a.x;
  const IDX H = (IDX)a.h, W = (IDX)a.w;
#ifdef NHWC
  // A thread takes VEC consecutive channels of one position: the index arithmetic (integer
  // divisions, the bulk of this kernel's work) once for all of them.
  const IDX CV = C / VEC;
  const IDX total = (IDX)a.planes / C * H * W * CV;
#else
  const IDX total = (IDX)a.planes * H * W;
#endif
  for (IDX i = blockIdx.x * (IDX)blockDim.x + threadIdx.x; i < total; i += step) {
#ifdef NHWC
    const IDX ch = (i % CV) * VEC, t = i / CV, c = t % W, t2 = t / W, y = t2 % H, n = t2 / H;
    // window (oh, ow)'s positions at[(oh * OW + ow) * C + v]
    const int* at = pos + n * OH * OW * C + ch;
    const IDX wstep = C;
#else
    const IDX c = i % W, t = i / W, y = t % H, p = t / H, n = p / C, ch = p % C;
    const int* at = pos + p * OH * OW;
    const IDX wstep = 1;
#endif
    const IDX bg = n * (IDX)a.gs[0] + ch * (IDX)a.gs[1];
    const IDX here = y * W + c;
    const IDX oh1 = min((y + (IDX)a.ph) / (IDX)a.sh + 1, OH), ow0 = kfirst_window(c, a.pw, a.kw, a.dw, a.sw);
    const IDX ow1 = min((c + (IDX)a.pw) / (IDX)a.sw + 1, OW);
    ACC g[VEC];
#pragma unroll
    for (int v = 0; v < VEC; v++) g[v] = 0;
    for (IDX oh = kfirst_window(y, a.ph, a.kh, a.dh, a.sh); oh < oh1; oh++) {
      for (IDX ow = ow0; ow < ow1; ow++) {
        const int* w = at + (oh * OW + ow) * wstep;
        const T* d = dy + bg + oh * (IDX)a.gs[2] + ow * (IDX)a.gs[3];
#pragma unroll
        for (int v = 0; v < VEC; v++) {
          if (w[v] == here) g[v] += LD(d[v * (IDX)a.gs[1]]);
        }
      }
    }
#pragma unroll
    for (int v = 0; v < VEC; v++) ((T*)a.out)[i * VEC + v] = ST(g[v]);
  }
#endif
}
