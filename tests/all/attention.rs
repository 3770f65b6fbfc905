//! Fused scaled dot-product attention (the GPU's kernels; the CPU runs matmul and softmax, and
//! its reference op is checked in the library's unit tests) against the same attention written
//! with matmul and softmax: outputs and gradients, masks, causal, cross-attention lengths over
//! several key tiles, head dims that are not multiples of 32; eager, compiled, and inside
//! MultiheadAttention; in F16 and BF16 the tensor-core kernels and cuDNN's. On the GPU the
//! reference computes in F32 from the same rounded inputs. Tolerances: F32 1e-5 relative +
//! 1e-5 absolute (different summation order), BF16 2e-2 + 2e-2 (probabilities and outputs
//! rounded to 8 bits), F16 5e-3 + 5e-3 (11 bits), F64 1e-12.

use crate::common::*;
use kiln::compile::compile;
use kiln::nn::{self, functional as F, AttnArgs, Module};
use kiln::prelude::*;
use kiln::BackwardOptions;
use kiln::{gradcheck, GradcheckOptions};

fn rand_t(shape: &[usize], seed: u64, dt: DType) -> Tensor {
    t(&host_rand(shape.iter().product(), seed), shape, dt)
}

/// softmax(q k^T scale + mask) v with plain ops, over [N, H, L, D].
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, causal: bool, scale: f64) -> Tensor {
    let mut s = q.mul_scalar(scale).unwrap().matmul(&k.transpose(2, 3).unwrap()).unwrap();
    if let Some(m) = mask {
        s = s.add(m).unwrap();
    }
    if causal {
        let (l, n) = (q.shape()[2], k.shape()[2]);
        let above = Tensor::full(&[l, n], f64::NEG_INFINITY, s.dtype(), &s.device()).unwrap().triu(1).unwrap();
        s = s.add(&above).unwrap();
    }
    F::softmax(&s, -1).unwrap().to_dtype(q.dtype()).unwrap().matmul(v).unwrap()
}

struct Case {
    shape_q: [usize; 4],
    s: usize,
    causal: bool,
    masked: bool,
}

/// Output and d(q, k, v) of the fused op and the reference, compared.
fn check(c: &Case, dt: DType, rtol: f64, atol: f64) {
    check_padded(c, dt, rtol, atol, 0);
}

/// `check` in BF16 (rtol = atol = 2e-2) and F16 (5e-3).
fn check_half_precision(c: &Case) {
    check(c, DType::BF16, 2e-2, 2e-2);
    check(c, DType::F16, 5e-3, 5e-3);
}

/// `check` with q, k and v narrowed from rows `pad` elements longer than the head dim (their
/// rows then start wherever that stride puts them).
fn check_padded(c: &Case, dt: DType, rtol: f64, atol: f64, pad: usize) {
    let [n, h, l, d] = c.shape_q;
    let mk = |shape: &[usize], seed| {
        let wide = [shape[0], shape[1], shape[2], shape[3] + pad];
        rand_t(&wide, seed, dt).narrow(3, 0, shape[3]).unwrap().requires_grad()
    };
    let (q, k, v) = (mk(&[n, h, l, d], 1), mk(&[n, h, c.s, d], 2), mk(&[n, h, c.s, d], 3));
    let mask = c.masked.then(|| rand_t(&[1, h, l, c.s], 4, dt));
    let go = rand_t(&[n, h, l, d], 5, dt);
    let opts = F::SdpaOptions { attn_mask: mask.as_ref(), is_causal: c.causal, ..Default::default() };
    // On the GPU the reference computes in F32 from the same (rounded) inputs: what it leaves
    // is the fused kernels' own rounding, not the reference's (a BF16 reference rounds its
    // scores too, and with a mask and long rows that alone came to 0.03). The CPU runs this
    // same composite for attention, so there it is its own reference, in its own dtype.
    let wide = |t: &Tensor| if dt == DType::F64 || !dev().is_cuda() { t.detach() } else { t.detach().to_dtype(DType::F32).unwrap() };
    let run = |fused: bool| {
        let leaf = |t: &Tensor| if fused { t.detach().requires_grad() } else { wide(t).requires_grad() };
        let (q, k, v) = (leaf(&q), leaf(&k), leaf(&v));
        let (y, go) = if fused {
            (F::scaled_dot_product_attention(&q, &k, &v, &opts).unwrap(), go.clone())
        } else {
            (reference(&q, &k, &v, mask.as_ref().map(wide).as_ref(), c.causal, 1.0 / (d as f64).sqrt()), wide(&go))
        };
        y.backward_with(BackwardOptions { gradient: Some(go), retain_graph: false }).unwrap();
        [y, q.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap()]
    };
    let (got, want) = (run(true), run(false));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.shape(), w.shape(), "shape of result {i}");
        assert_eq!(g.dtype(), dt, "dtype of result {i}");
        assert_close(&vals(g), &vals(w), rtol, atol);
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case { shape_q: [2, 3, 37, 40], s: 45, causal: false, masked: false },
        Case { shape_q: [2, 3, 37, 40], s: 45, causal: false, masked: true },
        Case { shape_q: [1, 2, 70, 64], s: 70, causal: true, masked: false },
        Case { shape_q: [3, 2, 5, 8], s: 9, causal: true, masked: true },
        Case { shape_q: [1, 1, 1, 128], s: 1, causal: false, masked: false },
        // A head dim of 36: four F32 values per key load, but single BF16 loads (not 8 | 36).
        Case { shape_q: [2, 2, 9, 36], s: 11, causal: true, masked: false },
        // A head dim over 64 on the warp kernels (13 keys: BF16 too): the backward's blocks of
        // 8 rows, several per head.
        Case { shape_q: [1, 2, 20, 96], s: 13, causal: true, masked: true },
    ]
}

