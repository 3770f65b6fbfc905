//! CUDA C generation. Every eager kernel is emitted here from an op's definition (its CUDA
//! expression in ops::pointwise) and a small spec of dtypes and layout classes, then compiled
//! by NVRTC and cached (nvrtc.rs). Sources are lean: no CUDA headers; half and bfloat16
//! conversions are one PTX instruction each.

use crate::backend::cuda::kernel_args;
use crate::ops::ReduceOp;
use crate::dtype::CType;
use crate::DType;
use std::fmt::Write;

/// The C type elements of `d` are stored as.
pub(crate) fn storage_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 | DType::BF16 => "unsigned short",
        DType::I64 => "long long",
        DType::I32 => "int",
        DType::U8 | DType::Bool => "unsigned char",
    }
}

pub(crate) fn short(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I64 => "i64",
        DType::I32 => "i32",
        DType::U8 => "u8",
        DType::Bool => "bool",
    }
}

/// Converts an expression of type `from` to `to`.
pub(crate) fn convert(from: CType, to: CType, e: &str) -> String {
    if from == to {
        return e.to_string();
    }
    match to {
        CType::Bool => format!("(({e}) != 0)"),
        _ => format!("(({})({e}))", to.name()),
    }
}

/// A stored element of dtype `d` as a value of `to`.
pub(crate) fn load(d: DType, to: CType, e: &str) -> String {
    let own = match d {
        DType::F16 => format!("kh2f({e})"),
        DType::BF16 => format!("kb2f({e})"),
        DType::I32 | DType::U8 => format!("((long long)({e}))"),
        DType::Bool => format!("(({e}) != 0)"),
        _ => e.to_string(),
    };
    convert(CType::of(d), to, &own)
}

/// A value of `from` as a stored element of dtype `d` (integers wrap through i64, as on the CPU).
pub(crate) fn store(d: DType, from: CType, e: &str) -> String {
    let c = convert(from, CType::of(d), e);
    match d {
        DType::F16 => format!("kf2h({c})"),
        DType::BF16 => format!("kf2b({c})"),
        DType::I32 => format!("((int)({c}))"),
        DType::U8 | DType::Bool => format!("((unsigned char)({c}))"),
        _ => c,
    }
}

/// Shared by every kernel: one by-value argument block, conversions, helpers.
pub(crate) const PRELUDE: &str = include_str!("prelude.cu");

/// How a kernel walks an operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Class {
    /// Row-major over the whole iteration space.
    Contig,
    /// One element read by everyone (a broadcast scalar).
    Scalar,
    /// Arbitrary strides, offsets computed from the linear index.
    Strided,
    /// Strided and the same along each vector of a vectorised kernel (inner stride 0, a
    /// per-channel value spread over an image): one element loaded per vector.
    Splat,
}

/// Threads per block of a map kernel. Blocks of 128 keep as many threads per SM as blocks of
/// 256 (registers limit both) and let new blocks start sooner as others finish: the compiled
/// bias + GELU over 8192 x 8192 f32 ran 1.6% faster back to back (130.7 -> 128.6 µs, as fast as
/// cudaMemcpy's 127.8), 512 and 1024 slower (`tools/maps/NOTES.md`).
pub(crate) const MAP_THREADS: u32 = 128;

/// Elements a thread of a map kernel without vector loads takes per step.
pub(crate) const MAP_ILP: usize = 4;

/// Most dims a strided map kernel takes after coalescing.
pub(crate) const MAX_DIMS: usize = 8;
/// Where parameters (`P(k)` in expressions) start in the argument block.
pub(crate) const PARAM_BASE: usize = 56;

/// A pointwise kernel: at each linear index `i` the inputs `v0..` are loaded (as their compute
/// types), `body` runs, and output `m` stores `outs[m]`'s expression. Expressions may use `i`
/// and `P(k)` (parameter word k). An eager op is one output and no body; a fused kernel of the
/// compiler has a body of `const` temporaries and as many outputs as values it stores.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MapSpec {
    pub name: String,
    pub inputs: Vec<(DType, CType, Class)>,
    /// Per output: its dtype, the type of its expression, the expression, and whether only
    /// element 0 stores it (one value for every element, into a one-element buffer).
    pub outs: Vec<(DType, CType, String, bool)>,
    /// Contig for fresh outputs; Strided only for a single output written in place.
    pub out_class: Class,
    pub body: String,
    pub ndim: usize,
    /// Elements per thread per step with vector loads (1 = none).
    pub vec: usize,
    pub idx64: bool,
}

/// Where a map kernel's arguments sit: `w[0]` the element count, then the outputs' and the
/// inputs' addresses, then the sizes, then the strides of each strided operand.
pub(crate) struct MapWords {
    pub sizes: usize,
    /// Per operand (outputs first): where its strides start, if it is strided.
    pub strides: Vec<Option<usize>>,
    pub end: usize,
}

impl MapSpec {
    pub(crate) fn kernel_name(&self) -> String {
        let cls = if self.vec > 1 { format!("v{}", self.vec) } else if self.ndim > 0 { format!("s{}", self.ndim) } else { "c".into() };
        format!("{}_{}_{}", self.name, short(self.outs[0].0), cls)
    }
    /// The word of the element count.
    pub(crate) const COUNT_WORD: usize = 0;
    pub(crate) fn ptr_word(operand: usize) -> usize {
        1 + operand
    }
    pub(crate) fn words(&self) -> MapWords {
        let o = self.outs.len();
        let sizes = 1 + o + self.inputs.len();
        let mut next = sizes + self.ndim;
        let classes = std::iter::repeat_n(self.out_class, o).chain(self.inputs.iter().map(|x| x.2));
        let strides = classes
            .map(|c| {
                (matches!(c, Class::Strided | Class::Splat) && self.ndim > 0).then(|| {
                    next += self.ndim;
                    next - self.ndim
                })
            })
            .collect();
        MapWords { sizes, strides, end: next }
    }
}

