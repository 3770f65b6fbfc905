//! Vendor libraries: cuBLASLt for matrix products (with bias and ReLU epilogues), cuDNN for
//! convolutions (with their epilogues) and fused attention.

pub(crate) mod blas;
pub(crate) mod conv_epilogue;
pub(crate) mod cudnn;
pub(crate) mod cudnn_graph;
pub(crate) mod sdpa;
