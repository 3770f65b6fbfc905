//! The CPU backend: host tensors over TCP between every pair of ranks (the part gloo plays for
//! PyTorch). One worker thread per group runs the collectives in the order they were issued, so
//! every call returns at once with a [`Work`] handle. All-reduce, all-gather and reduce-scatter
//! go around a ring (each rank sends to the next and receives from the previous at once), which
//! moves 2(n-1)/n of the buffer per rank, as NCCL's ring does.

use super::{Pending, ReduceOp, Work};
use crate::backend::cpu::{bytes_of, bytes_of_mut, CpuStorage};
use crate::storage::BackendStorage;
use crate::{DType, Error, Result, Tensor};
use half::{bf16, f16};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ops::Range;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce(&mut Mesh) -> Result<()> + Send>;

pub(crate) struct TcpGroup {
    jobs: parking_lot::Mutex<mpsc::Sender<(Job, Arc<Pending>)>>,
}

/// The connections of one rank to all others, owned by the group's worker thread.
pub(crate) struct Mesh {
    rank: usize,
    world: usize,
    peers: Vec<Option<TcpStream>>,
    timeout: Duration,
    /// The first failure: once a collective has failed, the ranks no longer agree on what comes
    /// next on the wire, so every later one fails with it.
    broken: Option<String>,
}

