//! kiln: tensors on GPUs and CPUs, eager execution with autograd, and (growing) a compiler that
//! fuses Rust functions over tensors into generated kernels.
//!
//! ```
//! use kiln::prelude::*;
//! # fn main() -> kiln::Result<()> {
//! let dev = Device::cuda_if_available(0);
//! let a = Tensor::randn(&[1000], DType::F32, &dev)?;
//! let b = Tensor::randn(&[1000], DType::F32, &dev)?;
//! let c = (&a + &b)?.relu()?;
//! assert!(c.to_vec::<f32>()?.iter().all(|&v| v >= 0.0));
//! # Ok(())
//! # }
//! ```

pub mod amp;
pub mod autograd;
pub mod compile;
pub(crate) mod backend;
pub mod custom;
pub mod data;
pub mod demo;
pub mod distributed;
pub mod doctor;
pub mod cpu;
pub mod cuda;
mod device;
mod dtype;
mod error;
mod files;
mod hash;
pub(crate) mod kir;
pub(crate) mod layout;
pub mod logging;
pub mod models;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod profiler;
mod storage;
mod switches;
mod tensor;

pub use custom::{CustomOp, CustomOpBuilder, HostTensor, LaunchSpec, OpCtx};
pub use autograd::{enable_grad, gradcheck, inference_mode, is_grad_enabled, no_grad, BackwardOptions, Ctx, Function, GradcheckOptions};
pub use device::Device;
pub use dtype::{promote_types, result_type, Category, DType, Tier, WithDType};
pub use error::{Error, Result};
pub use layout::MemoryFormat;
pub use ops::elementwise::{where_, RoundingMode, Scalar};
pub use ops::movement::{cat, stack};
pub use profiler::{set_sync_debug_mode, with_sync_debug_mode, SyncDebug};
pub use tensor::{manual_seed, Tensor};

/// What most programs need: `use kiln::prelude::*;`.
pub mod prelude {
    pub use crate::amp;
    pub use crate::nn::{self, Module};
    pub use crate::optim::{self, Optimizer};
    pub use crate::profiler::{self, SortBy};
    pub use crate::{cat, manual_seed, no_grad, stack, Ctx, CustomOp, DType, Device, Function, LaunchSpec, MemoryFormat, Result, SyncDebug, Tensor};
}
