//! Datasets and a batching loader: seeded shuffling, worker threads, bounded prefetch, pinned
//! batches for asynchronous copies to the GPU.

mod idx;
mod loader;
mod synthetic;

pub use idx::Mnist;
pub use loader::{Batches, DataLoader, DistributedSampler};
pub(crate) use loader::{loader_activity, LoaderActivity};
pub use synthetic::SyntheticClassification;

use crate::{Result, Tensor};

/// Samples by index: an input and a target, as host tensors of fixed shapes.
pub trait Dataset: Send + Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn get(&self, index: usize) -> Result<(Tensor, Tensor)>;
}
