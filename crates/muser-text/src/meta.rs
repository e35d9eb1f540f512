//! Typed reads of GGUF metadata with llama.cpp's strictness (a key of the wrong type is an error).

use std::collections::HashMap;

use muser_gguf::{Array, Value};

use crate::error::{Result, TextError};

/// An index over a GGUF file's metadata pairs.
pub(crate) struct Meta<'a> {
    map: HashMap<&'a str, &'a Value>,
}

impl<'a> Meta<'a> {
    pub fn new(pairs: &'a [(String, Value)]) -> Self {
        Meta {
            map: pairs.iter().map(|(k, v)| (k.as_str(), v)).collect(),
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).copied()
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> TextError {
        TextError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_desc(),
        }
    }

    pub fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong(key, "string", v)),
        }
    }

    pub fn u32_opt(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::U32(x)) => Ok(Some(*x)),
            Some(v) => Err(Self::wrong(key, "u32", v)),
        }
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(x)) => Ok(Some(*x)),
            Some(v) => Err(Self::wrong(key, "bool", v)),
        }
    }

    pub fn array_opt(&self, key: &str) -> Result<Option<&'a Array>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(Self::wrong(key, "array", v)),
        }
    }

    pub fn str_array_opt(&self, key: &str) -> Result<Option<&'a [String]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(Array::String(a))) => Ok(Some(a)),
            Some(v) => Err(Self::wrong(key, "array[string]", v)),
        }
    }
}
