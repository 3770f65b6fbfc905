//! The rendezvous store, as c10d's `TCPStore`: rank 0 serves a key-value map at
//! `MASTER_ADDR:MASTER_PORT`, and every rank (rank 0 included) talks to it as a client. Ranks
//! publish their addresses through it, and the NCCL unique id travels through it.
//!
//! Wire format, one request per message: a command byte, the key (u32 length + bytes), then for
//! `set` the value (u64 length + bytes) and for `add` an i64. `get` waits on the server until the
//! key exists; the client gives up after its timeout and names the key.

use crate::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SET: u8 = 1;
const GET: u8 = 2;
const ADD: u8 = 3;

/// A client of the store (and, on the rank that created it with `serve`, its server too).
pub struct Store {
    conn: Mutex<TcpStream>,
    timeout: Duration,
    server: Option<Server>,
}

impl Store {
    /// Serves the store at `addr` (rank 0), then connects to it.
    pub fn serve(addr: &str, port: u16, timeout: Duration) -> Result<Store> {
        let listener = TcpListener::bind((addr, port))
            .or_else(|_| TcpListener::bind(("0.0.0.0", port)))
            .map_err(|e| Error::dist("store", format!("cannot listen on {addr}:{port}: {e} (is another job using MASTER_PORT?)")))?;
        let local = listener.local_addr()?;
        let server = Server::start(listener)?;
        let mut store = Store::connect(&local.ip().to_string(), local.port(), timeout)?;
        store.server = Some(server);
        Ok(store)
    }

    /// Connects to the store at `addr:port`, retrying until `timeout` while rank 0 starts it.
    pub fn connect(addr: &str, port: u16, timeout: Duration) -> Result<Store> {
        let target: Vec<SocketAddr> = (addr, port)
            .to_socket_addrs()
            .map_err(|e| Error::dist("store", format!("MASTER_ADDR {addr}:{port} does not resolve: {e}")))?
            .collect();
        let start = Instant::now();
        loop {
            let last = match target.iter().find_map(|a| TcpStream::connect_timeout(a, Duration::from_millis(500)).ok()) {
                Some(conn) => {
                    conn.set_nodelay(true)?;
                    conn.set_read_timeout(Some(timeout))?;
                    conn.set_write_timeout(Some(timeout))?;
                    return Ok(Store { conn: Mutex::new(conn), timeout, server: None });
                }
                None => start.elapsed(),
            };
            if last >= timeout {
                return Err(Error::dist("store", format!("no store at {addr}:{port} after {:.0} s: is rank 0 running, and are MASTER_ADDR and MASTER_PORT the same on every rank?", timeout.as_secs_f64())));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The port this rank's server listens on (rank 0's store only).
    #[cfg(test)]
    pub(crate) fn server_port(&self) -> Option<u16> {
        self.server.as_ref().map(|s| s.addr.port())
    }

    /// A second client of the same server, with a connection and `timeout` of its own (for a
    /// thread that must neither wait behind another's request nor as long).
    pub(crate) fn another_client(&self, timeout: Duration) -> Result<Store> {
        let server = self.conn.lock().peer_addr()?;
        Store::connect(&server.ip().to_string(), server.port(), timeout)
    }

    /// The address the store's connection leaves from: the interface other ranks can reach.
    pub(crate) fn local_ip(&self) -> Result<std::net::IpAddr> {
        Ok(self.conn.lock().local_addr()?.ip())
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut c = self.conn.lock();
        let mut msg = request(SET, key);
        msg.extend_from_slice(&(value.len() as u64).to_le_bytes());
        msg.extend_from_slice(value);
        c.write_all(&msg).map_err(|e| self.lost("set", key, e))?;
        let mut ack = [0u8; 1];
        c.read_exact(&mut ack).map_err(|e| self.lost("set", key, e))
    }

    /// The value of `key`, waiting until some rank sets it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let mut c = self.conn.lock();
        c.write_all(&request(GET, key)).map_err(|e| self.lost("get", key, e))?;
        let mut len = [0u8; 8];
        c.read_exact(&mut len).map_err(|e| self.lost("get", key, e))?;
        let mut v = vec![0u8; u64::from_le_bytes(len) as usize];
        c.read_exact(&mut v).map_err(|e| self.lost("get", key, e))?;
        Ok(v)
    }

    /// Adds `delta` to the integer at `key` (0 when unset) and returns the sum.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut c = self.conn.lock();
        let mut msg = request(ADD, key);
        msg.extend_from_slice(&delta.to_le_bytes());
        c.write_all(&msg).map_err(|e| self.lost("add", key, e))?;
        let mut v = [0u8; 8];
        c.read_exact(&mut v).map_err(|e| self.lost("add", key, e))?;
        Ok(i64::from_le_bytes(v))
    }

