//! Neural-network building blocks. `functional` holds the composite ops (softmax, layer norm,
//! losses, ...), written as decompositions into primitives so the compiler sees through them;
//! `Module` and the layers build models from them.

pub mod functional;
mod layers;
mod module;
pub mod safetensors;

pub use layers::{Dropout, Embedding, LayerNorm, Linear, ReLU, Sequential, SiLU, Sigmoid, Tanh, GELUTanh, GELU};
pub use module::Module;