/// The argument word of a map kernel's dim of size `d`: the size, and for kernels with 32-bit
/// indices the magic number of unsigned division by it in the high half (the kernel derives
/// the shift, the least `s` with 2^s >= d): n / d = (umulhi(n, magic) + n) >> s for n < 2^31.
pub(crate) fn size_word(d: usize, idx64: bool) -> u64 {
    if idx64 || d == 0 || d > i32::MAX as usize {
        return d as u64;
    }
    let shift = usize::BITS - (d - 1).leading_zeros();
    let magic = ((1u128 << 32) * ((1u128 << shift) - d as u128)) / d as u128 + 1;
    d as u64 | ((magic as u64) << 32)
}

pub(crate) fn gen_map(s: &MapSpec) -> String {
    let mut c = String::from(PRELUDE);
    let uses = |f: &str| s.body.contains(f) || s.outs.iter().any(|o| o.2.contains(f));
    if ["kuniform", "knormal", "kbits64"].iter().any(|f| uses(f)) {
        c.push_str(RANDOM);
    }
    let words = s.words();
    let idx = if s.idx64 { "long long" } else { "int" };
    let name = s.kernel_name();
    let nout = s.outs.len();
    // A single element (no dims) sits at index 0 = i: no offsets needed.
    let strided_out = s.out_class == Class::Strided && s.ndim > 0;
    let strided = words.strides.iter().any(|w| w.is_some());
    // Operands read per element, not as a broadcast scalar.
    let walks = |cls: Class| cls != Class::Scalar;
    let _ = writeln!(c, "typedef {idx} IDX;\n#define P(k) (a.w[{PARAM_BASE} + (k)])");
    if s.vec > 1 {
        for (m, (d, ..)) in s.outs.iter().enumerate() {
            let _ = writeln!(c, "struct __align__({}) VO{m} {{ {} v[{}]; }};", s.vec * d.size_in_bytes(), storage_type(*d), s.vec);
        }
        for (k, (d, _, cls)) in s.inputs.iter().enumerate() {
            if walks(*cls) && *cls != Class::Splat {
                let _ = writeln!(c, "struct __align__({}) VI{k} {{ {} v[{}]; }};", s.vec * d.size_in_bytes(), storage_type(*d), s.vec);
            }
        }
    }
    let _ = writeln!(c, "extern \"C\" __global__ void __launch_bounds__({MAP_THREADS}) {name}(const LaunchArgs a) {{\n  KILN_AFTER_PREVIOUS();");
    let _ = writeln!(c, "  const IDX n = (IDX)a.w[{}];", MapSpec::COUNT_WORD);
    for (m, (d, ..)) in s.outs.iter().enumerate() {
        let _ = writeln!(c, "  {t}* __restrict__ out{m} = ({t}*)a.w[{}];", MapSpec::ptr_word(m), t = storage_type(*d));
    }
    for (k, (d, _, _)) in s.inputs.iter().enumerate() {
        let _ = writeln!(c, "  const {t}* __restrict__ p{k} = (const {t}*)a.w[{}];", MapSpec::ptr_word(nout + k), t = storage_type(*d));
    }
    let _ = writeln!(c, "  const IDX tid = (IDX)blockIdx.x * blockDim.x + threadIdx.x, step = (IDX)gridDim.x * blockDim.x;");
    // Storage offsets o0 (the strided output), o1.. (inputs) of linear index `i`.
    let offsets = |c: &mut String, i: &str| {
        if !strided {
            return;
        }
        let _ = writeln!(c, "    IDX rem = {i}, o0 = 0;");
        for k in 0..s.inputs.len() {
            let _ = writeln!(c, "    IDX o{} = 0;", k + 1);
        }
        for d in (0..s.ndim).rev() {
            let w = words.sizes + d;
            if s.idx64 {
                let _ = writeln!(c, "    {{ const IDX sz = (IDX)a.w[{w}]; const IDX q = rem % sz; rem /= sz;");
            } else {
                // 32-bit indices divide by multiplying with the size's magic number (the high
                // half of its word, see `size_word`): a hardware division is ~20 instructions.
                let _ = writeln!(c, "    {{ const unsigned int sz = (unsigned int)a.w[{w}], qq = (__umulhi((unsigned int)rem, (unsigned int)(a.w[{w}] >> 32)) + (unsigned int)rem) >> (32 - __clz(sz - 1)); const IDX q = rem - (IDX)(qq * sz); rem = (IDX)qq;");
            }
            if let Some(w) = words.strides[0].filter(|_| strided_out) {
                let _ = writeln!(c, "      o0 += q * (IDX)a.w[{}];", w + d);
            }
            for k in 0..s.inputs.len() {
                if let Some(w) = words.strides[nout + k] {
                    let _ = writeln!(c, "      o{} += q * (IDX)a.w[{}];", k + 1, w + d);
                }
            }
            let _ = writeln!(c, "    }}");
        }
    };
    let at = |k: usize, i: &str| match s.inputs[k].2 {
        Class::Contig => i.to_string(),
        Class::Scalar => "0".to_string(),
        Class::Strided | Class::Splat => format!("o{}", k + 1),
    };
    let out_at = |i: &str| if strided_out { "o0".to_string() } else { i.to_string() };
    // The inputs' values v{k} (`value(k)`: input k's value as its compute type), then the body.
    let body = |c: &mut String, value: &dyn Fn(usize) -> String| {
        for (k, (_, t, _)) in s.inputs.iter().enumerate() {
            let _ = writeln!(c, "    const {} v{k} = {};", t.name(), value(k));
        }
        c.push_str(&s.body);
    };
    // Input k's stored element `elem`, as its compute type.
    let loaded = |k: usize, elem: &str| load(s.inputs[k].0, s.inputs[k].1, elem);
    let results: Vec<String> = s.outs.iter().map(|(d, t, e, _)| store(*d, *t, e)).collect();
    let once = |m: usize| s.outs[m].3;
    // One element's outputs, the others stored at `idx` (element 0 alone stores a one-value output).
    let store_outs = |c: &mut String, idx: &str| {
        for (m, r) in results.iter().enumerate() {
            match once(m) {
                true => writeln!(c, "    if (i == 0) out{m}[0] = {r};"),
                false => writeln!(c, "    out{m}[{idx}] = {r};"),
            }
            .expect("writing to a String");
        }
    };
    if s.vec > 1 {
        // Strided operands qualify only with unit inner stride and vector-aligned runs, or as
        // splats (checked at launch), so one offset computation serves a whole vector.
        let _ = writeln!(c, "  const IDX nv = n / {v};\n  for (IDX t = tid; t < nv; t += step) {{\n    const IDX base = t * {v};", v = s.vec);
        offsets(&mut c, "base");
        for (k, (d, _, cls)) in s.inputs.iter().enumerate() {
            if *cls == Class::Splat {
                let _ = writeln!(c, "    const {} x{k} = p{k}[{}];", storage_type(*d), at(k, "base"));
            } else if walks(*cls) {
                let _ = writeln!(c, "    const VI{k} x{k} = *(const VI{k}*)(p{k} + {});", at(k, "base"));
            }
        }
        for m in (0..nout).filter(|&m| !once(m)) {
            let _ = writeln!(c, "    VO{m} r{m};");
        }
        let _ = writeln!(c, "    #pragma unroll\n    for (int j = 0; j < {}; j++) {{\n    const IDX i = base + j;", s.vec);
        body(&mut c, &|k| {
            loaded(
                k,
                &match s.inputs[k].2 {
                    Class::Splat => format!("x{k}"),
                    Class::Scalar => format!("p{k}[0]"),
                    _ => format!("x{k}.v[j]"),
                },
            )
        });
        for (m, r) in results.iter().enumerate() {
            match once(m) {
                true => writeln!(c, "    if (i == 0) out{m}[0] = {r};"),
                false => writeln!(c, "    r{m}.v[j] = {r};"),
            }
            .expect("writing to a String");
        }
        let _ = writeln!(c, "    }}");
        for m in (0..nout).filter(|&m| !once(m)) {
            let _ = writeln!(c, "    *(VO{m}*)(out{m} + {}) = r{m};", out_at("base"));
        }
        let _ = writeln!(c, "  }}\n  const IDX start = nv * {};", s.vec);
        // The few elements past the vectors, one per thread.
        let _ = writeln!(c, "  for (IDX i = start + tid; i < n; i += step) {{");
        offsets(&mut c, "i");
        body(&mut c, &|k| loaded(k, &format!("p{k}[{}]", at(k, "i"))));
        store_outs(&mut c, &out_at("i"));
        let _ = writeln!(c, "  }}\n}}");
        return c;
    }
    // Without vector loads each thread takes MAP_ILP elements a step apart (coalesced for each
    // j), every load issued before the first store: one 2-byte load in flight per thread left
    // a strided bf16 map at a third of the copy bandwidth.
    let _ = writeln!(c, "  for (IDX i0 = tid; i0 < n; i0 = n - i0 > {MAP_ILP} * step ? i0 + {MAP_ILP} * step : n) {{");
    let walked: Vec<usize> = (0..s.inputs.len()).filter(|&k| walks(s.inputs[k].2)).collect();
    for &k in &walked {
        let _ = writeln!(c, "    {} x{k}[{MAP_ILP}];", s.inputs[k].1.name());
    }
    if strided_out {
        let _ = writeln!(c, "    IDX at0[{MAP_ILP}];");
    }
    let _ = writeln!(c, "    #pragma unroll\n    for (int j = 0; j < {MAP_ILP}; j++) {{\n    if ((IDX)j * step >= n - i0) break;\n    const IDX i = i0 + (IDX)j * step;");
    offsets(&mut c, "i");
    for &k in &walked {
        let _ = writeln!(c, "    x{k}[j] = {};", loaded(k, &format!("p{k}[{}]", at(k, "i"))));
    }
    if strided_out {
        let _ = writeln!(c, "    at0[j] = o0;");
    }
    let _ = writeln!(c, "    }}\n    #pragma unroll\n    for (int j = 0; j < {MAP_ILP}; j++) {{\n    if ((IDX)j * step >= n - i0) break;\n    const IDX i = i0 + (IDX)j * step; (void)i;");
    body(&mut c, &|k| if walks(s.inputs[k].2) { format!("x{k}[j]") } else { loaded(k, &format!("p{k}[0]")) });
    store_outs(&mut c, if strided_out { "at0[j]" } else { "i" });
    let _ = writeln!(c, "    }}\n  }}\n}}");
    c
}

