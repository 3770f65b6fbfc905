//! Custom ops: a CUDA C kernel compiled at run time (like `torch.utils.cpp_extension.load`), a
//! CPU function, and optionally a gradient, usable in eager code and inside compiled functions,
//! where the op is one opaque node (`NodeOp::Custom`) that fusion stops at.
//!
//! ```
//! use kiln::prelude::*;
//! # fn main() -> kiln::Result<()> {
//! const SRC: &str = r#"
//! extern "C" __global__ void scale_kernel(const scalar_t* x, out_t* out, long long n, double a) {
//!     long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
//!     if (i < n) out[i] = (out_t)(a * x[i]);
//! }"#;
//! let scale = CustomOp::new("scale3")
//!     .inputs(1)
//!     .cuda_source(SRC, "scale_kernel")
//!     .launch(|inputs| LaunchSpec::elementwise(inputs[0].numel()).arg_f64(3.0))
//!     .output_like(0)
//!     .cpu(|inputs, out| {
//!         for (o, x) in out.iter_mut().zip(inputs[0].iter()) {
//!             *o = 3.0 * x;
//!         }
//!         Ok(())
//!     })
//!     .backward(|_ctx, grad| Ok(vec![Some(grad.mul_scalar(3.0)?)]))
//!     .build()?;
//! let x = Tensor::randn(&[1000], DType::F32, &Device::cuda_if_available(0))?;
//! assert!(scale.call(&[&x])?.allclose(&x.mul_scalar(3.0)?, 1e-6, 1e-6)?);
//! # Ok(())
//! # }
//! ```
//!
//! **Calling convention of the CUDA kernel.** It is an `extern "C" __global__` function (so its
//! name is not mangled) taking one `const scalar_t*` per input, then `out_t*` for the output,
//! then the launch spec's scalar arguments in order ([`LaunchSpec::elementwise`] passes
//! `long long n`; `arg_i64` / `arg_i32` / `arg_f64` / `arg_f32` append `long long` / `int` /
//! `double` / `float`). `scalar_t` and `out_t` are macros (NVRTC `-D` options) for the C types of
//! the inputs' and the output's dtype (F32 `float`, F64 `double`, I32 `int`, I64 `long long`,
//! U8 `unsigned char`), so one source serves every dtype the op accepts. Inputs are contiguous
//! row-major (non-contiguous inputs are copied first); the output is a fresh contiguous buffer
//! the kernel must fill. The source is compiled for the device's architecture with
//! `--std=c++17`, no headers; it is cached per device by (source, name, types) and on disk like
//! generated kernels. Where the driver reports parameter sizes (CUDA 12.4+), the kernel's
//! parameters are checked against the call before launching. A kernel must only write its
//! output: the compiler treats the op as a pure function (common subexpressions, dead code).
//!
//! **The CPU function** receives the inputs as contiguous row-major f64 values ([`HostTensor`],
//! with their shapes) and fills the zeroed output in f64, rounded once to the output dtype.
//!
//! **Closures given to `check`, `output` and `backward`** read only shapes, dtypes and
//! devices of their tensors, or compute with kiln ops: inside a compiled function the tensors
//! are symbolic. `backward` receives the saved inputs and output ([`OpCtx`]) and d(output) and
//! returns one gradient (or `None`) per input, written with kiln ops or other custom ops.

mod cpu;
mod launch;

pub use cpu::HostTensor;
pub use launch::LaunchSpec;
pub(crate) use launch::KernelArg;

use crate::autograd::{Ctx, Function};
use crate::compile::graph::NodeOp;
use crate::{is_grad_enabled, DType, Device, Error, Result, Tensor};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

type CheckFn = Box<dyn Fn(&[&Tensor]) -> std::result::Result<(), String> + Send + Sync>;
type OutputFn = Box<dyn Fn(&[&Tensor]) -> Result<(Vec<usize>, DType)> + Send + Sync>;
type LaunchFn = Box<dyn Fn(&[&Tensor]) -> LaunchSpec + Send + Sync>;
type CpuFn = Box<dyn Fn(&[HostTensor], &mut HostTensor) -> Result<()> + Send + Sync>;
type BackwardFn = Box<dyn Fn(&OpCtx, &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// What `backward` sees: the inputs and the output of the forward call.
pub struct OpCtx<'a> {
    inputs: &'a [Tensor],
    output: &'a Tensor,
}

impl OpCtx<'_> {
    pub fn inputs(&self) -> &[Tensor] {
        self.inputs
    }
    pub fn input(&self, i: usize) -> &Tensor {
        &self.inputs[i]
    }
    pub fn output(&self) -> &Tensor {
        self.output
    }
}