/// Shapes the GPU's tensor-core forward takes in F16 and BF16 (head dims a multiple of 16):
/// several query blocks of 64 rows and key tiles of 64, partial last tiles, masks, causal.
fn tensor_core_cases() -> Vec<Case> {
    vec![
        Case { shape_q: [2, 3, 37, 64], s: 45, causal: false, masked: true },
        Case { shape_q: [1, 2, 150, 64], s: 150, causal: true, masked: false },
        Case { shape_q: [2, 2, 130, 32], s: 200, causal: true, masked: true },
        Case { shape_q: [1, 2, 70, 16], s: 300, causal: false, masked: true },
        Case { shape_q: [1, 1, 65, 128], s: 129, causal: false, masked: false },
        // Head dims that are not powers of two; more queries than keys, causal.
        Case { shape_q: [1, 2, 100, 48], s: 70, causal: true, masked: true },
        Case { shape_q: [2, 1, 33, 96], s: 257, causal: false, masked: true },
    ]
}

#[test]
fn fused_attention_matches_matmul_softmax_in_f32() {
    for c in cases() {
        check(&c, DType::F32, 1e-5, 1e-5);
    }
}

#[test]
fn fused_attention_matches_matmul_softmax_in_bf16() {
    for c in cases() {
        check(&c, DType::BF16, 2e-2, 2e-2);
    }
}

#[test]
fn fused_attention_reads_rows_that_do_not_start_on_16_bytes() {
    // Rows of D + 1 elements narrowed to D: 16-byte loads would be misaligned, so the warp
    // kernels load one element at a time (and the tensor-core ones take no such rows).
    for c in [Case { shape_q: [2, 2, 9, 36], s: 11, causal: true, masked: false }, Case { shape_q: [1, 2, 20, 64], s: 13, causal: false, masked: true }] {
        check_padded(&c, DType::F32, 1e-5, 1e-5, 1);
        check_padded(&c, DType::BF16, 2e-2, 2e-2, 1);
    }
}

#[test]
fn tensor_core_attention_matches_matmul_softmax_in_bf16_and_f16() {
    for c in tensor_core_cases() {
        check_half_precision(&c);
    }
}

/// One query row per head over many keys under a mask, as in decoding (cuDNN's kernels on the
/// GPU); head dims 64, 80 and 128, with and without a mask.
#[test]
fn one_query_row_over_many_keys_matches_matmul_softmax() {
    let cases = [
        Case { shape_q: [2, 3, 1, 64], s: 1000, causal: false, masked: true },
        Case { shape_q: [1, 2, 1, 128], s: 300, causal: false, masked: false },
        Case { shape_q: [1, 2, 1, 80], s: 200, causal: false, masked: true },
    ];
    for c in cases {
        check_half_precision(&c);
    }
}

/// The mask `keys <= last[n]` of `attention_up_to`, additive, `[N, 1, 1, S]`.
fn up_to_mask(last: &[i64], s: usize, dt: DType) -> Tensor {
    let m: Vec<f64> = last.iter().flat_map(|&p| (0..s as i64).map(move |j| if j <= p { 0.0 } else { f64::NEG_INFINITY })).collect();
    t(&m, &[last.len(), 1, 1, s], dt)
}

/// `[N, H_kv, S, D]` with each head repeated for the `groups` query heads that share it.
fn repeat_heads(x: &Tensor, groups: usize) -> Tensor {
    let s = x.shape().to_vec();
    x.unsqueeze(2).unwrap().broadcast_to(&[s[0], s[1], groups, s[2], s[3]]).unwrap().reshape(&[s[0] as i64, (s[1] * groups) as i64, s[2] as i64, s[3] as i64]).unwrap()
}

