//! Several processes training together, in the form PyTorch users know: a process group made
//! from torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`, as `kiln launch` sets them), and collectives on tensors that return a [`Work`]
//! handle at once.
//!
//! Two backends: [`Backend::Nccl`] for CUDA tensors (NCCL loaded at run time, like the other CUDA
//! libraries) and [`Backend::Tcp`] for host tensors, over TCP between every pair of ranks (what
//! gloo is to PyTorch). Rank 0 serves the rendezvous [`Store`]; the others find it at
//! `MASTER_ADDR:MASTER_PORT`. A rank that never arrives, dies or calls a different collective
//! makes the others fail with an error naming it after the group's timeout, never hang (for
//! NCCL through a watchdog thread that aborts the communicator: `watchdog.rs`).
//!
//! ```no_run
//! use kiln::distributed as dist;
//! # fn main() -> kiln::Result<()> {
//! dist::init_process_group(dist::Backend::Tcp)?;
//! let t = kiln::Tensor::ones(&[4], kiln::DType::F32, &kiln::Device::Cpu)?;
//! dist::all_reduce(&t, dist::ReduceOp::Sum)?.wait()?; // every element is now WORLD_SIZE
//! # Ok(())
//! # }
//! ```

pub(crate) mod nccl;
mod store;
mod tcp;
mod watchdog;

pub use store::Store;

use crate::{DType, Device, Error, Result, Tensor};
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::time::Duration;

/// How ranks exchange tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// CUDA tensors through NCCL, one GPU per rank (`LOCAL_RANK`).
    Nccl,
    /// Host tensors over TCP.
    Tcp,
}

/// How `all_reduce` and `reduce_scatter` combine the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size (floating-point tensors only).
    Avg,
    Max,
    Min,
}

/// Where a process group's ranks meet; unset fields come from torchrun's environment variables.
#[derive(Clone, Debug)]
pub struct InitOptions {
    pub backend: Backend,
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    /// How long a rank waits for another at the rendezvous and in every collective (PyTorch's
    /// default is 10 minutes for NCCL and 30 for gloo; 5 is kiln's).
    pub timeout: Duration,
}

impl InitOptions {
    pub fn new(backend: Backend) -> Self {
        InitOptions { backend, rank: None, world_size: None, master_addr: None, master_port: None, timeout: Duration::from_secs(300) }
    }
}

/// The ranks of one job and the connections between them. Cloning shares the group.
#[derive(Clone)]
pub struct ProcessGroup(Arc<Group>);

struct Group {
    rank: usize,
    world: usize,
    backend: Backend,
    imp: Imp,
    /// Kept open so that rank 0's store server lives as long as the group (the NCCL
    /// backend's watchdog publishes its progress there too).
    _store: Store,
}

enum Imp {
    Tcp(tcp::TcpGroup),
    Nccl(nccl::NcclGroup),
}

fn env_usize(name: &str) -> Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| Error::dist("init", format!("{name}={v:?} is not a non-negative integer"))),
        Err(_) => Ok(None),
    }
}

