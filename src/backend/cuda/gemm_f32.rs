//! Generated F32 matrix products on CUDA cores (`gemm_f32.cu`), max-autotune's rivals to
//! cuBLASLt for F32 (as Inductor's GEMM templates are to cuBLAS). Their edge is the products
//! of a small model: a few hundred rows make only a few output tiles, and cuBLAS's FP32
//! kernels then leave most multiprocessors idle; these take smaller tiles and split K over
//! more blocks, adding the partial tiles in a fixed order (deterministic results).
//!
//! A variant is a tile configuration and a split count; max-autotune times the variants that
//! fit a problem beside cuBLASLt's algorithms and keeps the fastest (`blas::tuned`).

use super::{CudaDevice, CudaStorage, KArgs, Kernel, KernelKey};
use crate::{DType, Result};
use std::sync::Arc;

const SOURCE: &str = include_str!("gemm_f32.cu");

/// A block's tile of the output (bm x bn), its K step (bk) and each thread's outputs (tm x tn).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tile {
    pub bm: usize,
    pub bn: usize,
    pub bk: usize,
    pub tm: usize,
    pub tn: usize,
}

impl Tile {
    const fn new(bm: usize, bn: usize, bk: usize, tm: usize, tn: usize) -> Tile {
        Tile { bm, bn, bk, tm, tn }
    }
    fn threads(self) -> usize {
        (self.bm / self.tm) * (self.bn / self.tn)
    }
}

/// The tiles timed: small ones for products of few rows, larger ones for big products.
pub(crate) const TILES: [Tile; 7] = [
    Tile::new(32, 32, 32, 4, 4),
    Tile::new(32, 64, 16, 4, 4),
    Tile::new(64, 64, 16, 4, 4),
    Tile::new(64, 64, 16, 8, 4),
    Tile::new(128, 64, 16, 8, 4),
    Tile::new(64, 128, 16, 8, 8),
    Tile::new(128, 128, 8, 8, 8),
];

/// K split counts tried.
const SPLITS: [usize; 8] = [1, 2, 3, 4, 6, 8, 12, 16];

/// One way to run a product: a tile of `TILES` and how many parts K is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Variant {
    pub tile: Tile,
    pub splits: usize,
}

impl Variant {
    /// As stored by max-autotune: `generated 64x64x16/8x4 split 4`.
    pub(crate) fn text(&self) -> String {
        let t = self.tile;
        format!("generated {}x{}x{}/{}x{} split {}", t.bm, t.bn, t.bk, t.tm, t.tn, self.splits)
    }

    /// The variant `text` wrote, if its tile is still one of `TILES`.
    pub(crate) fn parse(s: &str) -> Option<Variant> {
        let rest = s.strip_prefix("generated ")?;
        let (tile, splits) = rest.split_once(" split ")?;
        let (block, thread) = tile.split_once('/')?;
        let b: Vec<usize> = block.split('x').map(|v| v.parse().ok()).collect::<Option<_>>()?;
        let t: Vec<usize> = thread.split('x').map(|v| v.parse().ok()).collect::<Option<_>>()?;
        let (&[bm, bn, bk], &[tm, tn]) = (b.as_slice(), t.as_slice()) else { return None };
        let tile = Tile::new(bm, bn, bk, tm, tn);
        let splits = splits.parse().ok().filter(|&s| s >= 1)?;
        TILES.contains(&tile).then_some(Variant { tile, splits })
    }
}

/// How a product reads its operands and what it does after: everything a kernel's source
/// depends on besides its tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    /// A read transposed (A(m, k) at m + k·lda), B read transposed (B(k, n) at k + n·ldb).
    pub ta: bool,
    pub tb: bool,
    /// 4-float loads of A, of B.
    pub va: bool,
    pub vb: bool,
    /// 0 none, 1 bias, 2 bias then ReLU.
    pub epilogue: u8,
}