/// A decode step against a static cache: one query row per head over the keys up to its
/// sequence's position (on the GPU one kernel that reads only those keys, a block per chunk of
/// 256): at the first position, inside the first chunk, at its end and past it, far in, at the
/// last, and past the last (all keys); two sequences at different positions; grouped-query
/// heads (12 query heads over 4 and over 1 key/value heads); head dims 64, 80 and 128; keys
/// and values read through the cache's strides; compiled as a decode step, the same values as
/// eager.
#[test]
fn one_query_row_over_a_partly_written_cache_matches_the_masked_attention() {
    let s = 1024;
    for (dt, tol) in [(DType::BF16, 2e-2), (DType::F16, 5e-3), (DType::F32, 1e-5)] {
        for (n, h, hkv, d) in [(1, 12, 12, 64), (2, 12, 4, 64), (1, 12, 1, 128), (2, 3, 3, 80)] {
            // The cache as the models keep it: keys and values in one [2, N, H_kv, S, D] buffer.
            let kv = rand_t(&[2, n, hkv, s, d], 2, dt);
            let (k, v) = (kv.narrow(0, 0, 1).unwrap().squeeze(0).unwrap(), kv.narrow(0, 1, 1).unwrap().squeeze(0).unwrap());
            let q = rand_t(&[n, h, 1, d], 1, dt);
            // Compiled as a decode step: the cache captured, a kernel before the attention (on
            // the GPU the attention then loads the cache before that kernel ends).
            let (kc, vc) = (k.clone(), v.clone());
            let step = compile(move |xs: &[Tensor]| Ok(vec![F::attention_up_to(&xs[0].mul_scalar(2.0)?, &kc, &vc, &xs[1], Some((&xs[2], &xs[3])), None)?]));
            for pos in [0, 5, 128, 255, 256, 700, s as i64 - 1, s as i64 + 7] {
                let last: Vec<i64> = (0..n as i64).map(|i| (pos - 3 * i).max(0)).collect();
                let lt = Tensor::from_vec(last.clone(), &[n], &dev()).unwrap();
                let got = F::attention_up_to(&q, &k, &v, &lt, None, None).unwrap();
                let wide = |t: &Tensor| if dev().is_cuda() { t.to_dtype(DType::F32).unwrap() } else { t.clone() };
                let mask = up_to_mask(&last, s, wide(&q).dtype());
                let want = reference(&wide(&q), &repeat_heads(&wide(&k), h / hkv), &repeat_heads(&wide(&v), h / hkv), Some(&mask), false, 1.0 / (d as f64).sqrt());
                assert_eq!(got.shape(), [n, h, 1, d]);
                assert_close_named(&format!("{dt:?} n {n} h {h}/{hkv} d {d} at {pos}"), &vals(&got), &vals(&want), tol, tol);
                // New keys and values at each position, standing in for the cache's rows there:
                // as if written into the cache first.
                let (kn, vn) = (rand_t(&[n, hkv, 1, d], 5, dt), rand_t(&[n, hkv, 1, d], 6, dt));
                let got = F::attention_up_to(&q, &k, &v, &lt, Some((&kn, &vn)), None).unwrap();
                let written = |c: &Tensor, row: &Tensor| {
                    let at = Tensor::from_vec(last.iter().map(|&p| p.min(s as i64 - 1)).collect::<Vec<i64>>(), &[n, 1, 1, 1], &dev()).unwrap().broadcast_to(&[n, hkv, 1, d]).unwrap();
                    let rows_in_range = last.iter().all(|&p| p < s as i64);
                    if rows_in_range { c.scatter(2, &at, row).unwrap() } else { c.clone() }
                };
                let want = reference(&wide(&q), &repeat_heads(&wide(&written(&k, &kn)), h / hkv), &repeat_heads(&wide(&written(&v, &vn)), h / hkv), Some(&mask), false, 1.0 / (d as f64).sqrt());
                assert_close_named(&format!("{dt:?} n {n} h {h}/{hkv} d {d} at {pos}, new rows"), &vals(&got), &vals(&want), tol, tol);
                let eager = F::attention_up_to(&q.mul_scalar(2.0).unwrap(), &k, &v, &lt, Some((&kn, &vn)), None).unwrap();
                let compiled = step.call(&[q.clone(), lt.clone(), kn.clone(), vn.clone()]).unwrap().remove(0);
                assert_close_named(&format!("{dt:?} n {n} h {h}/{hkv} d {d} at {pos}, compiled"), &vals(&compiled), &vals(&eager), 0.0, 0.0);
            }
        }
    }
}

/// More than one query row per sequence (the masked attention underneath), gradients by finite
/// differences (the masked attention's, summed over each key/value head's query heads), a
/// position below 0 (no key: NaN, as a fully masked row), and the errors for bad arguments.
#[test]
fn attention_up_to_rows_gradients_and_bad_arguments() {
    let (q, k, v) = (rand_t(&[2, 4, 3, 8], 1, DType::F32), rand_t(&[2, 2, 6, 8], 2, DType::F32), rand_t(&[2, 2, 6, 8], 3, DType::F32));
    let lt = Tensor::from_vec(vec![2i64, 5], &[2], &dev()).unwrap();
    let got = F::attention_up_to(&q, &k, &v, &lt, None, Some(0.3)).unwrap();
    let want = reference(&q, &repeat_heads(&k, 2), &repeat_heads(&v, 2), Some(&up_to_mask(&[2, 5], 6, DType::F32)), false, 0.3);
    assert_close(&vals(&got), &vals(&want), 1e-5, 1e-5);

    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    gradcheck(|xs| F::attention_up_to(&xs[0], &xs[1], &xs[2], &lt, None, Some(0.7)), &[f64s(&q), f64s(&k), f64s(&v)], GradcheckOptions::default()).unwrap();
    let one_row = f64s(&q.narrow(2, 0, 1).unwrap());
    gradcheck(|xs| F::attention_up_to(&xs[0], &xs[1], &xs[2], &lt, None, None), &[one_row.clone(), f64s(&k), f64s(&v)], GradcheckOptions::default()).unwrap();
    // With the new rows standing in for the cache's at each position: their gradients too.
    let (kn, vn) = (rand_t(&[2, 2, 1, 8], 6, DType::F64), rand_t(&[2, 2, 1, 8], 7, DType::F64));
    gradcheck(|xs| F::attention_up_to(&xs[0], &xs[1], &xs[2], &lt, Some((&xs[3], &xs[4])), None), &[one_row, f64s(&k), f64s(&v), kn, vn], GradcheckOptions::default()).unwrap();

    for dt in [DType::BF16, DType::F32] {
        let before = Tensor::from_vec(vec![-1i64, 0], &[2], &dev()).unwrap();
        let y = vals(&F::attention_up_to(&q.narrow(2, 0, 1).unwrap().to_dtype(dt).unwrap(), &k.to_dtype(dt).unwrap(), &v.to_dtype(dt).unwrap(), &before, None, None).unwrap());
        assert!(y[..32].iter().all(|x| x.is_nan()) && y[32..].iter().all(|x| x.is_finite()), "{dt:?}: {y:?}");
    }

    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert!(err(F::attention_up_to(&q, &k.narrow(1, 0, 1).unwrap().broadcast_to(&[2, 3, 6, 8]).unwrap(), &v, &lt, None, None)).contains("H_kv"));
    assert!(err(F::attention_up_to(&q, &k, &v, &lt.to_dtype(DType::I32).unwrap(), None, None)).contains("I64"));
    assert!(err(F::attention_up_to(&q, &k, &v, &lt.narrow(0, 0, 1).unwrap(), None, None)).contains("[2]"));
    assert!(err(F::attention_up_to(&q, &k, &v.narrow(2, 0, 5).unwrap(), &lt, None, None)).contains("[N, H_kv, S, D]"));
    let row = k.narrow(2, 0, 1).unwrap();
    assert!(err(F::attention_up_to(&q, &k, &v, &lt, Some((&row, &row.narrow(3, 0, 4).unwrap())), None)).contains("new key and value"));
}

