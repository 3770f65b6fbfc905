//! How a custom op's CUDA kernel is launched: grid, block, dynamic shared memory, and the scalar
//! arguments passed after the tensor pointers.

/// Threads per block of [`LaunchSpec::elementwise`].
const THREADS: u32 = 256;

/// A scalar kernel argument, passed by value after the output pointer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum KernelArg {
    I64(i64),
    I32(i32),
    F64(f64),
    F32(f32),
}

impl KernelArg {
    /// Bytes the kernel parameter occupies.
    pub(crate) fn size(self) -> usize {
        match self {
            KernelArg::I64(_) | KernelArg::F64(_) => 8,
            KernelArg::I32(_) | KernelArg::F32(_) => 4,
        }
    }
    /// The value's bytes in the low bytes of a word (the launch reads `size()` bytes from it).
    pub(crate) fn word(self) -> u64 {
        match self {
            KernelArg::I64(v) => v as u64,
            KernelArg::I32(v) => v as u32 as u64,
            KernelArg::F64(v) => v.to_bits(),
            KernelArg::F32(v) => v.to_bits() as u64,
        }
    }
    pub(crate) fn c_type(self) -> &'static str {
        match self {
            KernelArg::I64(_) => "long long",
            KernelArg::I32(_) => "int",
            KernelArg::F64(_) => "double",
            KernelArg::F32(_) => "float",
        }
    }
}

/// Grid, block and shared memory of one launch of a custom op's kernel, and the scalar
/// arguments that follow its pointer parameters (see [`crate::custom`] for the convention).
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchSpec {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Bytes of dynamic shared memory (`extern __shared__`).
    pub shared_mem: u32,
    pub(crate) args: Vec<KernelArg>,
}

impl LaunchSpec {
    /// A launch of `grid` blocks of `block` threads with no arguments after the pointers.
    pub fn new(grid: (u32, u32, u32), block: (u32, u32, u32)) -> LaunchSpec {
        LaunchSpec { grid, block, shared_mem: 0, args: vec![] }
    }

    /// One thread per element for `n` elements (256 per block) and the argument `long long n`.
    /// Above 2^31 - 1 blocks the grid is capped: such kernels need a grid-stride loop. `n = 0`
    /// gives an empty grid, which launches nothing.
    pub fn elementwise(n: usize) -> LaunchSpec {
        let blocks = n.div_ceil(THREADS as usize).min(i32::MAX as usize) as u32;
        LaunchSpec::new((blocks, 1, 1), (THREADS, 1, 1)).arg_i64(n as i64)
    }

    pub fn shared_mem(mut self, bytes: u32) -> LaunchSpec {
        self.shared_mem = bytes;
        self
    }
    /// Appends a `long long` argument.
    pub fn arg_i64(mut self, v: i64) -> LaunchSpec {
        self.args.push(KernelArg::I64(v));
        self
    }
    /// Appends an `int` argument.
    pub fn arg_i32(mut self, v: i32) -> LaunchSpec {
        self.args.push(KernelArg::I32(v));
        self
    }
    /// Appends a `double` argument.
    pub fn arg_f64(mut self, v: f64) -> LaunchSpec {
        self.args.push(KernelArg::F64(v));
        self
    }
    /// Appends a `float` argument.
    pub fn arg_f32(mut self, v: f32) -> LaunchSpec {
        self.args.push(KernelArg::F32(v));
        self
    }

    /// Whether the grid is empty (nothing to launch).
    pub(crate) fn is_empty(&self) -> bool {
        self.grid.0 == 0 || self.grid.1 == 0 || self.grid.2 == 0
    }
    pub(crate) fn threads(&self) -> u64 {
        self.block.0 as u64 * self.block.1 as u64 * self.block.2 as u64
    }
}