impl ProcessGroup {
    /// Joins the group described by `opts` (blocks until every rank has arrived, or fails after
    /// the timeout naming those that did not).
    pub fn new(opts: InitOptions) -> Result<ProcessGroup> {
        let rank = match opts.rank {
            Some(r) => r,
            None => env_usize("RANK")?.ok_or_else(|| Error::dist("init", "RANK is not set: start the program with `kiln launch` or pass InitOptions::rank"))?,
        };
        let world = match opts.world_size {
            Some(w) => w,
            None => env_usize("WORLD_SIZE")?.ok_or_else(|| Error::dist("init", "WORLD_SIZE is not set: start the program with `kiln launch` or pass InitOptions::world_size"))?,
        };
        if world == 0 || rank >= world {
            return Err(Error::dist("init", format!("rank {rank} is not below the world size {world}")));
        }
        let addr = opts.master_addr.clone().or_else(|| std::env::var("MASTER_ADDR").ok()).unwrap_or_else(|| "127.0.0.1".into());
        let port = match opts.master_port {
            Some(p) => p,
            None => match std::env::var("MASTER_PORT") {
                Ok(p) => p.trim().parse().map_err(|_| Error::dist("init", format!("MASTER_PORT={p:?} is not a port number")))?,
                Err(_) if world == 1 => 0, // alone: any free port
                Err(_) => return Err(Error::dist("init", "MASTER_PORT is not set: start the program with `kiln launch` or pass InitOptions::master_port")),
            },
        };
        let store = if rank == 0 { Store::serve(&addr, port, opts.timeout)? } else { Store::connect(&addr, port, opts.timeout)? };
        let imp = match opts.backend {
            Backend::Tcp => Imp::Tcp(tcp::TcpGroup::connect(&store, "pg0", rank, world, opts.timeout)?),
            Backend::Nccl => Imp::Nccl(nccl::NcclGroup::connect(&store, "pg0", rank, world, local_rank_from_env(rank)?, opts.timeout)?),
        };
        let g = ProcessGroup(Arc::new(Group { rank, world, backend: opts.backend, imp, _store: store }));
        // Nobody leaves the rendezvous before everyone has joined (rank 0's store must outlive it).
        g.barrier()?;
        Ok(g)
    }

    pub fn rank(&self) -> usize {
        self.0.rank
    }
    pub fn world_size(&self) -> usize {
        self.0.world
    }
    pub fn backend(&self) -> Backend {
        self.0.backend
    }

    /// Where this group's tensors live: the host for TCP, this rank's GPU for NCCL.
    pub fn device(&self) -> Device {
        match &self.0.imp {
            Imp::Tcp(_) => Device::Cpu,
            Imp::Nccl(g) => Device::Cuda(g.ordinal()),
        }
    }

    /// A tensor this group can exchange element for element with the same tensor of every
    /// rank: dense in its memory format (contiguous or channels-last, as PyTorch's c10d
    /// takes), on its device.
    fn check(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.dense_format().is_none() {
            return Err(Error::dist(op, format!("tensors must be dense in a memory format (shape {:?}, strides {:?}); call contiguous() first", t.shape(), t.strides())));
        }
        self.check_device(op, t)
    }

    /// A tensor whose blocks this group exchanges (all_gather, reduce_scatter): contiguous.
    fn check_blocked(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if !t.is_contiguous() {
            return Err(Error::dist(op, format!("tensors must be contiguous (shape {:?}, strides {:?})", t.shape(), t.strides())));
        }
        self.check_device(op, t)
    }

    fn check_device(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.device() != self.device() {
            return Err(Error::dist(op, format!("a tensor on {} in a {:?} group on rank {} (the TCP backend takes host tensors; NCCL this rank's GPU)", t.device(), self.0.backend, self.0.rank)));
        }
        Ok(())
    }

    /// `whole` (named `what`) holds one block the size of `part` per rank, of `part`'s dtype.
    fn check_blocks(&self, op: &'static str, what: &str, whole: &Tensor, part: &Tensor) -> Result<()> {
        if whole.dtype() != part.dtype() {
            return Err(Error::dist(op, format!("output {:?} and input {:?} differ in dtype", whole.dtype(), part.dtype())));
        }
        let want = part.numel() * self.0.world;
        if whole.numel() != want {
            return Err(Error::dist(op, format!("the {what} has {} elements; {} ranks of {:?} need {want}", whole.numel(), self.0.world, part.shape())));
        }
        Ok(())
    }

    fn check_op(&self, op: &'static str, t: &Tensor, how: ReduceOp) -> Result<()> {
        self.check(op, t)?;
        if how == ReduceOp::Avg && !t.dtype().is_float() {
            return Err(Error::dist(op, format!("ReduceOp::Avg needs a floating-point tensor, not {:?}", t.dtype())));
        }
        Ok(())
    }

    fn check_rank(&self, op: &'static str, r: usize, what: &str) -> Result<()> {
        if r >= self.0.world {
            return Err(Error::dist(op, format!("{what} rank {r} is not below the world size {}", self.0.world)));
        }
        Ok(())
    }