#[test]
fn cudnn_attention_takes_long_unmasked_sequences_forward_and_backward() {
    let cases = [
        Case { shape_q: [2, 4, 200, 64], s: 256, causal: false, masked: false },
        Case { shape_q: [1, 2, 130, 128], s: 300, causal: false, masked: false },
        Case { shape_q: [2, 2, 64, 40], s: 260, causal: false, masked: false },
        Case { shape_q: [1, 3, 300, 128], s: 384, causal: false, masked: false },
        // Causal, fewer queries than keys and more; an additive mask broadcast over the batch.
        Case { shape_q: [2, 4, 200, 64], s: 256, causal: true, masked: false },
        Case { shape_q: [1, 2, 300, 128], s: 256, causal: true, masked: false },
        Case { shape_q: [2, 4, 200, 64], s: 256, causal: false, masked: true },
        // Both: kiln's kernels (cuDNN's plan for both is not taken: see `sdpa::takes`).
        Case { shape_q: [2, 2, 300, 64], s: 256, causal: true, masked: true },
    ];
    for c in &cases {
        check_half_precision(c);
    }
    let version = kiln::cuda::cudnn_version();
    if !dev().is_cuda() || !version.as_ref().is_ok_and(|v| *v >= 91300) {
        eprintln!("cuDNN's fused attention not checked: {version:?} (its forward operation needs 9.13)");
        return;
    }
    // Which kernels ran: cuDNN's forward and backward, causal, masked or neither; short
    // attention on kiln's kernels.
    let leaf = |shape: &[usize], seed| rand_t(shape, seed, DType::BF16).requires_grad();
    let (q, k, v) = (leaf(&[2, 4, 200, 64], 1), leaf(&[2, 4, 256, 64], 2), leaf(&[2, 4, 256, 64], 3));
    let names = |p: &profiler::Profile| p.key_averages().rows().iter().map(|r| r.name.clone()).collect::<Vec<_>>();
    let causal = F::SdpaOptions { is_causal: true, ..Default::default() };
    for opts in [&Default::default(), &causal] {
        let p = profiler::profile(|| F::scaled_dot_product_attention(&q, &k, &v, opts)).unwrap();
        assert_eq!(names(&p), ["cudnn_sdpa_fwd_bfloat16"], "{}", p.key_averages().table(SortBy::DeviceTimeTotal, 10));
    }
    let g = rand_t(&[2, 4, 200, 64], 4, DType::BF16);
    let backward_kernels = |y: &Tensor| names(&profiler::profile(|| y.backward_with(BackwardOptions { gradient: Some(g.clone()), retain_graph: false })).unwrap());
    let y = F::scaled_dot_product_attention(&q, &k, &v, &Default::default()).unwrap();
    let bwd = backward_kernels(&y);
    assert!(bwd.iter().any(|n| n == "cudnn_sdpa_bwd_bfloat16") && bwd.iter().all(|n| !n.starts_with("attention")), "{bwd:?}");
    // cuDNN's backward after kiln's tensor-core forward, which keeps the log-sum-exps it needs:
    // the gradients of a cuDNN forward and backward, to BF16's precision.
    let want: Vec<Vec<f64>> = [&q, &k, &v].iter().map(|t| vals(&t.grad().unwrap())).collect();
    let fresh = || (q.detach().requires_grad(), k.detach().requires_grad(), v.detach().requires_grad());
    let (q2, k2, v2) = fresh();
    let y = kiln::cuda::with_cudnn_attention(false, || F::scaled_dot_product_attention(&q2, &k2, &v2, &Default::default())).unwrap();
    let bwd = backward_kernels(&y);
    assert!(bwd.iter().any(|n| n == "cudnn_sdpa_bwd_bfloat16"), "{bwd:?}");
    for (t, w) in [&q2, &k2, &v2].iter().zip(&want) {
        assert_close(&vals(&t.grad().unwrap()), w, 2e-2, 2e-2);
    }
    // Turned off for the backward too: kiln's kernels.
    let (q3, k3, v3) = fresh();
    let y = F::scaled_dot_product_attention(&q3, &k3, &v3, &Default::default()).unwrap();
    let bwd = kiln::cuda::with_cudnn_attention(false, || backward_kernels(&y));
    assert!(bwd.iter().any(|n| n.starts_with("attention_bwd_q_tc")) && bwd.iter().all(|n| !n.starts_with("cudnn")), "{bwd:?}");
    let bwd = backward_kernels(&F::scaled_dot_product_attention(&q, &k, &v, &causal).unwrap());
    assert!(bwd.iter().any(|n| n == "cudnn_sdpa_bwd_bfloat16") && bwd.iter().all(|n| !n.starts_with("attention")), "causal: {bwd:?}");
    // A padding mask (bool, per batch and key, broadcast over heads and queries): cuDNN takes
    // it as a bias of dims [N, 1, 1, S].
    let keep: Vec<f64> = (0..2 * 256).map(|i| if i % 256 < 200 + 40 * (i / 256) { 1.0 } else { 0.0 }).collect();
    let keep = t(&keep, &[2, 1, 1, 256], DType::F32).to_dtype(DType::Bool).unwrap();
    let padded = F::SdpaOptions { attn_mask: Some(&keep), ..Default::default() };
    let additive = Tensor::zeros(&[2, 1, 1, 256], DType::BF16, &dev()).unwrap().masked_fill(&keep.logical_not().unwrap(), f64::NEG_INFINITY).unwrap();
    let fused = |q: &Tensor| F::scaled_dot_product_attention(q, &k, &v, &padded);
    let (got, want) = (fused(&q).unwrap(), reference(&q, &k, &v, Some(&additive), false, 0.125));
    assert_close(&vals(&got), &vals(&want), 2e-2, 2e-2);
    let p = profiler::profile(|| fused(&q)).unwrap();
    assert!(names(&p).iter().any(|n| n == "cudnn_sdpa_fwd_bfloat16"), "{:?}", names(&p));
    let short = rand_t(&[2, 4, 128, 64], 5, DType::BF16);
    let p = profiler::profile(|| F::scaled_dot_product_attention(&q, &short, &short, &Default::default())).unwrap();
    assert!(names(&p).iter().all(|n| n.starts_with("attention_fwd_tc")), "128 keys: {:?}", names(&p));
    // Its backward is cuDNN's from 128 keys (after kiln's forward, which keeps the log-sum-exps
    // cuDNN needs): the gradients of kiln's own backward kernels, to BF16's precision.
    let short_grads = |cudnn: bool| {
        let (q, ks, vs) = (q.detach().requires_grad(), short.detach().requires_grad(), short.detach().requires_grad());
        let y = F::scaled_dot_product_attention(&q, &ks, &vs, &Default::default()).unwrap();
        let bwd = kiln::cuda::with_cudnn_attention(cudnn, || backward_kernels(&y));
        assert_eq!(bwd.iter().any(|n| n == "cudnn_sdpa_bwd_bfloat16"), cudnn, "128 keys, cuDNN allowed: {cudnn}: {bwd:?}");
        [q, ks, vs].iter().map(|t| vals(&t.grad().unwrap())).collect::<Vec<_>>()
    };
    for (got, want) in short_grads(true).iter().zip(&short_grads(false)) {
        assert_close(got, want, 2e-2, 2e-2);
    }
    let p = kiln::cuda::with_cudnn_attention(false, || profiler::profile(|| F::scaled_dot_product_attention(&q, &k, &v, &causal))).unwrap();
    assert!(names(&p).iter().all(|n| n.starts_with("attention_fwd_tc")), "{:?}", names(&p));
    // Captured in a CUDA graph and replayed (reduce-overhead): the same values as eager.
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let eager = vals(&F::scaled_dot_product_attention(&q, &k, &v, &Default::default()).unwrap());
    let (kc, vc) = (k.clone(), v.clone());
    let f = kiln::compile::compile_with(kiln::compile::CompileOptions::new().mode(kiln::compile::Mode::ReduceOverhead), move |q: &Tensor| F::scaled_dot_product_attention(q, &kc, &vc, &Default::default()));
    for _ in 0..3 {
        assert_close(&vals(&f.call(&q).unwrap()), &eager, 0.0, 0.0);
    }
    // A compiled function's gradient: its backward program runs cuDNN's backward too (cuDNN
    // adds dq's parts in any order: BF16's tolerance).
    let loss = move |xs: &[Tensor], g: &Tensor| F::scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], &Default::default())?.mul(g)?.to_dtype(DType::F32)?.sum_all();
    let gc = g.clone();
    let f = compile(move |xs: &[Tensor]| Ok(vec![loss(xs, &gc)?]));
    let leaves = || [q.detach().requires_grad(), k.detach().requires_grad(), v.detach().requires_grad()];
    let (a, b) = (leaves(), leaves());
    let y = f.call(&a).unwrap().remove(0);
    let bwd = names(&profiler::profile(|| y.backward()).unwrap());
    assert!(bwd.iter().any(|n| n == "cudnn_sdpa_bwd_bfloat16"), "{bwd:?}");
    loss(&b, &g).unwrap().backward().unwrap();
    for (x, e) in a.iter().zip(&b) {
        assert_close(&vals(&x.grad().unwrap()), &vals(&e.grad().unwrap()), 2e-2, 2e-2);
    }
}