impl TcpGroup {
    /// Connects rank `rank` to the `world - 1` others through addresses published in `store`.
    pub(crate) fn connect(store: &super::store::Store, prefix: &str, rank: usize, world: usize, timeout: Duration) -> Result<TcpGroup> {
        let listener = TcpListener::bind((store.local_ip()?, 0))?;
        store.set(&format!("{prefix}/tcp/{rank}"), listener.local_addr()?.to_string().as_bytes())?;
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (j, peer) in peers.iter_mut().enumerate().take(rank) {
            let addr = store.get(&format!("{prefix}/tcp/{j}")).map_err(|e| never_arrived(j, e))?;
            let addr = String::from_utf8_lossy(&addr).into_owned();
            let mut s = TcpStream::connect(&addr).map_err(|e| Error::dist("init", format!("cannot reach rank {j} at {addr}: {e}")))?;
            s.write_all(&(rank as u32).to_le_bytes())?;
            *peer = Some(s);
        }
        listener.set_nonblocking(true)?;
        let deadline = Instant::now() + timeout;
        let mut missing = world - 1 - rank;
        while missing > 0 {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_read_timeout(Some(timeout))?;
                    let mut r = [0u8; 4];
                    s.read_exact(&mut r)?;
                    let r = u32::from_le_bytes(r) as usize;
                    if r <= rank || r >= world || peers[r].is_some() {
                        return Err(Error::dist("init", format!("rank {rank} was reached by a rank {r} it did not expect (two jobs on one MASTER_PORT?)")));
                    }
                    peers[r] = Some(s);
                    missing -= 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let absent: Vec<usize> = (rank + 1..world).filter(|&r| peers[r].is_none()).collect();
                        return Err(Error::dist("init", format!("ranks {absent:?} never connected to rank {rank} within {:.0} s", timeout.as_secs_f64())));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e.into()),
            }
        }
        for s in peers.iter().flatten() {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
        }
        let mut mesh = Mesh { rank, world, peers, timeout, broken: None };
        let (tx, rx) = mpsc::channel::<(Job, Arc<Pending>)>();
        std::thread::Builder::new().name(format!("kiln-dist-{rank}")).spawn(move || {
            for (job, done) in rx {
                let r = match &mesh.broken {
                    Some(why) => Err(Error::dist("collective", format!("an earlier collective failed: {why}"))),
                    // A panic would leave its waiter waiting forever: it becomes the error.
                    None => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut mesh)))
                        .unwrap_or_else(|_| Err(Error::dist("collective", format!("rank {rank}'s collective worker panicked")))),
                };
                if let Err(e) = &r {
                    mesh.broken.get_or_insert_with(|| e.to_string());
                }
                done.finish(r);
            }
        })?;
        Ok(TcpGroup { jobs: parking_lot::Mutex::new(tx) })
    }

    fn submit(&self, job: impl FnOnce(&mut Mesh) -> Result<()> + Send + 'static) -> Result<Work> {
        let done = Arc::new(Pending::default());
        self.jobs.lock().send((Box::new(job), done.clone())).map_err(|_| Error::dist("collective", "the group's worker has stopped"))?;
        Ok(Work::host(done))
    }

    pub(crate) fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Work> {
        let t = t.clone();
        self.submit(move |m| {
            let world = m.world;
            with_bytes(&t, |buf, dtype| {
                let bounds = m.bounds(buf.len() / dtype.size_in_bytes(), dtype.size_in_bytes());
                m.reduce_scatter_ring("all_reduce", buf, &bounds, dtype, op)?;
                m.all_gather_ring("all_reduce", buf, &bounds)?;
                if op == ReduceOp::Avg {
                    divide(buf, dtype, world);
                }
                Ok(())
            })
        })
    }

    pub(crate) fn broadcast(&self, t: &Tensor, src: usize) -> Result<Work> {
        let t = t.clone();
        self.submit(move |m| {
            with_bytes(&t, |buf, _| {
                if m.rank == src {
                    for j in (0..m.world).filter(|&j| j != src) {
                        m.send_to("broadcast", j, buf)?;
                    }
                    Ok(())
                } else {
                    m.recv_from("broadcast", src, buf, None)
                }
            })
        })
    }

    /// `out` holds `world` blocks the size of `input`, in rank order.
    pub(crate) fn all_gather(&self, out: &Tensor, input: &Tensor) -> Result<Work> {
        let (out, input) = (out.clone(), input.clone());
        self.submit(move |m| {
            let mine = read_bytes(&input)?;
            with_bytes(&out, |buf, _| {
                let n = mine.len;
                buf[m.rank * n..(m.rank + 1) * n].copy_from_slice(mine.bytes());
                let bounds: Vec<usize> = (0..=m.world).map(|i| i * n).collect();
                m.all_gather_ring("all_gather", buf, &bounds)
            })
        })
    }

    /// `input` holds `world` blocks the size of `out`; rank r gets block r reduced over ranks.
    pub(crate) fn reduce_scatter(&self, out: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        let (out, input) = (out.clone(), input.clone());
        self.submit(move |m| {
            let mut all = read_bytes(&input)?;
            let (rank, world) = (m.rank, m.world);
            with_bytes(&out, |buf, dtype| {
                let n = buf.len();
                let bounds: Vec<usize> = (0..=world).map(|i| i * n).collect();
                m.reduce_scatter_ring("reduce_scatter", all.bytes_mut(), &bounds, dtype, op)?;
                buf.copy_from_slice(&all.bytes()[rank * n..(rank + 1) * n]);
                if op == ReduceOp::Avg {
                    divide(buf, dtype, world);
                }
                Ok(())
            })
        })
    }

    pub(crate) fn send(&self, t: &Tensor, dst: usize) -> Result<Work> {
        let t = t.clone();
        self.submit(move |m| {
            m.send_to("send", dst, read_bytes(&t)?.bytes())
        })
    }

    pub(crate) fn recv(&self, t: &Tensor, src: usize) -> Result<Work> {
        let t = t.clone();
        self.submit(move |m| with_bytes(&t, |buf, _| m.recv_from("recv", src, buf, None)))
    }
}

fn never_arrived(rank: usize, e: Error) -> Error {
    Error::dist("init", format!("rank {rank} never arrived ({e})"))
}

impl Mesh {
    /// Element boundaries of the ring's `world` chunks, in bytes.
    fn bounds(&self, numel: usize, elem: usize) -> Vec<usize> {
        (0..=self.world).map(|i| i * numel / self.world * elem).collect()
    }

    fn peer(&self, j: usize) -> &TcpStream {
        self.peers[j].as_ref().expect("a connection to every other rank")
    }

