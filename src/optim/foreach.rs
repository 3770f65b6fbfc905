//! The multi-tensor form of `step()` (PyTorch's `foreach`): in eager code, parameters on a
//! CUDA device are updated by one generated kernel per group of (device, dtype, and for SGD
//! whether the momentum buffer is new, for Adam the step count), or a few when a group is longer
//! than one launch holds (backend/cuda/foreach.rs); on the host, in one pass over each
//! parameter (backend/cpu/foreach.rs). The results are the per-tensor path's, bit for bit. What
//! does not fit runs the per-tensor path afterwards: tensors not dense in the parameter's memory format, a gradient of another dtype or shape, dtypes other than
//! F32/F64/F16/BF16, empty parameters, Adam state with a device step count (made inside a
//! compiled function), and every parameter when tensors written by the update share memory. A
//! function being traced always takes the per-tensor path, which the compiler records.

use super::{AdamCore, AdamState, Sgd};
use crate::backend::{multi_tensor_update as launch, multi_tensor_update_supports, UpdateRule as Rule};
use crate::{DType, Device, Result, Tensor};
use std::collections::HashSet;
use std::sync::Arc;

/// Whether parameter `p` with gradient `g` and its existing `state` can be updated by a kernel:
/// all dense in one memory format (the kernels walk their storage in order).
fn fits(p: &Tensor, g: &Tensor, state: &[&Tensor]) -> bool {
    let Some(format) = p.dense_format() else { return false };
    multi_tensor_update_supports(p.device(), p.dtype())
        && p.numel() > 0
        && std::iter::once(g).chain(state.iter().copied()).all(|t| t.device() == p.device() && t.dtype() == p.dtype() && t.shape() == p.shape() && t.is_contiguous_for(format))
}

/// Whether the tensors an update writes (parameters, state) share no memory with each other or
/// with the gradients it reads: one kernel updates them all at once, not one after another.
fn disjoint<'a>(written: impl IntoIterator<Item = &'a Tensor>, read: impl IntoIterator<Item = &'a Tensor>) -> bool {
    let mut seen = HashSet::new();
    written.into_iter().all(|t| seen.insert(Arc::as_ptr(t.storage()))) && read.into_iter().all(|t| !seen.contains(&Arc::as_ptr(t.storage())))
}

/// Groups item indices by key, in order of first appearance.
fn group<K: PartialEq>(keys: impl IntoIterator<Item = K>) -> Vec<(K, Vec<usize>)> {
    let mut groups: Vec<(K, Vec<usize>)> = vec![];
    for (i, k) in keys.into_iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, v)) => v.push(i),
            None => groups.push((k, vec![i])),
        }
    }
    groups
}

/// Whether `step()` may try the kernels at all.
fn enabled(foreach: bool, params: &[Tensor]) -> bool {
    foreach && !crate::compile::tracing() && !params.is_empty()
}

/// SGD's update of the parameters that fit; returns which parameters it updated.
pub(super) fn sgd(o: &mut Sgd) -> Result<Vec<bool>> {
    let mut done = vec![false; o.params.len()];
    if !enabled(o.foreach, &o.params) {
        return Ok(done);
    }
    let momentum = o.momentum != 0.0;
    // (parameter index, gradient)
    let mut items: Vec<(usize, Tensor)> = vec![];
    for (i, p) in o.params.iter().enumerate() {
        let Some(g) = p.grad() else { continue };
        let state: Vec<&Tensor> = o.momentum_buffers[i].iter().filter(|_| momentum).collect();
        if fits(p, &g, &state) {
            items.push((i, g));
        }
    }
    let written = items.iter().flat_map(|(i, _)| std::iter::once(&o.params[*i]).chain(o.momentum_buffers[*i].iter().filter(|_| momentum)));
    if items.is_empty() || !disjoint(written, items.iter().map(|(_, g)| g)) {
        return Ok(done);
    }
    let rule = Rule::Sgd { weight_decay: o.weight_decay != 0.0, momentum, nesterov: o.nesterov };
    // As the per-tensor path's scalars: lr, weight_decay, momentum, 1 - dampening.
    let scalars = [o.lr, o.weight_decay, o.momentum, 1.0 - o.dampening];
    let keys = items.iter().map(|(i, _)| {
        let p = &o.params[*i];
        (p.device(), p.dtype(), momentum && o.momentum_buffers[*i].is_none())
    });
    for ((_, dtype, first), members) in group(keys) {
        // A first step's buffer is written by the kernel (a copy of the decayed gradient).
        let mut new_bufs = vec![];
        if first {
            for &k in &members {
                let p = &o.params[items[k].0];
                // Written in the parameter's storage order.
                new_bufs.push(p.in_my_format(crate::backend::uninit_like(p, p.shape(), p.dtype())?)?);
            }
        }
        let entries: Vec<Vec<&Tensor>> = members
            .iter()
            .enumerate()
            .map(|(j, &k)| {
                let (i, g) = &items[k];
                let mut slots = vec![&o.params[*i], g];
                if momentum {
                    slots.push(if first { &new_bufs[j] } else { o.momentum_buffers[*i].as_ref().expect("grouped as not first") });
                }
                slots
            })
            .collect();
        launch(rule, dtype, &entries, &scalars, first)?;
        for (j, &k) in members.iter().enumerate() {
            let i = items[k].0;
            o.params[i].storage().bump_version();
            if first {
                o.momentum_buffers[i] = Some(new_bufs[j].clone());
            } else if let Some(b) = o.momentum_buffers[i].as_ref().filter(|_| momentum) {
                b.storage().bump_version();
            }
            done[i] = true;
        }
    }
    Ok(done)
}