#[test]
fn attention_picks_its_kernels_by_dtype_head_dim_and_length() {
    if !dev().is_cuda() {
        return;
    }
    for (dt, head_dim, kernel) in [(DType::BF16, 64, "attention_fwd_tc_bfloat16_d64"), (DType::F16, 32, "attention_fwd_tc_float16_d32"), (DType::BF16, 40, "attention_fwd_bfloat16_d40"), (DType::F32, 64, "attention_fwd_float32_d64")] {
        let (q, k, v) = (rand_t(&[2, 4, 100, head_dim], 1, dt), rand_t(&[2, 4, 90, head_dim], 2, dt), rand_t(&[2, 4, 90, head_dim], 3, dt));
        let p = profiler::profile(|| F::scaled_dot_product_attention(&q, &k, &v, &Default::default())).unwrap();
        // (The warp kernels' names end in their launch shape: `_r<rows>_v<vector width>`.)
        let names: Vec<String> = p.key_averages().rows().iter().map(|r| r.name.clone()).filter(|n| n.starts_with("attention")).collect();
        let kinds: Vec<&str> = names.iter().map(|n| n.split("_r").next().unwrap_or(n)).collect();
        assert_eq!(kinds, [kernel], "{dt:?} with a head dim of {head_dim}: {names:?}");
    }
    // F32 from 128 keys and 64 queries on: matmul and softmax, faster than the warp kernel.
    let (q, k, v) = (rand_t(&[1, 2, 64, 64], 1, DType::F32), rand_t(&[1, 2, 128, 64], 2, DType::F32), rand_t(&[1, 2, 128, 64], 3, DType::F32));
    let p = profiler::profile(|| F::scaled_dot_product_attention(&q, &k, &v, &Default::default())).unwrap();
    assert!(p.key_averages().rows().iter().all(|r| !r.name.starts_with("attention")), "{}", p.key_averages().table(SortBy::DeviceTimeTotal, 10));
    // The backward on the tensor cores too.
    let leaf = |shape: &[usize], seed| rand_t(shape, seed, DType::BF16).requires_grad();
    let (q, k, v) = (leaf(&[2, 4, 100, 64], 1), leaf(&[2, 4, 90, 64], 2), leaf(&[2, 4, 90, 64], 3));
    let y = F::scaled_dot_product_attention(&q, &k, &v, &Default::default()).unwrap();
    let g = rand_t(&[2, 4, 100, 64], 4, DType::BF16);
    let p = profiler::profile(|| y.backward_with(BackwardOptions { gradient: Some(g.clone()), retain_graph: false })).unwrap();
    let names: Vec<String> = p.key_averages().rows().iter().map(|r| r.name.clone()).filter(|n| n.starts_with("attention")).collect();
    assert_eq!(names.len(), 2, "{names:?}");
    for want in ["attention_bwd_q_tc_bfloat16_d64", "attention_bwd_kv_tc_bfloat16_d64"] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
}

