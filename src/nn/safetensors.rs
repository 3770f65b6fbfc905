//! State dicts as safetensors files (the format PyTorch exports with `safetensors.torch`).

use crate::backend::cpu::{with_storage, CpuStorage, HostBuf, HostElem};
use crate::{DType, Device, Error, Result, Tensor};
use safetensors::tensor::Dtype;
use std::borrow::Cow;
use std::path::Path;

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

fn io(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Io { op: "safetensors", msg: format!("{}: {msg}", path.display()) }
}

/// The tensor's bytes, little-endian (the host's order on every machine kiln runs on).
fn host_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let host = crate::no_grad(|| t.to_host()?.contiguous())?;
    let s = crate::backend::cpu::cast(&host, t.dtype());
    Ok(with_storage!(&s, v => crate::backend::cpu::bytes_of(v).to_vec()))
}

struct Bytes(Dtype, Vec<usize>, Vec<u8>);
impl safetensors::View for &Bytes {
    fn dtype(&self) -> Dtype {
        self.0
    }
    fn shape(&self) -> &[usize] {
        &self.1
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.2)
    }
    fn data_len(&self) -> usize {
        self.2.len()
    }
}

/// Writes `sd` to `path` atomically (a temporary file beside it, then a rename). Names must be
/// unique and must not be `__metadata__`, the key the format keeps for its own use.
pub fn save(sd: &[(String, Tensor)], path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let mut seen = std::collections::HashSet::with_capacity(sd.len());
    for (n, _) in sd {
        if n == METADATA {
            return Err(io(path, format!("tensor name {METADATA:?} is reserved by the format for metadata")));
        }
        if !seen.insert(n.as_str()) {
            return Err(io(path, format!("duplicate tensor name {n:?}: each name may occur once")));
        }
    }
    let items: Vec<(String, Bytes)> = sd
        .iter()
        .map(|(n, t)| Ok((n.clone(), Bytes(st_dtype(t.dtype()), t.shape().to_vec(), host_bytes(t).map_err(|e| io(path, format!("tensor {n:?}: {e}")))?))))
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(items.iter().map(|(n, b)| (n.as_str(), b)), None).map_err(|e| io(path, e))?;
    crate::files::write_atomically(path, &bytes).map_err(|e| io(path, e))
}

fn typed<T: HostElem>(data: &[u8]) -> HostBuf<T> {
    let n = data.len() / std::mem::size_of::<T>();
    let mut v: HostBuf<T> = HostBuf::with_capacity(n);
    // SAFETY: the file's bytes for n elements of T (checked by `entry` against the shape),
    // copied into aligned storage; bools are validated by the caller.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), v.as_mut_ptr() as *mut u8, n * std::mem::size_of::<T>());
        v.set_len(n);
    }
    v
}

fn to_tensor(path: &Path, e: &Entry, data: &[u8], device: &Device) -> Result<Tensor> {
    let s = match e.dtype {
        DType::F32 => CpuStorage::F32(typed(data)),
        DType::F64 => CpuStorage::F64(typed(data)),
        DType::F16 => CpuStorage::F16(typed(data)),
        DType::BF16 => CpuStorage::BF16(typed(data)),
        DType::I64 => CpuStorage::I64(typed(data)),
        DType::I32 => CpuStorage::I32(typed(data)),
        DType::U8 => CpuStorage::U8(typed(data)),
        DType::Bool => {
            if let Some(b) = data.iter().find(|&&b| b > 1) {
                return Err(io(path, format!("tensor {:?}: bool tensor holds the byte {b}, not 0 or 1", e.name)));
            }
            CpuStorage::Bool(data.iter().map(|&b| b == 1).collect())
        }
    };
    Tensor::from_cpu(s, &e.shape).to_device(device)
}

/// Every tensor of the file, sorted by name, on `device`. The whole header is checked before any
/// tensor is made: a damaged or foreign file is an error naming the file and what is wrong.
pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<Vec<(String, Tensor)>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    let (data, entries) = parse(&bytes).map_err(|m| io(path, m))?;
    let mut out = entries.iter().map(|e| Ok((e.name.clone(), to_tensor(path, e, &data[e.begin..e.end], device)?))).collect::<Result<Vec<_>>>()?;
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

const METADATA: &str = "__metadata__";
/// The reference reader's limit; a header past it is not a checkpoint.
const MAX_HEADER: u64 = 100_000_000;

/// One tensor of a checked header: its bytes are `data[begin..end]`, exactly `shape` of `dtype`.
struct Entry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    begin: usize,
    end: usize,
}

