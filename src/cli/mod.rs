//! The `kiln` program's subcommands.

pub mod bench;
pub mod bench_cpu;
pub mod bench_ddp;
pub mod doctor;
pub mod generate;
pub mod launch;
pub mod profile;
