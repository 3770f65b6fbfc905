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
    epoch: AtomicU64,
}

impl<D: Dataset + 'static> DataLoader<D> {
    /// In order, one worker, two batches of prefetch; see the builder methods.
    pub fn new(dataset: D, batch_size: usize) -> Result<DataLoader<D>> {
        if batch_size == 0 {
            return Err(Error::arg("DataLoader", "batch_size must be positive"));
        }
        Ok(DataLoader { dataset: Arc::new(dataset), batch_size, shuffle: false, seed: 0, drop_last: false, workers: 1, prefetch: 2, pin_memory: false, epoch: AtomicU64::new(0) })
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
    pub fn dataset(&self) -> &D {
        &self.dataset
    }
    /// Batches in one epoch.
    pub fn len(&self) -> usize {
        let n = self.dataset.len();
        if self.drop_last { n / self.batch_size } else { n.div_ceil(self.batch_size) }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample order of epoch `epoch`.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.dataset.len()).collect();
        if self.shuffle {
            // Fisher–Yates driven by the counter-based generator: (seed, epoch) fixes the order.
            let key = self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for i in (1..idx.len()).rev() {
                let w = crate::tensor::random::philox(key, i as u64);
                let r = (((w[0] as u64) << 32) | w[1] as u64) % (i as u64 + 1);
                idx.swap(i, r as usize);
            }
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
        Batches { rx, pending: BTreeMap::new(), next: 0, total: batches.len(), _workers: handles }
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

/// The batches of one epoch, in order.
pub struct Batches {
    rx: mpsc::Receiver<(usize, Result<(Tensor, Tensor)>)>,
    pending: BTreeMap<usize, Result<(Tensor, Tensor)>>,
    next: usize,
    total: usize,
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