/// A reduction of a contiguous input: `Rows` reduces each row of [M, K]; `Cols` reduces the
/// rows of [K, M] into M results. With `chunks > 1` (a launch argument) each row or column is
/// split and partial results are written, to be reduced again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ReduceLayout {
    Rows,
    Cols,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ReduceSpec {
    pub op: ReduceOp,
    pub input: DType,
    pub acc: CType,
    pub out: DType,
    pub layout: ReduceLayout,
    pub idx64: bool,
    /// Adjacent elements a thread reads with one load: columns (`Cols`), or a row's (`Rows` of
    /// one chunk, for a few long rows).
    pub vec: usize,
    /// Rows a `Cols` block reads at once (threads in y: 8, or 32 for an unsplit reduction that
    /// has a block for every SM; 1 for `Rows`).
    pub ty: usize,
    /// The input is `[P, ., Q]` with the reduced (Rows: kept) dims in the middle, read in place
    /// (`ReduceArgs::q` is Q): Rows reduce `[P, M, Q]` over P and Q, Cols reduce `[P, K, Q]`
    /// over K into P x Q results.
    pub strided: bool,
}

impl ReduceSpec {
    pub(crate) fn kernel_name(&self) -> String {
        let l = match (self.layout, self.strided) {
            (ReduceLayout::Rows, false) => "rows",
            (ReduceLayout::Rows, true) => "midrows",
            (ReduceLayout::Cols, false) => "cols",
            (ReduceLayout::Cols, true) => "batchcols",
        };
        format!("{}_{}_{}_{}{}{}", self.op.name(), short(self.input), short(self.out), l, self.vec, if self.ty > 8 { format!("_y{}", self.ty) } else { String::new() })
    }
}

