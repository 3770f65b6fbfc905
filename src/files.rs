//! Files kiln writes (checkpoints, the kernel and autotune caches) appear whole or not at all.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Writes `bytes` to a temporary file beside `path`, then renames it over `path`: a reader (of
/// this process or another) sees the old file or the new one, never half of one. The temporary
/// name is this write's own, so threads writing the same path at once cannot publish each
/// other's half-written file. On failure the temporary file is removed and `path` is untouched.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.{}.tmp", std::process::id(), WRITES.fetch_add(1, Ordering::Relaxed)));
    let tmp = path.with_file_name(name);
    let r = std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, path));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

#[cfg(test)]
mod tests {
    #[test]
    fn writes_replace_the_file_and_leave_no_temporary() {
        let dir = std::env::temp_dir().join(format!("kiln-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.bin");
        std::thread::scope(|s| {
            for i in 0..8u8 {
                let p = &p;
                s.spawn(move || super::write_atomically(p, &vec![i; 1 << 16]).unwrap());
            }
        });
        let got = std::fs::read(&p).unwrap();
        assert!(got.len() == 1 << 16 && got.iter().all(|&b| b == got[0]), "one writer's whole file");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "no temporary file left");
        assert!(super::write_atomically(&dir.join("missing/y.bin"), b"1").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
