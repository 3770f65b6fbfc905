//! `kiln launch`: starts the ranks of one node, as torchrun does. Each gets torchrun's
//! environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), its output lines prefixed with its rank; when one fails the others are
//! stopped and the launcher exits with the failed rank's status.

use kiln::{Error, Result};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Launch {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub program: Vec<String>,
}

/// Runs the ranks to the end; returns the exit status to leave with (0 when all succeeded).
pub fn run(l: &Launch) -> Result<i32> {
    if l.nproc_per_node == 0 || l.nnodes == 0 || l.node_rank >= l.nnodes {
        return Err(Error::Arg { op: "launch", msg: format!("--nproc-per-node {} --nnodes {} --node-rank {}: need at least one process and node, and a node rank below the node count", l.nproc_per_node, l.nnodes, l.node_rank) });
    }
    let Some((exe, args)) = l.program.split_first() else {
        return Err(Error::Arg { op: "launch", msg: "no program: kiln launch --nproc-per-node N -- PROGRAM ARGS".into() });
    };
    let world = l.nproc_per_node * l.nnodes;
    let mut children: Vec<(usize, Child)> = Vec::new();
    // Each forwarder says when its pipe closed.
    let (closed_tx, closed) = std::sync::mpsc::channel::<()>();
    for local in 0..l.nproc_per_node {
        let rank = l.node_rank * l.nproc_per_node + local;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", l.nproc_per_node.to_string())
            .env("GROUP_RANK", l.node_rank.to_string())
            .env("MASTER_ADDR", &l.master_addr)
            .env("MASTER_PORT", l.master_port.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // NVLink multicast stays off unless the user's environment says otherwise.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(Error::Io { op: "launch", msg: format!("cannot start {exe}: {e}") });
            }
        };
        let (out, err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
        let (a, b) = (closed_tx.clone(), closed_tx.clone());
        std::thread::spawn(move || {
            forward(rank, out, false);
            let _ = a.send(());
        });
        std::thread::spawn(move || {
            forward(rank, err, true);
            let _ = b.send(());
        });
        children.push((rank, child));
    }
    // Wait for all; the first failure stops the rest.
    let mut status = 0;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait()? {
                Some(s) => {
                    let (rank, _) = children.remove(i);
                    if !s.success() && status == 0 {
                        status = s.code().unwrap_or(1);
                        eprintln!("kiln launch: rank {rank} failed ({s}); stopping the other ranks");
                        stop(&mut children);
                    }
                }
                None => i += 1,
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The ranks' last lines, unless a process they started still holds their output open.
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    for _ in 0..2 * l.nproc_per_node {
        if closed.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())).is_err() {
            break;
        }
    }
    Ok(status)
}

fn stop(children: &mut Vec<(usize, Child)>) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
    }
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
    children.clear();
}

/// Copies one rank's output line by line, each prefixed with `[rank N]`.
fn forward(rank: usize, from: impl std::io::Read, to_stderr: bool) {
    for line in BufReader::new(from).split(b'\n') {
        let Ok(line) = line else { break };
        let text = String::from_utf8_lossy(&line);
        let _ = if to_stderr {
            writeln!(std::io::stderr().lock(), "[rank {rank}] {text}")
        } else {
            writeln!(std::io::stdout().lock(), "[rank {rank}] {text}")
        };
    }
}