/// Name of the combining function of a (non-arg) reduction emitted by `block_reduce`.
pub(crate) fn comb_name(op: ReduceOp, t: CType) -> String {
    format!("kc_{}_{}", op.name(), short(t.dtype()))
}

/// Name of the block reduction emitted by `block_reduce`.
pub(crate) fn block_name(op: ReduceOp, t: CType) -> String {
    format!("kb_{}_{}", op.name(), short(t.dtype()))
}

/// `kc_*(a, b)`, combining two partial results (max/min propagate NaN from either side), and
/// `kb_*(v)`, the reduction of one value per thread over a block of a multiple of 32 threads:
/// warp shuffles, each warp's result through shared memory, then one more round of shuffles,
/// so every thread gets the result. Shared by the eager and the compiler's row kernels.
pub(crate) fn block_reduce(op: ReduceOp, t: CType) -> String {
    let n = t.name();
    let comb = op.cuda_combine();
    // Booleans travel through the shuffles as ints.
    let sh = if t == CType::Bool { "int" } else { n };
    let (c, b, id) = (comb_name(op, t), block_name(op, t), op.cuda_identity(t));
    format!(
        r#"__device__ __forceinline__ {n} {c}({n} a, {n} b) {{ return {comb}; }}
__device__ __forceinline__ {n} {b}({n} v) {{
  __shared__ {n} red[32];
  for (int o = 16; o > 0; o >>= 1) v = {c}(v, ({n})__shfl_xor_sync(0xffffffffu, ({sh})v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads(); // the previous call's readers are done with red
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? red[lane] : {id};
  for (int o = 16; o > 0; o >>= 1) v = {c}(v, ({n})__shfl_xor_sync(0xffffffffu, ({sh})v, o));
  return v;
}}
"#
    )
}

kernel_args! {
    /// What a reduction kernel reads (`gen_reduce`): `x` as `m` rows of `k` (`ReduceLayout::Rows`)
    /// or `k` rows of `m` (`Cols`), each row's `k` split into `chunks`; `q` is the inner size
    /// of a strided spec (`ReduceSpec::strided`).
    ReduceArgs {
        x: u64, out: u64, m: i64, k: i64, chunks: i64, q: i64,
        /// A split column reduction's partials (`chunks` rows of `m`) and per-block-column
        /// counters (zero between launches).
        part: u64, count: u64,
    }
}

kernel_args! {
    /// What a gather kernel reads (`gen_gather`), over the index's shape (at most 8 dims).
    GatherArgs {
        n: i64, out: u64, x: u64, idx: u64,
        /// x's size along the gathered dim: indices outside [0, dim_size) are reported.
        dim_size: i64,
        /// Where a bad index is reported (`kbad_index`), and which op reports it.
        error_word: u64, error_op: u64,
        sizes: i64[8], idx_strides: i64[8], x_strides: i64[8],
    }
}

kernel_args! {
    /// What a scatter or scatter-add kernel reads (`gen_scatter`), over the index's shape.
    ScatterAddArgs {
        n: i64, acc: u64, src: u64, idx: u64,
        /// acc's size along the scattered dim.
        dim_size: i64,
        error_word: u64, error_op: u64,
        sizes: i64[8], idx_strides: i64[8], src_strides: i64[8], acc_strides: i64[8],
    }
}

kernel_args! {
    /// What the integer batched product reads (`gen_int_bmm`): strides are (batch, row, col).
    IntBmmArgs {
        out: u64, a: u64, b: u64,
        batch: i64, m: i64, n: i64, k: i64,
        a_strides: i64[3], b_strides: i64[3],
    }
}

pub(crate) fn gen_reduce(s: &ReduceSpec) -> String {
    let mut c = String::from(PRELUDE);
    c.push_str(ReduceArgs::C_DECL);
    let idx = if s.idx64 { "long long" } else { "int" };
    let (init, combine) = s.op.cuda_step(s.acc);
    let arg = s.op.is_arg();
    let t = s.acc.name();
    let finish = if arg { store(s.out, CType::I64, "ai") } else { store(s.out, s.acc, "acc") };
    let _ = writeln!(c, "typedef {idx} IDX;\n#define TY {}\n#define VEC {}\nstruct __align__({}) VX {{ {} v[VEC]; }};", s.ty, s.vec, s.vec * s.input.size_in_bytes(), storage_type(s.input));
    // Folds the partial (v, k) of another thread into (acc, ai).
    let _ = writeln!(c, "__device__ __forceinline__ void kcomb({t}& acc, long long& ai, {t} v, long long k) {{ {combine} }}");
    if (s.layout == ReduceLayout::Cols || arg) && s.acc == CType::Bool {
        // The split column fold reads partials with __ldcg, which has no bool overload.
        let _ = writeln!(c, "__device__ __forceinline__ bool kldcg_bool(const bool* p) {{ return __ldcg((const unsigned char*)p) != 0; }}");
    }
    // The block's (acc, ai) folded into thread 0's: shuffles, then a value per warp.
    if s.layout == ReduceLayout::Rows {
        let _ = writeln!(
            c,
        r#"__device__ __forceinline__ void kblock({t}& acc, long long& ai, {t}* sa, long long* si) {{
  for (int off = 16; off > 0; off >>= 1) {{
    const {t} v = __shfl_down_sync(0xffffffffu, acc, off); const long long k = __shfl_down_sync(0xffffffffu, ai, off);
    if ((threadIdx.x & 31) + off < 32) kcomb(acc, ai, v, k);
  }}
  const int warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  if ((threadIdx.x & 31) == 0) {{ sa[warp] = acc; si[warp] = ai; }}
  __syncthreads();
  if (threadIdx.x == 0) for (int w = 1; w < nw; w++) kcomb(acc, ai, sa[w], si[w]);
  __syncthreads();
}}"#
        );
    }
    let it = storage_type(s.input);
    let ot = storage_type(s.out);
    let name = s.kernel_name();
    let _ = writeln!(c, "extern \"C\" __global__ void {name}(const ReduceArgs a) {{\n  KILN_AFTER_PREVIOUS();");
    let _ = writeln!(c, "  const {it}* __restrict__ x = (const {it}*)a.x;\n  {ot}* __restrict__ out = ({ot}*)a.out;");
    let _ = writeln!(c, "  const IDX M = (IDX)a.m, K = (IDX)a.k, C = (IDX)a.chunks, Q = (IDX)a.q; (void)Q;");
    let lv = load(s.input, s.acc, "x[X]");
    match s.layout {
        ReduceLayout::Rows => {
            // At VEC > 1 (one chunk, rows VEC-aligned) a thread reads VEC elements at a time and
            // the loop after it takes the row's last K % VEC. Unrolled, so that a thread's loads
            // are in flight together rather than waited on one after another.
            let vector = if s.vec > 1 {
                format!(
                    "    const IDX tail = lo + (hi - lo) / VEC * VEC;\n    _Pragma(\"unroll 4\") for (IDX k = lo + threadIdx.x * VEC; k < tail; k += blockDim.x * VEC) {{\n      const VX q = *(const VX*)(x + row * K + k);\n      _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) {{ const {t} v = {lv}; kcomb(acc, ai, v, k + e); }}\n    }}\n",
                    lv = lv.replace("x[X]", "q.v[e]")
                )
            } else {
                "    const IDX tail = lo;\n".to_string()
            };
            // A split arg reduction (`a.count` set) leaves each chunk's value and index in
            // `part` ([M][C] indices, then [M][C] values), and the last chunk of a row to finish
            // folds them, a chunk per thread (one launch). Otherwise each chunk's result goes to
            // out[row * C + ch].
            let ld = if s.acc == CType::Bool { "kldcg_bool" } else { "__ldcg" };
            let (store_chunk, fold) = if arg {
                (
                    format!(
                        r#"if (a.count == 0) out[row * C + ch] = {finish};
      else {{
        pi[row * C + ch] = ai; pv[row * C + ch] = acc;
        klast = klast_arrival((unsigned int*)a.count + row, (unsigned int)C);
      }}"#
                    ),
                    format!(
                        r#"    if (a.count != 0) {{
      __syncthreads();
      if (klast) {{
        acc = {init}; ai = 9223372036854775807ll;
        for (IDX c2 = threadIdx.x; c2 < C; c2 += blockDim.x) kcomb(acc, ai, {ld}(pv + row * C + c2), __ldcg(pi + row * C + c2));
        kblock(acc, ai, sa, si);
        if (threadIdx.x == 0) out[row] = {finish};
      }}
    }}
"#
                    ),
                )
            } else {
                (format!("out[row * C + ch] = {finish};"), String::new())
            };
            if arg {
                let _ = writeln!(c, "  long long* pi = (long long*)a.part; {t}* pv = ({t}*)(pi + (long long)M * C); __shared__ bool klast;");
            }
            let _ = writeln!(c, r#"  __shared__ {t} sa[32]; __shared__ long long si[32];
  const IDX ch = blockIdx.y;
  // Chunks start at multiples of VEC (the vector loads stay aligned); the last ends at K.
  const IDX lo = (IDX)(((long long)K * ch) / C / VEC * VEC), hi = ch + 1 == C ? K : (IDX)(((long long)K * (ch + 1)) / C / VEC * VEC);
  for (IDX row = blockIdx.x; row < M; row += gridDim.x) {{
    {t} acc = {init}; long long ai = 9223372036854775807ll;
{vector}    for (IDX k = tail + threadIdx.x; k < hi; k += blockDim.x) {{ const {t} v = {lv}; kcomb(acc, ai, v, k); }}
    kblock(acc, ai, sa, si);
    if (threadIdx.x == 0) {{
      {store_chunk}
    }}
{fold}  }}
}}"#, lv = lv.replace("x[X]", if s.strided { "x[(k / Q) * (M * Q) + row * Q + k % Q]" } else { "x[row * K + k]" }), vector = vector);
        }
        ReduceLayout::Cols => {
            // A block is 32 x TY threads over 32 * VEC columns: each thread reads VEC adjacent
            // columns of every TY-th row of its chunk (one 16-byte load for f32 at VEC 4),
            // folding them into VEC accumulators; then the TY partial rows are folded through
            // shared memory, one column per thread. (Wider blocks, reading up to 4 KB of a row
            // at once, were measured slower on the H200 over 8192 x 8192: 64 x 4 threads 92%,
            // 128 x 2 89%, 256 x 1 77% of the copy rate, against 92-94% for 32 x 8.)
            let sidx = if arg { "  __shared__ long long si[TY][32 * VEC];\n" } else { "" };
            let keep_i = if arg { "si[threadIdx.y][threadIdx.x * VEC + e] = ai[e]; " } else { "" };
            let read_i = |r: &str| if arg { format!("si[{r}][l]") } else { "0".into() };
            let _ = writeln!(c, r#"  __shared__ {t} sa[TY][32 * VEC];
{sidx}  const IDX c0 = ((IDX)blockIdx.x * 32 + threadIdx.x) * VEC, ch = blockIdx.y;
  const IDX lo = (IDX)(((long long)K * ch) / C), hi = (IDX)(((long long)K * (ch + 1)) / C);
  {t} acc[VEC]; long long ai[VEC];
  _Pragma("unroll") for (int e = 0; e < VEC; e++) {{ acc[e] = {init}; ai[e] = 9223372036854775807ll; }}
  if (c0 < M) {{
    _Pragma("unroll {unroll}") for (IDX k = lo + threadIdx.y; k < hi; k += TY) {{
      const VX q = *(const VX*)(x + {at});
      _Pragma("unroll") for (int e = 0; e < VEC; e++) {{ const {t} v = {lv}; kcomb(acc[e], ai[e], v, k); }}
    }}
  }}
  _Pragma("unroll") for (int e = 0; e < VEC; e++) {{ sa[threadIdx.y][threadIdx.x * VEC + e] = acc[e]; {keep_i}}}
  __syncthreads();
  const int l = threadIdx.y * 32 + threadIdx.x;
  const IDX col = (IDX)blockIdx.x * (32 * VEC) + l;
  const bool mine = l < 32 * VEC && col < M;
  {t} r = {init}; long long ri = 9223372036854775807ll;
  if (mine) {{ r = sa[0][l]; ri = {i0}; for (int y = 1; y < TY; y++) kcomb(r, ri, sa[y][l], {iy}); }}
  if (C == 1) {{
    if (mine) out[col] = {finish};
    return;
  }}
  // Split columns: each chunk leaves its partial; the last block of a column group to finish
  // folds them, so one launch does the whole reduction. Its counter is reset for the next use.
  // One thread per block counts, with release and acquire semantics after the block's barrier
  // (covering every thread's partial), instead of a fence by every thread; the last block
  // reads the partials through L2, four loads in flight at a time (1-2% of the call on the
  // H200 over 8192 x 8192: tools/stream).
  {t}* part = ({t}*)a.part;
  unsigned int* count = (unsigned int*)a.count;
  if (mine) part[ch * M + col] = r;
  __syncthreads();
  __shared__ bool last;
  if (l == 0) last = klast_arrival(&count[blockIdx.x], gridDim.y);
  __syncthreads();
  if (!last) return;
  if (mine) {{
    r = {ld}(part + col);
    IDX c2 = 1;
    for (; c2 + 4 <= C; c2 += 4) {{
      const {t} v0 = {ld}(part + c2 * M + col), v1 = {ld}(part + (c2 + 1) * M + col), v2 = {ld}(part + (c2 + 2) * M + col), v3 = {ld}(part + (c2 + 3) * M + col);
      kcomb(r, ri, v0, 0); kcomb(r, ri, v1, 0); kcomb(r, ri, v2, 0); kcomb(r, ri, v3, 0);
    }}
    for (; c2 < C; c2++) kcomb(r, ri, {ld}(part + c2 * M + col), 0);
    out[col] = {finish};
  }}
}}"#, at = if s.strided { "(c0 / Q) * K * Q + k * Q + c0 % Q" } else { "k * M + c0" }, unroll = if s.ty > 8 { 8 } else { 4 }, ld = if s.acc == CType::Bool { "kldcg_bool" } else { "__ldcg" }, lv = lv.replace("x[X]", "q.v[e]"), i0 = read_i("0"), iy = read_i("y"), finish = if arg { store(s.out, CType::I64, "ri") } else { store(s.out, s.acc, "r") });
        }
    }
    c
}

