//! Output paths are checked before any work: an output must not be an input (by canonical path
//! or by file identity, so a symlink or a hard link to the config is caught too), nor another
//! output, nor a directory, and its directory must exist and be writable. A run that would
//! overwrite its own config, corpus or initial weights, or fail to save after hours of training,
//! is refused at once.

use std::path::{Path, PathBuf};

/// A path a run reads or writes, and the flag or key that named it (for messages).
#[derive(Clone, Copy, Debug)]
pub struct NamedPath<'a> {
    pub name: &'a str,
    pub path: &'a Path,
}

/// Why an output path cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum OutputPathError {
    #[error(
        "{output} {path} is the same file as {input} {input_path}: writing it would destroy the \
         input; choose another {output} path",
        path = .output_path.display(),
        input_path = .input_path.display()
    )]
    SameAsInput {
        output: String,
        output_path: PathBuf,
        input: String,
        input_path: PathBuf,
    },
    #[error("{first} and {second} both name {path}; give each output its own file", path = .path.display())]
    SameOutputs {
        first: String,
        second: String,
        path: PathBuf,
    },
    #[error("{output} {path} is a directory; give a file name inside it", path = .path.display())]
    IsDirectory { output: String, path: PathBuf },
    #[error("{output} {path}: the directory {dir} does not exist; create it first (mkdir -p {dir})", path = .path.display(), dir = .dir.display())]
    NoDirectory {
        output: String,
        path: PathBuf,
        dir: PathBuf,
    },
    #[error("{output} {path}: cannot write in {dir} ({reason}); choose a writable directory", path = .path.display(), dir = .dir.display())]
    NotWritable {
        output: String,
        path: PathBuf,
        dir: PathBuf,
        reason: String,
    },
}

/// Checks every output against every input and the others; see the module docs.
pub fn check_outputs(
    inputs: &[NamedPath<'_>],
    outputs: &[NamedPath<'_>],
) -> Result<(), OutputPathError> {
    for (i, out) in outputs.iter().enumerate() {
        check_writable(out)?;
        let id = identity(out.path);
        for input in inputs {
            if id.is_some() && id == identity(input.path) {
                return Err(OutputPathError::SameAsInput {
                    output: out.name.into(),
                    output_path: out.path.into(),
                    input: input.name.into(),
                    input_path: input.path.into(),
                });
            }
        }
        for other in &outputs[i + 1..] {
            if id.is_some() && id == identity(other.path) {
                return Err(OutputPathError::SameOutputs {
                    first: out.name.into(),
                    second: other.name.into(),
                    path: out.path.into(),
                });
            }
        }
    }
    Ok(())
}

/// What makes two paths the same file: the device and inode of an existing file (symlinks
/// followed), else the canonical directory plus the file name of one still to be created.
#[derive(Debug, PartialEq, Eq)]
enum Identity {
    Inode(u64, u64),
    Planned(PathBuf),
}

fn identity(path: &Path) -> Option<Identity> {
    use std::os::unix::fs::MetadataExt;
    if let Ok(m) = std::fs::metadata(path) {
        return Some(Identity::Inode(m.dev(), m.ino()));
    }
    let dir = std::fs::canonicalize(parent_of(path)).ok()?;
    Some(Identity::Planned(dir.join(path.file_name()?)))
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// The output is not a directory, and a file can be created in its directory (probed by creating
/// and removing an empty file there, which is what the run will need).
fn check_writable(out: &NamedPath<'_>) -> Result<(), OutputPathError> {
    if out.path.is_dir() {
        return Err(OutputPathError::IsDirectory {
            output: out.name.into(),
            path: out.path.into(),
        });
    }
    let dir = parent_of(out.path);
    if !dir.is_dir() {
        return Err(OutputPathError::NoDirectory {
            output: out.name.into(),
            path: out.path.into(),
            dir: dir.into(),
        });
    }
    let probe = dir.join(format!(".zerodp-write-probe-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(OutputPathError::NotWritable {
            output: out.name.into(),
            path: out.path.into(),
            dir: dir.into(),
            reason: e.kind().to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named<'a>(name: &'a str, path: &'a Path) -> NamedPath<'a> {
        NamedPath { name, path }
    }

    #[test]
    fn an_output_equal_to_an_input_is_refused_by_path_and_by_link() {
        let dir = std::env::temp_dir().join(format!("zerodp-outputs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("c.json");
        std::fs::write(&config, "{}").unwrap();
        let inputs = [named("--config", &config)];
        // The same path spelled differently.
        let dotted = dir.join(".").join("c.json");
        let e = check_outputs(&inputs, &[named("--metrics", &dotted)]).unwrap_err();
        assert!(
            e.to_string().contains("is the same file as --config"),
            "{e}"
        );
        // A hard link is the same file.
        let link = dir.join("link.json");
        let _ = std::fs::remove_file(&link);
        std::fs::hard_link(&config, &link).unwrap();
        let e = check_outputs(&inputs, &[named("--save", &link)]).unwrap_err();
        assert!(matches!(e, OutputPathError::SameAsInput { .. }), "{e}");
        // A new file beside it is fine; two outputs on one new file are not.
        let fresh = dir.join("m.jsonl");
        check_outputs(&inputs, &[named("--metrics", &fresh)]).unwrap();
        let e = check_outputs(
            &inputs,
            &[named("--metrics", &fresh), named("--save", &fresh)],
        )
        .unwrap_err();
        assert!(e.to_string().contains("both name"), "{e}");
        // A missing directory, and a directory as the output.
        let missing = dir.join("nope").join("w.safetensors");
        let e = check_outputs(&inputs, &[named("--save", &missing)]).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        let e = check_outputs(&inputs, &[named("--save", &dir)]).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        assert_eq!(std::fs::read_to_string(&config).unwrap(), "{}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