/// Splits a safetensors file into its data section and checked entries (in offset order), or
/// says what is wrong. Every rule of the format is checked here, with checked arithmetic, so no
/// value in the file can make a later step index out of range or overflow.
fn parse(bytes: &[u8]) -> std::result::Result<(&[u8], Vec<Entry>), String> {
    let Some((len, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(format!("{} bytes is shorter than the 8-byte header length: truncated or not a safetensors file", bytes.len()));
    };
    let n = u64::from_le_bytes(*len);
    if n > MAX_HEADER {
        return Err(format!("header length {n} is larger than the {MAX_HEADER}-byte limit: not a safetensors file"));
    }
    // n <= MAX_HEADER fits in usize on every target.
    let Some((header, data)) = rest.split_at_checked(n as usize) else {
        return Err(format!("header length {n} is larger than the {} bytes that follow it: truncated file", rest.len()));
    };
    let text = std::str::from_utf8(header).map_err(|e| format!("header is not UTF-8: {e}"))?;
    let json: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("header is not valid JSON: {e}"))?;
    let serde_json::Value::Object(map) = json else {
        return Err(format!("header is JSON but not an object of tensors: {}", clip(&json)));
    };
    let mut entries = Vec::with_capacity(map.len());
    for (name, v) in map {
        if name == METADATA {
            let ok = v.as_object().is_some_and(|m| m.values().all(|x| x.is_string()));
            if !ok {
                return Err(format!("header: {METADATA} must map names to strings, got {}", clip(&v)));
            }
            continue;
        }
        entries.push(entry(&name, &v, data.len()).map_err(|m| format!("header: tensor {name:?}: {m}"))?);
    }
    // The tensors tile the data section: in offset order each starts where the last ended.
    entries.sort_by_key(|e| (e.begin, e.end));
    let mut at = 0;
    let mut last: Option<&str> = None;
    for e in &entries {
        if e.begin < at {
            return Err(format!("header: tensors {:?} and {:?} overlap (the second starts at byte {} of the data, the first ends at {at})", last.unwrap_or_default(), e.name, e.begin));
        }
        if e.begin > at {
            return Err(format!("header: bytes {at}..{} of the data belong to no tensor (a gap before {:?})", e.begin, e.name));
        }
        at = e.end;
        last = Some(&e.name);
    }
    if at != data.len() {
        return Err(format!("header: bytes {at}..{} of the data belong to no tensor (trailing bytes after the last one)", data.len()));
    }
    Ok((data, entries))
}

/// One header entry, checked against a data section of `data_len` bytes.
fn entry(name: &str, v: &serde_json::Value, data_len: usize) -> std::result::Result<Entry, String> {
    let Some(info) = v.as_object() else {
        return Err(format!("entry is not an object: {}", clip(v)));
    };
    let dtype = match info.get("dtype").and_then(|d| d.as_str()) {
        Some(d) => kiln_dtype(d)?,
        None => return Err(format!("no dtype string in {}", clip(v))),
    };
    let uints = |key: &str| -> std::result::Result<Vec<usize>, String> {
        let list = info.get(key).and_then(|s| s.as_array()).ok_or_else(|| format!("no {key} list in {}", clip(v)))?;
        list.iter().map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()).ok_or_else(|| format!("{key} holds {x}, not a non-negative integer that fits in memory"))).collect()
    };
    let shape = uints("shape")?;
    let offsets = uints("data_offsets")?;
    let &[begin, end] = offsets.as_slice() else {
        return Err(format!("data_offsets must be [begin, end], got {offsets:?}"));
    };
    // As Tensor::zeros: strides multiply the sizes with zeros counted as ones, so that product
    // (in bytes) must fit too.
    let size = shape.iter().try_fold(dtype.size_in_bytes(), |n, &d| n.checked_mul(d.max(1)));
    if size.is_none_or(|b| b > isize::MAX as usize) {
        return Err(format!("shape {shape:?} of {dtype:?} overflows: more bytes than any memory holds"));
    }
    let need = shape.iter().product::<usize>() * dtype.size_in_bytes();
    if begin > end {
        return Err(format!("data_offsets [{begin}, {end}] run backwards"));
    }
    if end > data_len {
        return Err(format!("data_offsets [{begin}, {end}] are out of range: the data section has {data_len} bytes (a truncated file?)"));
    }
    if end - begin != need {
        return Err(format!("data_offsets [{begin}, {end}] hold {} bytes, but shape {shape:?} of {dtype:?} needs {need}", end - begin));
    }
    Ok(Entry { name: name.to_string(), dtype, shape, begin, end })
}

/// The kiln dtype of a safetensors dtype name.
fn kiln_dtype(name: &str) -> std::result::Result<DType, String> {
    Ok(match name {
        "F32" => DType::F32,
        "F64" => DType::F64,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "I64" => DType::I64,
        "I32" => DType::I32,
        "U8" => DType::U8,
        "BOOL" => DType::Bool,
        "I8" | "I16" | "U16" | "U32" | "U64" | "C64" | "F4" | "F6_E2M3" | "F6_E3M2" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ" | "F8_E5M2FNUZ" => {
            return Err(format!("dtype {name} is not supported by kiln (it has F64, F32, F16, BF16, I64, I32, U8 and BOOL)"))
        }
        _ => return Err(format!("unknown dtype {name:?}")),
    })
}

/// A JSON value for a message, cut short: a hostile header may be megabytes long.
fn clip(v: &serde_json::Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}