/// `out[i] = x[...]` where the position along `dim` comes from an index tensor (gather and
/// index_select). `ndim` dims, all strided; indices were range-checked by the caller.
pub(crate) fn gen_gather(dtype: DType, ndim: usize, dim: usize) -> (String, String) {
    let name = format!("gather_{}_{ndim}d_dim{dim}", short(dtype));
    let t = storage_type(dtype);
    let mut c = String::from(PRELUDE);
    c.push_str(GatherArgs::C_DECL);
    let _ = writeln!(c, "extern \"C\" __global__ void {name}(const GatherArgs a) {{\n  KILN_AFTER_PREVIOUS();");
    let _ = writeln!(c, "  const long long n = a.n; {t}* out = ({t}*)a.out; const {t}* x = (const {t}*)a.x; const long long* idx = (const long long*)a.idx;");
    let _ = writeln!(c, "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{");
    let _ = writeln!(c, "    long long rem = i, oi = 0, ox = 0, q;");
    for d in (0..ndim).rev() {
        let _ = writeln!(c, "    q = rem % a.sizes[{d}]; rem /= a.sizes[{d}]; oi += q * a.idx_strides[{d}];");
        if d != dim {
            let _ = writeln!(c, "    ox += q * a.x_strides[{d}];");
        }
    }
    let _ = writeln!(c, "    long long j = idx[oi];\n    if (j < 0 || j >= a.dim_size) {{ kbad_index(a.error_word, a.error_op, idx[oi], (u64)a.dim_size); continue; }}\n    out[i] = x[ox + j * a.x_strides[{dim}]];\n  }}\n}}");
    (name, c)
}