    /// Inside `compile`: the collective becomes a node of the graph, run in its place at each
    /// call (captured in the CUDA graph of a replayed step), and `t` is rebound to its result.
    fn traced(&self, kind: CollectiveKind, t: &Tensor) -> Result<Work> {
        let node = crate::compile::graph::NodeOp::Collective(Collective { group: self.clone(), kind });
        let out = crate::compile::trace::record_node(node, &[t], t.shape().to_vec(), t.dtype())?;
        crate::compile::trace::assign(t, &out)?;
        Ok(Work::queued())
    }

    fn not_traced(&self, op: &'static str) -> Result<()> {
        if crate::compile::trace::active() {
            return Err(Error::dist(op, "only all_reduce and broadcast can run inside a compiled function yet: call it outside `compile`"));
        }
        Ok(())
    }

    /// Combines `t` over all ranks, in place.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        self.check_op("all_reduce", t, op)?;
        if crate::compile::trace::active() {
            return self.traced(CollectiveKind::AllReduce(op), t);
        }
        match &self.0.imp {
            Imp::Tcp(g) => g.all_reduce(t, op),
            Imp::Nccl(g) => g.all_reduce(t, op),
        }
    }

    /// Copies rank `src`'s `t` into every rank's `t`.
    pub fn broadcast(&self, t: &Tensor, src: usize) -> Result<Work> {
        self.check("broadcast", t)?;
        self.check_rank("broadcast", src, "source")?;
        if crate::compile::trace::active() {
            return self.traced(CollectiveKind::Broadcast(src), t);
        }
        match &self.0.imp {
            Imp::Tcp(g) => g.broadcast(t, src),
            Imp::Nccl(g) => g.broadcast(t, src),
        }
    }

    /// Every rank's `input`, concatenated along dimension 0 in rank order, into `out`
    /// (PyTorch's `all_gather_into_tensor`): `out` has `world_size` times `input`'s elements.
    pub fn all_gather(&self, out: &Tensor, input: &Tensor) -> Result<Work> {
        self.not_traced("all_gather")?;
        self.check_blocked("all_gather", out)?;
        self.check_blocked("all_gather", input)?;
        self.check_blocks("all_gather", "output", out, input)?;
        match &self.0.imp {
            Imp::Tcp(g) => g.all_gather(out, input),
            Imp::Nccl(g) => g.all_gather(out, input),
        }
    }

    /// `input` split into `world_size` equal blocks along dimension 0; rank r receives block r
    /// combined over all ranks (PyTorch's `reduce_scatter_tensor`).
    pub fn reduce_scatter(&self, out: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        self.check_op("reduce_scatter", out, op)?;
        self.not_traced("reduce_scatter")?;
        self.check_blocked("reduce_scatter", out)?;
        self.check_blocked("reduce_scatter", input)?;
        self.check_blocks("reduce_scatter", "input", input, out)?;
        match &self.0.imp {
            Imp::Tcp(g) => g.reduce_scatter(out, input, op),
            Imp::Nccl(g) => g.reduce_scatter(out, input, op),
        }
    }

    /// Sends `t` to rank `dst`, which must `recv` a tensor of the same size.
    pub fn send(&self, t: &Tensor, dst: usize) -> Result<Work> {
        self.not_traced("send")?;
        self.check("send", t)?;
        self.check_peer("send", dst)?;
        match &self.0.imp {
            Imp::Tcp(g) => g.send(t, dst),
            Imp::Nccl(g) => g.send(t, dst),
        }
    }

    /// Receives into `t` what rank `src` sends.
    pub fn recv(&self, t: &Tensor, src: usize) -> Result<Work> {
        self.not_traced("recv")?;
        self.check("recv", t)?;
        self.check_peer("recv", src)?;
        match &self.0.imp {
            Imp::Tcp(g) => g.recv(t, src),
            Imp::Nccl(g) => g.recv(t, src),
        }
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        let t = Tensor::zeros(&[1], DType::U8, &self.device())?;
        self.all_reduce(&t, ReduceOp::Sum)?.wait()?;
        // The NCCL all-reduce is queued on the GPU: wait for it, as PyTorch's barrier does
        // (a collective the watchdog aborted ends too, and then the barrier fails).
        t.to_vec::<u8>()?;
        match &self.0.imp {
            Imp::Tcp(_) => Ok(()),
            Imp::Nccl(g) => g.check("barrier"),
        }
    }

    fn check_peer(&self, op: &'static str, r: usize) -> Result<()> {
        self.check_rank(op, r, "peer")?;
        if r == self.0.rank {
            return Err(Error::dist(op, format!("rank {r} cannot {op} to itself")));
        }
        Ok(())
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup({:?}, rank {} of {}, {:p})", self.0.backend, self.0.rank, self.0.world, Arc::as_ptr(&self.0))
    }
}

