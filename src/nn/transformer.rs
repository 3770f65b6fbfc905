//! `nn.Transformer` and its parts with PyTorch's semantics and parameter names: post-norm by
//! default (`norm_first` for pre-norm), ReLU or GELU feed-forward, final norms in the
//! encoder and decoder of the full model, square subsequent masks.

use super::attention::{AttnArgs, MultiheadAttention};
use super::{init, Dropout, LayerNorm, Linear, Module};
use crate::{DType, Device, Error, Result, Tensor};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    #[default]
    Relu,
    Gelu,
}

/// Settings of [`Transformer`] and of its layers, with `nn.Transformer`'s defaults.
#[derive(Clone, Copy, Debug)]
pub struct TransformerConfig {
    pub d_model: usize,
    pub nhead: usize,
    pub num_encoder_layers: usize,
    pub num_decoder_layers: usize,
    pub dim_feedforward: usize,
    pub dropout: f64,
    pub activation: Activation,
    pub layer_norm_eps: f64,
    pub batch_first: bool,
    pub norm_first: bool,
    pub bias: bool,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        TransformerConfig {
            d_model: 512,
            nhead: 8,
            num_encoder_layers: 6,
            num_decoder_layers: 6,
            dim_feedforward: 2048,
            dropout: 0.1,
            activation: Activation::Relu,
            layer_norm_eps: 1e-5,
            batch_first: false,
            norm_first: false,
            bias: true,
        }
    }
}

/// A float mask of shape `[sz, sz]`: `-inf` above the diagonal, 0 elsewhere
/// (`nn.Transformer.generate_square_subsequent_mask`).
pub fn generate_square_subsequent_mask(sz: usize, dev: &Device) -> Result<Tensor> {
    Tensor::zeros(&[sz, sz], DType::F32, dev)?.masked_fill(&Tensor::ones(&[sz, sz], DType::Bool, dev)?.triu(1)?, f64::NEG_INFINITY)
}

/// Linear -> activation -> dropout -> Linear -> dropout, the block both layers share.
struct FeedForward {
    linear1: Linear,
    dropout: Dropout,
    linear2: Linear,
    activation: Activation,
}

impl FeedForward {
    fn forward(&self, x: &Tensor, out_dropout: &Dropout) -> Result<Tensor> {
        let h = self.linear1.forward(x)?;
        let h = match self.activation {
            Activation::Relu => h.relu()?,
            Activation::Gelu => h.gelu()?,
        };
        out_dropout.forward(&self.linear2.forward(&self.dropout.forward(&h)?)?)
    }
}

fn feed_forward(c: &TransformerConfig, dev: &Device) -> Result<FeedForward> {
    Ok(FeedForward {
        linear1: Linear::with_bias(c.d_model, c.dim_feedforward, c.bias, dev)?,
        dropout: Dropout::new(c.dropout)?,
        linear2: Linear::with_bias(c.dim_feedforward, c.d_model, c.bias, dev)?,
        activation: c.activation,
    })
}

fn attention(c: &TransformerConfig, dev: &Device) -> Result<MultiheadAttention> {
    MultiheadAttention::with_options(c.d_model, c.nhead, c.dropout, c.bias, c.batch_first, dev)
}

fn norm(c: &TransformerConfig, dev: &Device) -> Result<LayerNorm> {
    LayerNorm::new(&[c.d_model], c.layer_norm_eps, dev)
}

/// Self-attention output (no weights) followed by `drop`.
fn self_attention(attn: &MultiheadAttention, x: &Tensor, mask: Option<&Tensor>, kpm: Option<&Tensor>, drop: &Dropout) -> Result<Tensor> {
    let args = AttnArgs { attn_mask: mask, key_padding_mask: kpm, need_weights: false, ..Default::default() };
    drop.forward(&attn.attend(x, x, x, args)?.0)
}

/// `nn.TransformerEncoderLayer`: self-attention and feed-forward, each with a residual.
pub struct TransformerEncoderLayer {
    cfg: TransformerConfig,
    pub self_attn: MultiheadAttention,
    ff: FeedForward,
    pub norm1: LayerNorm,
    pub norm2: LayerNorm,
    dropout1: Dropout,
    dropout2: Dropout,
}

