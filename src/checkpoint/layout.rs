//! Recognising checkpoints on disk by their layout (see the [module docs](super)), so that a
//! command can refuse to write into one ([`crate::outputs`]) whether or not it was told
//! the directory is a checkpoint.
//!
//! A *save directory* holds a `latest` that names a step directory, a lock, or a step directory
//! with a zerodp manifest. A *checkpoint* (step) directory holds a zerodp manifest, or is named
//! `stepNNNNNN` (or is a save's `.tmp-`/`.old-` directory) inside a save directory. A
//! `manifest.json` of another program does not make a directory a checkpoint.

use super::manifest::FORMAT;
use super::LOCK_FILE;
use std::path::{Path, PathBuf};

/// Every checkpoint directory's manifest.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The file of a save directory that names its newest complete checkpoint.
pub const LATEST_FILE: &str = "latest";

/// Whether `name` is a checkpoint directory's name (`step000120`), or a save's temporary
/// (`.tmp-step000120`) or replaced (`.old-step000120`) one.
pub(crate) fn is_step_name(name: &str) -> bool {
    let bare = name
        .strip_prefix(".tmp-")
        .or_else(|| name.strip_prefix(".old-"))
        .unwrap_or(name);
    bare.strip_prefix("step")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Whether a file named `name` directly in a save directory belongs to its checkpoints.
pub(crate) fn is_reserved_name(name: &str) -> bool {
    name == LATEST_FILE || name == LOCK_FILE || is_step_name(name)
}

/// Whether `dir` holds a zerodp manifest (read only as far as its `format`).
pub(crate) fn has_manifest(dir: &Path) -> bool {
    #[derive(serde::Deserialize)]
    struct Format {
        format: String,
    }
    let Ok(text) = std::fs::read(dir.join(MANIFEST_FILE)) else {
        return false;
    };
    serde_json::from_slice::<Format>(&text).is_ok_and(|f| f.format == FORMAT)
}

/// Whether `dir` is a save directory; see the module docs.
pub(crate) fn is_save_dir(dir: &Path) -> bool {
    if !dir.is_dir() {
        return false;
    }
    let latest = std::fs::read_to_string(dir.join(LATEST_FILE));
    if latest.is_ok_and(|t| is_step_name(t.trim())) || dir.join(LOCK_FILE).exists() {
        return true;
    }
    step_dirs(dir).iter().any(|d| has_manifest(d))
}

/// Whether `dir` is one checkpoint (a step directory); see the module docs.
pub(crate) fn is_checkpoint(dir: &Path) -> bool {
    if has_manifest(dir) {
        return true;
    }
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(is_step_name);
    named && dir.is_dir() && dir.parent().is_some_and(is_save_dir)
}

/// The step directories (and save temporaries) directly inside `dir`.
pub(crate) fn step_dirs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_step_name))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// Every file that belongs to the checkpoints of save directory `dir`: `latest`, the lock, and
/// the files of each step directory.
pub(crate) fn save_dir_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = [LATEST_FILE, LOCK_FILE]
        .iter()
        .map(|n| dir.join(n))
        .filter(|p| p.is_file())
        .collect();
    for step in step_dirs(dir) {
        files.extend(checkpoint_files(&step));
    }
    files
}

/// The files directly inside one checkpoint directory.
pub(crate) fn checkpoint_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.path())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_the_layout() {
        for n in ["step000120", "step1", ".tmp-step000004", ".old-step000004"] {
            assert!(is_step_name(n), "{n}");
        }
        for n in [
            "step",
            "steps",
            "step12a",
            "rank00000.safetensors",
            ".tmp-x",
        ] {
            assert!(!is_step_name(n), "{n}");
        }
        assert!(is_reserved_name("latest") && is_reserved_name(LOCK_FILE));
        assert!(!is_reserved_name("full.safetensors"));
    }

    #[test]
    fn another_programs_manifest_is_not_a_checkpoint() {
        let dir = std::env::temp_dir().join(format!("zerodp-layout-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("web")).unwrap();
        std::fs::write(dir.join("web").join(MANIFEST_FILE), r#"{"name":"app"}"#).unwrap();
        assert!(!is_checkpoint(&dir.join("web")) && !is_save_dir(&dir));
        let step = dir.join("step000002");
        std::fs::create_dir(&step).unwrap();
        std::fs::write(
            step.join(MANIFEST_FILE),
            format!(r#"{{"format":"{FORMAT}"}}"#),
        )
        .unwrap();
        assert!(is_checkpoint(&step) && is_save_dir(&dir));
        // A save's temporary directory, before its manifest exists, is one too.
        std::fs::create_dir(dir.join(".tmp-step000003")).unwrap();
        assert!(is_checkpoint(&dir.join(".tmp-step000003")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
