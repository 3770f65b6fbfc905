//! Process groups and collectives. The TCP backend's ranks run as threads of this process (each
//! its own group, as separate processes would be); DDP's multi-process runs are in `ddp.rs`.

use crate::common::*;
use kiln::distributed::{Backend, InitOptions, ProcessGroup, ReduceOp};
use kiln::prelude::*;
use std::time::Duration;

/// A port for one test's store, free when chosen. Ports below the kernel's ephemeral range
/// (where outgoing connections take theirs: a port found free by binding port 0 was once
/// taken by another test's connection before the store bound it), spread by process and
/// counted within one, so that tests side by side, in one process or several, ask for
/// different ones.
pub fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    for _ in 0..64 {
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = (20_000 + (std::process::id() % 500) * 24 + k % 24) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn options(backend: Backend, rank: usize, world: usize, port: u16, timeout: Duration) -> InitOptions {
    let mut o = InitOptions::new(backend);
    o.rank = Some(rank);
    o.world_size = Some(world);
    o.master_addr = Some("127.0.0.1".into());
    o.master_port = Some(port);
    o.timeout = timeout;
    o
}

/// Runs `f` on `world` TCP ranks at once and returns their results in rank order.
pub fn on_ranks<T: Send>(world: usize, f: impl Fn(&ProcessGroup) -> kiln::Result<T> + Sync) -> Vec<kiln::Result<T>> {
    // A port free when `free_port` looked can be taken before rank 0's store listens on it
    // (other tests start groups all the time): then the whole group starts again on another.
    for attempt in 0.. {
        let port = free_port();
        let results: Vec<kiln::Result<T>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let f = &f;
                    s.spawn(move || ProcessGroup::new(options(Backend::Tcp, r, world, port, Duration::from_secs(20))).and_then(|g| f(&g)))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
        });
        let taken = results.iter().any(|r| r.as_ref().is_err_and(|e| e.to_string().contains("Address already in use")));
        if !taken || attempt == 4 {
            return results;
        }
    }
    unreachable!("the loop returns")
}

/// Rank r's values: r * 100 + i (distinct across ranks and elements), as f64.
fn rank_values(r: usize, n: usize) -> Vec<f64> {
    (0..n).map(|i| (r * 100 + i) as f64 * if i % 2 == 0 { 1.0 } else { -1.0 }).collect()
}