enum Output {
    Like(usize),
    Rule(OutputFn),
}

struct Inner {
    name: &'static str,
    /// Tells apart ops of the same name in graphs (common subexpressions compare ops).
    id: u64,
    n_inputs: Option<usize>,
    dtypes: Vec<DType>,
    cuda: Option<(Arc<str>, Arc<str>)>,
    launch: Option<LaunchFn>,
    output: Output,
    check: Option<CheckFn>,
    cpu: Option<CpuFn>,
    backward: Option<BackwardFn>,
    inplace: bool,
}

/// A user op (see the module docs). Cloning is cheap: clones share one definition.
#[derive(Clone)]
pub struct CustomOp(Arc<Inner>);

/// Builds a [`CustomOp`]; `build` checks that it is complete.
pub struct CustomOpBuilder {
    name: String,
    n_inputs: Option<usize>,
    dtypes: Vec<DType>,
    cuda: Option<(String, String)>,
    launch: Option<LaunchFn>,
    output: Output,
    check: Option<CheckFn>,
    cpu: Option<CpuFn>,
    backward: Option<BackwardFn>,
    inplace: bool,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Op names live as long as the program (errors carry `&'static str`); each distinct name is
/// stored once, so ops rebuilt in a loop do not grow memory.
fn intern(name: String) -> &'static str {
    static NAMES: std::sync::OnceLock<parking_lot::Mutex<std::collections::HashSet<&'static str>>> = std::sync::OnceLock::new();
    let mut names = NAMES.get_or_init(Default::default).lock();
    if let Some(n) = names.get(name.as_str()) {
        return n;
    }
    let n: &'static str = Box::leak(name.into_boxed_str());
    names.insert(n);
    n
}

impl CustomOp {
    /// Starts an op named `name` (how it shows in errors, graphs and `<name>Backward`).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(name: &str) -> CustomOpBuilder {
        CustomOpBuilder {
            name: name.to_string(),
            n_inputs: None,
            dtypes: vec![DType::F32, DType::F64],
            cuda: None,
            launch: None,
            output: Output::Like(0),
            check: None,
            cpu: None,
            backward: None,
            inplace: false,
        }
    }
}

impl CustomOpBuilder {
    /// The number of input tensors every call must pass.
    pub fn inputs(mut self, n: usize) -> Self {
        self.n_inputs = Some(n);
        self
    }
    /// The dtypes the op accepts (default F32 and F64); all inputs of a call share one.
    pub fn dtypes(mut self, dtypes: &[DType]) -> Self {
        self.dtypes = dtypes.to_vec();
        self
    }
    /// CUDA C `source` defining `extern "C" __global__ void kernel(...)` (see the module docs).
    pub fn cuda_source(mut self, source: &str, kernel: &str) -> Self {
        self.cuda = Some((source.to_string(), kernel.to_string()));
        self
    }
    /// The launch configuration and scalar arguments of a call, from its (contiguous) inputs.
    pub fn launch(mut self, f: impl Fn(&[&Tensor]) -> LaunchSpec + Send + Sync + 'static) -> Self {
        self.launch = Some(Box::new(f));
        self
    }
    /// The output has input `k`'s shape and dtype (the default is `output_like(0)`).
    pub fn output_like(mut self, k: usize) -> Self {
        self.output = Output::Like(k);
        self
    }
    /// The output's shape and dtype from the inputs.
    pub fn output(mut self, f: impl Fn(&[&Tensor]) -> Result<(Vec<usize>, DType)> + Send + Sync + 'static) -> Self {
        self.output = Output::Rule(Box::new(f));
        self
    }
    /// Validates a call's inputs beyond count, dtype and device (shapes); an `Err(message)`
    /// becomes an `Error::Shape` naming the op.
    pub fn check(mut self, f: impl Fn(&[&Tensor]) -> std::result::Result<(), String> + Send + Sync + 'static) -> Self {
        self.check = Some(Box::new(f));
        self
    }
    /// The CPU implementation (see the module docs).
    pub fn cpu(mut self, f: impl Fn(&[HostTensor], &mut HostTensor) -> Result<()> + Send + Sync + 'static) -> Self {
        self.cpu = Some(Box::new(f));
        self
    }
    /// The gradient: one per input (or `None`) from the saved tensors and d(output).
    pub fn backward(mut self, f: impl Fn(&OpCtx, &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static) -> Self {
        self.backward = Some(Box::new(f));
        self
    }
    /// Declares that the kernel may write its output over input 0 (each output element reads
    /// only the same element of input 0), so `call_` on a GPU runs it in place without a copy.
    pub fn inplace_safe(mut self) -> Self {
        self.inplace = true;
        self
    }

    pub fn build(self) -> Result<CustomOp> {
        let op = "CustomOp::build";
        if self.name.is_empty() || self.name.contains(char::is_whitespace) {
            return Err(Error::arg(op, format!("the name {:?} must be non-empty and without spaces", self.name)));
        }
        let fail = |msg: String| Err(Error::arg(op, format!("{}: {msg}", self.name)));
        if self.cuda.is_none() && self.cpu.is_none() {
            return fail("give a CUDA kernel (cuda_source), a CPU function (cpu), or both".into());
        }
        if self.cuda.is_some() && self.launch.is_none() {
            return fail("a CUDA kernel needs a launch spec (.launch(|inputs| LaunchSpec::elementwise(..)))".into());
        }
        if let Some((_, k)) = &self.cuda {
            if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return fail(format!("the kernel name {k:?} is not a C identifier"));
            }
        }
        if self.dtypes.is_empty() {
            return fail("dtypes(..) is empty".into());
        }
        if let (Output::Like(k), Some(n)) = (&self.output, self.n_inputs) {
            if *k >= n {
                return fail(format!("output_like({k}) names an input of an op with {n} inputs"));
            }
        }
        Ok(CustomOp(Arc::new(Inner {
            name: intern(self.name),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            n_inputs: self.n_inputs,
            dtypes: self.dtypes,
            cuda: self.cuda.map(|(s, k)| (Arc::from(s), Arc::from(k))),
            launch: self.launch,
            output: self.output,
            check: self.check,
            cpu: self.cpu,
            backward: self.backward,
            inplace: self.inplace,
        })))
    }
}

