// Max pooling (`ops::pool`): MAXPOOL_FWD stores each window's maximum (a thread per window),
// MAXPOOL_BWD each input position's gradient (a thread per position, summing in window order
// the gradients of the windows whose maximum it is, each window's maximum found again). After the
// prelude, the argument struct and the #defines of `maxpool.rs`: NAME, T (storage type), ACC
// (compute type), LD / ST (element load and store as ACC).

// The flat position y * W + x of window (oh, ow)'s maximum in the plane at `x + base`, its value
// in *m: a larger value or a NaN takes over, as PyTorch's.
__device__ __forceinline__ long long kwindow_max(const MaxPoolArgs& a, const T* x, long long base, long long oh, long long ow, ACC* m) {
  const long long hs = oh * a.sh - a.ph, ws = ow * a.sw - a.pw;
  long long at = -1;
  ACC best = 0;
  for (long long i = 0; i < a.kh; i++) {
    const long long y = hs + i * a.dh;
    if (y < 0 || y >= a.h) continue;
    for (long long j = 0; j < a.kw; j++) {
      const long long c = ws + j * a.dw;
      if (c < 0 || c >= a.w) continue;
      const ACC v = LD(x[base + y * a.xs[2] + c * a.xs[3]]);
      if (at < 0 || v > best || isnan(v)) { best = v; at = y * a.w + c; }
    }
  }
  *m = best;
  return at;
}

extern "C" __global__ void NAME(const MaxPoolArgs a) {
  const T* __restrict__ x = (const T*)a.x;
  T* __restrict__ out = (T*)a.out;
  const long long step = (long long)gridDim.x * blockDim.x;
#ifdef MAXPOOL_FWD
  const long long total = a.planes * a.oh * a.ow;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += step) {
    const long long ow = i % a.ow, t = i / a.ow, oh = t % a.oh, p = t / a.oh;
    ACC m;
    kwindow_max(a, x, (p / a.c) * a.xs[0] + (p % a.c) * a.xs[1], oh, ow, &m);
    out[i] = ST(m);
  }
#else
  const T* __restrict__ dy = (const T*)a.dy;
  const long long total = a.planes * a.h * a.w;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += step) {
    const long long c = i % a.w, t = i / a.w, y = t % a.h, p = t / a.h;
    const long long bx = (p / a.c) * a.xs[0] + (p % a.c) * a.xs[1], bg = (p / a.c) * a.gs[0] + (p % a.c) * a.gs[1];
    ACC g = 0;
    // Windows in increasing (oh, ow): the kernel offsets from the last down.
    for (long long ki = a.kh - 1; ki >= 0; ki--) {
      const long long th = y + a.ph - ki * a.dh;
      if (th < 0 || th % a.sh != 0 || th / a.sh >= a.oh) continue;
      const long long oh = th / a.sh;
      for (long long kj = a.kw - 1; kj >= 0; kj--) {
        const long long tw = c + a.pw - kj * a.dw;
        if (tw < 0 || tw % a.sw != 0 || tw / a.sw >= a.ow) continue;
        const long long ow = tw / a.sw;
        ACC m;
        if (kwindow_max(a, x, bx, oh, ow, &m) == y * a.w + c) g += LD(dy[bg + oh * a.gs[2] + ow * a.gs[3]]);
      }
    }
    out[i] = ST(g);
  }
#endif
}
