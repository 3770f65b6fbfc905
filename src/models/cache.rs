//! The static key/value cache and the causal attention the models share.

use crate::nn::functional::{attention_up_to, scaled_dot_product_attention, SdpaOptions};
use crate::{DType, Device, Error, Result, Tensor};

/// Keys and values of the positions a model has seen, per layer one `[2, B, H_kv, capacity, D]`
/// buffer (keys, then values), allocated once: decoding writes each new position in place, so
/// shapes never change as the cache fills, and a layer's new keys and values go in with one
/// write.
pub struct KvCache {
    kv: Vec<Tensor>,
    len: usize,
}

impl KvCache {
    /// A cache of `layers` layers for `batch` sequences of up to `capacity` positions of
    /// `kv_heads` heads of `head_dim`.
    pub fn new(layers: usize, batch: usize, kv_heads: usize, capacity: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<KvCache> {
        let shape = [2, batch, kv_heads, capacity, head_dim];
        let kv = (0..layers).map(|_| Tensor::zeros(&shape, dtype, device)).collect::<Result<Vec<_>>>()?;
        Ok(KvCache { kv, len: 0 })
    }
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Positions it can hold.
    pub fn capacity(&self) -> usize {
        self.kv.first().map_or(0, |kv| kv.shape()[3])
    }
    pub fn batch(&self) -> usize {
        self.kv.first().map_or(0, |kv| kv.shape()[1])
    }
    /// Forgets every position (the buffers stay).
    pub fn clear(&mut self) {
        self.len = 0;
    }
    /// Holds the first `len` positions from now on, whatever keys and values were written there
    /// (to rewind, or to decode again at a fixed position).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.capacity() {
            return Err(Error::arg("KvCache", format!("{len} positions exceed its capacity of {}", self.capacity())));
        }
        self.len = len;
        Ok(())
    }

    /// Layer `layer`'s buffer.
    fn layer(&self, layer: usize) -> Result<&Tensor> {
        self.kv.get(layer).ok_or_else(|| Error::arg("KvCache", format!("layer {layer} of a cache of {} layers", self.kv.len())))
    }

    /// Writes layer `layer`'s keys and values `[2, B, H_kv, T, D]` of the next T positions;
    /// returns views of all the layer's positions so far, these included.
    fn write(&mut self, layer: usize, kv: &Tensor) -> Result<Tensor> {
        let t = kv.shape()[3];
        let buf = self.layer(layer)?;
        if kv.shape()[..3] != buf.shape()[..3] || kv.shape()[4] != buf.shape()[4] {
            return Err(Error::shape("KvCache", format!("keys and values of shape {:?} do not fit a cache of {:?}", kv.shape(), buf.shape())));
        }
        buf.narrow(3, self.len, t)?.copy_(kv)?;
        buf.narrow(3, 0, self.len + t)
    }

    /// Writes layer `layer`'s keys and values `[2, B, H_kv, 1, D]` of one position per sequence
    /// at `positions` `[B]`; returns the layer's whole buffer. A scatter: compiled, only those
    /// slots are written, and the shapes are the same at every position.
    fn write_at(&self, layer: usize, kv: &Tensor, positions: &Tensor) -> Result<()> {
        let buf = self.layer(layer)?;
        let s = buf.shape();
        let at = positions.reshape(&[1, s[1] as i64, 1, 1, 1])?.broadcast_to(&[2, s[1], s[2], 1, s[4]])?;
        buf.scatter_(3, &at, &kv.to_dtype(buf.dtype())?)?;
        Ok(())
    }

    /// Checks that `t` more positions fit.
    fn room(&self, t: usize, batch: usize) -> Result<()> {
        if batch != self.batch() {
            return Err(Error::shape("KvCache", format!("a batch of {batch} against a cache for {}", self.batch())));
        }
        if self.len + t > self.capacity() {
            return Err(Error::arg("KvCache", format!("{} positions held and {t} more do not fit its capacity of {}", self.len, self.capacity())));
        }
        Ok(())
    }
}

