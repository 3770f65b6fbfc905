//! `DataLoader`: batches of stacked samples in a seeded order, built by worker threads ahead of
//! the consumer (at most `prefetch` batches waiting), delivered in order.

use super::Dataset;
use crate::{stack, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

pub struct DataLoader<D: Dataset + 'static> {
    dataset: Arc<D>,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    workers: usize,
    prefetch: usize,
    pin_memory: bool,
    sampler: Option<DistributedSampler>,
    epoch: AtomicU64,
}

impl<D: Dataset + 'static> DataLoader<D> {
    /// In order, one worker, two batches of prefetch; see the builder methods.
    pub fn new(dataset: D, batch_size: usize) -> Result<DataLoader<D>> {
        if batch_size == 0 {
            return Err(Error::arg("DataLoader", "batch_size must be positive"));
        }
        Ok(DataLoader { dataset: Arc::new(dataset), batch_size, shuffle: false, seed: 0, drop_last: false, workers: 1, prefetch: 2, pin_memory: false, sampler: None, epoch: AtomicU64::new(0) })
    }
    /// A new random order every epoch, the same for the same seed.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = true;
        self.seed = seed;
        self
    }
    /// Leaves out the last, smaller batch.
    pub fn drop_last(mut self, on: bool) -> Self {
        self.drop_last = on;
        self
    }
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }
    /// Batches built ahead of the consumer.
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = n.max(1);
        self
    }
    /// Batches in page-locked memory, so `to_device_async` copies them without staging
    /// (needs a CUDA driver).
    pub fn pin_memory(mut self, on: bool) -> Self {
        self.pin_memory = on;
        self
    }
    /// Takes each epoch's samples from `sampler` (this rank's shard) instead of the whole
    /// dataset; the loader's epoch counter drives the sampler's reshuffle, so ranks that iterate
    /// alike stay in step.
    pub fn sampler(mut self, sampler: DistributedSampler) -> Result<Self> {
        if sampler.dataset_len != self.dataset.len() {
            return Err(Error::arg("DataLoader::sampler", format!("the sampler was made for {} samples, the dataset has {}", sampler.dataset_len, self.dataset.len())));
        }
        self.sampler = Some(sampler);
        Ok(self)
    }
    pub fn dataset(&self) -> &D {
        &self.dataset
    }
    /// Batches in one epoch.
    pub fn len(&self) -> usize {
        let n = self.sampler.as_ref().map_or(self.dataset.len(), |s| s.num_samples());
        if self.drop_last { n / self.batch_size } else { n.div_ceil(self.batch_size) }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample order of epoch `epoch`.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        if let Some(s) = &self.sampler {
            return s.indices(epoch);
        }
        let mut idx: Vec<usize> = (0..self.dataset.len()).collect();
        if self.shuffle {
            shuffle(&mut idx, self.seed, epoch);
        }
        idx
    }

    /// One epoch of batches (each call starts the next epoch).
    pub fn iter(&self) -> Batches {
        let epoch = self.epoch.fetch_add(1, Ordering::Relaxed);
        let order = self.order(epoch);
        let batches: Vec<Vec<usize>> = order.chunks(self.batch_size).filter(|c| !self.drop_last || c.len() == self.batch_size).map(|c| c.to_vec()).collect();
        let batches = Arc::new(batches);
        let next = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = mpsc::sync_channel::<(usize, Result<(Tensor, Tensor)>)>(self.prefetch);
        let mut handles = Vec::new();
        for _ in 0..self.workers {
            let (ds, batches, next, tx, pin) = (self.dataset.clone(), batches.clone(), next.clone(), tx.clone(), self.pin_memory);
            handles.push(std::thread::spawn(move || loop {
                let b = next.fetch_add(1, Ordering::Relaxed);
                let Some(ids) = batches.get(b) else { break };
                if tx.send((b, collate(ds.as_ref(), ids, pin))).is_err() {
                    break; // the consumer stopped early
                }
            }));
        }
        Batches { rx, pending: BTreeMap::new(), next: 0, total: batches.len(), workers: self.workers, pinned: self.pin_memory, _workers: handles }
    }
}

/// Fisher–Yates driven by the counter-based generator: (seed, epoch) fixes the order.
fn shuffle(idx: &mut [usize], seed: u64, epoch: u64) {
    let key = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for i in (1..idx.len()).rev() {
        let w = crate::tensor::random::philox(key, i as u64);
        let r = (((w[0] as u64) << 32) | w[1] as u64) % (i as u64 + 1);
        idx.swap(i, r as usize);
    }
}

