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
//!
//! The first backward also records the order its gradients arrived in; the next forward packs
//! the buckets anew in that order (rank 0's, broadcast, so that every rank agrees), as
//! PyTorch's reducer does once, so that a model whose layers are used in another order than
//! they were registered in still starts communicating early. Not with
//! `find_unused_parameters` (the order may differ from pass to pass), as in PyTorch.

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
    first_bucket_bytes: usize,
    bucket_bytes: usize,
    find_unused: bool,
    comm_hook: Option<CommHook>,
    /// Off inside `no_sync`: gradients accumulate locally.
    sync: AtomicBool,
    state: Mutex<State>,
    /// Each bucket's parameters, as `state` has them, for `bucket_names`: a comm hook runs while
    /// `state` is held, and may ask.
    published: Mutex<Vec<Vec<usize>>>,
}

struct State {
    buckets: Buckets,
    pass: Pass,
    rebuild: Rebuild,
}

/// The parameters in buckets, and each parameter's bucket.
struct Buckets {
    list: Vec<Bucket>,
    bucket_of: Vec<usize>,
}

impl Buckets {
    fn members(&self) -> Vec<Vec<usize>> {
        self.list.iter().map(|b| b.params.clone()).collect()
    }
}

/// Parameters packed together, in launch order within the bucket.
struct Bucket {
    params: Vec<usize>,
}

/// Where the one rebuild of the buckets stands.
enum Rebuild {
    /// The next synchronised backward records its gradients' order.
    Record,
    /// That order, for the next forward to pack the buckets in.
    Recorded(Vec<usize>),
    /// Rebuilt, or never to be (unused parameters are looked for).
    Done,
}

