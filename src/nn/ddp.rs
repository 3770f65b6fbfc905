//! `DistributedDataParallel`: one model replica per rank, gradients averaged over the ranks
//! during backward, as PyTorch's DDP does it.
//!
//! At construction every parameter and buffer is broadcast from rank 0, and the parameters are
//! put in buckets in reverse order (the order backward produces their gradients): the first
//! bucket up to 1 MiB, so that communication starts early, the others up to 25 MiB. Each
//! parameter's post-accumulate-grad hook marks it ready; once a bucket is
//! full, its gradients are packed into one flat tensor whose all-reduce (average) starts at
//! once, while backward goes on with the earlier layers; each `.grad` becomes a view of it.
//! Buckets are launched in the same order on every rank. When backward ends, it waits for them
//! all. Inside `compile` the same code records each bucket's all-reduce as a graph node.

use crate::autograd::HookHandle;
use crate::distributed::{self, ProcessGroup, ReduceOp, Work};
use crate::nn::Module;
use crate::{no_grad, DType, Device, Error, Result, Tensor};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

/// Options of [`DistributedDataParallel`] (PyTorch's keyword arguments).
#[derive(Clone)]
pub struct DdpOptions {
    /// Bucket size limit in MiB (`bucket_cap_mb`, 25).
    pub bucket_cap_mib: f64,
    /// The first bucket's limit in MiB (1): the last layers' gradients start moving early.
    pub first_bucket_mib: f64,
    /// Parameters that get no gradient in a backward count as ready with zeros, instead of the
    /// pass ending in an error that lists them.
    pub find_unused_parameters: bool,
    /// Buffers (running statistics) broadcast from rank 0 before every forward (true).
    pub broadcast_buffers: bool,
    /// The group; the default one when `None`.
    pub group: Option<ProcessGroup>,
    /// Starts a full bucket's communication instead of the average all-reduce (PyTorch's
    /// `register_comm_hook`): called with the group and the bucket's flat gradient, which must
    /// hold the averaged gradient once the returned work is done.
    pub comm_hook: Option<CommHook>,
}

/// See [`DdpOptions::comm_hook`].
pub type CommHook = Arc<dyn Fn(&ProcessGroup, &Tensor) -> Result<Work> + Send + Sync>;

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions { bucket_cap_mib: 25.0, first_bucket_mib: 1.0, find_unused_parameters: false, broadcast_buffers: true, group: None, comm_hook: None }
    }
}

/// Wraps a module so that `backward` averages its gradients over the ranks of a process group.
/// Its parameter names get the `module.` prefix, as PyTorch's do.
pub struct DistributedDataParallel<M: Module> {
    module: M,
    reducer: Arc<Reducer>,
    hooks: Vec<HookHandle>,
    buffers: Vec<Tensor>,
    broadcast_buffers: bool,
}

struct Reducer {
    group: ProcessGroup,
    names: Vec<String>,
    params: Vec<Tensor>,
    buckets: Vec<Bucket>,
    /// Each parameter's bucket.
    bucket_of: Vec<usize>,
    find_unused: bool,
    comm_hook: Option<CommHook>,
    /// Off inside `no_sync`: gradients accumulate locally.
    sync: AtomicBool,
    pass: Mutex<Pass>,
}

/// Parameters packed together, in launch order within the bucket.
struct Bucket {
    params: Vec<usize>,
}

/// The state of one backward pass.
#[derive(Default)]
struct Pass {
    active: bool,
    ready: Vec<bool>,
    waiting: Vec<usize>,
    next: usize,
    works: Vec<Work>,
    error: Option<String>,
}

impl<M: Module> DistributedDataParallel<M> {
    pub fn new(module: M) -> Result<Self> {
        Self::with_options(module, DdpOptions::default())
    }

