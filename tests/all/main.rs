//! The integration suite: one binary (each test binary links the whole crate), one module per
//! area. Device-generic tests take their device from `KILN_TEST_DEVICE` (`cpu` when unset).

mod attention;
mod channels_last;
mod autograd;
mod common;
mod compile;
mod corpus_files;
mod corpus_ops;
mod cpu_codegen;
mod cuda;
mod custom;
mod data;
mod ddp;
mod demo;
mod distributed;
mod doctor;
mod errors;
mod fixtures;
mod lm;
mod models;
mod nn;
mod opinfo;
mod ops;
mod ops_index;
mod ops_matmul;
mod ops_nn;
mod ops_pointwise;
mod ops_reduce;
mod optim;
mod parity;
mod profiler;
mod smoke;
mod tensor;