#[test]
fn fused_attention_gradients_match_finite_differences() {
    // F64 takes the matmul path on every device; this checks the public function's masks,
    // scale and causal handling.
    let (q, k, v) = (rand_t(&[1, 2, 3, 4], 1, DType::F64), rand_t(&[1, 2, 5, 4], 2, DType::F64), rand_t(&[1, 2, 5, 4], 3, DType::F64));
    let mask = rand_t(&[3, 5], 4, DType::F64);
    for causal in [false, true] {
        let opts = F::SdpaOptions { attn_mask: Some(&mask), is_causal: causal, scale: Some(0.7), ..Default::default() };
        gradcheck(|xs| F::scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], &opts), &[q.clone(), k.clone(), v.clone()], GradcheckOptions::default()).unwrap();
    }
}

#[test]
fn bool_masks_follow_pytorch_true_attends() {
    let d = dev();
    let (q, k, v) = (rand_t(&[1, 1, 2, 4], 1, DType::F32), rand_t(&[1, 1, 3, 4], 2, DType::F32), rand_t(&[1, 1, 3, 4], 3, DType::F32));
    let keep = Tensor::from_vec(vec![true, false, true, false, true, true], &[2, 3], &d).unwrap();
    let y = F::scaled_dot_product_attention(&q, &k, &v, &F::SdpaOptions { attn_mask: Some(&keep), ..Default::default() }).unwrap();
    let add = t(&[0.0, f64::NEG_INFINITY, 0.0, f64::NEG_INFINITY, 0.0, 0.0], &[2, 3], DType::F32);
    let want = reference(&q, &k, &v, Some(&add), false, 0.5);
    assert_close(&vals(&y), &vals(&want), 1e-5, 1e-6);
}

#[test]
fn fused_attention_is_one_kernel_and_compiles_with_its_gradient() {
    let d = dev();
    let (q, k, v) = (rand_t(&[2, 4, 10, 64], 1, DType::F32), rand_t(&[2, 4, 12, 64], 2, DType::F32), rand_t(&[2, 4, 12, 64], 3, DType::F32));
    let opts = F::SdpaOptions { is_causal: true, ..Default::default() };
    let eager = F::scaled_dot_product_attention(&q, &k, &v, &opts).unwrap();
    if d.is_cuda() {
        let p = profiler::profile(|| F::scaled_dot_product_attention(&q, &k, &v, &opts)).unwrap();
        assert_eq!(p.kernel_count(), 1, "{}", p.key_averages().table(SortBy::DeviceTimeTotal, 10));
    }
    // Compiled, with gradients through the compiled backward.
    let f = compile(move |xs: &[Tensor]| Ok(vec![(F::scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], &opts)?.mul(&xs[0]))?.sum_all()?]));
    let leaves = || [q.detach().requires_grad(), k.detach().requires_grad(), v.detach().requires_grad()];
    let (a, b) = (leaves(), leaves());
    f.call(&a).unwrap()[0].backward().unwrap();
    let y = eager.detach();
    assert_close(&vals(&F::scaled_dot_product_attention(&b[0], &b[1], &b[2], &opts).unwrap()), &vals(&y), 0.0, 0.0);
    (F::scaled_dot_product_attention(&b[0], &b[1], &b[2], &opts).unwrap().mul(&b[0]).unwrap()).sum_all().unwrap().backward().unwrap();
    for (x, e) in a.iter().zip(&b) {
        assert_close(&vals(&x.grad().unwrap()), &vals(&e.grad().unwrap()), 1e-5, 1e-6);
    }
}

