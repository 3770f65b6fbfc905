//! Bad files: malformed safetensors and IDX files, names that cannot be saved, and paths that are
//! not UTF-8. Every bad case is an error that names the file and the problem, never a panic, and a
//! failed load leaves the model bitwise as it was.

use crate::common::*;
use kiln::data::{Dataset, Mnist};
use kiln::nn::{self, Module};
use kiln::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// A directory of its own under the system's temporary one, removed at the end.
struct Scratch(PathBuf);
impl Scratch {
    fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("kiln-corpus-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The cases run so far and what went wrong in them; `finish` fails the test on any.
#[derive(Default)]
struct Cases {
    run: usize,
    panics: usize,
    failures: Vec<String>,
}

impl Cases {
    /// Case `name` must return an error whose message contains `word` and `path`'s file name.
    fn err<T>(&mut self, name: &str, path: &Path, word: &str, f: impl FnOnce() -> kiln::Result<T>) {
        self.run += 1;
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        match catch_unwind(AssertUnwindSafe(f)) {
            Err(p) => {
                self.panics += 1;
                let what = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                self.failures.push(format!("{name}: panicked: {what}"));
            }
            Ok(Ok(_)) => self.failures.push(format!("{name}: accepted, expected an error about {word:?}")),
            Ok(Err(e)) => {
                let msg = e.to_string();
                if !msg.contains(word) || !msg.contains(&file) {
                    self.failures.push(format!("{name}: expected {word:?} and {file:?} in: {msg}"));
                }
            }
        }
    }

    /// Case `name` loads into `m`, must fail as `err` says, and must leave `m` as `before`.
    fn load_err(&mut self, name: &str, m: &impl Module, before: &[(String, Vec<u32>)], path: &Path, word: &str) {
        self.err(name, path, word, || m.load_safetensors(path));
        if bits(m) != before {
            self.failures.push(format!("{name}: the failed load changed the model"));
        }
    }

    fn finish(self, what: &str) {
        println!("{what}: {} cases, {} panics, {} failures", self.run, self.panics, self.failures.len());
        assert!(self.failures.is_empty(), "{what}: {} of {} cases failed ({} panicked):\n{}", self.failures.len(), self.run, self.panics, self.failures.join("\n"));
        assert_eq!(self.panics, 0);
    }
}

/// Every parameter and buffer of `m` (all F32 here), bit for bit.
fn bits(m: &dyn Module) -> Vec<(String, Vec<u32>)> {
    m.state_dict()
        .into_iter()
        .map(|(n, t)| {
            assert_eq!(t.dtype(), DType::F32);
            (n, t.detach().to_device(&Device::Cpu).unwrap().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
        })
        .collect()
}

type StateDict = Vec<(String, Tensor)>;

/// A safetensors file from a raw header and data section.
fn st(header: &str, data: &[u8]) -> Vec<u8> {
    st_raw(header.as_bytes(), data)
}
fn st_raw(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(data);
    b
}

/// A header of one tensor `w`.
fn one(dtype: &str, shape: &str, offsets: &str) -> String {
    format!(r#"{{"w":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}}}"#)
}

fn linear(seed: u64) -> nn::Linear {
    manual_seed(seed);
    nn::Linear::new(3, 2, &dev()).unwrap()
}

#[test]
fn malformed_safetensors_files_are_errors_that_change_nothing() {
    let dir = Scratch::new("st");
    let mut c = Cases::default();
    let model = linear(1);
    let before = bits(&model);
    let good = dir.0.join("good.safetensors");
    linear(2).save_safetensors(&good).unwrap();
    let valid = std::fs::read(&good).unwrap();
    let header_len = u64::from_le_bytes(valid[..8].try_into().unwrap()) as usize;
    assert_eq!(valid.len(), 8 + header_len + 4 * (6 + 2), "one F32 [2, 3] and one F32 [2]");

    // Truncated at every offset: the length, every byte of the header, every byte of the data.
    for cut in 0..valid.len() {
        let p = dir.write(&format!("cut{cut}.safetensors"), &valid[..cut]);
        c.load_err(&format!("truncated at {cut}"), &model, &before, &p, "truncated");
        let _ = std::fs::remove_file(&p);
    }
    // A byte changed anywhere in the length or header (where the result cannot be valid).
    for at in 0..8 + header_len {
        let mut b = valid.clone();
        b[at] = if b[at] == b'"' { b'}' } else { b'"' };
        let p = dir.write(&format!("flip{at}.safetensors"), &b);
        c.load_err(&format!("header byte {at} changed"), &model, &before, &p, "header");
        let _ = std::fs::remove_file(&p);
    }

    let f32x2 = [0u8; 8];
    let bad: Vec<(&str, Vec<u8>, &str)> = vec![
        // Header length and encoding.
        ("empty file", vec![], "shorter"),
        ("length larger than the file", {
            let mut b = 1000u64.to_le_bytes().to_vec();
            b.extend(b"{}");
            b
        }, "larger than"),
        ("length u64::MAX", u64::MAX.to_le_bytes().to_vec(), "limit"),
        ("length past the limit", (1u64 << 40).to_le_bytes().to_vec(), "limit"),
        ("empty header", st("", &[]), "JSON"),
        ("header not UTF-8", st_raw(b"{\"\xff\xfe\":{}}", &[]), "UTF-8"),
        // Bad JSON.
        ("unclosed object", st(r#"{"w":{"dtype":"F32""#, &f32x2), "JSON"),
        ("trailing garbage", st(r#"{} x"#, &[]), "JSON"),
        ("a JSON array", st("[1, 2]", &[]), "not an object"),
        ("a JSON string", st(r#""w""#, &[]), "not an object"),
        ("entry not an object", st(r#"{"w":5}"#, &f32x2), "not an object"),
        ("no dtype", st(r#"{"w":{"shape":[2],"data_offsets":[0,8]}}"#, &f32x2), "dtype"),
        ("dtype a number", st(r#"{"w":{"dtype":7,"shape":[2],"data_offsets":[0,8]}}"#, &f32x2), "dtype"),
        ("no shape", st(r#"{"w":{"dtype":"F32","data_offsets":[0,8]}}"#, &f32x2), "shape"),
        ("shape a string", st(&one("F32", r#""2""#, "[0,8]"), &f32x2), "shape"),
        ("negative dim", st(&one("F32", "[-2]", "[0,8]"), &f32x2), "shape"),
        ("fractional dim", st(&one("F32", "[1.5]", "[0,8]"), &f32x2), "shape"),
        ("dim past u64", st(&one("F32", "[18446744073709551616]", "[0,8]"), &f32x2), "shape"),
        ("no data_offsets", st(r#"{"w":{"dtype":"F32","shape":[2]}}"#, &f32x2), "data_offsets"),
        ("one offset", st(&one("F32", "[2]", "[8]"), &f32x2), "data_offsets"),
        ("three offsets", st(&one("F32", "[2]", "[0,4,8]"), &f32x2), "data_offsets"),
        ("negative offset", st(&one("F32", "[2]", "[-8,0]"), &f32x2), "data_offsets"),
        ("metadata not strings", st(r#"{"__metadata__":{"format":1}}"#, &[]), "__metadata__"),
        ("metadata a list", st(r#"{"__metadata__":["pt"]}"#, &[]), "__metadata__"),
        // Offsets.
        ("end past the data", st(&one("F32", "[16]", "[0,64]"), &f32x2), "out of range"),
        ("begin past the data", st(&one("F32", "[0]", "[9,9]"), &f32x2), "out of range"),
        ("offsets backwards", st(&one("F32", "[2]", "[8,0]"), &f32x2), "backwards"),
        ("fewer bytes than the shape", st(&one("F32", "[3]", "[0,8]"), &f32x2), "needs 12"),
        ("more bytes than the shape", st(&one("F32", "[1]", "[0,8]"), &f32x2), "needs 4"),
        ("bytes for another dtype", st(&one("F64", "[2]", "[0,8]"), &f32x2), "needs 16"),
        ("overlapping tensors", st(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#, &[0; 12]), "overlap"),
        ("the same bytes twice", st(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &f32x2), "overlap"),
        ("a gap between tensors", st(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#, &[0; 20]), "belong to no tensor"),
        ("a gap at the start", st(&one("F32", "[1]", "[4,8]"), &f32x2), "belong to no tensor"),
        ("trailing data", st(&one("F32", "[2]", "[0,8]"), &[0; 12]), "belong to no tensor"),
        // Shapes whose size overflows.
        ("element count overflows", st(&one("F32", "[4294967296,4294967296]", "[0,8]"), &f32x2), "overflows"),
        ("byte count overflows", st(&one("F32", "[4611686018427387904]", "[0,8]"), &f32x2), "overflows"),
        ("empty but strides overflow", st(&one("F32", "[0,4294967296,4294967296]", "[0,0]"), &[]), "overflows"),
        ("past isize::MAX bytes", st(&one("U8", "[9223372036854775808]", "[0,8]"), &f32x2), "overflows"),
        // Dtypes.
        ("unsupported I8", st(&one("I8", "[8]", "[0,8]"), &f32x2), "not supported"),
        ("unsupported U64", st(&one("U64", "[1]", "[0,8]"), &f32x2), "not supported"),
        ("unsupported F8_E4M3", st(&one("F8_E4M3", "[8]", "[0,8]"), &f32x2), "not supported"),
        ("unsupported F4", st(&one("F4", "[16]", "[0,8]"), &f32x2), "not supported"),
        ("unknown dtype", st(&one("Q4_K", "[8]", "[0,8]"), &f32x2), "unknown dtype"),
        ("lower-case dtype", st(&one("f32", "[2]", "[0,8]"), &f32x2), "unknown dtype"),
        ("bool byte 2", st(&one("BOOL", "[2]", "[0,2]"), &[1, 2]), "bool"),
    ];
    for (i, (name, bytes, word)) in bad.iter().enumerate() {
        let p = dir.write(&format!("bad{i}.safetensors"), bytes);
        c.err(name, &p, word, || nn::safetensors::load(&p, &Device::Cpu));
        c.load_err(name, &model, &before, &p, word);
    }

    // Files that are valid but do not fit the model: nothing is written, even for the tensors that do.
    let (w, b) = (Tensor::ones(&[2, 3], DType::F32, &Device::Cpu).unwrap(), Tensor::ones(&[2], DType::F32, &Device::Cpu).unwrap());
    let misfits: Vec<(&str, StateDict, &str)> = vec![
        ("bias of the wrong shape", vec![("weight".into(), w.clone()), ("bias".into(), Tensor::ones(&[3], DType::F32, &Device::Cpu).unwrap())], "bias: shape [3]"),
        ("bias of the wrong dtype", vec![("weight".into(), w.clone()), ("bias".into(), b.to_dtype(DType::F64).unwrap())], "bias: dtype F64"),
        ("bias missing", vec![("weight".into(), w.clone())], "missing bias"),
        ("an extra tensor", vec![("weight".into(), w.clone()), ("bias".into(), b.clone()), ("extra".into(), b.clone())], "unexpected extra"),
        ("nothing", vec![], "missing weight"),
    ];
    for (i, (name, sd, word)) in misfits.iter().enumerate() {
        let p = dir.0.join(format!("misfit{i}.safetensors"));
        nn::safetensors::save(sd, &p).unwrap();
        c.load_err(name, &model, &before, &p, word);
    }
    c.err("a missing file", &dir.0.join("absent.safetensors"), "No such file", || model.load_safetensors(dir.0.join("absent.safetensors")));
    c.err("a directory", &dir.0, "directory", || model.load_safetensors(&dir.0));
    assert_eq!(bits(&model), before);
    c.finish("safetensors loads");
}

#[test]
fn failed_state_dict_loads_change_no_parameter() {
    let mut c = Cases::default();
    let model = linear(3);
    let before = bits(&model);
    let sd = linear(4).state_dict();
    let none = Path::new("load_state_dict");
    let mut dup = sd.clone();
    dup.push(sd[0].clone());
    c.err("a name twice", none, "duplicate weight", || model.load_state_dict(&dup));
    let mut wrong = sd.clone();
    wrong[1].1 = Tensor::zeros(&[5], DType::F32, &dev()).unwrap();
    c.err("the last tensor of the wrong shape", none, "bias: shape [5]", || model.load_state_dict(&wrong));
    let mut wrong = sd.clone();
    wrong[1].1 = wrong[1].1.to_dtype(DType::F16).unwrap();
    c.err("the last tensor of the wrong dtype", none, "bias: dtype F16", || model.load_state_dict(&wrong));
    assert_eq!(bits(&model), before, "no failed load wrote anything");

    // The model's own tensors under each other's names: every value is read before any write.
    let m = nn::Sequential::new().add(nn::Linear::new(2, 2, &dev()).unwrap()).add(nn::Linear::new(2, 2, &dev()).unwrap());
    let own = m.state_dict();
    let was = bits(&m);
    let swapped: Vec<(String, Tensor)> = own.iter().map(|(n, t)| (if n.starts_with('0') { n.replacen('0', "1", 1) } else { n.replacen('1', "0", 1) }, t.clone())).collect();
    m.load_state_dict(&swapped).unwrap();
    let now = bits(&m);
    for (name, v) in &was {
        let other = if name.starts_with('0') { name.replacen('0', "1", 1) } else { name.replacen('1', "0", 1) };
        assert_eq!(&now.iter().find(|(n, _)| *n == other).unwrap().1, v, "{other} holds what {name} held");
    }
    c.finish("state dict loads");
}

#[test]
fn saves_with_bad_names_are_errors_that_write_nothing() {
    let dir = Scratch::new("save");
    let mut c = Cases::default();
    let x = Tensor::ones(&[2], DType::F32, &dev()).unwrap();
    let cases: Vec<(&str, StateDict, &str)> = vec![
        ("a name twice", vec![("a".into(), x.clone()), ("b".into(), x.clone()), ("a".into(), x.clone())], "duplicate tensor name \"a\""),
        ("a name twice, other dtypes", vec![("a".into(), x.clone()), ("a".into(), x.to_dtype(DType::I64).unwrap())], "duplicate"),
        ("the metadata key", vec![("__metadata__".into(), x.clone())], "reserved"),
    ];
    for (i, (name, sd, word)) in cases.iter().enumerate() {
        let p = dir.0.join(format!("dup{i}.safetensors"));
        c.err(name, &p, word, || nn::safetensors::save(sd, &p));
        assert!(!p.exists(), "{name}: nothing is written");
    }
    let p = dir.0.join("no-such-dir").join("m.safetensors");
    c.err("a missing directory", &p, "m.safetensors", || linear(5).save_safetensors(&p));
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 0, "no temporary file left");
    c.finish("safetensors saves");
}

fn idx(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut b = magic.to_be_bytes().to_vec();
    for d in dims {
        b.extend(d.to_be_bytes());
    }
    b.extend_from_slice(data);
    b
}

#[test]
fn malformed_idx_files_are_errors() {
    let dir = Scratch::new("idx");
    let mut c = Cases::default();
    let pixels: Vec<u8> = (0..12).collect();
    let images = idx(0x0803, &[2, 2, 3], &pixels);
    let imgs = dir.write("imgs", &images);
    let labs = dir.write("labs", &idx(0x0801, &[2], &[4, 9]));
    assert_eq!(Mnist::from_idx(&imgs, &labs).unwrap().len(), 2);

    for cut in 0..images.len() {
        let p = dir.write(&format!("cut{cut}"), &images[..cut]);
        let word = if cut < 16 { "shorter" } else { "short data" };
        c.err(&format!("images truncated at {cut}"), &p, word, || Mnist::from_idx(&p, &labs));
    }
    let labels = std::fs::read(&labs).unwrap();
    for cut in 0..labels.len() {
        let p = dir.write(&format!("lcut{cut}"), &labels[..cut]);
        let word = if cut < 8 { "shorter" } else { "short data" };
        c.err(&format!("labels truncated at {cut}"), &p, word, || Mnist::from_idx(&imgs, &p));
    }
    let max = u32::MAX;
    let bad_images: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "shorter"),
        ("nonzero first byte", idx(0x0100_0803, &[2, 2, 3], &pixels), "magic"),
        ("nonzero second byte", idx(0x0001_0803, &[2, 2, 3], &pixels), "two zero bytes"),
        ("text file", b"hello, world, not idx".to_vec(), "magic"),
        ("f32 type byte", idx(0x0D03, &[2, 2, 3], &pixels), "type byte 0x0d (f32 elements)"),
        ("i32 type byte", idx(0x0C03, &[2, 2, 3], &pixels), "type byte 0x0c"),
        ("unknown type byte", idx(0x0703, &[2, 2, 3], &pixels), "unknown type"),
        ("two dims for images", idx(0x0802, &[2, 6], &pixels), "2 dims, expected 3"),
        ("no dims", idx(0x0800, &[], &pixels), "0 dims"),
        ("dims overflow to zero", idx(0x0803, &[4, 1 << 31, 1 << 31], &[]), "overflows"),
        ("count times pixels overflows", idx(0x0803, &[1 << 31, 1 << 31, 4], &[]), "overflows"),
        ("every dim u32::MAX", idx(0x0803, &[max, max, max], &pixels), "overflows"),
        ("empty count, huge images", idx(0x0803, &[0, max, max], &[]), "overflows"),
        ("dims larger than the data", idx(0x0803, &[2, 28, 28], &pixels), "need 1568 bytes"),
        ("short data", idx(0x0803, &[2, 2, 3], &pixels[..11]), "short data"),
        ("trailing bytes", idx(0x0803, &[2, 2, 3], &[0; 13]), "trailing bytes"),
        ("labels for another count", idx(0x0803, &[1, 2, 3], &pixels[..6]), "2 labels for 1 images"),
    ];
    for (i, (name, bytes, word)) in bad_images.iter().enumerate() {
        let p = dir.write(&format!("bad-images{i}"), bytes);
        let named = if name.starts_with("labels") { labs.clone() } else { p.clone() };
        c.err(name, &named, word, || Mnist::from_idx(&p, &labs));
    }
    let bad_labels: Vec<(&str, Vec<u8>, &str)> = vec![
        ("labels with images' magic", idx(0x0803, &[2, 1, 1], &[1, 2]), "3 dims, expected 1"),
        ("labels of f64", idx(0x0E01, &[2], &[0; 16]), "f64"),
        ("labels short", idx(0x0801, &[3], &[1, 2]), "short data"),
        ("labels overflowing", idx(0x0801, &[max], &[1, 2]), "short data"),
    ];
    for (i, (name, bytes, word)) in bad_labels.iter().enumerate() {
        let p = dir.write(&format!("bad-labels{i}"), bytes);
        c.err(name, &p, word, || Mnist::from_idx(&imgs, &p));
    }
    c.err("a missing file", &dir.0.join("absent"), "No such file", || Mnist::from_idx(dir.0.join("absent"), &labs));
    c.finish("IDX reads");
}

#[cfg(unix)]
#[test]
fn paths_that_are_not_utf8_load_and_save() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let dir = Scratch::new("utf8");
    let name = |s: &[u8]| dir.0.join(OsStr::from_bytes(s));
    let a = linear(6);
    let b = linear(7);
    let p = name(b"model-\xff\xfe.safetensors");
    assert!(p.to_str().is_none(), "the name is not UTF-8");
    a.save_safetensors(&p).unwrap();
    b.load_safetensors(&p).unwrap();
    assert_eq!(bits(&a), bits(&b));
    let sd = nn::safetensors::load(&p, &dev()).unwrap();
    let p2 = name(b"sd-\x80.safetensors");
    nn::safetensors::save(&sd, &p2).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&p2).unwrap(), "the same bytes under either name");

    // A trait object takes the same paths through the state dict functions.
    let boxed: Box<dyn Module> = Box::new(linear(8));
    let p3 = name(b"boxed-\xc3.safetensors");
    nn::safetensors::save(&boxed.state_dict(), &p3).unwrap();
    boxed.load_state_dict(&nn::safetensors::load(&p, &Device::Cpu).unwrap()).unwrap();
    assert_eq!(bits(boxed.as_ref()), bits(&a));

    let imgs = name(b"images-\xe9");
    let labs = name(b"labels-\xe9");
    std::fs::write(&imgs, idx(0x0803, &[1, 2, 2], &[0, 51, 102, 255])).unwrap();
    std::fs::write(&labs, idx(0x0801, &[1], &[7])).unwrap();
    let m = Mnist::from_idx(&imgs, &labs).unwrap();
    assert_eq!(m.get(0).unwrap().1.item::<i64>().unwrap(), 7);

    // Errors show such a name as well as it can be shown.
    let mut c = Cases::default();
    let bad = name(b"broken-\xff.safetensors");
    std::fs::write(&bad, &std::fs::read(&p).unwrap()[..20]).unwrap();
    c.err("truncated, not UTF-8", &bad, "broken-\u{fffd}.safetensors", || b.load_safetensors(&bad));
    std::fs::write(&labs, idx(0x0801, &[2], &[7])).unwrap();
    c.err("short labels, not UTF-8", &labs, "labels-\u{fffd}", || Mnist::from_idx(&imgs, &labs));
    c.finish("non-UTF-8 paths");
}
