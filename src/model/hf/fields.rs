//! Reading a Hugging Face `config.json` field by field, the same way for every family: a typed
//! value or a default, and an error that names the file and the field.

use std::path::Path;

use serde_json::{Map, Value};

use super::HfError;

pub(in crate::model) fn field_err(path: &Path, field: &str, message: impl Into<String>) -> HfError {
    HfError::Field {
        path: path.to_path_buf(),
        field: field.into(),
        message: message.into(),
    }
}

pub(in crate::model) fn unsupported(path: &Path, field: &str, value: &Value, why: &str) -> HfError {
    HfError::Unsupported {
        path: path.to_path_buf(),
        field: field.into(),
        value: value.to_string(),
        why: why.into(),
    }
}

/// Reads a JSON file into a value.
pub(in crate::model) fn read_json(path: &Path) -> Result<Value, HfError> {
    let text = std::fs::read_to_string(path).map_err(|source| HfError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| HfError::Format {
        path: path.to_path_buf(),
        message: format!("not valid JSON: {e}"),
    })
}

/// The config's object, field by field, with the file's path for messages.
pub(in crate::model) struct Fields<'a> {
    pub path: &'a Path,
    pub map: &'a Map<String, Value>,
}

impl Fields<'_> {
    /// A positive integer field, or `default` when absent (transformers' `GPT2Config` default).
    pub fn size(&self, field: &str, default: Option<usize>) -> Result<usize, HfError> {
        match self.map.get(field) {
            None | Some(Value::Null) => {
                default.ok_or_else(|| field_err(self.path, field, "is missing"))
            }
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    field_err(self.path, field, format!("{v} is not a positive integer"))
                }),
        }
    }

    pub fn flag(&self, field: &str, default: bool) -> Result<bool, HfError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(field_err(
                self.path,
                field,
                format!("{v} is not true or false"),
            )),
        }
    }

    /// Refuses `field` when present with a value other than `wanted` (absent means `wanted`).
    pub(crate) fn require_flag(&self, field: &str, wanted: bool, why: &str) -> Result<(), HfError> {
        if self.flag(field, wanted)? != wanted {
            return Err(unsupported(self.path, field, &self.map[field], why));
        }
        Ok(())
    }

    pub fn number(&self, field: &str, default: f64) -> Result<f64, HfError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| field_err(self.path, field, format!("{v} is not a number"))),
        }
    }

    pub fn text(&self, field: &str) -> Option<&str> {
        self.map.get(field).and_then(Value::as_str)
    }
}
