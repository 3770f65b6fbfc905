//! API.md "Compiling": a compiled function, its options, and a custom backend that prints the
//! captured graph and writes it as Graphviz.

use kiln::compile::{compile, compile_with, Backend, CompileOptions, Mode};
use kiln::prelude::*;

fn main() -> Result<()> {
    let dev = Device::cuda_if_available(0);
    let x = Tensor::randn(&[4, 8], DType::F32, &dev)?;
    let eager = |x: &Tensor| x.sin()?.exp()? + x.cos()?.abs()?.log()?;

    let f = compile(|x: &Tensor| x.sin()?.exp()? + x.cos()?.abs()?.log()?);
    let y = f.call(&x)?; // first call traces and compiles; later calls replay
    assert!(y.allclose(&eager(&x)?, 1e-5, 1e-6)?);
    println!("compiled: {} kernel(s) per call", f.kernels_per_call().unwrap_or(0));

    let g = |x: &Tensor| nn::functional::softmax(&x.mul_scalar(2.0)?, -1);
    let f = compile_with(CompileOptions::new().mode(Mode::ReduceOverhead).dynamic(true).fullgraph(true), g);
    f.call(&x)?;
    let dot = std::env::temp_dir().join("kiln_graph.dot");
    let d2 = dot.clone();
    let f = compile_with(
        CompileOptions::new().backend(Backend::custom(move |graph, _example_inputs| {
            println!("{graph}"); // the captured graph, as text
            std::fs::write(&d2, graph.to_dot())?; // and as Graphviz
            Ok(graph.eager_runner()) // run it op by op
        })),
        g,
    );
    f.call(&x)?;
    println!("graph written to {}", dot.display());
    Ok(())
}