/// One product's sizes and addresses (batch strides in elements).
pub(crate) struct Operands {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub b: u64,
    pub out: u64,
    pub bias: u64,
    pub lda: usize,
    pub ldb: usize,
    pub batch_a: i64,
    pub batch_b: i64,
}

impl Operands {
    /// Whether 4-float loads fit A and B: the contiguous dim, the leading dim and the batch
    /// stride multiples of 4, the base 16-byte aligned.
    pub(crate) fn vector_loads(&self, ta: bool, tb: bool) -> (bool, bool) {
        let fits = |base: u64, ld: usize, stride: i64, contiguous: usize| base % 16 == 0 && ld % 4 == 0 && stride % 4 == 0 && contiguous % 4 == 0;
        (fits(self.a, self.lda, self.batch_a, if ta { self.m } else { self.k }), fits(self.b, self.ldb, self.batch_b, if tb { self.k } else { self.n }))
    }
}

fn kernel_name(t: Tile, s: Shape) -> String {
    format!(
        "gemm_f32_{}x{}x{}_{}x{}_{}{}{}{}_e{}",
        t.bm,
        t.bn,
        t.bk,
        t.tm,
        t.tn,
        if s.ta { "t" } else { "n" },
        if s.tb { "t" } else { "n" },
        if s.va { "v" } else { "s" },
        if s.vb { "v" } else { "s" },
        s.epilogue
    )
}

fn source(t: Tile, s: Shape) -> (String, String) {
    let name = kernel_name(t, s);
    let src = format!(
        "{prelude}\n#define BM {}\n#define BN {}\n#define BK {}\n#define TM {}\n#define TN {}\n#define TA {}\n#define TB {}\n#define VA {}\n#define VB {}\n#define EPI {}\n#define KNAME {name}\n{SOURCE}",
        t.bm,
        t.bn,
        t.bk,
        t.tm,
        t.tn,
        s.ta as u8,
        s.tb as u8,
        s.va as u8,
        s.vb as u8,
        s.epilogue,
        prelude = super::codegen::PRELUDE,
    );
    (name, src)
}

fn kernel(dev: &CudaDevice, t: Tile, s: Shape) -> Result<Kernel> {
    dev.kernel(KernelKey::Named(kernel_name(t, s)), || source(t, s))
}

/// Notes every tile's kernel for `s` (inside a rehearsal: they are then built side by side
/// before max-autotune times them).
pub(crate) fn want_all(dev: &CudaDevice, s: Shape) -> Result<()> {
    for t in TILES {
        kernel(dev, t, s)?;
    }
    Ok(())
}

/// K per split: a whole number of K steps.
fn k_per_split(k: usize, bk: usize, splits: usize) -> usize {
    k.div_ceil(splits).div_ceil(bk).max(1) * bk
}

/// The variants worth timing for `o` on `dev`: each tile with each split count that leaves
/// every split at least 4 K steps and makes at most about 8 blocks per multiprocessor.
pub(crate) fn variants(dev: &CudaDevice, o: &Operands) -> Vec<Variant> {
    let mut out = vec![];
    for tile in TILES {
        let tiles = o.m.div_ceil(tile.bm) * o.n.div_ceil(tile.bn) * o.batch;
        for splits in SPLITS {
            let per = k_per_split(o.k, tile.bk, splits);
            let real = o.k.div_ceil(per);
            if real != splits || (splits > 1 && (per < 4 * tile.bk || tiles * splits > 8 * dev.sm_count)) {
                continue;
            }
            // Grid limits: row tiles in y, batch × splits in z.
            if o.batch * splits <= 65535 && o.m.div_ceil(tile.bm) <= 65535 {
                out.push(Variant { tile, splits });
            }
        }
    }
    out
}