/// Two handles are equal when they share one group.
impl PartialEq for ProcessGroup {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A collective recorded in a compiled function's graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Collective {
    group: ProcessGroup,
    kind: CollectiveKind,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum CollectiveKind {
    AllReduce(ReduceOp),
    Broadcast(usize),
}

impl Collective {
    pub(crate) fn name(&self) -> &'static str {
        match self.kind {
            CollectiveKind::AllReduce(_) => "all_reduce",
            CollectiveKind::Broadcast(_) => "broadcast",
        }
    }

    pub(crate) fn params(&self) -> String {
        match self.kind {
            CollectiveKind::AllReduce(op) => format!("[{op:?}, world {}]", self.group.world_size()),
            CollectiveKind::Broadcast(src) => format!("[src={src}, world {}]", self.group.world_size()),
        }
    }

    /// The node's value at run time: a copy of `x` combined over the ranks (the input may be a
    /// captured tensor, written back only through the graph's mutations).
    pub(crate) fn run(&self, x: &Tensor) -> Result<Tensor> {
        let (out, w) = self.start(x)?;
        w.wait()?;
        Ok(out)
    }

    /// Starts the collective on a copy of `x` and returns that copy with its handle: the value
    /// may be read only after `wait`, so a program goes on with work that does not need it
    /// (backward's earlier layers while a bucket's gradients travel).
    pub(crate) fn start(&self, x: &Tensor) -> Result<(Tensor, Work)> {
        let out = x.copy_contiguous()?;
        let w = match self.kind {
            CollectiveKind::AllReduce(op) => self.group.all_reduce(&out, op)?,
            CollectiveKind::Broadcast(src) => self.group.broadcast(&out, src)?,
        };
        Ok((out, w))
    }
}

/// A collective in flight. `wait` returns its result: for the TCP backend once the values are in
/// place; for NCCL once later work on the device's stream is ordered after it (as PyTorch's
/// `Work.wait()`; read the values on the host to wait for the GPU itself). A handle dropped
/// without `wait` orders the device's stream after the collective all the same.
#[must_use = "a collective's result is known only after wait()"]
pub struct Work(WorkKind);

enum WorkKind {
    Host(Arc<Pending>),
    /// On a communication stream: the device's stream waits for it at `wait` (or when the
    /// handle is dropped), and the tensor lives until then.
    Stream(StreamWork),
    /// Nothing was queued (a rehearsal).
    Queued,
}

struct StreamWork {
    done: Option<cudarc::driver::CudaEvent>,
    waiter: Arc<cudarc::driver::CudaStream>,
    _tensor: Tensor,
}

impl StreamWork {
    fn join(&mut self) -> Result<()> {
        match self.done.take() {
            Some(e) => self.waiter.wait(&e).map_err(|e| Error::dist("wait", format!("CUDA: {e:?}"))),
            None => Ok(()),
        }
    }
}

