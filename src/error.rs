//! One error type for the whole crate. Every message names the op and the shapes, dtypes or
//! devices involved, so a user can find the mistake without a debugger.

use crate::{DType, Device};

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op}: shape mismatch: {msg}")]
    Shape { op: &'static str, msg: String },

    #[error("{op}: dimension {dim} is out of range for a tensor of {ndim} dimensions (expected in [{lo}, {hi}])", lo = -(*ndim.max(&1) as i64), hi = (*ndim.max(&1) as i64) - 1)]
    Dim { op: &'static str, dim: i64, ndim: usize },

    #[error("{op}: dtype {dtype:?} is not supported: {msg}")]
    DType { op: &'static str, dtype: DType, msg: String },

    #[error("{op}: expected all tensors on one device, found {a} and {b}")]
    DeviceMismatch { op: &'static str, a: Device, b: Device },

    #[error("{op}: device {device} is not available: {msg}")]
    DeviceUnavailable { op: &'static str, device: Device, msg: String },

    #[error("{op}: index {index} is out of range for size {size}")]
    Index { op: &'static str, index: i64, size: usize },

    #[error("{op}: invalid argument: {msg}")]
    Arg { op: &'static str, msg: String },

    #[error("autograd: {0}")]
    Autograd(String),

    #[error("{op}: {msg}")]
    Io { op: &'static str, msg: String },

    #[error("{device}: out of memory: {msg}")]
    OutOfMemory { device: Device, msg: String },

    #[error("{device}: CUDA error in {op}: {msg}")]
    Cuda { op: &'static str, device: Device, msg: String },

    /// The compiler could not trace or run a function (a host read under `fullgraph`, an
    /// unsupported construct), with the reason and, where known, the call site.
    #[error("compile: {0}")]
    Compile(String),

    /// A host synchronisation while sync debug mode is `Error`, with the call site.
    #[error("{what}: host synchronisation with {device} at {at} (sync debug mode is Error)")]
    Sync { what: &'static str, device: Device, at: String },

    /// A collective or the rendezvous failed: a rank that never arrived, died or disagreed,
    /// naming it.
    #[error("distributed {op}: {msg}")]
    Distributed { op: &'static str, msg: String },

    /// A generated kernel that failed to compile, with its source.
    #[error("{device}: kernel compilation failed: {msg}\n--- source ---\n{code}")]
    Kernel { device: Device, msg: String, code: String },
}

impl Error {
    pub(crate) fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape { op, msg: msg.into() }
    }
    pub(crate) fn arg(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Arg { op, msg: msg.into() }
    }
    pub(crate) fn dist(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Distributed { op, msg: msg.into() }
    }
    pub(crate) fn dtype(op: &'static str, dtype: DType, msg: impl Into<String>) -> Self {
        Error::DType { op, dtype, msg: msg.into() }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io { op: "io", msg: e.to_string() }
    }
}
