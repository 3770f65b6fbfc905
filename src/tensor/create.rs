//! Creating tensors: constants, ranges, random values, and host data.

use super::random::{philox, reserve, uniform_f32, uniform_f64};
use super::Tensor;
use crate::backend::check_device;
use crate::compile::graph::RandomKind;
use crate::backend::cpu::{fill_new, with_dtype, CpuStorage, HostElem};
use crate::dtype::{Elem, WithDType};
use crate::layout::numel;
use crate::{DType, Device, Error, Result};

impl Tensor {
    /// A tensor of `shape` with every element `value` (converted to `dtype`).
    #[track_caller]
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        check_device("full", *device)?;
        let n = checked_numel("full", shape, dtype)?;
        if crate::compile::trace::active() {
            return crate::compile::trace::full(shape, value, dtype, *device);
        }
        if let Device::Cuda(d) = device {
            return crate::backend::cuda_full(*d, shape, value, dtype);
        }
        crate::backend::cpu::ensure_host_memory("full", n * dtype.size_in_bytes())?;
        Ok(Tensor::from_cpu(with_dtype!(dtype, T => T::wrap(vec![T::from_f64(value); n])), shape))
    }
    #[track_caller]
    pub fn zeros(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        check_device("zeros", *device)?;
        if device.is_cuda() || crate::compile::trace::active() {
            return Tensor::full(shape, 0.0, dtype, device);
        }
        Ok(Tensor::from_cpu(CpuStorage::zeros(dtype, host_numel("zeros", shape, dtype)?), shape))
    }
    #[track_caller]
    pub fn ones(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        Tensor::full(shape, 1.0, dtype, device)
    }
    /// Zeros of this tensor's shape, dtype and device, in its memory format (PyTorch's
    /// `preserve_format`), as are `ones_like` and `full_like`.
    #[track_caller]
    pub fn zeros_like(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.in_my_format(Tensor::zeros(self.shape(), self.dtype(), &self.device())?)
    }
    #[track_caller]
    pub fn ones_like(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.in_my_format(Tensor::ones(self.shape(), self.dtype(), &self.device())?)
    }
    #[track_caller]
    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.in_my_format(Tensor::full(self.shape(), value, self.dtype(), &self.device())?)
    }
    /// `filled` (a fresh tensor of this shape: a constant, or a buffer not written yet) laid out
    /// in this tensor's memory format: the same values, so only the strides change.
    pub(crate) fn in_my_format(&self, filled: Tensor) -> Result<Tensor> {
        if self.suggest_memory_format() == crate::MemoryFormat::ChannelsLast && !crate::compile::trace::active() {
            return Ok(filled.relaid(crate::layout::Layout::channels_last(self.shape())));
        }
        Ok(filled)
    }
    /// A 0-dimensional tensor.
    #[track_caller]
    pub fn scalar(value: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        Tensor::full(&[], value, dtype, device)
    }

    /// Values `start, start + step, ...` below `end` (`torch.arange`).
    #[track_caller]
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        check_device("arange", *device)?;
        if step == 0.0 || !((end - start) / step).is_finite() {
            return Err(Error::arg("arange", format!("step must be non-zero and the range finite (start {start}, end {end}, step {step})")));
        }
        if (end - start) * step < 0.0 {
            return Err(Error::arg("arange", format!("upper bound and step sign are inconsistent (start {start}, end {end}, step {step})")));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        Tensor::arange_n(start, step, n, dtype, device)
    }

    /// The `n` values `start + i * step` (`arange`'s values, counted rather than bounded: how a
    /// compiled program makes an `arange` it traced); inside a traced function, a node.
    pub(crate) fn arange_n(start: f64, step: f64, n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        host_numel("arange", &[n], dtype)?;
        if crate::compile::trace::active() {
            return crate::compile::trace::arange(start, step, n, dtype, *device);
        }
        Tensor::from_cpu(
            with_dtype!(dtype, T => T::wrap((0..n).map(|i| T::from_f64(start + i as f64 * step)).collect::<Vec<_>>())),
            &[n],
        )
        .placed(device)
    }

    /// `steps` values evenly spaced from `start` to `end` inclusive (`torch.linspace`).
    #[track_caller]
    pub fn linspace(start: f64, end: f64, steps: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        check_device("linspace", *device)?;
        host_numel("linspace", &[steps], dtype)?;
        let step = if steps > 1 { (end - start) / (steps - 1) as f64 } else { 0.0 };
        // Like PyTorch, the second half counts back from `end` so both ends are exact.
        let half = if steps == 1 { 1 } else { steps / 2 };
        Tensor::from_cpu(
            with_dtype!(dtype, T => T::wrap((0..steps).map(|i| {
                T::from_f64(if i < half { start + step * i as f64 } else { end - step * (steps - 1 - i) as f64 })
            }).collect::<Vec<_>>())),
            &[steps],
        )
        .placed(device)
    }

    /// The n×n identity.
    #[track_caller]
    pub fn eye(n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        check_device("eye", *device)?;
        host_numel("eye", &[n, n], dtype)?;
        Tensor::from_cpu(
            with_dtype!(dtype, T => T::wrap((0..n * n).map(|i| T::from_bool(i / n == i % n)).collect::<Vec<_>>())),
            &[n, n],
        )
        .placed(device)
    }

    /// Uniform in [0, 1) from the global generator (`torch.rand`).
    #[track_caller]
    pub fn rand(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        float_only("rand", dtype)?;
        let bits = match dtype {
            DType::F64 => 53,
            DType::F16 => 11,
            DType::BF16 => 8,
            _ => 24,
        };
        if crate::compile::trace::active() {
            return crate::compile::trace::random(RandomKind::Uniform, shape, dtype, *device);
        }
        if let Some(t) = on_cuda_random("rand", shape, dtype, device, crate::backend::Dist::Uniform { bits })? {
            return Ok(t);
        }
        // Half types take only the bits they hold (as torch's uniform_real): rounding a 24-bit
        // value to f16/bf16 could give 1.0.
        random_values("rand", shape, dtype, device, |w| match dtype {
            DType::F64 => uniform_f64(w[0], w[1]),
            DType::F16 => (w[0] >> 21) as f64 / (1u32 << 11) as f64,
            DType::BF16 => (w[0] >> 24) as f64 / (1u32 << 8) as f64,
            _ => uniform_f32(w[0]),
        })
    }

    /// Standard normal from the global generator (`torch.randn`), by Box–Muller.
    #[track_caller]
    pub fn randn(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        float_only("randn", dtype)?;
        if crate::compile::trace::active() {
            return crate::compile::trace::random(RandomKind::Normal, shape, dtype, *device);
        }
        if let Some(t) = on_cuda_random("randn", shape, dtype, device, crate::backend::Dist::Normal)? {
            return Ok(t);
        }
        random_values("randn", shape, dtype, device, |w| {
            let u1 = 1.0 - uniform_f64(w[0], w[1]); // (0, 1]: ln is finite
            let u2 = uniform_f64(w[2], w[3]);
            (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
        })
    }

    /// Integers uniform in [low, high) (`torch.randint`), I64.
    #[track_caller]
    pub fn randint(low: i64, high: i64, shape: &[usize], device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if high <= low {
            return Err(Error::arg("randint", format!("empty range: low {low} >= high {high}")));
        }
        check_device("randint", *device)?;
        let n = checked_numel("randint", shape, DType::I64)?;
        let span = high.wrapping_sub(low) as u64;
        if crate::compile::trace::active() {
            return crate::compile::trace::random(RandomKind::Int { low, high }, shape, DType::I64, *device);
        }
        if let Some(t) = on_cuda_random("randint", shape, DType::I64, device, crate::backend::Dist::Int { low, span })? {
            return Ok(t);
        }
        crate::backend::cpu::ensure_host_memory("randint", n * DType::I64.size_in_bytes())?;
        let (seed, first) = reserve(n as u64);
        let v: crate::backend::cpu::HostBuf<i64> = fill_new(n, |start, out| {
            for (k, o) in out.iter_mut().enumerate() {
                let w = philox(seed, first + (start + k) as u64);
                o.write(low.wrapping_add(((((w[0] as u64) << 32) | w[1] as u64) % span) as i64));
            }
        });
        Ok(Tensor::from_cpu(i64::wrap(v), shape))
    }

    /// A tensor of `shape` holding `data` (row-major).
    #[track_caller]
    pub fn from_vec<T: WithDType>(data: Vec<T>, shape: &[usize], device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if data.len() != checked_numel("from_vec", shape, T::DTYPE)? {
            return Err(Error::shape("from_vec", format!("{} values cannot fill shape {shape:?} ({} elements)", data.len(), numel(shape))));
        }
        check_device("from_vec", *device)?;
        Tensor::from_cpu(T::wrap(data), shape).placed(device)
    }
    #[track_caller]
    pub fn from_slice<T: WithDType>(data: &[T], shape: &[usize], device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        Tensor::from_vec(data.to_vec(), shape, device)
    }
}