    pub fn with_options(module: M, opts: DdpOptions) -> Result<Self> {
        let group = match opts.group.clone() {
            Some(g) => g,
            None => distributed::group()?,
        };
        if !(opts.bucket_cap_mib > 0.0 && opts.first_bucket_mib > 0.0) {
            return Err(Error::arg("DistributedDataParallel", format!("bucket sizes must be positive (bucket_cap_mib {}, first_bucket_mib {})", opts.bucket_cap_mib, opts.first_bucket_mib)));
        }
        let named: Vec<(String, Tensor)> = module.named_parameters().into_iter().filter(|(_, p)| p.is_requires_grad()).collect();
        let buffers: Vec<Tensor> = module.named_buffers().into_iter().map(|(_, b)| b).collect();
        for (name, t) in named.iter().map(|(n, t)| (n.as_str(), t)).chain(buffers.iter().map(|b| ("a buffer", b))) {
            if t.device() != group.device() {
                return Err(Error::arg("DistributedDataParallel", format!("{name} is on {}, but the {:?} group on rank {} reduces on {}", t.device(), group.backend(), group.rank(), group.device())));
            }
        }
        verify_same_model(&group, &named)?;
        // Every replica starts from rank 0's values.
        no_grad(|| {
            let works = named.iter().map(|(_, p)| p).chain(&buffers).map(|t| group.broadcast(t, 0)).collect::<Result<Vec<_>>>()?;
            works.into_iter().try_for_each(Work::wait)
        })?;
        let (buckets, bucket_of) = assign_buckets(&named, opts.first_bucket_mib, opts.bucket_cap_mib);
        let n = named.len();
        // Named as `DistributedDataParallel::named_parameters` names them.
        let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().map(|(n, p)| (format!("module.{n}"), p)).unzip();
        let reducer = Arc::new(Reducer { group, names, params, buckets, bucket_of, find_unused: opts.find_unused_parameters, comm_hook: opts.comm_hook.clone(), sync: AtomicBool::new(true), pass: Mutex::new(Pass::default()) });
        let mut hooks = Vec::with_capacity(n);
        for (i, p) in reducer.params.iter().enumerate() {
            let weak: Weak<Reducer> = Arc::downgrade(&reducer);
            hooks.push(p.register_post_accumulate_grad_hook(move |_| match weak.upgrade() {
                Some(r) => r.grad_ready(i),
                None => Ok(()),
            })?);
        }
        Ok(DistributedDataParallel { module, reducer, hooks, buffers, broadcast_buffers: opts.broadcast_buffers })
    }

    /// The wrapped module.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// Runs `f` (forward and backward of micro-batches) without averaging gradients: they
    /// accumulate in `.grad` on each rank, and the next backward outside `no_sync` averages the
    /// sum (PyTorch's `with model.no_sync():`).
    pub fn no_sync<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let was = self.reducer.sync.swap(false, Ordering::AcqRel);
        let r = f();
        self.reducer.sync.store(was, Ordering::Release);
        r
    }

    /// The buckets' parameter names, in launch order (for tests and `KILN_LOG`).
    pub fn bucket_names(&self) -> Vec<Vec<String>> {
        self.reducer.buckets.iter().map(|b| b.params.iter().map(|&i| self.reducer.names[i].clone()).collect()).collect()
    }
}

impl<M: Module> Drop for DistributedDataParallel<M> {
    fn drop(&mut self) {
        for h in self.hooks.drain(..) {
            h.remove();
        }
    }
}

impl<M: Module> Module for DistributedDataParallel<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if self.broadcast_buffers && !self.buffers.is_empty() && self.reducer.group.world_size() > 1 {
            no_grad(|| {
                let works = self.buffers.iter().map(|b| self.reducer.group.broadcast(b, 0)).collect::<Result<Vec<_>>>()?;
                works.into_iter().try_for_each(Work::wait)
            })?;
        }
        self.module.forward(x)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("module".into(), &self.module)]
    }
}

impl Reducer {
    /// Parameter `i`'s gradient is complete for this pass.
    fn grad_ready(self: Arc<Self>, i: usize) -> Result<()> {
        if !self.sync.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut pass = self.pass.lock();
        if !pass.active {
            *pass = Pass { active: true, ready: vec![false; self.params.len()], waiting: self.buckets.iter().map(|b| b.params.len()).collect(), ..Pass::default() };
            let me = self.clone();
            crate::autograd::queue_callback(move || me.finish());
        }
        if pass.ready[i] {
            return Ok(());
        }
        self.mark(&mut pass, i)
    }

    fn mark(&self, pass: &mut Pass, i: usize) -> Result<()> {
        pass.ready[i] = true;
        pass.waiting[self.bucket_of[i]] -= 1;
        // Buckets start in order on every rank (the backends match collectives by order).
        while pass.next < self.buckets.len() && pass.waiting[pass.next] == 0 {
            if let Err(e) = self.launch(pass, pass.next) {
                pass.error.get_or_insert(e.to_string());
            }
            pass.next += 1;
        }
        Ok(())
    }

    /// Packs bucket `b`'s gradients into one flat tensor (zeros for a parameter without one),
    /// starts its all-reduce, and points each `.grad` at its part. Inside `compile` the same
    /// calls record the bucket's all-reduce as a node of the graph, where its gradients become
    /// ready.
    fn launch(&self, pass: &mut Pass, b: usize) -> Result<()> {
        let members = &self.buckets[b].params;
        let parts = members
            .iter()
            .map(|&i| {
                let p = &self.params[i];
                let g = match p.grad() {
                    Some(g) => g,
                    None => Tensor::zeros(p.shape(), p.dtype(), &p.device())?,
                };
                g.reshape(&[-1])
            })
            .collect::<Result<Vec<_>>>()?;
        let flat = crate::cat(&parts.iter().collect::<Vec<_>>(), 0)?;
        drop(parts);
        let w = match &self.comm_hook {
            Some(h) => h(&self.group, &flat)?,
            None => self.group.all_reduce(&flat, ReduceOp::Avg)?,
        };
        pass.works.push(w);
        // Views made after the call see the reduced values (traced, the call rebinds `flat`).
        let mut off = 0;
        for &i in members {
            let p = &self.params[i];
            let shape: Vec<i64> = p.shape().iter().map(|&d| d as i64).collect();
            p.set_grad(Some(flat.narrow(0, off, p.numel())?.reshape(&shape)?))?;
            off += p.numel();
        }
        Ok(())
    }

