//! The summary of a GGUF file that `muser inspect` prints: architecture, geometry (the
//! `<arch>.*` keys), tokenizer, tensor table and totals. Built from the header alone.

use std::fmt;

use crate::value::{Array, Value};
use crate::{GgmlType, GgufFile};

/// Tokenizer facts from the `tokenizer.*` keys.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerSummary {
    pub model: String,
    pub pre: Option<String>,
    pub n_tokens: usize,
    pub n_merges: usize,
    pub bos: Option<u64>,
    pub eos: Option<u64>,
    pub eot: Option<u64>,
    pub has_chat_template: bool,
}

/// One row of the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRow {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub n_elements: u64,
    pub bytes: u64,
}

/// Tensor count, values and bytes of one type.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeTotal {
    pub ty: GgmlType,
    pub n_tensors: usize,
    pub n_elements: u64,
    pub bytes: u64,
}

/// Everything `muser inspect` shows.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub version: u32,
    pub alignment: u64,
    pub file_len: u64,
    pub architecture: Option<String>,
    pub name: Option<String>,
    /// `<arch>.*` keys with the prefix removed, in file order, values rendered.
    pub geometry: Vec<(String, String)>,
    pub tokenizer: Option<TokenizerSummary>,
    pub tensors: Vec<TensorRow>,
    pub by_type: Vec<TypeTotal>,
    /// Sum of the element counts of all tensors (what llama.cpp reports as the model's params).
    pub n_params: u64,
    pub tensor_bytes: u64,
}

impl Report {
    /// Builds the report from a validated file.
    pub fn new(file: &GgufFile) -> Report {
        let architecture = file.get_opt_str("general.architecture").ok().flatten();
        let geometry = match architecture {
            Some(arch) => {
                let prefix = format!("{arch}.");
                file.metadata()
                    .iter()
                    .filter_map(|(k, v)| Some((k.strip_prefix(&prefix)?.to_string(), render(v))))
                    .collect()
            }
            None => Vec::new(),
        };
        let tensors: Vec<TensorRow> = file
            .tensors()
            .iter()
            .map(|t| TensorRow {
                name: t.name.clone(),
                ty: t.ty,
                dims: t.dims.clone(),
                n_elements: t.n_elements(),
                bytes: t.size as u64,
            })
            .collect();
        let mut by_type: Vec<TypeTotal> = Vec::new();
        for t in &tensors {
            match by_type.iter_mut().find(|x| x.ty == t.ty) {
                Some(x) => {
                    x.n_tensors += 1;
                    x.n_elements += t.n_elements;
                    x.bytes += t.bytes;
                }
                None => by_type.push(TypeTotal {
                    ty: t.ty,
                    n_tensors: 1,
                    n_elements: t.n_elements,
                    bytes: t.bytes,
                }),
            }
        }
        by_type.sort_by_key(|x| std::cmp::Reverse(x.bytes));
        Report {
            version: file.version(),
            alignment: file.alignment(),
            file_len: file.file_len(),
            architecture: architecture.map(str::to_string),
            name: file
                .get_opt_str("general.name")
                .ok()
                .flatten()
                .map(str::to_string),
            geometry,
            tokenizer: tokenizer_summary(file),
            n_params: tensors.iter().map(|t| t.n_elements).sum(),
            tensor_bytes: tensors.iter().map(|t| t.bytes).sum(),
            tensors,
            by_type,
        }
    }
}

fn tokenizer_summary(file: &GgufFile) -> Option<TokenizerSummary> {
    let model = file.get_opt_str("tokenizer.ggml.model").ok().flatten()?;
    let len = |key| file.get_array(key).map(Array::len).unwrap_or(0);
    let id = |key| file.get(key).and_then(Value::as_u64_lossless);
    Some(TokenizerSummary {
        model: model.to_string(),
        pre: file
            .get_opt_str("tokenizer.ggml.pre")
            .ok()
            .flatten()
            .map(str::to_string),
        n_tokens: len("tokenizer.ggml.tokens"),
        n_merges: len("tokenizer.ggml.merges"),
        bos: id("tokenizer.ggml.bos_token_id"),
        eos: id("tokenizer.ggml.eos_token_id"),
        eot: id("tokenizer.ggml.eot_token_id"),
        has_chat_template: file.get("tokenizer.chat_template").is_some(),
    })
}