#[test]
fn tensor_core_attention_compiles_with_its_gradient() {
    // On the GPU the compiled forward keeps each row's log-sum-exp for the compiled backward,
    // as eager does; both give the same gradients. Causal and not; 2 x 4 heads, 100 x 90.
    let (q, k, v) = (rand_t(&[2, 4, 100, 64], 1, DType::BF16), rand_t(&[2, 4, 90, 64], 2, DType::BF16), rand_t(&[2, 4, 90, 64], 3, DType::BF16));
    let r = rand_t(&[2, 4, 100, 64], 4, DType::BF16);
    for causal in [false, true] {
        let opts = F::SdpaOptions { is_causal: causal, ..Default::default() };
        let loss = move |xs: &[Tensor], r: &Tensor| F::scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], &opts)?.mul(r)?.to_dtype(DType::F32)?.sum_all();
        let rc = r.clone();
        let f = compile(move |xs: &[Tensor]| Ok(vec![loss(xs, &rc)?]));
        let leaves = || [q.detach().requires_grad(), k.detach().requires_grad(), v.detach().requires_grad()];
        let (a, b) = (leaves(), leaves());
        f.call(&a).unwrap()[0].backward().unwrap();
        loss(&b, &r).unwrap().backward().unwrap();
        for (x, e) in a.iter().zip(&b) {
            assert_close(&vals(&x.grad().unwrap()), &vals(&e.grad().unwrap()), 2e-2, 2e-2);
        }
    }
}

/// `m.attend(x, k, k)` without weights (the fused path) and with them (matmul and softmax),
/// under autocast to `cast` if given: each output and the gradient of its sum with respect to x.
fn fused_and_weights_paths(m: &nn::MultiheadAttention, x: &Tensor, k: &Tensor, kpm: Option<&Tensor>, cast: Option<DType>) -> [(Tensor, Tensor); 2] {
    [false, true].map(|need_weights| {
        let q = x.detach().requires_grad();
        let args = AttnArgs { key_padding_mask: kpm, need_weights, ..Default::default() };
        let y = match cast {
            Some(dt) => amp::autocast(&dev(), dt, || Ok(m.attend(&q, k, k, args)?.0)).unwrap(),
            None => m.attend(&q, k, k, args).unwrap().0,
        };
        y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
        (y, q.grad().unwrap())
    })
}

#[test]
fn multihead_attention_fused_path_matches_the_weights_path() {
    let d = dev();
    manual_seed(3);
    let m = nn::MultiheadAttention::new(64, 4, &d).unwrap();
    m.eval();
    let x = rand_t(&[7, 3, 64], 1, DType::F32);
    let mem = rand_t(&[9, 3, 64], 2, DType::F32);
    let kpm = Tensor::from_vec(vec![false, false, true, false, false, false, false, false, true, false, false, false, false, false, false, false, false, false, false, false, false, false, false, false, false, false, true], &[3, 9], &d).unwrap();
    for (k, kpm) in [(&x, None), (&mem, Some(&kpm))] {
        let [(y1, g1), (y2, g2)] = fused_and_weights_paths(&m, &x, k, kpm, None);
        assert_close(&vals(&y1), &vals(&y2), 1e-5, 1e-5);
        assert_close(&vals(&g1), &vals(&g2), 1e-5, 1e-5);
    }
    // A transformer layer in eval mode takes the fused path end to end.
    let cfg = nn::TransformerConfig { d_model: 64, nhead: 4, dim_feedforward: 128, ..Default::default() };
    let layer = nn::TransformerEncoderLayer::new(&cfg, &d).unwrap();
    layer.eval();
    let y = layer.forward(&x).unwrap();
    assert_eq!(y.shape(), &[7, 3, 64]);
    assert!(vals(&y).iter().all(|v| v.is_finite()));
}

#[test]
fn multihead_attention_under_bf16_autocast_takes_the_tensor_cores_through_its_projections() {
    // Head dim 64 and more than 32 keys: on the GPU the fused path reads q, k and v as strided
    // views of the projections' outputs, on the tensor cores; the weights path is matmul and
    // softmax. BF16 tolerance (2e-2), as for the op itself.
    let d = dev();
    manual_seed(4);
    let m = nn::MultiheadAttention::new(128, 2, &d).unwrap();
    m.eval();
    let x = rand_t(&[40, 3, 128], 1, DType::F32);
    let mem = rand_t(&[50, 3, 128], 2, DType::F32);
    let mut keep = vec![false; 3 * 50];
    keep[7] = true;
    keep[50 + 49] = true;
    let kpm = Tensor::from_vec(keep, &[3, 50], &d).unwrap();
    let [(y1, g1), (y2, g2)] = fused_and_weights_paths(&m, &x, &mem, Some(&kpm), Some(DType::BF16));
    assert_eq!(y1.dtype(), DType::BF16);
    assert_close(&vals(&y1), &vals(&y2), 2e-2, 2e-2);
    assert_close(&vals(&g1), &vals(&g2), 2e-2, 2e-2);
    if d.is_cuda() {
        let fused = AttnArgs { need_weights: false, ..Default::default() };
        let p = profiler::profile(|| amp::autocast(&d, DType::BF16, || Ok(m.attend(&x, &mem, &mem, fused)?.0))).unwrap();
        assert!(p.key_averages().rows().iter().any(|r| r.name == "attention_fwd_tc_bfloat16_d64"), "{}", p.key_averages().table(SortBy::DeviceTimeTotal, 10));
    }
}