    /// The end of backward: unused parameters, then every bucket's all-reduce waited for.
    fn finish(&self) -> Result<()> {
        let mut pass = std::mem::take(&mut *self.pass.lock());
        let unused: Vec<usize> = (0..self.params.len()).filter(|&i| !pass.ready[i]).collect();
        if !unused.is_empty() {
            if !self.find_unused {
                let names: Vec<&str> = unused.iter().map(|&i| self.names[i].as_str()).collect();
                let e = Error::Autograd(format!(
                    "DDP: parameters {names:?} received no gradient in this backward, so their buckets never started and the ranks would disagree; \
                     construct with DdpOptions {{ find_unused_parameters: true, .. }} or use every parameter in the loss"
                ));
                for w in pass.works.drain(..) {
                    let _ = w.wait();
                }
                return Err(e);
            }
            for i in unused {
                self.mark(&mut pass, i)?;
            }
        }
        let mut first = pass.error.take().map(|e| Error::dist("all_reduce", e));
        for w in pass.works.drain(..) {
            if let Err(e) = w.wait() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Parameters in reverse order, packed into buckets of one dtype and device each: the first up
/// to `first_mib`, the rest up to `cap_mib`.
fn assign_buckets(named: &[(String, Tensor)], first_mib: f64, cap_mib: f64) -> (Vec<Bucket>, Vec<usize>) {
    /// The bucket being filled for one dtype and device, and how many it closed before.
    struct Filling {
        key: (DType, Device),
        params: Vec<usize>,
        bytes: usize,
        closed: usize,
    }
    let limit = |closed: usize| ((if closed == 0 { first_mib } else { cap_mib }) * 1048576.0) as usize;
    let mut filling: Vec<Filling> = Vec::new();
    let mut buckets: Vec<Bucket> = Vec::new();
    for i in (0..named.len()).rev() {
        let p = &named[i].1;
        let key = (p.dtype(), p.device());
        let bytes = p.numel() * p.dtype().size_in_bytes();
        let f = match filling.iter().position(|f| f.key == key) {
            Some(f) => &mut filling[f],
            None => {
                filling.push(Filling { key, params: Vec::new(), bytes: 0, closed: 0 });
                filling.last_mut().expect("just pushed")
            }
        };
        if !f.params.is_empty() && f.bytes + bytes > limit(f.closed) {
            buckets.push(Bucket { params: std::mem::take(&mut f.params) });
            (f.bytes, f.closed) = (0, f.closed + 1);
        }
        f.params.push(i);
        f.bytes += bytes;
    }
    buckets.extend(filling.into_iter().filter(|f| !f.params.is_empty()).map(|f| Bucket { params: f.params }));
    let mut bucket_of = vec![0; named.len()];
    for (b, bucket) in buckets.iter().enumerate() {
        for &i in &bucket.params {
            bucket_of[i] = b;
        }
    }
    (buckets, bucket_of)
}

/// The same parameters (count, shapes, dtypes) on every rank, or an error before any
/// collective could mismatch: the minimum and maximum of a fingerprint over the ranks agree.
fn verify_same_model(group: &ProcessGroup, named: &[(String, Tensor)]) -> Result<()> {
    let shapes: String = named.iter().map(|(_, p)| format!("{:?} {:?};", p.shape(), p.dtype())).collect();
    // 62 bits, so that the values stay exact as i64 on every backend.
    let fp = [named.len() as i64, (crate::hash::fnv64(&[shapes.as_bytes()]) >> 2) as i64];
    let lo = Tensor::from_vec(fp.to_vec(), &[2], &Device::Cpu)?.to_device(&group.device())?;
    let hi = lo.copy_contiguous()?;
    group.all_reduce(&lo, ReduceOp::Min)?.wait()?;
    group.all_reduce(&hi, ReduceOp::Max)?.wait()?;
    if lo.to_vec::<i64>()? != hi.to_vec::<i64>()? {
        return Err(Error::arg("DistributedDataParallel", format!("rank {} has {} parameters, or shapes and dtypes, that differ from another rank's: every rank must build the same model", group.rank(), named.len())));
    }
    Ok(())
}