/// Each rank's share of a dataset, as PyTorch's `DistributedSampler`: one seeded permutation per
/// epoch, the same on every rank, padded by repeating its start to a multiple of the ranks (or
/// cut, with `drop_last`), and dealt out so that rank r takes positions r, r + n, r + 2n, ...
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    seed: u64,
    shuffle: bool,
    drop_last: bool,
}

impl DistributedSampler {
    /// This process's shard in the default process group (the whole dataset without one).
    pub fn new(dataset: &impl Dataset, seed: u64) -> Result<Self> {
        Self::with_replicas(dataset.len(), crate::distributed::world_size(), crate::distributed::rank(), seed)
    }

    /// Shard `rank` of `num_replicas` of a dataset of `dataset_len` samples.
    pub fn with_replicas(dataset_len: usize, num_replicas: usize, rank: usize, seed: u64) -> Result<Self> {
        if num_replicas == 0 || rank >= num_replicas {
            return Err(Error::arg("DistributedSampler", format!("rank {rank} is not below num_replicas {num_replicas}")));
        }
        Ok(DistributedSampler { dataset_len, num_replicas, rank, seed, shuffle: true, drop_last: false })
    }

    /// In dataset order instead of shuffled.
    pub fn shuffle(mut self, on: bool) -> Self {
        self.shuffle = on;
        self
    }

    /// Cuts the tail instead of padding it, so no sample is seen twice in an epoch.
    pub fn drop_last(mut self, on: bool) -> Self {
        self.drop_last = on;
        self
    }

    /// Samples per rank and epoch.
    pub fn num_samples(&self) -> usize {
        if self.drop_last { self.dataset_len / self.num_replicas } else { self.dataset_len.div_ceil(self.num_replicas) }
    }

    /// This rank's samples in epoch `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.dataset_len).collect();
        if self.shuffle {
            shuffle(&mut idx, self.seed, epoch);
        }
        let total = self.num_samples() * self.num_replicas;
        if idx.is_empty() {
            return idx;
        }
        while idx.len() < total {
            let more = (total - idx.len()).min(idx.len());
            idx.extend_from_within(..more);
        }
        idx.truncate(total);
        idx.into_iter().skip(self.rank).step_by(self.num_replicas).collect()
    }
}

fn collate(ds: &dyn Dataset, ids: &[usize], pin: bool) -> Result<(Tensor, Tensor)> {
    let samples: Vec<(Tensor, Tensor)> = ids.iter().map(|&i| ds.get(i)).collect::<Result<_>>()?;
    let xs: Vec<&Tensor> = samples.iter().map(|s| &s.0).collect();
    let ys: Vec<&Tensor> = samples.iter().map(|s| &s.1).collect();
    let (x, y) = crate::no_grad(|| Ok::<_, Error>((stack(&xs, 0)?, stack(&ys, 0)?)))?;
    if pin {
        return Ok((x.pin_memory()?, y.pin_memory()?));
    }
    Ok((x, y))
}

/// What this thread took from loaders: batches, and of those how many were pinned, with the
/// most workers a loader had (`kiln::doctor` reads it around the steps it checks).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LoaderActivity {
    pub(crate) batches: usize,
    pub(crate) pinned: usize,
    pub(crate) workers: usize,
}

thread_local! {
    static TAKEN: std::cell::Cell<LoaderActivity> = const { std::cell::Cell::new(LoaderActivity { batches: 0, pinned: 0, workers: 0 }) };
}

fn note_batch(workers: usize, pinned: bool) {
    TAKEN.with(|t| {
        let mut a = t.get();
        a.batches += 1;
        a.pinned += pinned as usize;
        a.workers = a.workers.max(workers);
        t.set(a);
    });
}

/// This thread's loader activity so far.
pub(crate) fn loader_activity() -> LoaderActivity {
    TAKEN.with(|t| t.get())
}

/// The batches of one epoch, in order.
pub struct Batches {
    rx: mpsc::Receiver<(usize, Result<(Tensor, Tensor)>)>,
    pending: BTreeMap<usize, Result<(Tensor, Tensor)>>,
    next: usize,
    total: usize,
    workers: usize,
    pinned: bool,
    _workers: Vec<std::thread::JoinHandle<()>>,
}

impl Iterator for Batches {
    type Item = Result<(Tensor, Tensor)>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.total {
            return None;
        }
        // Workers finish out of order; hold early batches until their turn.
        loop {
            if let Some(b) = self.pending.remove(&self.next) {
                self.next += 1;
                note_batch(self.workers, self.pinned);
                return Some(b);
            }
            match self.rx.recv() {
                Ok((i, b)) => {
                    self.pending.insert(i, b);
                }
                Err(_) => return Some(Err(Error::arg("DataLoader", "a worker stopped before producing every batch"))),
            }
        }
    }
}