impl TransformerEncoderLayer {
    /// Uses `d_model`, `nhead`, `dim_feedforward`, `dropout`, `activation`, `layer_norm_eps`,
    /// `batch_first`, `norm_first` and `bias` of `cfg`.
    pub fn new(cfg: &TransformerConfig, dev: &Device) -> Result<Self> {
        Ok(TransformerEncoderLayer {
            cfg: *cfg,
            self_attn: attention(cfg, dev)?,
            ff: feed_forward(cfg, dev)?,
            norm1: norm(cfg, dev)?,
            norm2: norm(cfg, dev)?,
            dropout1: Dropout::new(cfg.dropout)?,
            dropout2: Dropout::new(cfg.dropout)?,
        })
    }

    /// `src_mask` and `src_key_padding_mask` as in [`AttnArgs`].
    #[track_caller]
    pub fn forward_masked(&self, src: &Tensor, src_mask: Option<&Tensor>, src_key_padding_mask: Option<&Tensor>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let sa = |x: &Tensor| self_attention(&self.self_attn, x, src_mask, src_key_padding_mask, &self.dropout1);
        let ff = |x: &Tensor| self.ff.forward(x, &self.dropout2);
        if self.cfg.norm_first {
            let x = src.add(&sa(&self.norm1.forward(src)?)?)?;
            x.add(&ff(&self.norm2.forward(&x)?)?)
        } else {
            let x = self.norm1.forward(&src.add(&sa(src)?)?)?;
            self.norm2.forward(&x.add(&ff(&x)?)?)
        }
    }
}

/// Masks of a decoder layer, decoder or transformer; all optional, as in [`AttnArgs`].
#[derive(Clone, Copy, Debug, Default)]
pub struct TransformerMasks<'a> {
    pub src_mask: Option<&'a Tensor>,
    pub tgt_mask: Option<&'a Tensor>,
    pub memory_mask: Option<&'a Tensor>,
    pub src_key_padding_mask: Option<&'a Tensor>,
    pub tgt_key_padding_mask: Option<&'a Tensor>,
    pub memory_key_padding_mask: Option<&'a Tensor>,
}

/// `nn.TransformerDecoderLayer`: self-attention, attention over the encoder's memory, and
/// feed-forward, each with a residual.
pub struct TransformerDecoderLayer {
    cfg: TransformerConfig,
    pub self_attn: MultiheadAttention,
    pub multihead_attn: MultiheadAttention,
    ff: FeedForward,
    pub norm1: LayerNorm,
    pub norm2: LayerNorm,
    pub norm3: LayerNorm,
    dropout1: Dropout,
    dropout2: Dropout,
    dropout3: Dropout,
}

impl TransformerDecoderLayer {
    pub fn new(cfg: &TransformerConfig, dev: &Device) -> Result<Self> {
        Ok(TransformerDecoderLayer {
            cfg: *cfg,
            self_attn: attention(cfg, dev)?,
            multihead_attn: attention(cfg, dev)?,
            ff: feed_forward(cfg, dev)?,
            norm1: norm(cfg, dev)?,
            norm2: norm(cfg, dev)?,
            norm3: norm(cfg, dev)?,
            dropout1: Dropout::new(cfg.dropout)?,
            dropout2: Dropout::new(cfg.dropout)?,
            dropout3: Dropout::new(cfg.dropout)?,
        })
    }

    /// Uses the `tgt_*` and `memory_*` masks of `masks`.
    #[track_caller]
    pub fn forward_memory(&self, tgt: &Tensor, memory: &Tensor, masks: &TransformerMasks) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let sa = |x: &Tensor| self_attention(&self.self_attn, x, masks.tgt_mask, masks.tgt_key_padding_mask, &self.dropout1);
        let mha = |x: &Tensor| {
            let args = AttnArgs { attn_mask: masks.memory_mask, key_padding_mask: masks.memory_key_padding_mask, need_weights: false, ..Default::default() };
            self.dropout2.forward(&self.multihead_attn.attend(x, memory, memory, args)?.0)
        };
        let ff = |x: &Tensor| self.ff.forward(x, &self.dropout3);
        if self.cfg.norm_first {
            let x = tgt.add(&sa(&self.norm1.forward(tgt)?)?)?;
            let x = x.add(&mha(&self.norm2.forward(&x)?)?)?;
            x.add(&ff(&self.norm3.forward(&x)?)?)
        } else {
            let x = self.norm1.forward(&tgt.add(&sa(tgt)?)?)?;
            let x = self.norm2.forward(&x.add(&mha(&x)?)?)?;
            self.norm3.forward(&x.add(&ff(&x)?)?)
        }
    }
}

