// Shared by every generated kernel (codegen.rs: `PRELUDE`, placed before each kernel's own
// source): the by-value argument block, F16 / BF16 conversions, integer and rounded
// arithmetic as the CPU computes it, index checks and the random number generator.
typedef unsigned long long u64;
// Every kernel's first statement: wait for the grids before it to end and their writes to be
// visible, then let the next kernel's blocks start loading. Both do nothing unless the kernel
// was launched with programmatic dependent launch (`KILN_PDL=1`, compute capability 9.0 on),
// which lets a kernel start before the one before it ends.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KILN_AFTER_PREVIOUS() do { asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); } while (0)
#define KILN_LET_NEXT_START() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define KILN_AFTER_PREVIOUS() do { } while (0)
#define KILN_LET_NEXT_START() do { } while (0)
#endif
// The same wait, later, for a kernel handed memory that nothing still running can be writing
// (`settled`: a compiled program's weights, which it never writes, once the program has launched
// a kernel of its own, whose wait covered every grid before it). Such a kernel starts with
// KILN_WAIT_UNLESS_SETTLED, loads that memory, then calls KILN_WAIT_IF_SETTLED before any other
// read, so the loads overlap the kernel before. With `settled` 2 it lets the next kernel start
// at once, so that one's settled loads overlap this kernel's too: a chain of such kernels keeps
// memory busy a few kernels ahead. (Its wait still orders it after this one, and this one after
// the kernel before, so nothing reads before the writes it waits for; a grid lets the next start
// only once all its blocks run, so a later grid never holds an earlier one's places.)
#define KILN_WAIT_UNLESS_SETTLED(settled) do { if (!(settled)) KILN_AFTER_PREVIOUS(); else if ((settled) == 2) KILN_LET_NEXT_START(); } while (0)
#define KILN_WAIT_IF_SETTLED(settled) do { if (settled) KILN_AFTER_PREVIOUS(); } while (0)
// A split reduction's hand-over: called by one thread of a block after a __syncthreads that
// follows the block's partial results, it counts the block in at `count` with acquire-release
// semantics (covering every thread's partials, and making the other blocks' visible to the
// last) and says whether this block is the last of `blocks` to arrive; the last resets the
// counter for the next launch.
__device__ __forceinline__ bool klast_arrival(unsigned int* count, unsigned int blocks) {
  unsigned int before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(count) : "memory");
  const bool last = before == blocks - 1;
  if (last) *count = 0;
  return last;
}
struct LaunchArgs { u64 w[64]; };
__device__ __forceinline__ float kh2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short kf2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float kb2f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ unsigned short kf2b(float f) { unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ double kparam_f(u64 w) { return __longlong_as_double((long long)w); }
__device__ long long kipow(long long a, long long b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  unsigned long long r = 1, x = (unsigned long long)a;
  while (b) { if (b & 1) r *= x; x *= x; b >>= 1; }
  return (long long)r;
}
// Rounded divisions and remainders, as the CPU computes them (a zero integer divisor gives 0).
__device__ __forceinline__ float kdivtrunc(float a, float b) { return truncf(a / b); }
__device__ __forceinline__ double kdivtrunc(double a, double b) { return trunc(a / b); }
__device__ __forceinline__ long long kdivtrunc(long long a, long long b) { return b == 0 ? 0 : (b == -1 ? (long long)(0ull - (u64)a) : a / b); }
#define KDIVFLOOR(T, FMOD, FLOOR, COPYSIGN) __device__ __forceinline__ T kdivfloor(T a, T b) { \
  if (b == (T)0) return a / b; \
  T m = FMOD(a, b), d = (a - m) / b; \
  if (m != (T)0 && ((b < (T)0) != (m < (T)0))) d -= (T)1; \
  if (d != (T)0) { T f = FLOOR(d); return d - f > (T)0.5 ? f + (T)1 : f; } \
  return COPYSIGN((T)0, a / b); }
KDIVFLOOR(float, fmodf, floorf, copysignf)
KDIVFLOOR(double, fmod, floor, copysign)
__device__ __forceinline__ long long kdivfloor(long long a, long long b) {
  if (b == 0) return 0;
  if (b == -1) return (long long)(0ull - (u64)a);
  long long q = a / b, r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ float kfmod(float a, float b) { return fmodf(a, b); }
__device__ __forceinline__ double kfmod(double a, double b) { return fmod(a, b); }
__device__ __forceinline__ long long kfmod(long long a, long long b) { return (b == 0 || b == -1) ? 0 : a % b; }
template <typename T> __device__ __forceinline__ T kremainder(T a, T b) {
  T r = kfmod(a, b);
  return (r != (T)0 && ((b < (T)0) != (r < (T)0))) ? r + b : r;
}
// Reports an out-of-range index to the host (mapped memory at `word`): the first one wins.
__device__ void kbad_index(u64 word, u64 op, long long index, u64 size) {
  long long* e = (long long*)word;
  if (atomicCAS((unsigned long long*)e, 0ull, (unsigned long long)op) == 0ull) { e[1] = index; e[2] = (long long)size; __threadfence_system(); }
}
// Philox4x32-10, as the host generator: element i of a stream draws counter (first + i).
__device__ void kphilox(u64 seed, u64 ctr, unsigned int* o) {
  unsigned int c0 = (unsigned int)ctr, c1 = (unsigned int)(ctr >> 32), c2 = 0, c3 = 0;
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    unsigned long long p0 = (unsigned long long)0xD2511F53u * c0, p1 = (unsigned long long)0xCD9E8D57u * c2;
    unsigned int n0 = (unsigned int)(p1 >> 32) ^ c1 ^ k0, n1 = (unsigned int)p1, n2 = (unsigned int)(p0 >> 32) ^ c3 ^ k1, n3 = (unsigned int)p0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  o[0] = c0; o[1] = c1; o[2] = c2; o[3] = c3;
}
