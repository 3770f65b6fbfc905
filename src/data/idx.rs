//! The IDX format of MNIST (big-endian header: magic `0x0000_08_NN`, then dims): images as F32
//! scaled to [0, 1], labels as I64.

use super::Dataset;
use crate::{DType, Device, Error, Result, Tensor};

pub struct Mnist {
    images: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
}

fn bad(path: &str, msg: impl std::fmt::Display) -> Error {
    Error::Io { op: "idx", msg: format!("{path}: {msg}") }
}

/// Dims and payload of an IDX file of unsigned bytes with `ndim` dims.
fn read_idx(path: &str, ndim: usize) -> Result<(Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).map_err(|e| bad(path, e))?;
    let header = 4 + 4 * ndim;
    if bytes.len() < header {
        return Err(bad(path, format!("{} bytes is shorter than the header", bytes.len())));
    }
    let magic = u32::from_be_bytes(bytes[0..4].try_into().expect("4 bytes"));
    if magic != 0x0800 | ndim as u32 {
        return Err(bad(path, format!("magic {magic:#010x}: expected unsigned bytes with {ndim} dims ({:#010x})", 0x0800 | ndim as u32)));
    }
    let dims: Vec<usize> = (0..ndim).map(|d| u32::from_be_bytes(bytes[4 + 4 * d..8 + 4 * d].try_into().expect("4 bytes")) as usize).collect();
    let n: usize = dims.iter().product();
    if bytes.len() != header + n {
        return Err(bad(path, format!("dims {dims:?} need {n} bytes of data, the file has {}", bytes.len() - header)));
    }
    Ok((dims, bytes[header..].to_vec()))
}

impl Mnist {
    /// Reads an images file (`*-images-idx3-ubyte`) and its labels file (`*-labels-idx1-ubyte`).
    pub fn from_idx(images: &str, labels: &str) -> Result<Mnist> {
        let (idims, ibytes) = read_idx(images, 3)?;
        let (ldims, lbytes) = read_idx(labels, 1)?;
        if idims[0] != ldims[0] {
            return Err(bad(labels, format!("{} labels for {} images", ldims[0], idims[0])));
        }
        Ok(Mnist { images: ibytes, labels: lbytes, rows: idims[1], cols: idims[2] })
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
        let px = self.rows * self.cols;
        let x: Vec<f32> = self.images[index * px..(index + 1) * px].iter().map(|&b| b as f32 / 255.0).collect();
        Ok((Tensor::from_vec(x, &[px], &Device::Cpu)?, Tensor::scalar(self.labels[index] as f64, DType::I64, &Device::Cpu)?))
    }
}