/// One forward's place in the sequence, and what its queries may attend (the same for every
/// layer, so built once).
pub(super) struct Step<'a> {
    place: Place<'a>,
    /// Device positions: each layer's new keys and values, written into the cache by `finish`
    /// (its attention read them directly, so no later work waits for the write).
    pending: Vec<(usize, Tensor)>,
    /// Broadcast to `[B, H, T, keys]`: true where a query sees a key. None: every key, or (from
    /// position 0 without padding) the plain causal pattern (`is_causal`), or (positions on the
    /// device) the keys up to each sequence's position (`attention_up_to`).
    attn_mask: Option<Tensor>,
}

enum Place<'a> {
    /// Positions counted on the host: the T new ones start at `start`, after those in the
    /// cache (if any); `mask` `[B, start + T]` marks real tokens.
    Host { start: usize, cache: Option<&'a mut KvCache>, mask: Option<Tensor> },
    /// One position per sequence given as a device tensor `[B]` (I64): each sequence attends
    /// the cache up to its position, the new keys and values read beside it
    /// (`attention_up_to`), and `finish` writes them there, so the shapes never change from one
    /// position to the next (a compiled decode step replays).
    Device { positions: Tensor, cache: &'a KvCache },
}

impl<'a> Step<'a> {
    /// Checks `ids` `[B, T]` against the cache and the mask.
    pub fn new(ids: &Tensor, cache: Option<&'a mut KvCache>, mask: Option<&Tensor>) -> Result<Step<'a>> {
        let op = "forward_ids";
        let (b, t) = ids_shape(op, ids)?;
        let start = cache.as_ref().map_or(0, |c| c.len());
        if let Some(c) = &cache {
            c.room(t, b)?;
        }
        let mask = match mask {
            None => None,
            Some(m) if m.shape() == [b, start + t] => Some(if m.dtype() == DType::Bool { m.clone() } else { m.ne_scalar(0)? }),
            Some(m) => return Err(Error::shape(op, format!("mask must be [B, cached + new positions] = [{b}, {}], got {:?}", start + t, m.shape()))),
        };
        // Query i (at position start + i) sees keys up to itself; with padding, only real keys,
        // and itself always, so that a padded query's row is never empty (an empty row's NaN
        // would reach every later layer's keys).
        let attn_mask = match (&mask, start, t) {
            (None, 0, _) | (None, _, 1) => None,
            (m, start, _) => {
                let (s, dev) = (start + t, ids.device());
                let keys = Tensor::arange(0.0, s as f64, 1.0, DType::I64, &dev)?.unsqueeze(0)?;
                let queries = Tensor::arange(start as f64, s as f64, 1.0, DType::I64, &dev)?.unsqueeze(1)?;
                let causal = keys.le(&queries)?;
                Some(match m {
                    None => causal,
                    Some(m) => causal.logical_and(&m.reshape(&[b as i64, 1, 1, s as i64])?.logical_or(&keys.eq(&queries)?)?)?,
                })
            }
        };
        Ok(Step { place: Place::Host { start, cache, mask }, pending: vec![], attn_mask })
    }

    /// One token per sequence (`ids` `[B, 1]`) at `positions` `[B]` (I64, on the model's device).
    pub fn at(ids: &Tensor, positions: &Tensor, cache: &'a KvCache) -> Result<Step<'a>> {
        let op = "decode_step";
        let (b, t) = ids_shape(op, ids)?;
        if t != 1 || positions.shape() != [b] || positions.dtype() != DType::I64 {
            return Err(Error::shape(op, format!("one token per sequence ([B, 1]) and one I64 position each ([B]), got ids {:?} and positions {:?} {:?}", ids.shape(), positions.shape(), positions.dtype())));
        }
        if cache.batch() != b {
            return Err(Error::shape(op, format!("a batch of {b} against a cache for {}", cache.batch())));
        }
        // Each sequence sees the positions up to its own (`attend`: no mask).
        Ok(Step { place: Place::Device { positions: positions.clone(), cache }, pending: vec![], attn_mask: None })
    }

    /// The first new position when it is known on the host (the model checks its limit).
    pub fn start(&self) -> Option<usize> {
        match &self.place {
            Place::Host { start, .. } => Some(*start),
            Place::Device { .. } => None,
        }
    }

    /// Position ids `[B, T]` of the new tokens: their index, or with a mask the count of real
    /// tokens before them (`transformers`' `cumsum(mask) - 1`; padding gets 0).
    pub fn positions(&self, b: usize, t: usize, device: &Device) -> Result<Tensor> {
        match &self.place {
            Place::Host { start, mask: None, .. } => Tensor::arange(*start as f64, (start + t) as f64, 1.0, DType::I64, device)?.unsqueeze(0)?.broadcast_to(&[b, t]),
            Place::Host { start, mask: Some(m), .. } => m.to_dtype(DType::I64)?.cumsum(-1)?.sub_scalar(1)?.narrow(1, *start, t)?.clamp(Some(0.0), None),
            Place::Device { positions, .. } => positions.unsqueeze(1),
        }
    }

    /// Causal attention of q `[B, H, T, D]` over this step's keys and values `kv`
    /// `[2, B, H_kv, T, D]` (keys, then values; written into layer `layer` of the cache first,
    /// or with device positions by `finish`) and those cached before them; heads share
    /// key/value heads in groups of H / H_kv.
    /// Returns `[B, H, T, D]`.
    pub fn attend(&mut self, layer: usize, q: &Tensor, kv: &Tensor, scale: f64) -> Result<Tensor> {
        let (h, t) = (q.shape()[1], q.shape()[2]);
        let hkv = kv.shape()[2];
        // Keys, then values.
        let half = |t: &Tensor, i: usize| t.narrow(0, i, 1)?.squeeze(0);
        let kv = match &mut self.place {
            Place::Host { cache: Some(c), .. } => c.write(layer, kv)?,
            Place::Host { cache: None, .. } => kv.clone(),
            Place::Device { positions, cache } => {
                // The cache's positions before this one, each sequence's up to its own, and the
                // new keys and values at it; `finish` writes them into the cache.
                let buf = cache.layer(layer)?;
                let kv_new = kv.to_dtype(buf.dtype())?;
                let out = attention_up_to(q, &half(buf, 0)?, &half(buf, 1)?, positions, Some((&half(&kv_new, 0)?, &half(&kv_new, 1)?)), Some(scale))?;
                self.pending.push((layer, kv_new));
                return Ok(out);
            }
        };
        let (k, v) = (half(&kv, 0)?, half(&kv, 1)?);
        let (k, v) = if hkv == h { (k, v) } else { (repeat_heads(&k, h / hkv)?, repeat_heads(&v, h / hkv)?) };
        let causal = self.attn_mask.is_none() && self.start() == Some(0) && t > 1;
        let opts = SdpaOptions { attn_mask: self.attn_mask.as_ref(), is_causal: causal, scale: Some(scale), dropout_p: 0.0 };
        scaled_dot_product_attention(q, &k, &v, &opts)
    }

    /// After the last layer's attention: a host-counted cache holds the new positions; a
    /// device-positioned step writes each layer's new keys and values into the cache.
    pub fn finish(self, t: usize) -> Result<()> {
        match self.place {
            Place::Host { cache: Some(c), .. } => c.len += t,
            Place::Host { cache: None, .. } => {}
            Place::Device { positions, cache } => {
                for (layer, kv) in &self.pending {
                    cache.write_at(*layer, kv, &positions)?;
                }
            }
        }
        Ok(())
    }
}

/// `[B, T]` of `ids`, checked.
fn ids_shape(op: &'static str, ids: &Tensor) -> Result<(usize, usize)> {
    let &[b, t] = ids.shape() else {
        return Err(Error::shape(op, format!("ids must be [B, T], got {:?}", ids.shape())));
    };
    if ids.dtype() != DType::I64 {
        return Err(Error::dtype(op, ids.dtype(), "token ids must be I64"));
    }
    if t == 0 {
        return Err(Error::shape(op, "no tokens"));
    }
    Ok((b, t))
}

/// `[B, H_kv, S, D]` with each head repeated `n` times in place: `[B, H_kv * n, S, D]`.
fn repeat_heads(x: &Tensor, n: usize) -> Result<Tensor> {
    let s = x.shape();
    let (b, hkv, len, d) = (s[0], s[1], s[2], s[3]);
    x.unsqueeze(2)?.broadcast_to(&[b, hkv, n, len, d])?.reshape(&[b as i64, (hkv * n) as i64, len as i64, d as i64])
}
