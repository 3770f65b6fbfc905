//! Neural-network building blocks. `functional` holds the composite ops (softmax, layer norm,
//! losses, ...), written as decompositions into primitives so the compiler sees through them.

pub mod functional;