/// The element count of a host tensor of `shape`, or an error when its size overflows (torch:
/// "Storage size calculation overflowed") or the host cannot allocate it.
fn host_numel(op: &'static str, shape: &[usize], dtype: DType) -> Result<usize> {
    let n = checked_numel(op, shape, dtype)?;
    crate::backend::cpu::ensure_host_memory(op, n * dtype.size_in_bytes())?;
    Ok(n)
}

/// The element count of `shape`, or an error when it, its strides or its size in bytes overflow.
fn checked_numel(op: &'static str, shape: &[usize], dtype: DType) -> Result<usize> {
    crate::layout::checked_numel(op, shape, dtype.size_in_bytes())
}

/// Draws on the GPU when `device` is one: the same stream, element for element, as the host.
fn on_cuda_random(op: &'static str, shape: &[usize], dtype: DType, device: &Device, dist: crate::backend::Dist) -> Result<Option<Tensor>> {
    let Device::Cuda(d) = device else { return Ok(None) };
    check_device(op, *device)?;
    checked_numel(op, shape, dtype)?;
    crate::backend::cuda_random(*d, shape, dtype, dist).map(Some)
}

fn float_only(op: &'static str, dtype: DType) -> Result<()> {
    if !dtype.is_float() {
        return Err(Error::dtype(op, dtype, "needs a floating-point dtype"));
    }
    Ok(())
}

/// Element i draws from counter block (first + i): one Philox call per element, so the stream
/// does not depend on how the work is split across threads.
fn random_values(op: &'static str, shape: &[usize], dtype: DType, device: &Device, f: impl Fn([u32; 4]) -> f64 + Sync) -> Result<Tensor> {
    check_device(op, *device)?;
    let n = host_numel(op, shape, dtype)?;
    let (seed, first) = reserve(n as u64);
    let s = with_dtype!(dtype, T => T::wrap(fill_new(n, |start, out| {
        for (k, o) in out.iter_mut().enumerate() {
            o.write(<T as Elem>::from_f64(f(philox(seed, first + (start + k) as u64))));
        }
    })));
    Ok(Tensor::from_cpu(s, shape))
}

impl Tensor {
    /// This host tensor, made from a constructor's arguments alone, on `device`. Inside a
    /// compiled function it is a constant of the graph (captured once at trace time), not a
    /// copy to the device at every call, which would keep the call out of a CUDA graph.
    fn placed(self, device: &Device) -> Result<Tensor> {
        let _constant = crate::compile::trace::Suspend::new();
        self.to_device(device)
    }
}