impl Drop for StreamWork {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

impl Work {
    fn host(p: Arc<Pending>) -> Work {
        Work(WorkKind::Host(p))
    }
    pub(crate) fn queued() -> Work {
        Work(WorkKind::Queued)
    }
    pub(crate) fn on_stream(done: cudarc::driver::CudaEvent, waiter: Arc<cudarc::driver::CudaStream>, tensor: Tensor) -> Work {
        Work(WorkKind::Stream(StreamWork { done: Some(done), waiter, _tensor: tensor }))
    }
    /// Waits for the collective and returns its error, if any.
    pub fn wait(self) -> Result<()> {
        match self.0 {
            WorkKind::Host(p) => p.wait(),
            WorkKind::Stream(mut s) => s.join(),
            WorkKind::Queued => Ok(()),
        }
    }
    /// Whether `wait` would return at once (for NCCL: whether the GPU has finished it).
    pub fn is_completed(&self) -> bool {
        match &self.0 {
            WorkKind::Host(p) => p.result.lock().is_some(),
            WorkKind::Stream(s) => s.done.as_ref().is_none_or(|e| e.is_complete()),
            WorkKind::Queued => true,
        }
    }
}

/// The result of a host collective, filled in by the group's worker.
#[derive(Default)]
pub(crate) struct Pending {
    result: Mutex<Option<Result<()>>>,
    cv: Condvar,
}

impl Pending {
    fn finish(&self, r: Result<()>) {
        *self.result.lock() = Some(r);
        self.cv.notify_all();
    }
    fn wait(&self) -> Result<()> {
        let mut g = self.result.lock();
        while g.is_none() {
            self.cv.wait(&mut g);
        }
        // Errors are not Clone: the first waiter gets it; Work::wait consumes the handle anyway.
        g.take().expect("set")
    }
}

static DEFAULT: Mutex<Option<ProcessGroup>> = Mutex::new(None);

/// Joins the default group from torchrun's environment variables (`kiln launch` sets them).
pub fn init_process_group(backend: Backend) -> Result<()> {
    init_process_group_with(InitOptions::new(backend))
}

/// Joins the default group as `opts` describe.
pub fn init_process_group_with(opts: InitOptions) -> Result<()> {
    if DEFAULT.lock().is_some() {
        return Err(Error::dist("init", "the default process group is already initialised (destroy_process_group first)"));
    }
    let g = ProcessGroup::new(opts)?;
    *DEFAULT.lock() = Some(g);
    Ok(())
}

/// Leaves the default group (after a barrier, so that rank 0's store outlives every rank's use).
pub fn destroy_process_group() -> Result<()> {
    let g = DEFAULT.lock().take();
    match g {
        Some(g) => g.barrier(),
        None => Ok(()),
    }
}

pub fn is_initialized() -> bool {
    DEFAULT.lock().is_some()
}

/// The default group.
pub fn group() -> Result<ProcessGroup> {
    DEFAULT.lock().clone().ok_or_else(|| Error::dist("group", "no process group: call distributed::init_process_group first"))
}

/// This process's rank in the default group (0 when there is none).
pub fn rank() -> usize {
    DEFAULT.lock().as_ref().map_or(0, |g| g.rank())
}

/// The default group's size (1 when there is none).
pub fn world_size() -> usize {
    DEFAULT.lock().as_ref().map_or(1, |g| g.world_size())
}

/// This process's rank on its machine: `LOCAL_RANK`, else its rank.
pub fn local_rank() -> usize {
    local_rank_from_env(rank()).unwrap_or(0)
}

fn local_rank_from_env(rank: usize) -> Result<usize> {
    Ok(env_usize("LOCAL_RANK")?.unwrap_or(rank))
}

/// [`ProcessGroup::all_reduce`] on the default group.
pub fn all_reduce(t: &Tensor, op: ReduceOp) -> Result<Work> {
    group()?.all_reduce(t, op)
}
/// [`ProcessGroup::broadcast`] on the default group.
pub fn broadcast(t: &Tensor, src: usize) -> Result<Work> {
    group()?.broadcast(t, src)
}
/// [`ProcessGroup::all_gather`] on the default group.
pub fn all_gather(out: &Tensor, input: &Tensor) -> Result<Work> {
    group()?.all_gather(out, input)
}
/// [`ProcessGroup::reduce_scatter`] on the default group.
pub fn reduce_scatter(out: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
    group()?.reduce_scatter(out, input, op)
}
/// [`ProcessGroup::send`] on the default group.
pub fn send(t: &Tensor, dst: usize) -> Result<Work> {
    group()?.send(t, dst)
}
/// [`ProcessGroup::recv`] on the default group.
pub fn recv(t: &Tensor, src: usize) -> Result<Work> {
    group()?.recv(t, src)
}
/// [`ProcessGroup::barrier`] on the default group.
pub fn barrier() -> Result<()> {
    group()?.barrier()
}