    fn io_error(&self, op: &'static str, j: usize, e: std::io::Error) -> Error {
        let why = match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => format!("rank {j} did not answer within {:.0} s (did it die, hang, or call a different collective?)", self.timeout.as_secs_f64()),
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
                format!("rank {j} closed its connection (it exited or failed)")
            }
            _ => format!("rank {j}: {e}"),
        };
        Error::dist(op, format!("on rank {}: {why}", self.rank))
    }

    fn send_to(&self, op: &'static str, j: usize, bytes: &[u8]) -> Result<()> {
        let mut s = self.peer(j);
        s.write_all(&(bytes.len() as u64).to_le_bytes()).and_then(|_| s.write_all(bytes)).map_err(|e| self.io_error(op, j, e))
    }

    /// One step of a ring: sends `buf[send]` to the next rank while receiving the previous
    /// rank's message for `buf[recv]`, in pieces, so that combining one piece overlaps the
    /// arrival of the next (`how`: combine into it; `None`: overwrite it).
    fn ring_step(&self, op: &'static str, buf: &mut [u8], send: Range<usize>, recv: Range<usize>, how: Option<(DType, ReduceOp)>) -> Result<()> {
        let (next, prev) = ((self.rank + 1) % self.world, (self.rank + self.world - 1) % self.world);
        let (out, into) = disjoint(buf, send, recv);
        std::thread::scope(|sc| {
            let sent = sc.spawn(|| self.send_to(op, next, out));
            let got = self.recv_from(op, prev, into, how);
            let sent = sent.join().unwrap_or_else(|_| Err(Error::dist(op, "the sending thread panicked")));
            got.and(sent)
        })
    }

    /// Receives exactly `into.len()` bytes from rank `j` (a message of another length means the
    /// ranks called the collective with different sizes), in pieces: combined into `into` with
    /// `how`, or written over it with `None`.
    fn recv_from(&self, op: &'static str, j: usize, into: &mut [u8], how: Option<(DType, ReduceOp)>) -> Result<()> {
        const PIECE: usize = 1 << 20;
        let mut s = self.peer(j);
        let mut len = [0u8; 8];
        s.read_exact(&mut len).map_err(|e| self.io_error(op, j, e))?;
        let len = u64::from_le_bytes(len) as usize;
        if len != into.len() {
            return Err(Error::dist(op, format!("rank {j} sent {len} bytes where rank {} expected {} (tensors of different sizes on different ranks?)", self.rank, into.len())));
        }
        let mut scratch = Scratch::default();
        for dst in into.chunks_mut(PIECE) {
            match how {
                None => s.read_exact(dst).map_err(|e| self.io_error(op, j, e))?,
                Some((dtype, red)) => {
                    let piece = scratch.take(dst.len());
                    s.read_exact(piece).map_err(|e| self.io_error(op, j, e))?;
                    combine(dtype, red, dst, piece);
                }
            }
        }
        Ok(())
    }

    /// Leaves chunk `rank` of `buf` reduced over all ranks (the other chunks partly reduced).
    fn reduce_scatter_ring(&self, op: &'static str, buf: &mut [u8], bounds: &[usize], dtype: DType, how: ReduceOp) -> Result<()> {
        let w = self.world;
        for s in 0..w.saturating_sub(1) {
            let (send, recv) = ((self.rank + 2 * w - s - 1) % w, (self.rank + 2 * w - s - 2) % w);
            self.ring_step(op, buf, bounds[send]..bounds[send + 1], bounds[recv]..bounds[recv + 1], Some((dtype, how)))?;
        }
        Ok(())
    }

    /// Given chunk `rank` of `buf` complete, fills in every other rank's.
    fn all_gather_ring(&self, op: &'static str, buf: &mut [u8], bounds: &[usize]) -> Result<()> {
        let w = self.world;
        for s in 0..w.saturating_sub(1) {
            let (send, recv) = ((self.rank + w - s) % w, (self.rank + 2 * w - s - 1) % w);
            self.ring_step(op, buf, bounds[send]..bounds[send + 1], bounds[recv]..bounds[recv + 1], None)?;
        }
        Ok(())
    }
}

/// `buf[a]` to read and `buf[b]` to write, for two ranges that do not overlap.
fn disjoint(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    // An empty chunk (fewer elements than ranks) may start where the other does.
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.end <= b.start {
        let (left, right) = buf.split_at_mut(b.start);
        (&left[a], &mut right[..b.end - b.start])
    } else {
        let (left, right) = buf.split_at_mut(a.start);
        (&right[..a.end - a.start], &mut left[b])
    }
}

/// A byte buffer aligned for every element type (the reduction reads it as typed values).
#[derive(Default)]
struct Scratch {
    words: Vec<u64>,
    len: usize,
}

