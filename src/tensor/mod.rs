//! `Tensor`: shared storage + layout + dtype + device, with autograd metadata.

mod create;
mod display;
pub(crate) mod random;

use crate::autograd::Node;
use crate::backend::cpu::{self, CpuStorage};
use crate::dtype::WithDType;
use crate::layout::{Layout, MemoryFormat};
use crate::storage::Storage;
use crate::{DType, Device, Error, Result};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use random::manual_seed;

/// A multi-dimensional array on a device. Cloning is cheap and shares everything, like a second
/// Python reference to the same `torch.Tensor`.
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorImpl>);

pub(crate) struct TensorImpl {
    storage: Arc<Storage>,
    layout: Layout,
    dtype: DType,
    device: Device,
    /// Shares storage with the tensor it was derived from (reshape, permute, slice, ...).
    is_view: bool,
    /// The storage's version when this tensor was made: a view whose base has since been
    /// modified in place has stale autograd history.
    created_version: u64,
    id: u64,
    pub(crate) meta: Mutex<AutogradMeta>,
}

#[derive(Default)]
pub(crate) struct AutogradMeta {
    pub(crate) requires_grad: bool,
    pub(crate) grad: Option<Tensor>,
    pub(crate) grad_fn: Option<Arc<Node>>,
    /// Called once per backward after this leaf's gradient is complete, by id.
    pub(crate) post_accumulate_hooks: Vec<(u64, crate::autograd::GradHook)>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl Tensor {
    pub(crate) fn from_parts(storage: Arc<Storage>, layout: Layout, dtype: DType, is_view: bool) -> Tensor {
        let device = storage.device;
        let created_version = storage.version();
        Tensor(Arc::new(TensorImpl {
            created_version,
            storage,
            layout,
            dtype,
            device,
            is_view,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            meta: Mutex::new(AutogradMeta::default()),
        }))
    }

    /// A new contiguous tensor owning `s`.
    pub(crate) fn from_cpu(s: CpuStorage, shape: &[usize]) -> Tensor {
        debug_assert_eq!(s.len(), crate::layout::numel(shape));
        let dtype = s.dtype();
        Tensor::from_parts(Arc::new(Storage::cpu(s)), Layout::contiguous(shape), dtype, false)
    }

    /// A new contiguous tensor owning backend storage `s`.
    pub(crate) fn from_backend(s: crate::storage::BackendStorage, shape: &[usize]) -> Tensor {
        use crate::storage::BackendStorage;
        match s {
            BackendStorage::Cpu(c) => Tensor::from_cpu(c, shape),
            BackendStorage::Cuda(c) => {
                let dtype = c.dtype;
                Tensor::from_parts(Arc::new(Storage::cuda(c)), Layout::contiguous(shape), dtype, false)
            }
            BackendStorage::Traced(_) => unreachable!("backends return data"),
        }
    }

    /// A copy of this tensor's values on `device`, through the host (a copy between two GPUs
    /// is explicit, and rare enough for this).
    #[track_caller]
    pub(crate) fn copy_to_device(&self, device: Device, non_blocking: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if let (true, Device::Cpu, Device::Cuda(n)) = (non_blocking, self.device(), device) {
            return crate::backend::upload(self, n, true);
        }
        let host = self.to_host()?;
        match device {
            Device::Cpu => Ok(if host.shares_storage_with(self) { host.copy_contiguous()? } else { host }),
            Device::Cuda(n) => crate::backend::upload(&host, n, false),
        }
    }

    /// A copy in page-locked host memory, so `to_device_async` can copy it without staging
    /// (`pin_memory`). Needs a CUDA driver.
    #[track_caller]
    pub fn pin_memory(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let host = self.to_host()?;
        let s = crate::backend::cpu::cast(&host, self.dtype());
        let st = Storage::cpu_pinned(s)?;
        Ok(Tensor::from_parts(Arc::new(st), Layout::contiguous(self.shape()), self.dtype(), false))
    }

    /// Whether the tensor lives in page-locked host memory.
    pub fn is_pinned(&self) -> bool {
        self.0.storage.is_pinned()
    }

    /// Like `to_device`, but a host-to-GPU copy is queued without waiting for it: later work on
    /// the GPU is ordered after it, and the source may be dropped at once. A pinned source is
    /// copied directly; any other through a pinned staging buffer. To the host it is `to_device`.
    #[track_caller]
    pub fn to_device_async(&self, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        match (self.device(), device) {
            (Device::Cpu, Device::Cuda(_)) => crate::ops::apply(crate::ops::Op::ToDevice { from: self.device(), to: *device, non_blocking: true }, &[self]),
            _ => self.to_device(device),
        }
    }

    /// This tensor's values on the host (a copy when it lives on a GPU; synchronises).
    #[track_caller]
    pub(crate) fn to_host(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        crate::compile::trace::before_host_read(self, "a host read")?;
        match self.device() {
            Device::Cpu => Ok(self.clone()),
            Device::Cuda(_) => crate::backend::download(self),
        }
    }

    /// Another tensor over the same storage (a view).
    pub(crate) fn view_as_layout(&self, layout: Layout) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), layout, self.0.dtype, true)
    }

    /// A result over this (fresh) tensor's storage with another layout: not a view, since
    /// nothing else holds the storage.
    pub(crate) fn relaid(&self, layout: Layout) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), layout, self.0.dtype, false)
    }

    /// The same data without autograd history (`torch.Tensor.detach`).
    pub fn detach(&self) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), self.0.layout.clone(), self.0.dtype, self.0.is_view)
    }

    pub(crate) fn storage(&self) -> &Arc<Storage> {
        &self.0.storage
    }
    pub(crate) fn layout(&self) -> &Layout {
        &self.0.layout
    }
    pub(crate) fn is_view(&self) -> bool {
        self.0.is_view
    }
    /// A view with history whose storage was written in place after it was made: its history
    /// no longer describes its values.
    pub(crate) fn has_stale_history(&self) -> bool {
        self.0.is_view && self.version() != self.0.created_version && self.grad_fn().is_some()
    }
    /// A process-unique identity (the compiler keys captured tensors by it).
    pub fn id(&self) -> u64 {
        self.0.id
    }
    pub fn shape(&self) -> &[usize] {
        &self.0.layout.shape
    }
    /// `size(dim)`, with negative dims counting from the end.
    pub fn size(&self, dim: i64) -> Result<usize> {
        Ok(self.shape()[crate::layout::norm_dim("size", dim, self.ndim())?])
    }
    pub fn strides(&self) -> &[usize] {
        &self.0.layout.strides
    }
    pub fn storage_offset(&self) -> usize {
        self.0.layout.offset
    }
    pub fn ndim(&self) -> usize {
        self.0.layout.ndim()
    }
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    pub fn device(&self) -> Device {
        self.0.device
    }
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// Whether the elements are dense in `format`'s order (`is_contiguous(memory_format=...)`).
    pub fn is_contiguous_for(&self, format: MemoryFormat) -> bool {
        self.0.layout.is_contiguous_for(format)
    }
    /// The memory format results computed from this tensor keep: channels-last for a 4-D
    /// tensor stored NHWC (and not also plain contiguous), else contiguous
    /// (`suggest_memory_format`).
    pub fn suggest_memory_format(&self) -> MemoryFormat {
        self.0.layout.suggested_format()
    }
    /// The memory format the elements are dense in, if any: storage walked in order is the
    /// tensor in that format's order (what kernels over flat storage and collectives need).
    pub(crate) fn dense_format(&self) -> Option<MemoryFormat> {
        let f = self.suggest_memory_format();
        self.is_contiguous_for(f).then_some(f)
    }
    /// The storage's version counter, bumped by every in-place write to it or any of its views.
    pub fn version(&self) -> u64 {
        self.0.storage.version()
    }
    /// Whether `handles` clones of this tensor are all that refer to its storage (no view of
    /// it, nothing else holding it): what a compiled program checks before a kernel writes
    /// into the buffer of a value that dies there.
    pub(crate) fn held_only_by(&self, handles: usize) -> bool {
        Arc::strong_count(&self.0.storage) == 1 && Arc::strong_count(&self.0) == handles
    }
    /// Whether both are handles of one tensor (not merely views of one storage).
    pub(crate) fn same_tensor(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
    /// Whether two tensors share storage.
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    /// Copies the elements to the host as `T`, which must be the tensor's dtype. Synchronises.
    #[track_caller]
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        let _site = crate::profiler::call_site();
        self.check_read::<T>("to_vec")?;
        crate::compile::trace::before_host_read(self, "to_vec")?;
        Ok(cpu::to_plain_vec_as::<T>(&self.to_host()?))
    }

    /// The single element of a one-element tensor. Synchronises.
    #[track_caller]
    pub fn item<T: WithDType>(&self) -> Result<T> {
        let _site = crate::profiler::call_site();
        self.check_read::<T>("item")?;
        if self.numel() != 1 {
            return Err(Error::shape("item", format!("a tensor with {} elements (shape {:?}) cannot be converted to a scalar", self.numel(), self.shape())));
        }
        crate::compile::trace::before_host_read(self, "item")?;
        Ok(cpu::to_vec_as::<T>(&self.to_host()?)[0])
    }

    fn check_read<T: WithDType>(&self, op: &'static str) -> Result<()> {
        if T::DTYPE != self.dtype() {
            return Err(Error::dtype(op, self.dtype(), format!("the tensor holds {:?}, asked for {:?}; convert with to_dtype first", self.dtype(), T::DTYPE)));
        }
        crate::backend::check_device(op, self.device())?;
        // A broadcast view may stand for more elements than the host can hold.
        cpu::ensure_host_memory(op, self.numel() * self.dtype().size_in_bytes())
    }

    /// Moves the tensor to `device` (a no-op when it is already there). Synchronous.
    #[track_caller]
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if *device == self.device() {
            return Ok(self.clone());
        }
        crate::backend::check_device("to_device", *device)?;
        crate::ops::apply(crate::ops::Op::ToDevice { from: self.device(), to: *device, non_blocking: false }, &[self])
    }

    // ---- autograd metadata ----

    /// Marks a floating-point tensor as needing gradients and returns it (builder form).
    /// Integer and bool tensors cannot require gradients and are returned unchanged; use
    /// [`Tensor::set_requires_grad`] to get that as an error.
    pub fn requires_grad(self) -> Tensor {
        let _ = self.set_requires_grad(true);
        self
    }

    /// `requires_grad_(flag)`: only floating-point leaves can require gradients.
    pub fn set_requires_grad(&self, flag: bool) -> Result<()> {
        if flag && !self.dtype().is_float() {
            return Err(Error::dtype("requires_grad", self.dtype(), "only floating-point tensors can require gradients"));
        }
        let mut m = self.0.meta.lock();
        if m.grad_fn.is_some() && !flag {
            return Err(Error::Autograd("requires_grad cannot be turned off on a non-leaf tensor; use detach()".into()));
        }
        m.requires_grad = flag || m.grad_fn.is_some();
        Ok(())
    }

    /// Whether gradients flow to or through this tensor (`torch.Tensor.requires_grad`).
    pub fn is_requires_grad(&self) -> bool {
        let m = self.0.meta.lock();
        m.requires_grad || m.grad_fn.is_some()
    }

    /// Leaves are tensors the user made (not results of recorded ops).
    pub fn is_leaf(&self) -> bool {
        self.0.meta.lock().grad_fn.is_none()
    }

    /// The accumulated gradient of a leaf, after `backward`.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.meta.lock().grad.clone()
    }

    /// Replaces (or clears, with `None`) the accumulated gradient.
    /// Sets (or clears) the accumulated gradient. It must match the tensor's shape, dtype and
    /// device, as in PyTorch ("assigned grad has data of a different size").
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            if g.shape() != self.shape() {
                return Err(Error::shape("set_grad", format!("assigned grad has shape {:?}, the tensor has shape {:?}", g.shape(), self.shape())));
            }
            if g.dtype() != self.dtype() {
                return Err(Error::dtype("set_grad", g.dtype(), format!("assigned grad must have the tensor's dtype {:?}", self.dtype())));
            }
            if g.device() != self.device() {
                return Err(Error::DeviceMismatch { op: "set_grad", a: self.device(), b: g.device() });
            }
        }
        self.0.meta.lock().grad = grad;
        Ok(())
    }
    /// Clears the accumulated gradient.
    pub fn clear_grad(&self) {
        self.0.meta.lock().grad = None;
    }

    /// The name of the node that made this tensor (`MulBackward`, ...), if it was recorded.
    pub fn grad_fn_name(&self) -> Option<String> {
        self.0.meta.lock().grad_fn.as_ref().map(|n| n.name())
    }

    /// Calls `hook` with this leaf after each backward pass has finished accumulating its
    /// gradient (PyTorch's `register_post_accumulate_grad_hook`): once per pass, however many
    /// uses the leaf had in the graph. `DistributedDataParallel` starts its all-reduces from here.
    pub fn register_post_accumulate_grad_hook(&self, hook: impl Fn(&Tensor) -> Result<()> + Send + Sync + 'static) -> Result<crate::autograd::HookHandle> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let mut m = self.0.meta.lock();
        if m.grad_fn.is_some() || !m.requires_grad {
            return Err(Error::Autograd(format!("post-accumulate-grad hooks go on leaves that require grad (shape {:?})", self.shape())));
        }
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        m.post_accumulate_hooks.push((id, Arc::new(hook)));
        Ok(crate::autograd::HookHandle { tensor: self.clone(), id })
    }

    pub(crate) fn grad_fn(&self) -> Option<Arc<Node>> {
        self.0.meta.lock().grad_fn.clone()
    }

    pub(crate) fn set_grad_fn(&self, node: Option<Arc<Node>>) {
        let mut m = self.0.meta.lock();
        m.requires_grad = node.is_some() || (m.requires_grad && m.grad_fn.is_none());
        m.grad_fn = node;
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor[{:?}, {:?}, {}]", self.shape(), self.dtype(), self.device())
    }
}