/// A stack of `num_layers` copies of a layer (identical initial values, as PyTorch's deep
/// copies), with an optional final norm.
fn clones<L: Module>(layer: L, num_layers: usize, make: impl Fn() -> Result<L>) -> Result<Vec<L>> {
    let mut layers = Vec::with_capacity(num_layers);
    let sd = layer.state_dict();
    for _ in 1..num_layers {
        let l = make()?;
        l.load_state_dict(&sd)?;
        layers.push(l);
    }
    if num_layers > 0 {
        layers.insert(0, layer);
    }
    Ok(layers)
}

/// `nn.TransformerEncoder`: `layers.0`, `layers.1`, ... then `norm` if given.
pub struct TransformerEncoder {
    pub layers: Vec<TransformerEncoderLayer>,
    pub norm: Option<LayerNorm>,
}

impl TransformerEncoder {
    pub fn new(layer: TransformerEncoderLayer, num_layers: usize, norm: Option<LayerNorm>, dev: &Device) -> Result<Self> {
        let cfg = layer.cfg;
        Ok(TransformerEncoder { layers: clones(layer, num_layers, || TransformerEncoderLayer::new(&cfg, dev))?, norm })
    }
    #[track_caller]
    pub fn forward_masked(&self, src: &Tensor, mask: Option<&Tensor>, src_key_padding_mask: Option<&Tensor>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let mut x = src.clone();
        for l in &self.layers {
            x = l.forward_masked(&x, mask, src_key_padding_mask)?;
        }
        match &self.norm {
            Some(n) => n.forward(&x),
            None => Ok(x),
        }
    }
}

/// `nn.TransformerDecoder`: `layers.0`, `layers.1`, ... then `norm` if given.
pub struct TransformerDecoder {
    pub layers: Vec<TransformerDecoderLayer>,
    pub norm: Option<LayerNorm>,
}

impl TransformerDecoder {
    pub fn new(layer: TransformerDecoderLayer, num_layers: usize, norm: Option<LayerNorm>, dev: &Device) -> Result<Self> {
        let cfg = layer.cfg;
        Ok(TransformerDecoder { layers: clones(layer, num_layers, || TransformerDecoderLayer::new(&cfg, dev))?, norm })
    }
    #[track_caller]
    pub fn forward_memory(&self, tgt: &Tensor, memory: &Tensor, masks: &TransformerMasks) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let mut x = tgt.clone();
        for l in &self.layers {
            x = l.forward_memory(&x, memory, masks)?;
        }
        match &self.norm {
            Some(n) => n.forward(&x),
            None => Ok(x),
        }
    }
}

/// `nn.Transformer`: an encoder and a decoder, each with a final LayerNorm; every parameter
/// with more than one dim re-drawn xavier uniform, as PyTorch's `_reset_parameters`.
pub struct Transformer {
    pub cfg: TransformerConfig,
    pub encoder: TransformerEncoder,
    pub decoder: TransformerDecoder,
}

impl Transformer {
    pub fn new(cfg: TransformerConfig, dev: &Device) -> Result<Self> {
        let encoder = TransformerEncoder::new(TransformerEncoderLayer::new(&cfg, dev)?, cfg.num_encoder_layers, Some(norm(&cfg, dev)?), dev)?;
        let decoder = TransformerDecoder::new(TransformerDecoderLayer::new(&cfg, dev)?, cfg.num_decoder_layers, Some(norm(&cfg, dev)?), dev)?;
        let t = Transformer { cfg, encoder, decoder };
        crate::no_grad(|| {
            for p in t.parameters().iter().filter(|p| p.ndim() > 1) {
                p.copy_(&init::xavier_uniform(p.shape(), dev)?)?;
            }
            Ok::<(), crate::Error>(())
        })?;
        Ok(t)
    }

    /// See [`generate_square_subsequent_mask`] (PyTorch's static method).
    pub fn generate_square_subsequent_mask(sz: usize, dev: &Device) -> Result<Tensor> {
        generate_square_subsequent_mask(sz, dev)
    }

