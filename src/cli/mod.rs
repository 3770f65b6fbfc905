//! The `kiln` program's subcommands.

pub mod bench;
pub mod profile;