fn host(values: &[f64], dtype: DType) -> Tensor {
    Tensor::from_vec(values.to_vec(), &[values.len()], &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

#[test]
fn all_reduce_matches_its_definition_for_every_op_size_and_world() {
    for world in [1, 2, 3, 4] {
        // Sizes below, at and off multiples of the world (the ring splits into world chunks).
        for n in [1, 3, 4, 7, 1000] {
            for (op, dtype) in [(ReduceOp::Sum, DType::F32), (ReduceOp::Avg, DType::F64), (ReduceOp::Max, DType::I64), (ReduceOp::Min, DType::F32), (ReduceOp::Sum, DType::I32), (ReduceOp::Sum, DType::BF16)] {
                let got = on_ranks(world, |g| {
                    let t = host(&rank_values(g.rank(), n), dtype);
                    g.all_reduce(&t, op)?.wait()?;
                    Ok(vals(&t))
                });
                // The definition over the values as stored in `dtype`.
                let stored: Vec<Vec<f64>> = (0..world).map(|r| vals(&host(&rank_values(r, n), dtype))).collect();
                let want: Vec<f64> = (0..n)
                    .map(|i| {
                        let xs = (0..world).map(|r| stored[r][i]);
                        match op {
                            ReduceOp::Sum => xs.sum(),
                            ReduceOp::Avg => xs.sum::<f64>() / world as f64,
                            ReduceOp::Max => xs.fold(f64::MIN, f64::max),
                            ReduceOp::Min => xs.fold(f64::MAX, f64::min),
                        }
                    })
                    .collect();
                for (r, g) in got.into_iter().enumerate() {
                    let g = g.unwrap_or_else(|e| panic!("world {world} n {n} {op:?} rank {r}: {e}"));
                    // BF16 sums round at each of the ring's world - 1 additions (unit roundoff 2^-8).
                    let tol = if dtype == DType::BF16 { (world - 1) as f64 * 2f64.powi(-8) } else { 0.0 };
                    assert_close(&g, &want, tol, 0.0);
                }
            }
        }
    }
}

#[test]
fn broadcast_all_gather_reduce_scatter_send_and_recv_match_their_definitions() {
    let world = 3;
    let got = on_ranks(world, |g| {
        let r = g.rank();
        // Broadcast from rank 1.
        let b = host(&rank_values(r, 5), DType::F32);
        g.broadcast(&b, 1)?.wait()?;
        // All-gather of [2, 2] blocks into [6, 2].
        let input = host(&rank_values(r, 4), DType::F32).reshape(&[2, 2])?;
        let out = Tensor::zeros(&[2 * world, 2], DType::F32, &Device::Cpu)?;
        g.all_gather(&out, &input)?.wait()?;
        // Reduce-scatter of 6 values into 2 per rank.
        let rs_in = host(&rank_values(r, 6), DType::F32);
        let rs_out = Tensor::zeros(&[2], DType::F32, &Device::Cpu)?;
        g.reduce_scatter(&rs_out, &rs_in, ReduceOp::Sum)?.wait()?;
        // A ring of sends: each rank sends to the next and receives from the previous.
        let mine = host(&rank_values(r, 3), DType::I64);
        let from_prev = Tensor::zeros(&[3], DType::I64, &Device::Cpu)?;
        if r % 2 == 0 {
            g.send(&mine, (r + 1) % world)?.wait()?;
            g.recv(&from_prev, (r + world - 1) % world)?.wait()?;
        } else {
            g.recv(&from_prev, (r + world - 1) % world)?.wait()?;
            g.send(&mine, (r + 1) % world)?.wait()?;
        }
        g.barrier()?;
        Ok((vals(&b), vals(&out), vals(&rs_out), vals(&from_prev)))
    });
    for (r, res) in got.into_iter().enumerate() {
        let (b, gathered, scattered, received) = res.unwrap();
        assert_eq!(b, rank_values(1, 5), "broadcast on rank {r}");
        let want: Vec<f64> = (0..world).flat_map(|q| rank_values(q, 4)).collect();
        assert_eq!(gathered, want, "all_gather on rank {r}");
        let want: Vec<f64> = (2 * r..2 * r + 2).map(|i| (0..world).map(|q| rank_values(q, 6)[i]).sum()).collect();
        assert_eq!(scattered, want, "reduce_scatter on rank {r}");
        assert_eq!(received, rank_values((r + world - 1) % world, 3), "recv on rank {r}");
    }
}

#[test]
fn a_rank_that_never_arrives_is_named_and_nobody_hangs() {
    let port = free_port();
    let start = std::time::Instant::now();
    // Rank 2 of 3 never starts.
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2).map(|r| s.spawn(move || ProcessGroup::new(options(Backend::Tcp, r, 3, port, Duration::from_secs(2))).err().map(|e| e.to_string()))).collect();
        hs.into_iter().map(|h| h.join().unwrap().expect("an error, not a group")).collect()
    });
    assert!(start.elapsed() < Duration::from_secs(15), "took {:?}", start.elapsed());
    assert!(errs.iter().any(|e| e.contains("rank 2") || e.contains("[2]")), "{errs:?}");
}

#[test]
fn a_rank_that_dies_or_disagrees_makes_the_others_fail_naming_it() {
    // Rank 1 leaves after the rendezvous; rank 0's all-reduce then fails naming rank 1.
    let got = on_ranks(2, |g| {
        if g.rank() == 1 {
            return Ok(String::new());
        }
        std::thread::sleep(Duration::from_millis(200));
        let t = host(&[1.0; 8], DType::F32);
        Ok(g.all_reduce(&t, ReduceOp::Sum)?.wait().err().map(|e| e.to_string()).unwrap_or_default())
    });
    let e = got[0].as_ref().unwrap();
    assert!(e.contains("rank 1"), "{e}");
    // Different sizes on the two ranks: an error that says so, on both.
    let got = on_ranks(2, |g| {
        let t = host(&vec![1.0; 4 + 4 * g.rank()], DType::F32);
        Ok(g.all_reduce(&t, ReduceOp::Sum)?.wait().err().map(|e| e.to_string()).unwrap_or_default())
    });
    assert!(got.iter().any(|e| e.as_ref().unwrap().contains("different sizes")), "{got:?}");
}

