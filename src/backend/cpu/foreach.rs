//! The multi-tensor optimiser update on the host: each parameter read and written once, with
//! its gradient and state, instead of one pass (and one fresh buffer) per eager op of the
//! per-tensor step. Every value is rounded to the parameter's dtype where an eager op would
//! round it, in the order of the CUDA kernel (`cuda/kernels/foreach.cu`), so the results are the
//! per-tensor step's bit for bit. Large parameters are split across cores.

use super::{HostElem, PAR_THRESHOLD};
use crate::backend::UpdateRule as Rule;
use crate::storage::BackendStorage;
use crate::{DType, Result, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// The type an update computes in: F32 for the 16-bit dtypes, as the eager ops do.
trait Real: Copy + Send + Sync + std::ops::Add<Output = Self> + std::ops::Sub<Output = Self> + std::ops::Mul<Output = Self> + std::ops::Div<Output = Self> {
    fn of(x: f64) -> Self;
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// A stored element type and how it is computed on: loaded into `T`, and stored back (the
/// rounding of one eager op's result).
trait Stored: HostElem + Send + Sync {
    type T: Real;
    fn ld(self) -> Self::T;
    fn st(x: Self::T) -> Self;
    /// `x` rounded as an eager op's result is.
    fn kr(x: Self::T) -> Self::T {
        Self::st(x).ld()
    }
}

/// F32 and F64 compute in themselves.
macro_rules! native_stored {
    ($($t:ty),*) => {$(
        impl Stored for $t {
            type T = $t;
            fn ld(self) -> $t {
                self
            }
            fn st(x: $t) -> $t {
                x
            }
        }
    )*};
}
native_stored!(f32, f64);

/// The 16-bit dtypes compute in F32.
macro_rules! half_stored {
    ($($t:ty),*) => {$(
        impl Stored for $t {
            type T = f32;
            fn ld(self) -> f32 {
                self.to_f32()
            }
            fn st(x: f32) -> $t {
                <$t>::from_f32(x)
            }
        }
    )*};
}
half_stored!(f16, bf16);

/// Whether the host updates parameters of `dtype` in one pass: the dtypes the device does.
pub(crate) use crate::backend::cuda::kernels::foreach::supports;

/// Applies `rule` to every entry: its slots (parameter, gradient, state; contiguous, of
/// `dtype`, the written ones in storages of their own), with `scalars` as `Rule` documents.
pub(crate) fn update(rule: Rule, dtype: DType, entries: &[Vec<&Tensor>], scalars: &[f64], first: bool) -> Result<()> {
    let _rec = crate::profiler::record::cpu_kernel(&rule.name(dtype));
    for slots in entries {
        match dtype {
            DType::F32 => entry::<f32>(rule, slots, scalars, first),
            DType::F64 => entry::<f64>(rule, slots, scalars, first),
            DType::F16 => entry::<f16>(rule, slots, scalars, first),
            DType::BF16 => entry::<bf16>(rule, slots, scalars, first),
            d => return Err(crate::Error::arg("optimizer step", format!("no multi-tensor update for {d:?} on the host"))),
        }
    }
    Ok(())
}

fn entry<S: Stored>(rule: Rule, slots: &[&Tensor], scalars: &[f64], first: bool) {
    let range = |t: &Tensor| t.storage_offset()..t.storage_offset() + t.numel();
    // The gradient is read, the rest written; `foreach` checked they share no storage.
    let g_guard = slots[1].storage().data.read_recursive();
    let BackendStorage::Cpu(gs) = &*g_guard else { unreachable!("a host update of a device tensor") };
    let g = &S::slice(gs).expect("the gradient has the update's dtype")[range(slots[1])];
    let mut guards: Vec<_> = [0].into_iter().chain(2..slots.len()).map(|i| (i, slots[i].storage().data.write())).collect();
    let mut written: Vec<&mut [S]> = guards
        .iter_mut()
        .map(|(i, w)| {
            let BackendStorage::Cpu(s) = &mut **w else { unreachable!("a host update of a device tensor") };
            &mut S::slice_mut(s).expect("the slot has the update's dtype")[range(slots[*i])]
        })
        .collect();
    let s = |i: usize| S::T::of(scalars[i]);
    let kr = S::kr;
    match rule {
        // With momentum the slots hold the buffer too (`Rule::depth`).
        Rule::Sgd { weight_decay, nesterov, .. } => {
            let (lr, wd, mom, keep) = (s(0), s(1), s(2), s(3));
            let one = move |p: &mut S, g: S, buf: Option<&mut S>| {
                let (pv, mut gv) = (p.ld(), g.ld());
                if weight_decay {
                    gv = kr(gv + kr(pv * wd));
                }
                if let Some(b) = buf {
                    let bv = if first { gv } else { kr(kr(b.ld() * mom) + kr(gv * keep)) };
                    *b = S::st(bv);
                    gv = if nesterov { kr(gv + kr(bv * mom)) } else { bv };
                }
                *p = S::st(pv - kr(gv * lr));
            };
            chunked(&mut written, g, |w, g| match w {
                [p, b] => p.iter_mut().zip(g).zip(b.iter_mut()).for_each(|((p, g), b)| one(p, *g, Some(b))),
                [p] => p.iter_mut().zip(g).for_each(|(p, g)| one(p, *g, None)),
                _ => unreachable!("SGD writes the parameter and, with momentum, its buffer"),
            });
        }
        Rule::Adam { weight_decay, decoupled } => {
            let (wd, decay, beta1, keep1, beta2, keep2, bc2s, eps, step_size) = (s(0), s(1), s(2), s(3), s(4), s(5), s(6), s(7), s(8));
            chunked(&mut written, g, |w, g| {
                let [p, m, v] = w else { unreachable!("Adam writes the parameter and its two moments") };
                for (((p, m), g), v) in p.iter_mut().zip(m.iter_mut()).zip(g).zip(v.iter_mut()) {
                    let (mut pv, mut gv) = (p.ld(), g.ld());
                    if weight_decay && decoupled {
                        pv = kr(pv * decay);
                    } else if weight_decay {
                        gv = kr(gv + kr(pv * wd));
                    }
                    let mv = kr(kr(m.ld() * beta1) + kr(gv * keep1));
                    let vv = kr(kr(v.ld() * beta2) + kr(kr(gv * gv) * keep2));
                    let denom = kr(kr(kr(vv.sqrt()) / bc2s) + eps);
                    *p = S::st(pv - kr(kr(mv / denom) * step_size));
                    (*m, *v) = (S::st(mv), S::st(vv));
                }
            });
        }
    }
}

/// Elements per core's share below which one thread updates the whole parameter.
const CHUNK: usize = 4 * PAR_THRESHOLD;

/// Runs `f` on matching chunks of the written slots and the gradient: the whole of each below
/// `2 * CHUNK` elements, else chunks of `CHUNK` split across cores.
fn chunked<S: Send + Sync>(written: &mut [&mut [S]], g: &[S], f: impl Fn(&mut [&mut [S]], &[S]) + Sync) {
    if g.len() < 2 * CHUNK {
        return f(written, g);
    }
    let mut parts: Vec<Vec<&mut [S]>> = (0..g.len().div_ceil(CHUNK)).map(|_| Vec::with_capacity(written.len())).collect();
    for w in written.iter_mut() {
        for (part, c) in parts.iter_mut().zip(w.chunks_mut(CHUNK)) {
            part.push(c);
        }
    }
    parts.into_par_iter().zip(g.par_chunks(CHUNK)).for_each(|(mut w, g)| f(&mut w, g));
}
