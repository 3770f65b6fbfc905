//! State dicts as safetensors files (the format PyTorch exports with `safetensors.torch`).

use crate::backend::cpu::{with_storage, CpuStorage, HostElem};
use crate::{DType, Device, Error, Result, Tensor};
use safetensors::tensor::{Dtype, TensorView};
use std::borrow::Cow;

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

fn io(path: &str, msg: impl std::fmt::Display) -> Error {
    Error::Io { op: "safetensors", msg: format!("{path}: {msg}") }
}

/// The tensor's bytes, little-endian (the host's order on every machine kiln runs on).
fn host_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let host = crate::no_grad(|| t.to_host()?.contiguous())?;
    let s = crate::backend::cpu::cast(&host, t.dtype());
    Ok(with_storage!(&s, v => {
        // SAFETY: plain old data of the element type, viewed as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v.as_slice())) }.to_vec()
    }))
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

pub fn save(sd: &[(String, Tensor)], path: &str) -> Result<()> {
    let items: Vec<(String, Bytes)> = sd
        .iter()
        .map(|(n, t)| Ok((n.clone(), Bytes(st_dtype(t.dtype()), t.shape().to_vec(), host_bytes(t)?))))
        .collect::<Result<_>>()?;
    let bytes = safetensors::serialize(items.iter().map(|(n, b)| (n.as_str(), b)), None).map_err(|e| io(path, e))?;
    crate::files::write_atomically(std::path::Path::new(path), &bytes).map_err(|e| io(path, e))
}

fn typed<T: HostElem>(data: &[u8]) -> Vec<T> {
    let n = data.len() / std::mem::size_of::<T>();
    let mut v: Vec<T> = Vec::with_capacity(n);
    // SAFETY: the file's bytes for n elements of T (checked by safetensors against the shape),
    // copied into aligned storage; bools are validated by the caller.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr(), v.as_mut_ptr() as *mut u8, n * std::mem::size_of::<T>());
        v.set_len(n);
    }
    v
}

fn to_tensor(path: &str, name: &str, v: &TensorView<'_>, device: &Device) -> Result<Tensor> {
    let data = v.data();
    let s = match v.dtype() {
        Dtype::F32 => CpuStorage::F32(typed(data)),
        Dtype::F64 => CpuStorage::F64(typed(data)),
        Dtype::F16 => CpuStorage::F16(typed(data)),
        Dtype::BF16 => CpuStorage::BF16(typed(data)),
        Dtype::I64 => CpuStorage::I64(typed(data)),
        Dtype::I32 => CpuStorage::I32(typed(data)),
        Dtype::U8 => CpuStorage::U8(typed(data)),
        Dtype::BOOL => {
            if data.iter().any(|&b| b > 1) {
                return Err(io(path, format!("{name}: bool tensor holds a byte other than 0 or 1")));
            }
            CpuStorage::Bool(data.iter().map(|&b| b == 1).collect())
        }
        d => return Err(io(path, format!("{name}: dtype {d:?} is not supported by kiln"))),
    };
    Tensor::from_cpu(s, v.shape()).to_device(device)
}

/// Every tensor of the file, in the file's order, on `device`.
pub fn load(path: &str, device: &Device) -> Result<Vec<(String, Tensor)>> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| io(path, format!("not a valid safetensors file: {e}")))?;
    let mut out: Vec<(String, Tensor)> = st.tensors().iter().map(|(n, v)| Ok((n.clone(), to_tensor(path, n, v, device)?))).collect::<Result<_>>()?;
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}