/// `acc[... index ...] += src[...]` with atomics in compute type `add` (`acc` contiguous in that
/// type), or without it `acc[... index ...] = src[...]` (`acc` in `src`'s own storage type),
/// over the index's elements.
pub(crate) fn gen_scatter(src: DType, ndim: usize, dim: usize, add: Option<CType>) -> (String, String) {
    let name = match add {
        Some(t) => format!("scatter_add_{}_{}_{ndim}d_dim{dim}", short(src), short(t.dtype())),
        None => format!("scatter_{}_{ndim}d_dim{dim}", short(src)),
    };
    let mut c = String::from(PRELUDE);
    c.push_str(ScatterAddArgs::C_DECL);
    let st = storage_type(src);
    let tn = add.map_or(st, |t| t.name());
    let _ = writeln!(c, "extern \"C\" __global__ void {name}(const ScatterAddArgs a) {{\n  KILN_AFTER_PREVIOUS();");
    let _ = writeln!(c, "  const long long n = a.n; {tn}* acc = ({tn}*)a.acc; const {st}* src = (const {st}*)a.src; const long long* idx = (const long long*)a.idx;");
    let _ = writeln!(c, "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{");
    let _ = writeln!(c, "    long long rem = i, oi = 0, os = 0, oa = 0, q;");
    for d in (0..ndim).rev() {
        let _ = writeln!(c, "    q = rem % a.sizes[{d}]; rem /= a.sizes[{d}]; oi += q * a.idx_strides[{d}]; os += q * a.src_strides[{d}];");
        if d != dim {
            let _ = writeln!(c, "    oa += q * a.acc_strides[{d}];");
        }
    }
    let write = match add {
        None => "acc[oa] = src[os]".to_string(),
        Some(t) => {
            let v = load(src, t, "src[os]");
            if t == CType::I64 { format!("atomicAdd((unsigned long long*)&acc[oa], (unsigned long long)({v}))") } else { format!("atomicAdd(&acc[oa], {v})") }
        }
    };
    let _ = writeln!(c, "    long long j = idx[oi];\n    if (j < 0 || j >= a.dim_size) {{ kbad_index(a.error_word, a.error_op, idx[oi], (u64)a.dim_size); continue; }}\n    oa += j * a.acc_strides[{dim}];\n    {write};\n  }}\n}}");
    (name, c)
}