/// A value for the geometry list: scalars as they are, short scalar arrays in full.
fn render(v: &Value) -> String {
    fn list<T: fmt::Display>(v: &[T]) -> String {
        let items: Vec<String> = v.iter().map(|x| x.to_string()).collect();
        format!("[{}]", items.join(", "))
    }
    const SHORT: usize = 64;
    match v {
        Value::Array(a) if a.len() <= SHORT => match a {
            Array::U32(x) => list(x),
            Array::I32(x) => list(x),
            Array::F32(x) => list(x),
            Array::Bool(x) => {
                let s: String = x.iter().map(|&b| if b { 'T' } else { 'F' }).collect();
                format!("[{s}] (bool)")
            }
            _ => v.to_string(),
        },
        _ => v.to_string(),
    }
}

fn dims(d: &[u64]) -> String {
    let parts: Vec<String> = d.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// "27,854,794,240".
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".to_string());
        writeln!(
            f,
            "file          GGUF v{}, {} bytes, alignment {}",
            self.version,
            thousands(self.file_len),
            self.alignment
        )?;
        writeln!(f, "architecture  {}", opt(&self.architecture))?;
        writeln!(f, "name          {}", opt(&self.name))?;
        if !self.geometry.is_empty() {
            writeln!(f, "\ngeometry")?;
            for (k, v) in &self.geometry {
                writeln!(f, "  {k:<40} {v}")?;
            }
        }
        match &self.tokenizer {
            Some(t) => {
                let id = |x: Option<u64>| x.map_or("-".to_string(), |v| v.to_string());
                writeln!(f, "\ntokenizer")?;
                writeln!(
                    f,
                    "  model {}, pre {}, {} tokens, {} merges",
                    t.model,
                    t.pre.as_deref().unwrap_or("-"),
                    t.n_tokens,
                    t.n_merges
                )?;
                writeln!(
                    f,
                    "  bos {}, eos {}, eot {}, chat template: {}",
                    id(t.bos),
                    id(t.eos),
                    id(t.eot),
                    if t.has_chat_template { "yes" } else { "no" }
                )?;
            }
            None => writeln!(f, "\ntokenizer     none")?,
        }
        writeln!(f, "\ntensors ({})", self.tensors.len())?;
        writeln!(
            f,
            "  {:<40} {:<8} {:<24} {:>16}",
            "name", "type", "dims", "bytes"
        )?;
        for t in &self.tensors {
            writeln!(
                f,
                "  {:<40} {:<8} {:<24} {:>16}",
                t.name,
                t.ty.name(),
                dims(&t.dims),
                thousands(t.bytes)
            )?;
        }
        writeln!(f, "\nby type")?;
        for t in &self.by_type {
            writeln!(
                f,
                "  {:<8} {:>5} tensors {:>18} params {:>10.3} GiB",
                t.ty.name(),
                t.n_tensors,
                thousands(t.n_elements),
                gib(t.bytes)
            )?;
        }
        let bpw = if self.n_params == 0 {
            0.0
        } else {
            self.tensor_bytes as f64 * 8.0 / self.n_params as f64
        };
        writeln!(f, "\nparameters    {}", thousands(self.n_params))?;
        writeln!(
            f,
            "tensor bytes  {} ({:.2} GiB, {:.2} bits per weight)",
            thousands(self.tensor_bytes),
            gib(self.tensor_bytes),
            bpw
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(27_854_794_240), "27,854,794,240");
    }
}