impl CustomOp {
    pub fn name(&self) -> &'static str {
        self.0.name
    }

    /// Runs the op; records it for autograd when an input requires grad, and as one node when
    /// called inside a compiled function.
    pub fn call(&self, inputs: &[&Tensor]) -> Result<Tensor> {
        let recording = is_grad_enabled() && inputs.iter().any(|t| t.is_requires_grad());
        if self.0.backward.is_some() {
            return Apply(self.clone()).apply(inputs);
        }
        if recording && self.meta(inputs)?.1.is_float() {
            return Err(Error::Autograd(format!(
                "{}: an input requires grad but the custom op has no backward; give it one (.backward(..)) or call it under no_grad",
                self.name()
            )));
        }
        self.forward(inputs)
    }

    /// In-place form: writes the result into input 0 (which it must fit in shape and dtype)
    /// and bumps its version, like the built-in in-place ops. On a GPU, an op built with
    /// `inplace_safe` runs its kernel over input 0 directly; otherwise the result is computed
    /// out of place and copied in (also with autograd recording or inside a compiled function).
    pub fn call_(&self, inputs: &[&Tensor]) -> Result<()> {
        let (shape, dtype) = self.meta(inputs)?;
        let x = inputs[0];
        if shape != x.shape() || dtype != x.dtype() {
            return Err(Error::shape(
                self.name(),
                format!("in place into input 0 ({:?} {:?}) needs an output of that shape and dtype, the op gives {shape:?} {dtype:?}", x.shape(), x.dtype()),
            ));
        }
        let recording = is_grad_enabled() && inputs.iter().any(|t| t.is_requires_grad());
        let aliased = inputs[1..].iter().any(|t| t.shares_storage_with(x));
        let direct = self.0.inplace && x.device().is_cuda() && x.is_contiguous() && !aliased && !recording && !crate::compile::trace::active();
        if direct {
            let rest = contiguous(&inputs[1..])?;
            let mut all: Vec<&Tensor> = vec![x];
            all.extend(rest.iter());
            self.launch_cuda(&all, x)?;
            x.storage().bump_version();
            return Ok(());
        }
        // With history, the op reads a copy: the tensors its backward saves are not the ones
        // overwritten here.
        let base = if recording { x.copy_contiguous()? } else { x.clone() };
        let mut args = inputs.to_vec();
        args[0] = &base;
        let value = self.call(&args)?;
        x.copy_(&value)
    }

    /// Output shape and dtype of a call, after checking its inputs.
    fn meta(&self, inputs: &[&Tensor]) -> Result<(Vec<usize>, DType)> {
        let name = self.name();
        if let Some(n) = self.0.n_inputs {
            if inputs.len() != n {
                return Err(Error::arg(name, format!("expected {n} input tensor(s), got {}", inputs.len())));
            }
        }
        let Some(first) = inputs.first() else {
            return Err(Error::arg(name, "a custom op needs at least one input tensor"));
        };
        let (device, dtype) = (first.device(), first.dtype());
        for (i, t) in inputs.iter().enumerate() {
            if t.device() != device {
                return Err(Error::DeviceMismatch { op: name, a: device, b: t.device() });
            }
            if t.dtype() != dtype {
                return Err(Error::dtype(name, t.dtype(), format!("input {i} is {:?} but input 0 is {dtype:?}; all inputs share one dtype", t.dtype())));
            }
        }
        if !self.0.dtypes.contains(&dtype) {
            return Err(Error::dtype(name, dtype, format!("this op accepts {:?}", self.0.dtypes)));
        }
        match device {
            Device::Cpu if self.0.cpu.is_none() => return Err(Error::arg(name, "has no CPU implementation (.cpu(..)) and got CPU tensors")),
            Device::Cuda(_) if self.0.cuda.is_none() => return Err(Error::arg(name, format!("has no CUDA kernel (.cuda_source(..)) and got tensors on {device}"))),
            _ => {}
        }
        if let Some(check) = &self.0.check {
            check(inputs).map_err(|msg| Error::shape(name, msg))?;
        }
        match &self.0.output {
            Output::Like(k) => match inputs.get(*k) {
                Some(t) => Ok((t.shape().to_vec(), t.dtype())),
                None => Err(Error::arg(name, format!("the output is like input {k}, but the call passes {} input(s)", inputs.len()))),
            },
            Output::Rule(f) => f(inputs),
        }
    }

    /// Computes the output without recording history: a node when tracing, else a kernel.
    fn forward(&self, inputs: &[&Tensor]) -> Result<Tensor> {
        let (shape, dtype) = self.meta(inputs)?;
        if crate::compile::trace::active() {
            return crate::compile::trace::record_node(NodeOp::Custom(self.clone()), inputs, shape, dtype);
        }
        let xs = contiguous(inputs)?;
        let xs: Vec<&Tensor> = xs.iter().collect();
        match inputs[0].device() {
            Device::Cpu => cpu::run(self.name(), self.0.cpu.as_ref().expect("checked by meta"), &xs, &shape, dtype),
            Device::Cuda(_) => {
                let out = crate::backend::cuda::kernels::custom::empty(xs[0], &shape, dtype)?;
                self.launch_cuda(&xs, &out)?;
                Ok(out)
            }
        }
    }

    fn launch_cuda(&self, xs: &[&Tensor], out: &Tensor) -> Result<()> {
        let (source, name) = self.0.cuda.as_ref().expect("checked by meta");
        let spec = (self.0.launch.as_ref().expect("checked by build"))(xs);
        let k = crate::backend::cuda::kernels::custom::UserKernel { op: self.name(), source, name };
        crate::backend::cuda::kernels::custom::launch(&k, xs, out, &spec)
    }

    /// The input gradients from the user's backward, checked against the inputs (the eager
    /// tape and the compiler's autodiff both come here).
    pub(crate) fn gradients(&self, inputs: &[Tensor], output: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let name = self.name();
        let Some(backward) = &self.0.backward else {
            return Err(Error::Autograd(format!("{name}: a gradient is needed but the custom op has no backward")));
        };
        let grads = backward(&OpCtx { inputs, output }, grad)?;
        if grads.len() != inputs.len() {
            return Err(Error::Autograd(format!("{name}: backward returned {} gradients for {} inputs", grads.len(), inputs.len())));
        }
        for (i, (g, x)) in grads.iter().zip(inputs).enumerate() {
            if let Some(g) = g.as_ref().filter(|g| g.shape() != x.shape()) {
                return Err(Error::Autograd(format!("{name}: backward returned a gradient of shape {:?} for input {i} of shape {:?}", g.shape(), x.shape())));
            }
        }
        Ok(grads)
    }
}

fn contiguous(ts: &[&Tensor]) -> Result<Vec<Tensor>> {
    ts.iter().map(|t| if t.is_contiguous() { Ok((*t).clone()) } else { t.copy_contiguous() }).collect()
}

/// The autograd node of a custom op: saves the inputs and the output for its backward.
struct Apply(CustomOp);

impl Function for Apply {
    fn forward(&self, ctx: &mut Ctx, xs: &[&Tensor]) -> Result<Tensor> {
        let out = self.0.forward(xs)?;
        let mut saved = xs.to_vec();
        saved.push(&out);
        ctx.save_for_backward(&saved);
        Ok(out)
    }
    fn backward(&self, ctx: &Ctx, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (inputs, output) = ctx.saved().split_at(ctx.saved().len() - 1);
        self.0.gradients(inputs, &output[0], grad)
    }
    fn name(&self) -> String {
        self.0.name().to_string()
    }
}

impl fmt::Debug for CustomOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CustomOp({}#{})", self.0.name, self.0.id)
    }
}

impl PartialEq for CustomOp {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
