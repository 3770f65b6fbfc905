//! Reading a `transformers` model directory: `config.json` and the safetensors weights, one
//! file or shards listed by `model.safetensors.index.json`.

use crate::{DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const OP: &str = "models::load";

/// An error about `path`.
pub(super) fn bad(path: impl AsRef<Path>, msg: impl std::fmt::Display) -> Error {
    Error::Io { op: OP, msg: format!("{}: {msg}", path.as_ref().display()) }
}

/// `config.json` of `dir`, as a JSON object.
pub(super) fn read_config(dir: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| bad(&path, e))?;
    match serde_json::from_str(&text).map_err(|e| bad(&path, format!("is not valid JSON: {e}")))? {
        serde_json::Value::Object(m) => Ok(m),
        _ => Err(bad(&path, "is JSON but not an object")),
    }
}

/// Reads a config's fields with the file named in every error.
pub(super) struct Fields<'a> {
    pub map: &'a serde_json::Map<String, serde_json::Value>,
}

impl Fields<'_> {
    fn err(&self, key: &str, msg: impl std::fmt::Display) -> Error {
        Error::Io { op: OP, msg: format!("config.json: {key} {msg}") }
    }
    /// A positive integer field, or `default` when the field is absent or null.
    pub fn size(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match self.map.get(key) {
            None | Some(serde_json::Value::Null) => default.ok_or_else(|| self.err(key, "is missing")),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && n <= u32::MAX as u64 => Ok(n as usize),
                _ => Err(self.err(key, format!("must be a positive integer, got {v}"))),
            },
        }
    }
    /// A finite number field, or `default` when absent.
    pub fn number(&self, key: &str, default: Option<f64>) -> Result<f64> {
        match self.map.get(key) {
            None | Some(serde_json::Value::Null) => default.ok_or_else(|| self.err(key, "is missing")),
            Some(v) => v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| self.err(key, format!("must be a number, got {v}"))),
        }
    }
    pub fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.map.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.err(key, format!("must be true or false, got {v}"))),
        }
    }
    pub fn string(&self, key: &str, default: &str) -> Result<String> {
        match self.map.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default.to_string()),
            Some(v) => v.as_str().map(str::to_string).ok_or_else(|| self.err(key, format!("must be a string, got {v}"))),
        }
    }
}

/// Every tensor of a checkpoint by name (on the host, as stored), handed out once each.
pub(super) struct Weights {
    dir: PathBuf,
    tensors: BTreeMap<String, Tensor>,
}

impl Weights {
    /// The tensors of `dir`: the shards of `model.safetensors.index.json` where there is one,
    /// else `model.safetensors`.
    pub fn read(dir: &Path) -> Result<Weights> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut tensors = BTreeMap::new();
        if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| bad(&index, e))?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(&index, format!("is not valid JSON: {e}")))?;
            let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
                return Err(bad(&index, "has no weight_map object"));
            };
            let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (name, file) in map {
                let Some(file) = file.as_str().filter(|f| !f.contains('/') && !f.contains('\\') && !f.is_empty()) else {
                    return Err(bad(&index, format!("weight_map: {name} maps to {file}, not a file name in the directory")));
                };
                shards.entry(file).or_default().push(name);
            }
            for (file, names) in shards {
                let path = dir.join(file);
                if !path.exists() {
                    return Err(bad(&path, format!("is missing: model.safetensors.index.json lists it for {} tensor(s), {} among them", names.len(), names[0])));
                }
                let mut found: BTreeMap<String, Tensor> = crate::nn::safetensors::load(&path, &Device::Cpu)?.into_iter().collect();
                for name in names {
                    let t = found.remove(name).ok_or_else(|| bad(&path, format!("does not hold {name}, which model.safetensors.index.json places there")))?;
                    tensors.insert(name.to_string(), t);
                }
            }
        } else if single.exists() {
            tensors = crate::nn::safetensors::load(&single, &Device::Cpu)?.into_iter().collect();
        } else {
            let other = ["pytorch_model.bin", "model.bin", "tf_model.h5"].into_iter().find(|f| dir.join(f).exists());
            return Err(bad(dir, match other {
                Some(f) => format!("holds {f} but no safetensors weights: save the model with safe_serialization=True"),
                None => "has neither model.safetensors nor model.safetensors.index.json".to_string(),
            }));
        }
        Ok(Weights { dir: dir.to_path_buf(), tensors })
    }

    /// Fresh weights for `shapes` as `transformers` initialises its models: normal with std
    /// 0.02 (drawn from kiln's generator), ones where `is_norm` says a name is a norm's weight,
    /// zeros for biases.
    pub fn fresh(shapes: Vec<(String, Vec<usize>)>, is_norm: impl Fn(&str) -> bool) -> Result<Weights> {
        let mut tensors = BTreeMap::new();
        for (name, shape) in shapes {
            let t = if is_norm(&name) {
                Tensor::ones(&shape, DType::F32, &Device::Cpu)?
            } else if name.ends_with(".bias") {
                Tensor::zeros(&shape, DType::F32, &Device::Cpu)?
            } else {
                Tensor::randn(&shape, DType::F32, &Device::Cpu)?.mul_scalar(0.02)?
            };
            tensors.insert(name, t);
        }
        Ok(Weights { dir: PathBuf::from("(fresh weights)"), tensors })
    }

    /// Whether the checkpoint holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Tensor `name` of `shape` as a parameter: converted to `dtype`, on `device`, requiring grad.
    pub fn take(&mut self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let t = self.tensors.remove(name).ok_or_else(|| bad(&self.dir, format!("the checkpoint has no tensor {name} (of shape {shape:?})")))?;
        if t.shape() != shape {
            return Err(bad(&self.dir, format!("{name} has shape {:?} in the checkpoint, the config asks for {shape:?}", t.shape())));
        }
        if !t.dtype().is_float() {
            return Err(bad(&self.dir, format!("{name} is {:?}, not floating point", t.dtype())));
        }
        Ok(t.to_dtype(dtype)?.to_device(device)?.detach().requires_grad())
    }

    /// Drops the tensors for which `unused` holds (buffers a checkpoint carries that the model
    /// computes itself, such as GPT-2's causal mask).
    pub fn drop_unused(&mut self, unused: impl Fn(&str) -> bool) {
        self.tensors.retain(|n, _| !unused(n));
    }

    /// An error naming the tensors nothing took.
    pub fn finish(self) -> Result<()> {
        if self.tensors.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = self.tensors.keys().map(String::as_str).take(8).collect();
        Err(bad(&self.dir, format!("{} tensor(s) of the checkpoint fit no parameter of the model: {}{}", self.tensors.len(), names.join(", "), if self.tensors.len() > 8 { ", ..." } else { "" })))
    }
}
