//! The IDX format of MNIST (big-endian header: magic `0x0000_08_NN`, then dims): images as F32
//! scaled to [0, 1], labels as I64.

use super::Dataset;
use crate::{DType, Device, Error, Result, Tensor};
use std::path::Path;

pub struct Mnist {
    images: Vec<u8>,
    labels: Vec<u8>,
    /// Pixels per image (rows * cols); `images` holds exactly `labels.len()` of them.
    px: usize,
}

fn bad(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Io { op: "idx", msg: format!("{}: {msg}", path.display()) }
}

/// The element type an IDX type byte names, for messages.
fn type_name(t: u8) -> Option<&'static str> {
    Some(match t {
        0x08 => "u8",
        0x09 => "i8",
        0x0B => "i16",
        0x0C => "i32",
        0x0D => "f32",
        0x0E => "f64",
        _ => return None,
    })
}

/// Dims and payload of an IDX file of unsigned bytes with `ndim` dims. The header is checked
/// field by field, and the dims against the data with checked arithmetic, so `get` can index
/// without further checks.
fn read_idx(path: &Path, ndim: usize) -> Result<(Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).map_err(|e| bad(path, e))?;
    let Some((&magic, rest)) = bytes.split_first_chunk::<4>() else {
        return Err(bad(path, format!("{} bytes is shorter than the 4-byte magic number", bytes.len())));
    };
    let shown = u32::from_be_bytes(magic);
    if magic[..2] != [0, 0] {
        return Err(bad(path, format!("magic {shown:#010x}: an IDX file starts with two zero bytes; not an IDX file")));
    }
    if magic[2] != 0x08 {
        let what = type_name(magic[2]).map_or("an unknown type".to_string(), |t| format!("{t} elements"));
        return Err(bad(path, format!("magic {shown:#010x}: type byte {:#04x} ({what}) is not supported; MNIST files hold unsigned bytes (0x08)", magic[2])));
    }
    if magic[3] as usize != ndim {
        return Err(bad(path, format!("magic {shown:#010x}: the file has {} dims, expected {ndim}", magic[3])));
    }
    let Some((dims, data)) = rest.split_at_checked(4 * ndim) else {
        return Err(bad(path, format!("{} bytes is shorter than the header of {} bytes (magic and {ndim} dims)", bytes.len(), 4 + 4 * ndim)));
    };
    let dims: Vec<usize> = dims.chunks_exact(4).map(|d| u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize).collect();
    // As Tensor::zeros: with zeros counted as ones the product must fit, so rows * cols does.
    let fits = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d.max(1))).is_some_and(|n| n <= isize::MAX as usize);
    if !fits {
        return Err(bad(path, format!("dims {dims:?}: their product overflows")));
    }
    let n: usize = dims.iter().product();
    if data.len() != n {
        let what = if data.len() < n { "short data" } else { "trailing bytes" };
        return Err(bad(path, format!("dims {dims:?} need {n} bytes of data, the file has {} ({what})", data.len())));
    }
    Ok((dims, data.to_vec()))
}

impl Mnist {
    /// Reads an images file (`*-images-idx3-ubyte`) and its labels file (`*-labels-idx1-ubyte`).
    pub fn from_idx(images: impl AsRef<Path>, labels: impl AsRef<Path>) -> Result<Mnist> {
        let (images, labels) = (images.as_ref(), labels.as_ref());
        let (idims, ibytes) = read_idx(images, 3)?;
        let (ldims, lbytes) = read_idx(labels, 1)?;
        if idims[0] != ldims[0] {
            return Err(bad(labels, format!("{} labels for {} images (in {})", ldims[0], idims[0], images.display())));
        }
        // Cannot overflow: read_idx checked the product of the dims.
        let px = idims[1] * idims[2];
        Ok(Mnist { images: ibytes, labels: lbytes, px })
    }
}

impl Dataset for Mnist {
    fn len(&self) -> usize {
        self.labels.len()
    }
    /// A flattened image of rows * cols values in [0, 1], and its label.
    fn get(&self, index: usize) -> Result<(Tensor, Tensor)> {
        if index >= self.len() {
            return Err(Error::Index { op: "Mnist::get", index: index as i64, size: self.len() });
        }
        let px = self.px;
        let x: Vec<f32> = self.images[index * px..(index + 1) * px].iter().map(|&b| b as f32 / 255.0).collect();
        Ok((Tensor::from_vec(x, &[px], &Device::Cpu)?, Tensor::scalar(self.labels[index] as f64, DType::I64, &Device::Cpu)?))
    }
}
