//! `tokenizer.json` through Hugging Face's `tokenizers`: the same ids as the Python library.

use crate::{Error, Result};
use std::path::Path;

/// A text tokenizer read from a `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

fn err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Io { op: "tokenizer", msg: format!("{what}: {e}") }
}

impl Tokenizer {
    /// Reads `tokenizer.json` (or any file in its format).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| err(&path.display().to_string(), e))?;
        Tokenizer::from_bytes(&bytes).map_err(|e| match e {
            Error::Io { op, msg } => Error::Io { op, msg: format!("{}: {msg}", path.display()) },
            e => e,
        })
    }
    /// A tokenizer from the contents of a `tokenizer.json`.
    pub fn from_bytes(json: &[u8]) -> Result<Tokenizer> {
        Ok(Tokenizer { inner: tokenizers::Tokenizer::from_bytes(json).map_err(|e| err("not a tokenizer.json", e))? })
    }
    /// Wraps a tokenizer built with the `tokenizers` crate.
    pub fn from_tokenizers(inner: tokenizers::Tokenizer) -> Tokenizer {
        Tokenizer { inner }
    }
    /// The token ids of `text` (with the special tokens the tokenizer's post-processor adds).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, true).map_err(|e| err("encode", e))?.get_ids().to_vec())
    }
    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| err("decode", e))
    }
    /// The id of `token` (a special token such as `<|endoftext|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