    fn lost(&self, op: &str, key: &str, e: std::io::Error) -> Error {
        let why = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!("timed out after {:.0} s", self.timeout.as_secs_f64()),
            _ => format!("the store's connection failed ({e}): did rank 0 exit?"),
        };
        Error::dist("store", format!("{op} of key {key:?} {why}"))
    }
}

fn request(cmd: u8, key: &str) -> Vec<u8> {
    let mut m = vec![cmd];
    m.extend_from_slice(&(key.len() as u32).to_le_bytes());
    m.extend_from_slice(key.as_bytes());
    m
}

type Map = Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>;

/// The server's accept thread; dropping it stops the thread and every connection's thread.
struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(listener: TcpListener) -> Result<Server> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let map: Map = Arc::default();
        let accept = {
            let stop = stop.clone();
            std::thread::Builder::new().name("kiln-store".into()).spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let (map, stop) = (map.clone(), stop.clone());
                    let _ = std::thread::Builder::new().name("kiln-store-conn".into()).spawn(move || serve(conn, &map, &stop));
                }
            })?
        };
        Ok(Server { addr, stop, accept: Some(accept) })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// Answers one client's requests until it disconnects or the server stops.
fn serve(mut c: TcpStream, map: &Map, stop: &AtomicBool) {
    let _ = c.set_nodelay(true);
    let mut cmd = [0u8; 1];
    while c.read_exact(&mut cmd).is_ok() {
        let mut len = [0u8; 4];
        if c.read_exact(&mut len).is_err() {
            return;
        }
        let mut key = vec![0u8; u32::from_le_bytes(len) as usize];
        if c.read_exact(&mut key).is_err() {
            return;
        }
        let key = String::from_utf8_lossy(&key).into_owned();
        let (lock, cv) = &**map;
        let reply = match cmd[0] {
            SET => {
                let mut n = [0u8; 8];
                if c.read_exact(&mut n).is_err() {
                    return;
                }
                let mut v = vec![0u8; u64::from_le_bytes(n) as usize];
                if c.read_exact(&mut v).is_err() {
                    return;
                }
                lock.lock().insert(key, v);
                cv.notify_all();
                vec![1]
            }
            GET => {
                let mut m = lock.lock();
                loop {
                    if let Some(v) = m.get(&key) {
                        let mut r = (v.len() as u64).to_le_bytes().to_vec();
                        r.extend_from_slice(v);
                        break r;
                    }
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    cv.wait_for(&mut m, Duration::from_millis(100));
                }
            }
            ADD => {
                let mut d = [0u8; 8];
                if c.read_exact(&mut d).is_err() {
                    return;
                }
                let mut m = lock.lock();
                let now = m.get(&key).and_then(|v| v.as_slice().try_into().ok()).map(i64::from_le_bytes).unwrap_or(0) + i64::from_le_bytes(d);
                m.insert(key, now.to_le_bytes().to_vec());
                cv.notify_all();
                now.to_le_bytes().to_vec()
            }
            _ => return,
        };
        if c.write_all(&reply).is_err() {
            return;
        }
    }
}