/// Integer batched matrix product, one thread per output element (cuBLAS has no i64 gemm).
pub(crate) fn gen_int_bmm(dtype: DType) -> (String, String) {
    let name = format!("bmm_{}", short(dtype));
    let t = storage_type(dtype);
    let mut c = String::from(PRELUDE);
    c.push_str(IntBmmArgs::C_DECL);
    let la = load(dtype, CType::I64, "pa[i * a.a_strides[1] + k * a.a_strides[2]]");
    let lb = load(dtype, CType::I64, "pb[k * a.b_strides[1] + j * a.b_strides[2]]");
    let st = store(dtype, CType::I64, "(long long)s");
    let _ = writeln!(c, r#"extern "C" __global__ void {name}(const IntBmmArgs a) {{
  KILN_AFTER_PREVIOUS();
  {t}* out = ({t}*)a.out;
  const long long B = a.batch, M = a.m, N = a.n, K = a.k;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < B * M * N; e += (long long)gridDim.x * blockDim.x) {{
    const long long b = e / (M * N), i = (e / N) % M, j = e % N;
    const {t}* pa = (const {t}*)a.a + b * a.a_strides[0];
    const {t}* pb = (const {t}*)a.b + b * a.b_strides[0];
    unsigned long long s = 0;
    for (long long k = 0; k < K; k++) s += (unsigned long long)({la}) * (unsigned long long)({lb});
    out[e] = {st};
  }}
}}"#);
    (name, c)
}

/// Device twins of the host generator's distributions (tensor/create.rs): the same bits of the
/// same Philox outputs, so a seed gives the same values on the CPU and the GPU.
pub(crate) const RANDOM: &str = r#"
__device__ double kuniform(u64 seed, u64 ctr, unsigned int bits) {
  unsigned int o[4]; kphilox(seed, ctr, o);
  if (bits == 53) return (double)((((u64)o[0] << 32) | o[1]) >> 11) * (1.0 / 9007199254740992.0);
  return (double)(o[0] >> (32 - bits)) / (double)(1ull << bits);
}
__device__ double knormal(u64 seed, u64 ctr) {
  unsigned int o[4]; kphilox(seed, ctr, o);
  const double u1 = 1.0 - (double)((((u64)o[0] << 32) | o[1]) >> 11) * (1.0 / 9007199254740992.0);
  const double u2 = (double)((((u64)o[2] << 32) | o[3]) >> 11) * (1.0 / 9007199254740992.0);
  return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.141592653589793 * u2);
}
__device__ u64 kbits64(u64 seed, u64 ctr) {
  unsigned int o[4]; kphilox(seed, ctr, o);
  return ((u64)o[0] << 32) | o[1];
}
"#;

/// Row kernels: element j of a thread's registers sits at column KIDX(j) of its row (vectors
/// of VEC columns, consecutive threads on consecutive vectors, so warps read whole lines), and
/// INROW(k) says whether column k is in the row. Where the threads' values cover the row
/// exactly (`full`) it is always true, and the checks compile away: 2-3% faster on the H200
/// over 8192 x 8192 (layer norm 137.1 -> 133.9 us back to back, `tools/stream`). KTHREADS, the
/// block's threads, is a constant of the source (every row kernel and prologue is launched
/// with the threads it was generated for): a vector's column is then a constant offset from
/// the thread's first, with no multiplication per vector.
pub(crate) fn row_index(full: bool, threads: usize) -> String {
    let inrow = if full { "true" } else { "((k) < K)" };
    format!("#define KTHREADS {threads}\n#define KIDX(j) ((((j) / VEC) * KTHREADS + (int)threadIdx.x) * VEC + ((j) % VEC))\n#define INROW(k) {inrow}\n")
}

/// Whether `threads` threads of `vpt` values each cover a row of `k` exactly.
pub(crate) fn row_full(k: usize, threads: usize, vpt: usize) -> bool {
    threads * vpt == k
}

/// Sources of every branch of the map, reduction, gather, scatter and integer product
/// generators, for the NVRTC check (`samples.rs`).
#[cfg(test)]
pub(super) fn samples() -> Vec<super::samples::Sample> {
    use super::samples::Sample;
    let map = |name: &str, inputs: Vec<(DType, CType, Class)>, outs: Vec<(DType, CType, &str, bool)>, out_class: Class, ndim: usize, vec: usize, idx64: bool| {
        let spec = MapSpec { name: name.into(), inputs, outs: outs.into_iter().map(|(d, t, e, once)| (d, t, e.to_string(), once)).collect(), out_class, body: String::new(), ndim, vec, idx64 };
        Sample::new((spec.kernel_name(), gen_map(&spec)))
    };
    let (f32_, bf16, f16) = ((DType::F32, CType::F32), (DType::BF16, CType::F32), (DType::F16, CType::F32));
    let mut v = vec![
        map("map_add", vec![(f32_.0, f32_.1, Class::Contig), (f32_.0, f32_.1, Class::Contig)], vec![(DType::F32, CType::F32, "(v0 + v1)", false)], Class::Contig, 0, 4, false),
        map("map_scale", vec![(bf16.0, bf16.1, Class::Contig), (bf16.0, bf16.1, Class::Splat)], vec![(DType::BF16, CType::F32, "(v0 * v1)", false)], Class::Contig, 3, 8, false),
        map("map_strided", vec![(f16.0, f16.1, Class::Strided), (DType::F32, CType::F32, Class::Scalar)], vec![(DType::F16, CType::F32, "(v0 + v1)", false)], Class::Strided, 2, 1, false),
        map("map_wide", vec![(DType::I64, CType::I64, Class::Strided)], vec![(DType::F64, CType::F64, "(double)v0", false), (DType::I64, CType::I64, "v0", true)], Class::Contig, 3, 1, true),
        map("map_uniform", vec![], vec![(DType::F32, CType::F32, "(float)kuniform(P(0), (u64)i, 24)", false)], Class::Contig, 0, 1, false),
        map("map_normal", vec![], vec![(DType::BF16, CType::F32, "(float)knormal(P(0), (u64)i)", false)], Class::Contig, 0, 8, false),
    ];
    for (op, input) in [(ReduceOp::Sum, DType::F32), (ReduceOp::Sum, DType::BF16), (ReduceOp::Max, DType::F16), (ReduceOp::ArgMax, DType::BF16), (ReduceOp::Sum, DType::Bool), (ReduceOp::Min, DType::I64)] {
        let (acc, out) = (op.acc_type(input), if op.is_arg() { DType::I64 } else { input });
        for (layout, strided, vec, ty, idx64) in [
            (ReduceLayout::Rows, false, 1, 1, false),
            (ReduceLayout::Rows, false, 16 / input.size_in_bytes(), 1, false),
            (ReduceLayout::Rows, true, 1, 1, true),
            (ReduceLayout::Cols, false, (16 / input.size_in_bytes()).min(4), 8, false),
            (ReduceLayout::Cols, false, 2, 32, false),
            (ReduceLayout::Cols, true, 1, 8, true),
        ] {
            let spec = ReduceSpec { op, input, acc, out, layout, idx64, vec, ty, strided };
            v.push(Sample::new((spec.kernel_name(), gen_reduce(&spec))));
        }
    }
    for d in [DType::F32, DType::BF16, DType::I64] {
        v.push(Sample::new(gen_gather(d, 3, 1)));
        v.push(Sample::new(gen_scatter(d, 4, 2, None)));
        v.push(Sample::new(gen_int_bmm(if d == DType::I64 { d } else { DType::I32 })));
    }
    v.push(Sample::new(gen_scatter(DType::BF16, 2, 0, Some(CType::F32))));
    v.push(Sample::new(gen_scatter(DType::I64, 2, 0, Some(CType::I64))));
    v
}

