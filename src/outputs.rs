//! Output paths are checked before any work, in one place for every command that writes a file
//! (`train`, `ckpt consolidate`, `plan --chart`, and any later writer):
//!
//! - an output must not be an input (by canonical path or by file identity, so a symlink or a
//!   hard link to the config is caught too), nor another output, nor a directory, and its
//!   directory must exist and be writable;
//! - it must not lie inside a checkpoint (a step directory, recognised by its layout,
//!   [`crate::checkpoint::layout`], whether or not the command was told about it), nor inside a
//!   directory the command reads (the checkpoint `ckpt consolidate` reads, `train --resume`'s) or
//!   the `--save-dir` it writes;
//! - it must not be a file of a checkpoint: a save directory's `latest`, its lock, a step
//!   directory (all by name), or, by device and inode, any file of a checkpoint the command reads
//!   or writes (a hard link to a shard elsewhere).
//!
//! A run that would overwrite its own config, corpus, initial weights or checkpoint, or fail to
//! save after hours of training, is refused at once, naming both paths. Outputs are then written
//! through [`crate::atomic_file`], so even an output that passes here never truncates a file in
//! place.

use crate::checkpoint::layout;
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
    #[error(
        "{output} {path}{link} lies inside the checkpoint {dir}: writing there could destroy \
         it; choose a path outside it",
        path = .output_path.display(),
        dir = .dir.display()
    )]
    InCheckpoint {
        output: String,
        output_path: PathBuf,
        /// ` (a link to ...)` when the path is a symbolic link, else empty.
        link: String,
        dir: PathBuf,
    },
    #[error(
        "{output} {path} lies inside {input} {dir}, a directory this command reads or writes; \
         choose a path outside it",
        path = .output_path.display(),
        dir = .dir.display()
    )]
    InReadDirectory {
        output: String,
        output_path: PathBuf,
        input: String,
        dir: PathBuf,
    },
    #[error(
        "{output} {path} is {file}, a file of a checkpoint: writing it would destroy the \
         checkpoint; choose another {output} path",
        path = .output_path.display(),
        file = .file.display()
    )]
    CheckpointFile {
        output: String,
        output_path: PathBuf,
        file: PathBuf,
    },
    #[error(
        "{output} {path} would replace the weights of the Hugging Face model directory {dir}, \
         which would then load nowhere (zerodp's own names and layouts are not Hugging Face's); \
         write a Hugging Face directory with `zerodp ckpt export` from a --save-dir checkpoint, \
         or choose another {output} path",
        path = .output_path.display(),
        dir = .dir.display()
    )]
    ModelWeights {
        output: String,
        output_path: PathBuf,
        dir: PathBuf,
    },
    #[error("{output} {path} is a directory; give a file name inside it", path = .path.display())]
    IsDirectory { output: String, path: PathBuf },
    #[error("{output} {path} is a file; give a directory", path = .path.display())]
    NotADirectory { output: String, path: PathBuf },
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