#[test]
fn bad_collective_arguments_are_errors_that_name_them() {
    let got = on_ranks(1, |g| {
        let ints = host(&[1.0, 2.0], DType::I64);
        let avg = g.all_reduce(&ints, ReduceOp::Avg).err().map(|e| e.to_string());
        let strided = Tensor::zeros(&[3, 2], DType::F32, &Device::Cpu)?.t()?;
        let nc = g.all_reduce(&strided, ReduceOp::Sum).err().map(|e| e.to_string());
        let small = Tensor::zeros(&[1], DType::F32, &Device::Cpu)?;
        let gather = g.all_gather(&small, &host(&[1.0, 2.0], DType::F32)).err().map(|e| e.to_string());
        let src = g.broadcast(&small, 3).err().map(|e| e.to_string());
        let me = g.send(&small, 0).err().map(|e| e.to_string());
        Ok([avg, nc, gather, src, me])
    });
    let [avg, nc, gather, src, me] = got.into_iter().next().unwrap().unwrap();
    assert!(avg.unwrap().contains("floating-point"));
    assert!(nc.unwrap().contains("contiguous"));
    assert!(gather.unwrap().contains("elements"));
    assert!(src.unwrap().contains("rank 3"));
    assert!(me.unwrap().contains("itself"));
}

/// NCCL with one rank on the test GPU; on the CPU an NCCL group is an error, never a panic.
#[test]
fn nccl_collectives_on_one_gpu_or_a_clear_error_without_one() {
    let d = dev();
    let opts = options(Backend::Nccl, 0, 1, 0, Duration::from_secs(20));
    if !d.is_cuda() {
        let e = ProcessGroup::new(opts).expect_err("no NCCL group without a GPU");
        assert!(e.to_string().contains("NCCL") || e.to_string().contains("cuda") || e.to_string().contains("CUDA"), "{e}");
        return;
    }
    let g = ProcessGroup::new(opts).unwrap();
    let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.5], &[3], &Device::Cpu).unwrap().to_device(&d).unwrap();
    g.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
    g.all_reduce(&x, ReduceOp::Avg).unwrap().wait().unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
    let b = x.to_dtype(DType::BF16).unwrap();
    g.broadcast(&b, 0).unwrap().wait().unwrap();
    let out = Tensor::zeros(&[3], DType::BF16, &d).unwrap();
    g.all_gather(&out, &b).unwrap().wait().unwrap();
    assert_eq!(out.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
    let rs = Tensor::zeros(&[3], DType::F32, &d).unwrap();
    g.reduce_scatter(&rs, &x, ReduceOp::Max).unwrap().wait().unwrap();
    assert_eq!(rs.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.5]);
    g.barrier().unwrap();
    let host_t = Tensor::zeros(&[1], DType::F32, &Device::Cpu).unwrap();
    assert!(g.all_reduce(&host_t, ReduceOp::Sum).err().unwrap().to_string().contains("NCCL"));
}

#[test]
fn a_rank_that_stops_answering_times_out_naming_it() {
    let port = free_port();
    let start = std::time::Instant::now();
    let e = std::thread::scope(|s| {
        let idle = s.spawn(move || {
            let g = ProcessGroup::new(options(Backend::Tcp, 1, 2, port, Duration::from_secs(1))).unwrap();
            // Alive, but never joins the all-reduce.
            std::thread::sleep(Duration::from_secs(3));
            drop(g);
        });
        let g = ProcessGroup::new(options(Backend::Tcp, 0, 2, port, Duration::from_secs(1))).unwrap();
        let e = g.all_reduce(&host(&[1.0; 4], DType::F32), ReduceOp::Sum).unwrap().wait().unwrap_err().to_string();
        idle.join().unwrap();
        e
    });
    assert!(e.contains("rank 1 did not answer within 1 s"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(10));
}