#[test]
fn attention_rejects_bad_shapes_and_dtypes() {
    let d = dev();
    let q = Tensor::zeros(&[1, 2, 3, 4], DType::F32, &d).unwrap();
    let k = Tensor::zeros(&[1, 2, 5, 8], DType::F32, &d).unwrap();
    let e = F::scaled_dot_product_attention(&q, &k, &k, &Default::default()).unwrap_err().to_string();
    assert!(e.contains("key and value must be [N, H, S, D]"), "{e}");
    let e = F::scaled_dot_product_attention(&q.reshape(&[2, 3, 4]).unwrap(), &k, &k, &Default::default()).unwrap_err().to_string();
    assert!(e.contains("query must be [N, H, L, D]"), "{e}");
    let k = Tensor::zeros(&[1, 2, 5, 4], DType::F32, &d).unwrap();
    let bad = Tensor::zeros(&[4, 5], DType::F32, &d).unwrap();
    let e = F::scaled_dot_product_attention(&q, &k, &k, &F::SdpaOptions { attn_mask: Some(&bad), ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("does not broadcast"), "{e}");
    let e = F::scaled_dot_product_attention(&q, &k.to_dtype(DType::F64).unwrap(), &k, &Default::default()).unwrap_err().to_string();
    assert!(e.contains("share a dtype"), "{e}");
}

/// A compiled training step around cuDNN's attention (BF16, 256 keys: its forward and
/// backward), replayed as a CUDA graph under reduce-overhead: the same parameters as eager
/// after three SGD steps, to BF16's precision (cuDNN adds dq's parts in any order).
#[test]
fn a_reduce_overhead_step_replays_cudnn_attention_and_its_backward() -> Result<()> {
    let x = rand_t(&[2, 4, 256, 64], 1, DType::BF16);
    let r = rand_t(&[2, 4, 256, 64], 2, DType::BF16);
    let w0 = rand_t(&[64, 64], 3, DType::BF16).mul_scalar(0.1)?;
    let run = |compiled: bool| -> Result<Tensor> {
        let w = w0.detach().copy_contiguous()?.requires_grad();
        let sgd = std::sync::Mutex::new(kiln::optim::Sgd::new(vec![w.clone()], 1e-4));
        let (xc, rc, wc) = (x.clone(), r.clone(), w.clone());
        let step = move |x: &Tensor| -> Result<Tensor> {
            let q = x.matmul(&wc)?;
            let loss = F::scaled_dot_product_attention(&q, x, x, &Default::default())?.mul(&rc)?.to_dtype(DType::F32)?.sum_all()?;
            loss.backward()?;
            let mut o = sgd.lock().unwrap();
            kiln::optim::Optimizer::step(&mut *o)?;
            kiln::optim::Optimizer::zero_grad(&mut *o);
            Ok(loss)
        };
        if compiled {
            let f = kiln::compile::compile_with(kiln::compile::CompileOptions::new().mode(kiln::compile::Mode::ReduceOverhead), step);
            for _ in 0..3 {
                f.call(&xc)?;
            }
        } else {
            for _ in 0..3 {
                step(&xc)?;
            }
        }
        Ok(w.detach())
    };
    let (eager, replayed) = (run(false)?, run(true)?);
    assert_close(&vals(&replayed), &vals(&eager), 2e-2, 2e-2);
    assert!(vals(&eager).iter().zip(vals(&w0)).any(|(a, b)| a != &b), "the steps moved the weights");
    Ok(())
}

/// GPT-2's attention: q, k and v as views of one `[B, L, 3E]` product, heads batch-first, the
/// output read back as `[B, L, E]`. The fused attention stores its output and its gradients
/// batch-first, q's, k's and v's side by side, so on the GPU (cuDNN) a compiled training step
/// copies nothing: no copy kernel forward or backward (the output's view, the output
/// gradient read in place, the product's gradient a view of the packed gradients). Eager and
/// compiled gradients equal matmul and softmax's (BF16's tolerance).
#[test]
fn attention_over_one_qkv_product_copies_nothing_when_compiled() {
    let (b, l, h, d) = (2, 256, 4, 64);
    let e = h * d;
    // Scores of a few units: softmax rounds in BF16 no worse than its inputs.
    let qkv = rand_t(&[b, l, 3 * e], 1, DType::F32).mul_scalar(0.7).unwrap();
    let g = rand_t(&[b, l, e], 2, DType::F32);
    let causal = F::SdpaOptions { is_causal: true, ..Default::default() };
    let attend = move |qkv: &Tensor, g: &Tensor, fused: bool| -> Result<Tensor> {
        let qkv = qkv.to_dtype(DType::BF16)?;
        let heads = |i: usize| qkv.narrow(2, i * e, e)?.reshape(&[b as i64, l as i64, h as i64, d as i64])?.permute(&[0, 2, 1, 3]);
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let y = if fused { F::scaled_dot_product_attention(&q, &k, &v, &causal)? } else { reference(&q.to_dtype(DType::F32)?, &k.to_dtype(DType::F32)?, &v.to_dtype(DType::F32)?, None, true, 0.125) };
        y.permute(&[0, 2, 1, 3])?.reshape(&[b as i64, l as i64, e as i64])?.to_dtype(DType::F32)?.mul(g)?.sum_all()
    };
    let grad = |f: &dyn Fn(&Tensor) -> Result<Tensor>| {
        let x = qkv.detach().requires_grad();
        f(&x).unwrap().backward().unwrap();
        vals(&x.grad().unwrap())
    };
    let want = grad(&|x| attend(x, &g, false));
    assert_close(&grad(&|x| attend(x, &g, true)), &want, 2e-2, 2e-2);
    let gc = g.clone();
    let step = compile(move |x: &Tensor| attend(x, &gc, true));
    let x = qkv.detach().requires_grad();
    step.call(&x).unwrap().backward().unwrap();
    let x = qkv.detach().requires_grad();
    let p = profiler::profile(|| step.call(&x)?.backward()).unwrap();
    assert_close(&vals(&x.grad().unwrap()), &want, 2e-2, 2e-2);
    let version = kiln::cuda::cudnn_version();
    if dev().is_cuda() && version.as_ref().is_ok_and(|v| *v >= 91300) {
        let names: Vec<String> = p.key_averages().rows().iter().map(|r| r.name.clone()).collect();
        assert!(names.iter().any(|n| n == "cudnn_sdpa_bwd_bfloat16") && !names.iter().any(|n| n.starts_with("copy")), "{}", p.key_averages().table(SortBy::DeviceTimeTotal, 20));
    }
}