impl Scratch {
    /// The buffer as `bytes` bytes, grown to hold them.
    fn take(&mut self, bytes: usize) -> &mut [u8] {
        self.words.resize(bytes.div_ceil(8), 0);
        self.len = bytes;
        self.bytes_mut()
    }
    fn bytes(&self) -> &[u8] {
        &bytes_of(&self.words)[..self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytes_of_mut(&mut self.words)[..self.len]
    }
}

/// Runs `f` on the bytes of a contiguous host tensor, in place, then marks it modified.
fn with_bytes(t: &Tensor, f: impl FnOnce(&mut [u8], DType) -> Result<()>) -> Result<()> {
    let (off, n, dtype) = (t.storage_offset(), t.numel(), t.dtype());
    let r = {
        let mut data = t.storage().data.write();
        let BackendStorage::Cpu(s) = &mut *data else {
            return Err(Error::dist("collective", "the TCP backend takes host tensors"));
        };
        crate::backend::cpu::with_storage!(s, v => f(bytes_of_mut(&mut v[off..off + n]), dtype))
    };
    t.storage().bump_version();
    r
}

/// A copy of a contiguous host tensor's bytes, aligned for its element type (reduce-scatter
/// combines into it).
fn read_bytes(t: &Tensor) -> Result<Scratch> {
    let (off, n) = (t.storage_offset(), t.numel());
    let data = t.storage().data.read();
    let BackendStorage::Cpu(s) = &*data else {
        return Err(Error::dist("collective", "the TCP backend takes host tensors"));
    };
    let bytes = crate::backend::cpu::with_storage!(s, v => bytes_of(&v[off..off + n]));
    let mut copy = Scratch::default();
    copy.take(bytes.len()).copy_from_slice(bytes);
    Ok(copy)
}

fn typed<T>(b: &[u8]) -> &[T] {
    debug_assert_eq!(b.as_ptr() as usize % std::mem::align_of::<T>(), 0);
    // SAFETY: callers pass buffers aligned for T (tensor storage or `Scratch`) of whole elements.
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / std::mem::size_of::<T>()) }
}

fn typed_mut<T>(b: &mut [u8]) -> &mut [T] {
    debug_assert_eq!(b.as_ptr() as usize % std::mem::align_of::<T>(), 0);
    // SAFETY: as in `typed`.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), b.len() / std::mem::size_of::<T>()) }
}

/// `dst = dst (op) src`, elementwise, in `dtype`.
fn combine(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    fn go<T: Copy + PartialOrd>(d: &mut [u8], s: &[u8], op: ReduceOp, add: impl Fn(T, T) -> T) {
        let (d, s) = (typed_mut::<T>(d), typed::<T>(s));
        for (a, &b) in d.iter_mut().zip(s) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => add(*a, b),
                // A NaN wins, as in NCCL and PyTorch (it is the value unordered with itself).
                ReduceOp::Max => if b > *a || b.partial_cmp(&b).is_none() { b } else { *a },
                ReduceOp::Min => if b < *a || b.partial_cmp(&b).is_none() { b } else { *a },
            };
        }
    }
    match dtype {
        DType::F32 => go::<f32>(dst, src, op, |a, b| a + b),
        DType::F64 => go::<f64>(dst, src, op, |a, b| a + b),
        DType::F16 => go::<f16>(dst, src, op, |a, b| a + b),
        DType::BF16 => go::<bf16>(dst, src, op, |a, b| a + b),
        DType::I64 => go::<i64>(dst, src, op, i64::wrapping_add),
        DType::I32 => go::<i32>(dst, src, op, i32::wrapping_add),
        DType::U8 => go::<u8>(dst, src, op, u8::wrapping_add),
        DType::Bool => go::<bool>(dst, src, op, |a, b| a | b),
    }
}

/// The mean from a sum over `world` ranks (floating dtypes only; checked before submitting).
fn divide(buf: &mut [u8], dtype: DType, world: usize) {
    let w = world as f64;
    match dtype {
        DType::F32 => typed_mut::<f32>(buf).iter_mut().for_each(|v| *v = (*v as f64 / w) as f32),
        DType::F64 => typed_mut::<f64>(buf).iter_mut().for_each(|v| *v /= w),
        DType::F16 => typed_mut::<f16>(buf).iter_mut().for_each(|v| *v = f16::from_f64(v.to_f64() / w)),
        DType::BF16 => typed_mut::<bf16>(buf).iter_mut().for_each(|v| *v = bf16::from_f64(v.to_f64() / w)),
        _ => unreachable!("Avg is checked to be floating point"),
    }
}
