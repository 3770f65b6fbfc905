//! The `kiln` program's subcommands.

pub mod bench;
pub mod bench_cpu;
pub mod profile;