/// Checks every output against every input, the others and the checkpoints around it; see the
/// module docs. Inputs may be files or directories (a checkpoint being read).
pub fn check_outputs(
    inputs: &[NamedPath<'_>],
    outputs: &[NamedPath<'_>],
) -> Result<(), OutputPathError> {
    for (i, out) in outputs.iter().enumerate() {
        let place = check_place(out)?;
        check_not_in_checkpoint(out, &place)?;
        check_not_model_weights(out, &place)?;
        for input in inputs {
            check_against_input(out, &place, input)?;
        }
        let id = identity(out.path);
        for other in &outputs[i + 1..] {
            if id.is_some() && id == identity(other.path) {
                return Err(OutputPathError::SameOutputs {
                    first: out.name.into(),
                    second: other.name.into(),
                    path: out.path.into(),
                });
            }
        }
        // A device or pipe (`/dev/stdout`) is written in place; its directory need not be
        // writable.
        if !is_special(out.path) {
            probe_writable(out, parent_of(out.path))?;
        }
    }
    Ok(())
}

/// An existing file that is neither a regular file nor a directory.
fn is_special(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Checks and creates (if missing) the checkpoint directory a run writes: [`check_save_dir`],
/// then [`create_save_dir`].
pub fn prepare_save_dir(
    dir: NamedPath<'_>,
    inputs: &[NamedPath<'_>],
    outputs: &[NamedPath<'_>],
) -> Result<(), OutputPathError> {
    check_save_dir(dir, inputs, outputs)?;
    create_save_dir(dir)
}

/// Checks the checkpoint directory a run writes, without creating it (a run refused later
/// leaves nothing behind): not a file, not inside a checkpoint or strictly inside a directory
/// the run reads (resuming from the save directory itself is the usual case), in a writable
/// place; and no output of the run inside it or on one of its files.
pub fn check_save_dir(
    dir: NamedPath<'_>,
    inputs: &[NamedPath<'_>],
    outputs: &[NamedPath<'_>],
) -> Result<(), OutputPathError> {
    if dir.path.exists() && !dir.path.is_dir() {
        return Err(OutputPathError::NotADirectory {
            output: dir.name.into(),
            path: dir.path.into(),
        });
    }
    let place = check_place_of_dir(dir)?;
    if let Some(a) = place.ancestors().find(|a| layout::is_checkpoint(a)) {
        return Err(in_checkpoint(&dir, a));
    }
    for input in inputs.iter().filter(|i| i.path.is_dir()) {
        match std::fs::canonicalize(input.path) {
            Ok(c) if place != c && place.starts_with(&c) => return Err(in_read_dir(&dir, input)),
            _ => {}
        }
    }
    for out in outputs {
        check_against_input(out, &resolved(out.path).unwrap_or_default(), &dir)?;
    }
    match dir.path.is_dir() {
        true => probe_writable(&dir, dir.path),
        false => probe_writable(&dir, parent_of(dir.path)),
    }
}

/// Creates the checked checkpoint directory if missing, and makes sure a file can be written in
/// it.
pub fn create_save_dir(dir: NamedPath<'_>) -> Result<(), OutputPathError> {
    create_dir(&dir)?;
    probe_writable(&dir, dir.path)
}

/// The output is not a directory and its directory exists; where it will be written, symlinks
/// followed.
fn check_place(out: &NamedPath<'_>) -> Result<PathBuf, OutputPathError> {
    if out.path.is_dir() {
        return Err(OutputPathError::IsDirectory {
            output: out.name.into(),
            path: out.path.into(),
        });
    }
    let dir = parent_of(out.path);
    match resolved(out.path) {
        Some(place) if dir.is_dir() => Ok(place),
        _ => Err(OutputPathError::NoDirectory {
            output: out.name.into(),
            path: out.path.into(),
            dir: dir.into(),
        }),
    }
}

fn check_place_of_dir(dir: NamedPath<'_>) -> Result<PathBuf, OutputPathError> {
    resolved(dir.path).ok_or_else(|| OutputPathError::NoDirectory {
        output: dir.name.into(),
        path: dir.path.into(),
        dir: parent_of(dir.path).into(),
    })
}

/// Not inside any checkpoint (step) directory, and not a save directory's own file by name.
fn check_not_in_checkpoint(out: &NamedPath<'_>, place: &Path) -> Result<(), OutputPathError> {
    if let Some(a) = place.ancestors().skip(1).find(|a| layout::is_checkpoint(a)) {
        return Err(in_checkpoint(out, a));
    }
    let name = place.file_name().and_then(|n| n.to_str());
    if name.is_some_and(layout::is_reserved_name) && place.parent().is_some_and(layout::is_save_dir)
    {
        return Err(checkpoint_file(out, place));
    }
    Ok(())
}

/// Not a file `transformers` loads weights from (`model.safetensors`, its index and shards,
/// `pytorch_model.bin`) in a Hugging Face model directory (one with a `config.json`): zerodp's own
/// weight files would leave the directory loading nowhere, whether or not the command reads it.
fn check_not_model_weights(out: &NamedPath<'_>, place: &Path) -> Result<(), OutputPathError> {
    let Some(dir) = place.parent().filter(|d| d.join("config.json").is_file()) else {
        return Ok(());
    };
    let name = place.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if is_model_weights_name(name) || shard_names(dir).iter().any(|s| s == name) {
        return Err(OutputPathError::ModelWeights {
            output: out.name.into(),
            output_path: out.path.into(),
            dir: dir.into(),
        });
    }
    Ok(())
}

/// The names `transformers` reads a model's weights from, shards by their usual pattern
/// (`model-00001-of-00002.safetensors`).
fn is_model_weights_name(name: &str) -> bool {
    const NAMES: [&str; 4] = [
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    ];
    let shard = |ext: &str| {
        name.strip_suffix(ext)
            .is_some_and(|stem| stem.starts_with("model-") || stem.starts_with("pytorch_model-"))
            && name.contains("-of-")
    };
    NAMES.contains(&name) || shard(".safetensors") || shard(".bin")
}

/// The shard files a directory's weight index names, whatever they are called.
fn shard_names(dir: &Path) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string(dir.join("model.safetensors.index.json")) else {
        return Vec::new();
    };
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        return Vec::new();
    };
    map.values()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

/// Not the input itself (same file); for a directory input (a checkpoint read, or the save
/// directory written), not inside it and not one of its checkpoint files under another name.
fn check_against_input(
    out: &NamedPath<'_>,
    place: &Path,
    input: &NamedPath<'_>,
) -> Result<(), OutputPathError> {
    let id = identity(out.path);
    if id.is_some() && id == identity(input.path) {
        return Err(OutputPathError::SameAsInput {
            output: out.name.into(),
            output_path: out.path.into(),
            input: input.name.into(),
            input_path: input.path.into(),
        });
    }
    if !input.path.is_dir() {
        return Ok(());
    }
    if std::fs::canonicalize(input.path).is_ok_and(|c| place.starts_with(c)) {
        return Err(in_read_dir(out, input));
    }
    let Some(id) = id else {
        return Ok(());
    };
    match checkpoint_files_of(input.path)
        .into_iter()
        .find(|f| identity(f).as_ref() == Some(&id))
    {
        Some(file) => Err(checkpoint_file(out, &file)),
        None => Ok(()),
    }
}

/// The files of the checkpoints `dir` holds: all of a save directory's, or one checkpoint's and
/// its save directory's.
fn checkpoint_files_of(dir: &Path) -> Vec<PathBuf> {
    if layout::is_save_dir(dir) {
        return layout::save_dir_files(dir);
    }
    if !layout::is_checkpoint(dir) {
        return Vec::new();
    }
    let mut files = layout::checkpoint_files(dir);
    if let Some(root) = dir.parent().filter(|p| layout::is_save_dir(p)) {
        files.extend(layout::save_dir_files(root));
    }
    files
}

fn in_checkpoint(out: &NamedPath<'_>, dir: &Path) -> OutputPathError {
    let is_link = std::fs::symlink_metadata(out.path).is_ok_and(|m| m.file_type().is_symlink());
    let link = match (is_link, resolved(out.path)) {
        (true, Some(to)) => format!(" (a link to {})", to.display()),
        _ => String::new(),
    };
    OutputPathError::InCheckpoint {
        output: out.name.into(),
        output_path: out.path.into(),
        link,
        dir: dir.into(),
    }
}

fn in_read_dir(out: &NamedPath<'_>, input: &NamedPath<'_>) -> OutputPathError {
    OutputPathError::InReadDirectory {
        output: out.name.into(),
        output_path: out.path.into(),
        input: input.name.into(),
        dir: input.path.into(),
    }
}

fn checkpoint_file(out: &NamedPath<'_>, file: &Path) -> OutputPathError {
    OutputPathError::CheckpointFile {
        output: out.name.into(),
        output_path: out.path.into(),
        file: file.into(),
    }
}

/// Where `path` is or will be: canonical (symlinks followed) when it exists, else its canonical
/// directory plus its name.
fn resolved(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Some(p);
    }
    let dir = std::fs::canonicalize(parent_of(path)).ok()?;
    Some(dir.join(path.file_name()?))
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

/// Creates the directory if missing (its parent must exist).
fn create_dir(dir: &NamedPath<'_>) -> Result<(), OutputPathError> {
    match std::fs::create_dir(dir.path) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            Err(OutputPathError::NotWritable {
                output: dir.name.into(),
                path: dir.path.into(),
                dir: parent_of(dir.path).into(),
                reason: e.kind().to_string(),
            })
        }
        _ => Ok(()),
    }
}

/// A file can be created in `dir` (probed by creating and removing an empty file there, which is
/// what the run will need).
fn probe_writable(out: &NamedPath<'_>, dir: &Path) -> Result<(), OutputPathError> {
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

#[cfg(test)]
mod checkpoint_tests {
    use super::*;
    use crate::checkpoint::{FORMAT, LATEST_FILE, MANIFEST_FILE};

    fn named<'a>(name: &'a str, path: &'a Path) -> NamedPath<'a> {
        NamedPath { name, path }
    }

    /// `root/ck/{latest, step000002/{manifest.json, rank00000.safetensors}}` and `root/elsewhere/`.
    fn tree(tag: &str) -> (PathBuf, PathBuf, PathBuf) {
        let root = std::env::temp_dir().join(format!("zerodp-outck-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let ck = root.join("ck");
        let step = ck.join("step000002");
        std::fs::create_dir_all(&step).unwrap();
        std::fs::create_dir_all(root.join("elsewhere")).unwrap();
        std::fs::write(ck.join(LATEST_FILE), "step000002").unwrap();
        let manifest = format!(r#"{{"format":"{FORMAT}"}}"#);
        std::fs::write(step.join(MANIFEST_FILE), manifest).unwrap();
        std::fs::write(step.join("rank00000.safetensors"), b"shard").unwrap();
        (root, ck, step)
    }

    fn refused(inputs: &[NamedPath<'_>], out: &Path) -> OutputPathError {
        check_outputs(inputs, &[named("output", out)]).unwrap_err()
    }

    #[test]
    fn a_checkpoint_is_recognised_whether_or_not_it_was_named() {
        let (root, ck, step) = tree("layout");
        let shard = step.join("rank00000.safetensors");
        let read = [named("checkpoint", &ck)];
        // Inside a step directory, with or without the checkpoint as an input.
        for inputs in [&read[..], &[]] {
            let e = refused(inputs, &shard);
            assert!(matches!(e, OutputPathError::InCheckpoint { .. }), "{e}");
            let e = refused(inputs, &step.join(MANIFEST_FILE));
            assert!(e.to_string().contains("lies inside the checkpoint"), "{e}");
            let e = refused(inputs, &step.join("new.safetensors"));
            assert!(matches!(e, OutputPathError::InCheckpoint { .. }), "{e}");
            // A save directory's own names.
            let e = refused(inputs, &ck.join(LATEST_FILE));
            assert!(matches!(e, OutputPathError::CheckpointFile { .. }), "{e}");
            let e = refused(inputs, &ck.join("step000004"));
            assert!(matches!(e, OutputPathError::CheckpointFile { .. }), "{e}");
        }
        // A new file beside the checkpoints: refused only when the command reads them.
        let beside = ck.join("full.safetensors");
        let e = refused(&read, &beside);
        let text = e.to_string();
        assert!(text.contains("lies inside checkpoint") && text.contains(&*ck.to_string_lossy()));
        check_outputs(&[], &[named("output", &beside)]).unwrap();
        // Reading one checkpoint, its save directory's `latest` is still refused.
        let e = refused(&[named("checkpoint", &step)], &ck.join(LATEST_FILE));
        assert!(matches!(e, OutputPathError::CheckpointFile { .. }), "{e}");
        check_outputs(&read, &[named("output", &root.join("out.safetensors"))]).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn links_to_a_shard_are_caught() {
        let (root, ck, step) = tree("links");
        let shard = step.join("rank00000.safetensors");
        let soft = root.join("elsewhere").join("soft.safetensors");
        std::os::unix::fs::symlink(&shard, &soft).unwrap();
        let e = refused(&[], &soft);
        assert!(matches!(e, OutputPathError::InCheckpoint { .. }), "{e}");
        let hard = root.join("elsewhere").join("hard.safetensors");
        std::fs::hard_link(&shard, &hard).unwrap();
        for input in [&ck, &step] {
            let e = refused(&[named("checkpoint", input)], &hard);
            assert!(matches!(e, OutputPathError::CheckpointFile { .. }), "{e}");
            assert!(e.to_string().contains("rank00000.safetensors"), "{e}");
        }
        // A symlinked directory leading into the checkpoint.
        let via = root.join("elsewhere").join("via");
        std::os::unix::fs::symlink(&step, &via).unwrap();
        let e = refused(&[], &via.join("x.safetensors"));
        assert!(matches!(e, OutputPathError::InCheckpoint { .. }), "{e}");
        assert_eq!(std::fs::read(&shard).unwrap(), b"shard");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_save_dir_is_checked_and_created() {
        let (root, ck, step) = tree("savedir");
        let save = named("--save-dir", &ck);
        // Resuming from the save directory itself is the usual case.
        prepare_save_dir(save, &[named("--resume", &ck)], &[]).unwrap();
        let e = prepare_save_dir(named("--save-dir", &step), &[], &[]).unwrap_err();
        assert!(matches!(e, OutputPathError::InCheckpoint { .. }), "{e}");
        let inside = ck.join("metrics.jsonl");
        let e = prepare_save_dir(save, &[], &[named("--metrics", &inside)]).unwrap_err();
        assert!(matches!(e, OutputPathError::InReadDirectory { .. }), "{e}");
        let sub = ck.join("sub");
        let e = prepare_save_dir(named("--save-dir", &sub), &[named("--resume", &ck)], &[])
            .unwrap_err();
        assert!(matches!(e, OutputPathError::InReadDirectory { .. }), "{e}");
        let fresh = root.join("fresh");
        prepare_save_dir(named("--save-dir", &fresh), &[named("--resume", &ck)], &[]).unwrap();
        assert!(fresh.is_dir());
        let file = root.join("file");
        std::fs::write(&file, "x").unwrap();
        let e = prepare_save_dir(named("--save-dir", &file), &[], &[]).unwrap_err();
        assert!(e.to_string().contains("is a file"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