/// Runs `o` with variant `v` (`s` must describe `o`). A split K adds its partial tiles in a
/// scratch buffer of splits × batch × m × n floats.
pub(crate) fn run(dev: &Arc<CudaDevice>, v: Variant, s: Shape, o: &Operands) -> Result<()> {
    let t = v.tile;
    let kern = kernel(dev, t, s)?;
    let grid = (o.n.div_ceil(t.bn) as u32, o.m.div_ceil(t.bm) as u32, (o.batch * v.splits) as u32);
    let per = k_per_split(o.k, t.bk, v.splits);
    let mut a = KArgs::default();
    // Kept alive until the launch is queued; freed in stream order after.
    let mut scratch = None;
    if v.splits > 1 {
        let ws = CudaStorage::new(dev, DType::F32, v.splits * o.batch * o.m * o.n)?;
        a.w[4] = ws.ptr();
        a.w[5] = dev.reduce_counters(grid.0 as usize * grid.1 as usize * o.batch)?;
        scratch = Some(ws);
    }
    a.w[0] = o.a;
    a.w[1] = o.b;
    a.w[2] = o.out;
    a.w[3] = o.bias;
    a.w[6..11].copy_from_slice(&[o.m as u64, o.n as u64, o.k as u64, o.lda as u64, o.ldb as u64]);
    a.w[11] = o.batch_a as u64;
    a.w[12] = o.batch_b as u64;
    a.w[13] = per as u64;
    a.w[14] = v.splits as u64;
    dev.launch(kern, grid, (t.threads() as u32, 1, 1), &a)?;
    drop(scratch);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_round_trip_through_text() {
        for tile in TILES {
            let v = Variant { tile, splits: 6 };
            assert_eq!(Variant::parse(&v.text()), Some(v));
        }
        assert_eq!(Variant::parse("generated 48x64x16/4x4 split 2"), None, "not a tile of TILES");
        assert_eq!(Variant::parse("generated 64x64x16/8x4 split 0"), None);
        assert_eq!(Variant::parse("0000 1111"), None);
    }

    #[test]
    fn every_tile_loads_whole_vectors_per_thread() {
        for t in TILES {
            let n = t.threads();
            assert!(t.tm % 4 == 0 && t.tn % 4 == 0 && n <= 1024, "{t:?}");
            for w in [1, 4] {
                assert_eq!((t.bm * t.bk) % (n * w), 0, "{t:?} A loads, width {w}");
                assert_eq!((t.bk * t.bn) % (n * w), 0, "{t:?} B loads, width {w}");
            }
            assert!((2 * t.bk * (t.bm + t.bn + 8) * 4) <= 48 << 10, "{t:?} shared memory");
        }
    }

    /// Runs `v` on [batch, m, k] @ [batch, k, n] (operands stored transposed where `s` says,
    /// random values) and checks every output against a float64 product with the error bound
    /// of a K-term F32 dot product, 2·K·2⁻²⁴·Σ|a||b| (split sums stay within it).
    fn check(dev: &Arc<CudaDevice>, v: Variant, s: Shape, (batch, m, n, k): (usize, usize, usize, usize)) {
        use crate::{Device, Tensor};
        let host = |len: usize, seed: u64| -> Vec<f64> {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
                })
                .collect()
        };
        let (av, bv, biasv) = (host(batch * m * k, 1), host(batch * k * n, 2), host(n, 3));
        // Stored [batch, rows, cols] of what the kernel reads at (row, col): A is [m, k] or,
        // transposed, [k, m]; B is [k, n] or [n, k].
        let a_at = |b: usize, i: usize, p: usize| if s.ta { av[b * m * k + p * m + i] } else { av[b * m * k + i * k + p] };
        let b_at = |b: usize, p: usize, j: usize| if s.tb { bv[b * k * n + j * k + p] } else { bv[b * k * n + p * n + j] };
        let on_gpu = |x: &[f64]| Tensor::from_slice(x, &[x.len()], &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().to_device(&Device::Cuda(dev.ordinal)).unwrap();
        let (ta, tb, tbias) = (on_gpu(&av), on_gpu(&bv), on_gpu(&biasv));
        let out = CudaStorage::new(dev, DType::F32, batch * m * n).unwrap();
        let ptr = |t: &Tensor| super::super::kernels::data_ptr(t).unwrap();
        let o = Operands {
            batch,
            m,
            n,
            k,
            a: ptr(&ta),
            b: ptr(&tb),
            out: out.ptr(),
            bias: if s.epilogue > 0 { ptr(&tbias) } else { 0 },
            lda: if s.ta { m } else { k },
            ldb: if s.tb { k } else { n },
            batch_a: (m * k) as i64,
            batch_b: (k * n) as i64,
        };
        let (va, vb) = o.vector_loads(s.ta, s.tb);
        assert!((va || !s.va) && (vb || !s.vb), "vector loads asked of a shape that does not take them");
        run(dev, v, s, &o).unwrap();
        let got = Tensor::from_backend(crate::storage::BackendStorage::Cuda(out), &[batch * m * n]).to_device(&Device::Cpu).unwrap().to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
        for b in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let (mut want, mut mag) = (0.0, 0.0);
                    for p in 0..k {
                        want += a_at(b, i, p) * b_at(b, p, j);
                        mag += (a_at(b, i, p) * b_at(b, p, j)).abs();
                    }
                    let mut bound = 2.0 * k as f64 * f32::EPSILON as f64 / 2.0 * mag;
                    if s.epilogue > 0 {
                        want += biasv[j];
                        bound += (want.abs() + biasv[j].abs()) * f32::EPSILON as f64;
                    }
                    if s.epilogue == 2 {
                        want = want.max(0.0);
                    }
                    let g = got[(b * m + i) * n + j];
                    assert!((g - want).abs() <= bound, "{} {s:?} [{batch}, {m}, {n}, {k}]: element ({b}, {i}, {j}) is {g}, expected {want} (bound {bound:e})", v.text());
                }
            }
        }
    }

    /// Every tile in the transformer's layout (row-major activations times a transposed
    /// weight, bias and ReLU after) with and without a split K; two tiles in every layout,
    /// with vector and scalar loads; shapes that are not multiples of any tile. On the GPU
    /// (`KILN_TEST_DEVICE=cuda`) only.
    #[test]
    fn every_variant_matches_a_float64_product_on_a_gpu() {
        if !std::env::var("KILN_TEST_DEVICE").is_ok_and(|d| d.starts_with("cuda")) {
            return;
        }
        let dev = super::super::device(0).unwrap();
        let linear = Shape { ta: false, tb: true, va: true, vb: true, epilogue: 2 };
        for tile in TILES {
            for splits in [1, 3] {
                check(&dev, Variant { tile, splits }, linear, (1, 68, 92, 200));
            }
        }
        for tile in [TILES[0], TILES[3]] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for vec in [true, false] {
                    let s = Shape { ta, tb, va: vec, vb: vec, epilogue: 0 };
                    check(&dev, Variant { tile, splits: 2 }, s, (2, 68, 92, 200));
                    if !vec {
                        check(&dev, Variant { tile, splits: 1 }, s, (2, 37, 45, 77));
                        check(&dev, Variant { tile, splits: 4 }, s, (1, 37, 45, 77));
                    }
                }
            }
        }
        check(&dev, Variant { tile: TILES[2], splits: 2 }, Shape { ta: false, tb: false, va: true, vb: false, epilogue: 1 }, (1, 64, 90, 128));
    }

    #[test]
    fn splits_cover_k_in_whole_steps() {
        for k in [1, 7, 64, 500, 512, 2048, 3000] {
            for s in SPLITS {
                let per = k_per_split(k, 16, s);
                assert_eq!(per % 16, 0);
                assert!(per * s >= k, "k {k} split {s}");
            }
        }
    }
}