impl std::fmt::Display for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use display::Values;
        let Ok(host) = self.to_host() else {
            return write!(f, "{self:?}");
        };
        let values = match self.dtype() {
            d if d.is_float() => Values::Float(cpu::to_plain_vec_as::<f64>(&host)),
            DType::Bool => Values::Bool(cpu::to_plain_vec_as::<bool>(&host)),
            _ => Values::Int(cpu::to_plain_vec_as::<i64>(&host)),
        };
        // In torch's order: device, size (of empty tensors), dtype, autograd.
        let mut suffixes = Vec::new();
        if let Device::Cuda(n) = self.device() {
            suffixes.push(format!("device='cuda:{n}'"));
        }
        if self.numel() == 0 && self.ndim() != 1 {
            suffixes.push(format!("size=({})", self.shape().iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")));
        }
        // An empty tensor has no elements to show that it is integer or bool, so torch names
        // every dtype but the default float one there.
        let implied = if self.numel() == 0 { self.dtype() == DType::F32 } else { matches!(self.dtype(), DType::F32 | DType::I64 | DType::Bool) };
        if !implied {
            suffixes.push(format!("dtype=kiln.{}", self.dtype().torch_name()));
        }
        if let Some(name) = self.grad_fn_name() {
            suffixes.push(format!("grad_fn=<{name}>"));
        } else if self.is_requires_grad() {
            suffixes.push("requires_grad=True".into());
        }
        let suffixes: Vec<&str> = suffixes.iter().map(|s| s.as_str()).collect();
        f.write_str(&display::format_tensor_with_suffixes(&values, self.shape(), &suffixes))
    }
}