/// The state of one backward pass.
#[derive(Default)]
struct Pass {
    active: bool,
    ready: Vec<bool>,
    /// The parameters in the order their gradients arrived.
    arrived: Vec<usize>,
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
        let n = named.len();
        let (first_bucket_bytes, bucket_bytes) = ((opts.first_bucket_mib * 1048576.0) as usize, (opts.bucket_cap_mib * 1048576.0) as usize);
        // Named as `DistributedDataParallel::named_parameters` names them.
        let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().map(|(n, p)| (format!("module.{n}"), p)).unzip();
        let buckets = assign_buckets(&params, (0..n).rev(), first_bucket_bytes, bucket_bytes);
        let rebuild = if opts.find_unused_parameters { Rebuild::Done } else { Rebuild::Record };
        let published = Mutex::new(buckets.members());
        let state = Mutex::new(State { buckets, pass: Pass::default(), rebuild });
        let reducer = Arc::new(Reducer { group, names, params, first_bucket_bytes, bucket_bytes, find_unused: opts.find_unused_parameters, comm_hook: opts.comm_hook.clone(), sync: AtomicBool::new(true), state, published });
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
        self.reducer.published.lock().iter().map(|b| b.iter().map(|&i| self.reducer.names[i].clone()).collect()).collect()
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
        self.reducer.rebuild_buckets()?;
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
        let mut state = self.state.lock();
        let State { buckets, pass, .. } = &mut *state;
        if !pass.active {
            *pass = Pass { active: true, ready: vec![false; self.params.len()], waiting: buckets.list.iter().map(|b| b.params.len()).collect(), ..Pass::default() };
            let me = self.clone();
            crate::autograd::queue_callback(move || me.finish());
        }
        if pass.ready[i] {
            return Ok(());
        }
        self.mark(buckets, pass, i);
        Ok(())
    }

    fn mark(&self, buckets: &Buckets, pass: &mut Pass, i: usize) {
        pass.ready[i] = true;
        pass.arrived.push(i);
        pass.waiting[buckets.bucket_of[i]] -= 1;
        // Buckets start in order on every rank (the backends match collectives by order).
        while pass.next < buckets.list.len() && pass.waiting[pass.next] == 0 {
            if let Err(e) = self.launch(&buckets.list[pass.next], pass) {
                pass.error.get_or_insert(e.to_string());
            }
            pass.next += 1;
        }
    }

    /// Before a forward: packs the buckets in the order the first backward's gradients arrived
    /// in, rank 0's order on every rank (once; outside any trace, since every rank does it at
    /// the same call, and the order is a fact of the run, not of the graph). Only before a
    /// forward that trains, as PyTorch's: an evaluation forward (without gradients, or in
    /// `no_sync`) may run on some ranks alone, and a pass still in progress counts by the
    /// buckets it started with.
    fn rebuild_buckets(&self) -> Result<()> {
        if !crate::is_grad_enabled() || !self.sync.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut state = self.state.lock();
        let Rebuild::Recorded(order) = &state.rebuild else { return Ok(()) };
        if state.pass.active {
            return Ok(());
        }
        let _real = crate::compile::trace::Suspend::new();
        let order = no_grad(|| {
            let t = Tensor::from_vec(order.iter().map(|&i| i as i64).collect::<Vec<_>>(), &[order.len()], &Device::Cpu)?.to_device(&self.group.device())?;
            self.group.broadcast(&t, 0)?.wait()?;
            t.to_vec::<i64>()
        })?;
        let n = self.params.len();
        let mut seen = vec![false; n];
        if order.len() != n || !order.iter().all(|&i| usize::try_from(i).is_ok_and(|i| i < n && !std::mem::replace(&mut seen[i], true))) {
            return Err(Error::dist("DistributedDataParallel", format!("rank 0's gradient order {order:?} is no order of this rank's {n} parameters")));
        }
        state.buckets = assign_buckets(&self.params, order.into_iter().map(|i| i as usize), self.first_bucket_bytes, self.bucket_bytes);
        *self.published.lock() = state.buckets.members();
        state.rebuild = Rebuild::Done;
        Ok(())
    }

    /// Packs bucket `b`'s gradients into one flat tensor (zeros for a parameter without one),
    /// starts its all-reduce, and points each `.grad` at its part. Inside `compile` the same
    /// calls record the bucket's all-reduce as a node of the graph, where its gradients become
    /// ready.
    fn launch(&self, bucket: &Bucket, pass: &mut Pass) -> Result<()> {
        let members = &bucket.params;
        let parts = members
            .iter()
            .map(|&i| {
                let p = &self.params[i];
                let g = match p.grad() {
                    Some(g) => g,
                    None => p.zeros_like()?,
                };
                // In the parameter's storage order, so that its `.grad` view is laid out as it.
                if stored_nhwc(p) { g.permute(&[0, 2, 3, 1])?.reshape(&[-1]) } else { g.reshape(&[-1]) }
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
            let part = flat.narrow(0, off, p.numel())?;
            let grad = if stored_nhwc(p) { part.reshape(&[shape[0], shape[2], shape[3], shape[1]])?.permute(&[0, 3, 1, 2])? } else { part.reshape(&shape)? };
            p.set_grad(Some(grad))?;
            off += p.numel();
        }
        Ok(())
    }

    /// The end of backward: unused parameters, then every bucket's all-reduce waited for.
    fn finish(&self) -> Result<()> {
        let mut pass = {
            let mut state = self.state.lock();
            let State { buckets, pass, rebuild } = &mut *state;
            let mut pass = std::mem::take(pass);
            let unused: Vec<usize> = (0..self.params.len()).filter(|&i| !pass.ready[i]).collect();
            if unused.is_empty() && matches!(rebuild, Rebuild::Record) {
                *rebuild = Rebuild::Recorded(std::mem::take(&mut pass.arrived));
            }
            if !unused.is_empty() && !self.find_unused {
                drop(state);
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
                self.mark(buckets, &mut pass, i);
            }
            pass
        };
        let mut first = pass.error.take().map(|e| Error::dist("all_reduce", e));
        for w in pass.works.drain(..) {
            if let Err(e) = w.wait() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Parameters taken in `order`, packed into buckets of one dtype and device each: the first up
/// to `first_bytes`, the rest up to `cap_bytes`.
fn assign_buckets(params: &[Tensor], order: impl IntoIterator<Item = usize>, first_bytes: usize, cap_bytes: usize) -> Buckets {
    /// The bucket being filled for one dtype and device, and how many it closed before.
    struct Filling {
        key: (DType, Device),
        params: Vec<usize>,
        bytes: usize,
        closed: usize,
    }
    let limit = |closed: usize| if closed == 0 { first_bytes } else { cap_bytes };
    let mut filling: Vec<Filling> = Vec::new();
    let mut list: Vec<Bucket> = Vec::new();
    for i in order {
        let p = &params[i];
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
            list.push(Bucket { params: std::mem::take(&mut f.params) });
            (f.bytes, f.closed) = (0, f.closed + 1);
        }
        f.params.push(i);
        f.bytes += bytes;
    }
    list.extend(filling.into_iter().filter(|f| !f.params.is_empty()).map(|f| Bucket { params: f.params }));
    let mut bucket_of = vec![0; params.len()];
    for (b, bucket) in list.iter().enumerate() {
        for &i in &bucket.params {
            bucket_of[i] = b;
        }
    }
    Buckets { list, bucket_of }
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

/// Whether `p` is a channels-last parameter (a convolution's weight after
/// `Module::to_memory_format`): its gradient travels in NHWC order.
fn stored_nhwc(p: &Tensor) -> bool {
    p.dense_format() == Some(crate::MemoryFormat::ChannelsLast)
}
