//! The "Models, optimisers, mixed precision" example of the API guide, as written there except
//! that the loader yields `Result` batches (`let (x, y) = batch?`), and sized to run in
//! seconds on a CPU (a 2+2-layer Transformer, 50 batches).
//!
//!     cargo run --release --example api_models

use kiln::data::{DataLoader, SyntheticClassification};
use kiln::prelude::*;

fn main() -> Result<()> {
    let dev = Device::cuda_if_available(0);
    let model = nn::Sequential::new()
        .add(nn::Linear::new(784, 256, &dev)?)
        .add(nn::ReLU)
        .add(nn::Linear::new(256, 10, &dev)?);
    let mut opt = optim::Sgd::new(model.parameters(), 0.01); // optim::AdamW::new(params, cfg)
    let tr = nn::Transformer::new(nn::TransformerConfig { d_model: 512, nhead: 8, num_encoder_layers: 2,
                                                          num_decoder_layers: 2, ..Default::default() }, &dev)?;
    let path = std::env::temp_dir().join("mlp.safetensors");
    model.save_safetensors(&path)?;  model.load_safetensors(&path)?;

    let loader = DataLoader::new(SyntheticClassification::mnist_like(32 * 50, 0)?, 32)?.shuffle(0).pin_memory(dev.is_cuda());
    let mut scaler = optim::GradScaler::new();
    for batch in loader.iter() {                                       // data::DataLoader, pinned + prefetched
        let (x, y) = batch?;
        let (x, y) = (x.to_device_async(&dev)?, y.to_device_async(&dev)?);
        let loss = amp::autocast(&dev, DType::F16, || {
            nn::functional::cross_entropy(&model.forward(&x)?, &y)
        })?;
        scaler.scale(&loss)?.backward()?;
        scaler.step(&mut opt)?;
        scaler.update()?;
        opt.zero_grad();
    }
    let src = Tensor::randn(&[10, 4, 512], DType::F32, &dev)?;
    tr.eval();
    let out = no_grad(|| tr.forward_src_tgt(&src, &src, &Default::default()))?;
    println!("transformer output {:?}, loss scale {}", out.shape(), scaler.get_scale());
    Ok(())
}