/// Adam's and AdamW's update of the parameters that fit; returns which parameters it updated.
pub(super) fn adam(o: &mut AdamCore) -> Result<Vec<bool>> {
    let mut done = vec![false; o.params.len()];
    if !enabled(o.foreach, &o.params) {
        return Ok(done);
    }
    let mut items: Vec<(usize, Tensor)> = vec![];
    for (i, p) in o.params.iter().enumerate() {
        let Some(g) = p.grad() else { continue };
        let state: Vec<&Tensor> = match &o.state[i] {
            Some(s) if s.step_tensor.is_some() => continue,
            Some(s) => vec![&s.exp_avg, &s.exp_avg_sq],
            None => vec![],
        };
        if fits(p, &g, &state) {
            items.push((i, g));
        }
    }
    let written = items.iter().flat_map(|(i, _)| std::iter::once(&o.params[*i]).chain(o.state[*i].iter().flat_map(|s| [&s.exp_avg, &s.exp_avg_sq])));
    if items.is_empty() || !disjoint(written, items.iter().map(|(_, g)| g)) {
        return Ok(done);
    }
    // State is created as the per-tensor path creates it; the step count is taken here.
    for (i, _) in &items {
        let p = &o.params[*i];
        let s = match &mut o.state[*i] {
            Some(s) => s,
            st @ None => st.insert(AdamState { step: 0, exp_avg: p.zeros_like()?, exp_avg_sq: p.zeros_like()?, step_tensor: None }),
        };
        s.step += 1;
    }
    let c = o.cfg;
    let rule = Rule::Adam { weight_decay: c.weight_decay != 0.0, decoupled: o.decoupled };
    let keys = items.iter().map(|(i, _)| {
        let p = &o.params[*i];
        (p.device(), p.dtype(), o.state[*i].as_ref().expect("created above").step)
    });
    for ((_, dtype, step), members) in group::<(Device, DType, u64)>(keys) {
        // As the per-tensor path: bias corrections in f64 from the host count, each scalar then
        // held in the compute dtype.
        let bc1 = 1.0 - c.beta1.powi(step as i32);
        let bc2 = 1.0 - c.beta2.powi(step as i32);
        let scalars = [c.weight_decay, 1.0 - c.lr * c.weight_decay, c.beta1, 1.0 - c.beta1, c.beta2, 1.0 - c.beta2, bc2.sqrt(), c.eps, c.lr / bc1];
        let entries: Vec<Vec<&Tensor>> = members
            .iter()
            .map(|&k| {
                let (i, g) = &items[k];
                let s = o.state[*i].as_ref().expect("created above");
                vec![&o.params[*i], g, &s.exp_avg, &s.exp_avg_sq]
            })
            .collect();
        launch(rule, dtype, &entries, &scalars, false)?;
        for &k in &members {
            let i = items[k].0;
            let s = o.state[i].as_ref().expect("created above");
            for t in [&o.params[i], &s.exp_avg, &s.exp_avg_sq] {
                t.storage().bump_version();
            }
            done[i] = true;
        }
    }
    Ok(done)
}
