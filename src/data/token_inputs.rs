//! The inputs of a tokenized corpus: which files `--data` names, and the documents in each.
//!
//! * A file named on the command line is read whatever its name: JSON Lines when it ends in
//!   `.jsonl`, `.ndjson` or `.json`, plain text otherwise. A directory contributes the files
//!   under it (recursively, in path order) that end in `.txt`, `.text`, `.md`, `.jsonl`,
//!   `.ndjson` or `.json`; names starting with a dot (the token cache among them) are skipped, so
//!   that a directory never picks up a stray binary or its own cache, and linked directories are
//!   not entered (a link to a parent would make the walk endless).
//! * A text file is one document, its whole UTF-8 text. A JSONL line is one document, the string
//!   in its text field; blank lines are skipped (a trailing newline is not a document).
//! * Every failure names the file and the line: a non-UTF-8 byte, a line that is not a JSON
//!   object, a missing or non-string field, a file with no document at all.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::DataError;

/// How a file is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputFormat {
    /// The whole file is one document.
    Text,
    /// One JSON object per line, the document in a string field.
    Jsonl,
}

/// One input file as the token cache's manifest records it: a file whose size or modification
/// time differs from the manifest's makes the cache stale.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFile {
    pub path: PathBuf,
    pub format: InputFormat,
    pub size: u64,
    /// Modification time in nanoseconds since the Unix epoch (0 where the system has none).
    pub modified_ns: u64,
}

/// Extensions a directory contributes; JSON Lines for the `json` family, text for the rest.
const DIR_EXTENSIONS: [&str; 6] = ["txt", "text", "md", "jsonl", "ndjson", "json"];

fn format_of(path: &Path) -> InputFormat {
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl" | "ndjson" | "json") => InputFormat::Jsonl,
        _ => InputFormat::Text,
    }
}

fn read_error(path: &Path, source: std::io::Error) -> DataError {
    DataError::Read {
        path: path.to_path_buf(),
        source,
        hint: "",
    }
}

/// The files behind the `--data` arguments, in argument order (a directory's in path order),
/// canonicalised, each once.
pub fn resolve_inputs(args: &[PathBuf]) -> Result<Vec<InputFile>, DataError> {
    if args.is_empty() {
        return Err(DataError::NoInputs(
            "no --data file or directory was given".into(),
        ));
    }
    let mut paths = Vec::new();
    for arg in args {
        let meta = std::fs::metadata(arg).map_err(|e| read_error(arg, e))?;
        if meta.is_dir() {
            let before = paths.len();
            collect_dir(arg, &mut paths)?;
            if paths.len() == before {
                return Err(DataError::NoInputs(format!(
                    "directory {} holds no {} file",
                    arg.display(),
                    DIR_EXTENSIONS.map(|e| format!(".{e}")).join(" / ")
                )));
            }
        } else {
            paths.push(arg.clone());
        }
    }
    let mut files: Vec<InputFile> = Vec::with_capacity(paths.len());
    for p in paths {
        let file = stat(&p)?;
        if !files.iter().any(|f| f.path == file.path) {
            files.push(file);
        }
    }
    Ok(files)
}

fn collect_dir(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| read_error(dir, e))?
        .map(|e| e.map(|e| e.path()).map_err(|e| read_error(dir, e)))
        .collect::<Result<_, _>>()?;
    entries.sort();
    for path in entries {
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_none_or(|n| n.starts_with('.'));
        if hidden {
            continue;
        }
        // A linked directory is not entered: a link back up would never end.
        let linked = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
        if path.is_dir() {
            if !linked {
                collect_dir(&path, out)?;
            }
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| DIR_EXTENSIONS.contains(&e))
        {
            out.push(path);
        }
    }
    Ok(())
}

fn stat(path: &Path) -> Result<InputFile, DataError> {
    let canonical = std::fs::canonicalize(path).map_err(|e| read_error(path, e))?;
    let meta = std::fs::metadata(&canonical).map_err(|e| read_error(path, e))?;
    let modified_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    Ok(InputFile {
        format: format_of(&canonical),
        path: canonical,
        size: meta.len(),
        modified_ns,
    })
}