#[cfg(test)]
mod tests {
    use super::size_word;

    /// The bytes a `kernel_args!` struct's CUDA C declaration lays out (eight per element).
    fn c_bytes(decl: &str) -> usize {
        let body = &decl[decl.find('{').expect("a body") + 1..decl.rfind('}').expect("a body")];
        body.split(';').map(str::trim).filter(|f| !f.is_empty()).map(|f| 8 * f.split_once('[').map_or(1, |(_, n)| n.trim_end_matches(']').parse::<usize>().expect("a length"))).sum()
    }

    #[test]
    fn argument_structs_are_laid_out_alike_in_rust_and_cuda_c() {
        use super::{GatherArgs, IntBmmArgs, ReduceArgs, ScatterAddArgs};
        use crate::backend::cuda::kernels::attention::AttentionArgs;
        use std::mem::size_of;
        for (decl, size) in [
            (ReduceArgs::C_DECL, size_of::<ReduceArgs>()),
            (GatherArgs::C_DECL, size_of::<GatherArgs>()),
            (ScatterAddArgs::C_DECL, size_of::<ScatterAddArgs>()),
            (IntBmmArgs::C_DECL, size_of::<IntBmmArgs>()),
            (AttentionArgs::C_DECL, size_of::<AttentionArgs>()),
        ] {
            assert_eq!(c_bytes(decl), size, "{decl}");
        }
        assert_eq!(
            GatherArgs::C_DECL,
            "struct GatherArgs { long long n; unsigned long long out; unsigned long long x; unsigned long long idx; long long dim_size; unsigned long long error_word; unsigned long long error_op; long long sizes[8]; long long idx_strides[8]; long long x_strides[8]; };\n"
        );
    }

    /// The kernels' division by a size word, done on the host as the device does it.
    fn divide(n: u32, word: u64) -> (u32, u32) {
        let (d, magic) = (word as u32, (word >> 32) as u32);
        let shift = 32 - (d - 1).leading_zeros();
        let hi = ((n as u64 * magic as u64) >> 32) as u32;
        let q = (hi + n) >> shift;
        (q, n - q * d)
    }

    #[test]
    fn rows_covered_exactly_have_no_column_checks() {
        use super::{row_full, row_index};
        let (exact, partial) = (row_index(true, 256), row_index(false, 256));
        assert!(exact.contains("#define INROW(k) true") && partial.contains("#define INROW(k) ((k) < K)"), "{exact}\n{partial}");
        assert!(row_full(8192, 512, 16) && !row_full(1000, 64, 16));
    }

    #[test]
    fn a_map_without_vectors_loads_all_its_elements_before_storing_any() {
        use super::{gen_map, Class, MapSpec, MAP_ILP};
        use crate::dtype::CType;
        use crate::DType;
        let spec = MapSpec {
            name: "mul".into(),
            inputs: vec![(DType::BF16, CType::F32, Class::Strided), (DType::F32, CType::F32, Class::Scalar)],
            outs: vec![(DType::BF16, CType::F32, "v0 * v1".into(), false)],
            out_class: Class::Strided,
            body: String::new(),
            ndim: 2,
            vec: 1,
            idx64: false,
        };
        let src = gen_map(&spec);
        let body = &src[src.find("__global__").unwrap()..];
        assert_eq!(body.matches('{').count(), body.matches('}').count(), "{body}");
        let (load, store) = (body.find("x0[j] =").unwrap(), body.find("out0[at0[j]] =").unwrap());
        assert!(load < store, "{body}");
        assert!(body.contains(&format!("for (int j = 0; j < {MAP_ILP}; j++)")), "{body}");
    }

    #[test]
    fn magic_division_matches_hardware_division() {
        let mut rng = 0x9E3779B97F4A7C15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let sizes = (1..300usize).chain([511, 512, 513, 1000, 4096, 8191, 8192, 8193, 65535, 1 << 20, 3 << 20, (1 << 31) - 1]);
        for d in sizes {
            let w = size_word(d, false);
            let ns = [0u32, 1, d as u32 - 1, d as u32, (1u32 << 31) - 1].into_iter().chain((0..200).map(|_| (next() % (1u64 << 31)) as u32));
            for n in ns {
                assert_eq!(divide(n, w), (n / d as u32, n % d as u32), "{n} / {d}");
            }
        }
        assert_eq!(size_word(12, true), 12, "64-bit kernels divide by the size itself");
    }
}