    /// `src` `[S, N, E]` and `tgt` `[T, N, E]` (`[N, S, E]`, `[N, T, E]` with `batch_first`;
    /// or unbatched `[S, E]`, `[T, E]`) to the decoder's output, shaped like `tgt`.
    #[track_caller]
    pub fn forward_src_tgt(&self, src: &Tensor, tgt: &Tensor, masks: &TransformerMasks) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let batch_dim = if self.cfg.batch_first { 0 } else { 1 };
        if src.ndim() != tgt.ndim() || !(2..=3).contains(&src.ndim()) || (src.ndim() == 3 && src.shape()[batch_dim] != tgt.shape()[batch_dim]) {
            return Err(Error::shape("Transformer", format!("src {:?} and tgt {:?} must both be 3-D with the same batch size (or both 2-D)", src.shape(), tgt.shape())));
        }
        if src.shape()[src.ndim() - 1] != self.cfg.d_model || tgt.shape()[tgt.ndim() - 1] != self.cfg.d_model {
            return Err(Error::shape("Transformer", format!("the feature size of src {:?} and tgt {:?} must be d_model {}", src.shape(), tgt.shape(), self.cfg.d_model)));
        }
        let memory = self.encoder.forward_masked(src, masks.src_mask, masks.src_key_padding_mask)?;
        self.decoder.forward_memory(tgt, &memory, masks)
    }
}

fn child<'a>(name: &str, m: &'a dyn Module) -> (String, &'a dyn Module) {
    (name.to_string(), m)
}

/// A stack's children: `layers.0`, ... and `norm`.
fn stack_children<'a, L: Module>(layers: &'a [L], norm: &'a Option<LayerNorm>) -> Vec<(String, &'a dyn Module)> {
    let mut c: Vec<(String, &dyn Module)> = layers.iter().enumerate().map(|(i, l)| (format!("layers.{i}"), l as &dyn Module)).collect();
    if let Some(n) = norm {
        c.push(child("norm", n));
    }
    c
}

fn visit_stack<L: Module>(layers: &mut [L], norm: &mut Option<LayerNorm>, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
    for l in layers {
        l.visit_tensors_mut(f)?;
    }
    match norm {
        Some(n) => n.visit_tensors_mut(f),
        None => Ok(()),
    }
}

impl Module for TransformerEncoderLayer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.forward_masked(x, None, None)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            child("self_attn", &self.self_attn),
            child("linear1", &self.ff.linear1),
            child("dropout", &self.ff.dropout),
            child("linear2", &self.ff.linear2),
            child("norm1", &self.norm1),
            child("norm2", &self.norm2),
            child("dropout1", &self.dropout1),
            child("dropout2", &self.dropout2),
        ]
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.self_attn.visit_tensors_mut(f)?;
        self.ff.linear1.visit_tensors_mut(f)?;
        self.ff.linear2.visit_tensors_mut(f)?;
        self.norm1.visit_tensors_mut(f)?;
        self.norm2.visit_tensors_mut(f)
    }
}

impl Module for TransformerDecoderLayer {
    /// A decoder layer needs the encoder's memory: use `forward_memory`.
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(Error::arg("TransformerDecoderLayer", "needs the encoder's memory: call forward_memory(tgt, memory, masks)"))
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            child("self_attn", &self.self_attn),
            child("multihead_attn", &self.multihead_attn),
            child("linear1", &self.ff.linear1),
            child("dropout", &self.ff.dropout),
            child("linear2", &self.ff.linear2),
            child("norm1", &self.norm1),
            child("norm2", &self.norm2),
            child("norm3", &self.norm3),
            child("dropout1", &self.dropout1),
            child("dropout2", &self.dropout2),
            child("dropout3", &self.dropout3),
        ]
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.self_attn.visit_tensors_mut(f)?;
        self.multihead_attn.visit_tensors_mut(f)?;
        self.ff.linear1.visit_tensors_mut(f)?;
        self.ff.linear2.visit_tensors_mut(f)?;
        self.norm1.visit_tensors_mut(f)?;
        self.norm2.visit_tensors_mut(f)?;
        self.norm3.visit_tensors_mut(f)
    }
}

impl Module for TransformerEncoder {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.forward_masked(x, None, None)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        stack_children(&self.layers, &self.norm)
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        visit_stack(&mut self.layers, &mut self.norm, f)
    }
}

impl Module for TransformerDecoder {
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(Error::arg("TransformerDecoder", "needs the encoder's memory: call forward_memory(tgt, memory, masks)"))
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        stack_children(&self.layers, &self.norm)
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        visit_stack(&mut self.layers, &mut self.norm, f)
    }
}

impl Module for Transformer {
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(Error::arg("Transformer", "takes a source and a target: call forward_src_tgt(src, tgt, masks)"))
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![child("encoder", &self.encoder), child("decoder", &self.decoder)]
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.encoder.visit_tensors_mut(f)?;
        self.decoder.visit_tensors_mut(f)
    }
}