/// A document and the 1-based line it starts on.
pub(crate) struct Document {
    pub line: usize,
    pub text: String,
}

/// Reads `file`'s documents, handing them to `sink` in order; `sink` also learns how many bytes
/// of the file each one consumed (for the progress bar).
pub(crate) fn read_documents(
    file: &InputFile,
    field: &str,
    sink: &mut dyn FnMut(Document, u64) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let path = file.path.as_path();
    let f = File::open(path).map_err(|e| read_error(path, e))?;
    match file.format {
        InputFormat::Text => read_text(path, f, sink),
        InputFormat::Jsonl => read_jsonl(path, f, field, sink),
    }
}

fn read_text(
    path: &Path,
    mut f: File,
    sink: &mut dyn FnMut(Document, u64) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).map_err(|e| read_error(path, e))?;
    if bytes.is_empty() {
        return Err(empty(path));
    }
    let n = bytes.len() as u64;
    let text = String::from_utf8(bytes).map_err(|e| {
        let bytes = e.as_bytes();
        not_utf8(path, bytes, 0, e.utf8_error().valid_up_to())
    })?;
    sink(Document { line: 1, text }, n)
}

fn read_jsonl(
    path: &Path,
    f: File,
    field: &str,
    sink: &mut dyn FnMut(Document, u64) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let mut reader = BufReader::new(f);
    let mut raw = Vec::new();
    let (mut line, mut offset, mut documents) = (0usize, 0u64, 0usize);
    loop {
        raw.clear();
        let n = reader
            .read_until(b'\n', &mut raw)
            .map_err(|e| read_error(path, e))?;
        if n == 0 {
            break;
        }
        line += 1;
        let text = std::str::from_utf8(&raw).map_err(|e| DataError::FileNotUtf8 {
            path: path.to_path_buf(),
            line,
            offset: offset + e.valid_up_to() as u64,
        })?;
        offset += n as u64;
        if text.trim().is_empty() {
            continue;
        }
        documents += 1;
        let text = field_of(path, line, text, field)?;
        sink(Document { line, text }, n as u64)?;
    }
    if documents == 0 {
        return Err(empty(path));
    }
    Ok(())
}

/// The string in `field` of the JSON object on `line`.
fn field_of(path: &Path, line: usize, text: &str, field: &str) -> Result<String, DataError> {
    let at = |msg: String| DataError::Jsonl {
        path: path.to_path_buf(),
        line,
        msg,
    };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        // serde_json counts lines inside this one; the column is what helps.
        let what = e.to_string();
        let what = what
            .rsplit_once(" at line ")
            .map_or(what.as_str(), |(w, _)| w);
        at(format!("not JSON: {what} (column {})", e.column()))
    })?;
    let serde_json::Value::Object(mut map) = value else {
        return Err(at(format!(
            "expected a JSON object with a \"{field}\" field, found {}",
            kind(&value)
        )));
    };
    match map.remove(field) {
        Some(serde_json::Value::String(s)) => Ok(s),
        Some(other) => Err(at(format!(
            "field \"{field}\" is {}, not a string",
            kind(&other)
        ))),
        None => {
            let keys: Vec<&str> = map.keys().map(String::as_str).collect();
            Err(at(format!(
                "no \"{field}\" field (the object has: {}); name the field with --text-field",
                if keys.is_empty() {
                    "no fields".to_string()
                } else {
                    keys.join(", ")
                }
            )))
        }
    }
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn empty(path: &Path) -> DataError {
    DataError::EmptyFile {
        path: path.to_path_buf(),
    }
}

/// The line and file offset of the first bad byte at `valid` in `bytes` (which start at file
/// offset `base`).
fn not_utf8(path: &Path, bytes: &[u8], base: u64, valid: usize) -> DataError {
    let line = 1 + bytes[..valid].iter().filter(|&&b| b == b'\n').count();
    DataError::FileNotUtf8 {
        path: path.to_path_buf(),
        line,
        offset: base + valid as u64,
    }
}
