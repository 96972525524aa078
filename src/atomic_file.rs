//! Writing a file so that nobody ever sees it half written: the bytes go to a new temporary file
//! in the target's directory, are fsynced, and only then renamed over the target (and the
//! directory fsynced). A write that fails, a full disk, a panic or a SIGKILL at any moment leaves
//! whatever was at the target before, whole, and at most a `.NAME.tmp-*` file beside it (removed
//! when the failure is an error or a panic).
//!
//! Every command that writes a file of its own (`ckpt consolidate`, `plan --chart`, a
//! checkpoint's manifest and `latest`) writes through [`AtomicFile`]. Two files are not: a
//! checkpoint's rank files, which are written inside a temporary directory that is itself renamed
//! into place (the same guarantee, one level up), and `train --metrics`, which is appended a whole
//! line at a time while the run goes on, so that it can be followed live and keeps the lines of an
//! interrupted run.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A file being written under a temporary name; see the module docs. Dropped without
/// [`AtomicFile::commit`], the temporary is removed and the target stays as it was.
///
/// A target that exists and is not a regular file (`/dev/stdout`, a named pipe) cannot be
/// replaced by a rename and holds nothing to keep: it is written directly.
pub struct AtomicFile {
    target: PathBuf,
    /// The temporary, until it is renamed into place; `None` when writing directly.
    tmp: Option<PathBuf>,
    file: Option<File>,
}

/// Distinguishes the temporaries of one process (several threads may write beside each other).
static NEXT: AtomicU64 = AtomicU64::new(0);

impl AtomicFile {
    /// Starts writing `path`. A symbolic link is followed, so the link stays and its target is
    /// replaced; the temporary is created new (never over an existing file) beside that target.
    pub fn create(path: &Path) -> io::Result<AtomicFile> {
        match std::fs::metadata(path) {
            Ok(m) if !m.is_file() && !m.is_dir() => {
                let file = OpenOptions::new().write(true).open(path)?;
                return Ok(AtomicFile {
                    target: path.to_path_buf(),
                    tmp: None,
                    file: Some(file),
                });
            }
            _ => {}
        }
        let target = match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path)?,
            _ => path.to_path_buf(),
        };
        let name = target
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
        let tmp = target.with_file_name(format!(
            ".{}.tmp-{}-{}",
            name.to_string_lossy(),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        Ok(AtomicFile {
            target,
            tmp: Some(tmp),
            file: Some(file),
        })
    }

    /// The temporary file's path (`None` when writing a special file directly).
    pub fn temporary_path(&self) -> Option<&Path> {
        self.tmp.as_deref()
    }

    /// Makes the written bytes the target's: fsync, rename over the target, fsync the directory.
    pub fn commit(mut self) -> io::Result<()> {
        let mut file = self.take_file()?;
        let Some(tmp) = &self.tmp else {
            return file.flush();
        };
        file.sync_all()?;
        drop(file);
        std::fs::rename(tmp, &self.target)?;
        // Renamed: the temporary is the target now and must not be removed.
        self.tmp = None;
        sync_parent(&self.target)
    }

    /// Puts the file at the target now, still empty or partly written, and hands it back for
    /// appending: for a log that is read while it grows (`train --metrics`). Like
    /// [`AtomicFile::commit`] it never truncates the old file in place, so another name of it (a
    /// hard link) keeps its bytes.
    pub fn publish(mut self) -> io::Result<File> {
        let file = self.take_file()?;
        if let Some(tmp) = &self.tmp {
            std::fs::rename(tmp, &self.target)?;
            self.tmp = None;
        }
        Ok(file)
    }

    fn take_file(&mut self) -> io::Result<File> {
        self.file
            .take()
            .ok_or_else(|| io::Error::other("already committed"))
    }

    fn file(&mut self) -> io::Result<&mut File> {
        self.file
            .as_mut()
            .ok_or_else(|| io::Error::other("already committed"))
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file()?.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file()?.flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if let Some(tmp) = &self.tmp {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// Writes `bytes` to `path` through an [`AtomicFile`].
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)?;
    f.commit()
}

/// A directory being built under a temporary name beside its target, then put in place whole by
/// [`AtomicDir::commit`]: the target is either what it was or the complete new directory (an
/// existing target is swapped out in one `renameat2(RENAME_EXCHANGE)` where the file system has
/// it, else by two renames, and removed). Dropped without commit, the temporary is removed.
pub struct AtomicDir {
    target: PathBuf,
    tmp: Option<PathBuf>,
}

impl AtomicDir {
    /// Creates the temporary directory `.NAME.tmp-*` beside `target` (whose parent must exist).
    pub fn create(target: &Path) -> io::Result<AtomicDir> {
        let name = target
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no directory name"))?;
        let tmp = target.with_file_name(format!(
            ".{}.tmp-{}-{}",
            name.to_string_lossy(),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&tmp)?;
        Ok(AtomicDir {
            target: target.to_path_buf(),
            tmp: Some(tmp),
        })
    }

    /// Where to write the directory's files until it is committed.
    pub fn path(&self) -> &Path {
        self.tmp.as_deref().unwrap_or(&self.target)
    }

    /// Puts the directory in place of the target (an empty or replaceable directory, or
    /// nothing), then removes what the target held.
    pub fn commit(mut self) -> io::Result<()> {
        let Some(tmp) = self.tmp.clone() else {
            return Ok(());
        };
        File::open(&tmp)?.sync_all()?;
        if !self.target.exists() {
            std::fs::rename(&tmp, &self.target)?;
        } else if exchange(&tmp, &self.target).is_err() {
            // No atomic exchange here: move the old directory aside (it stays whole under the
            // temporary name), then the new one in.
            let old = tmp.with_extension("old");
            std::fs::rename(&self.target, &old)?;
            std::fs::rename(&tmp, &self.target)?;
            std::fs::rename(&old, &tmp)?;
        }
        self.tmp = None;
        // The old directory now sits under the temporary name.
        let _ = std::fs::remove_dir_all(&tmp);
        sync_parent(&self.target)
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if let Some(tmp) = &self.tmp {
            let _ = std::fs::remove_dir_all(tmp);
        }
    }
}

/// Swaps two existing paths in one step (Linux `renameat2` with `RENAME_EXCHANGE`).
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other);
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both paths are NUL-terminated strings that outlive the call; AT_FDCWD resolves
    // relative paths as rename(2) does.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

/// fsyncs the directory holding `path`, so that a name created or renamed in it is on disk.
pub(crate) fn sync_parent(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zerodp-atomic-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_failed_write_leaves_the_old_content_and_no_temporary() {
        let dir = scratch("fail");
        let path = dir.join("out.bin");
        std::fs::write(&path, b"old").unwrap();
        // An error half way: the writer is dropped without commit.
        let result: io::Result<()> = (|| {
            let mut f = AtomicFile::create(&path)?;
            f.write_all(b"new and partial")?;
            assert!(f.temporary_path().is_some_and(Path::exists));
            Err(io::Error::other("the source failed"))
        })();
        assert!(result.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(entries(&dir), ["out.bin"]);
        // A committed write replaces it whole.
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(entries(&dir), ["out.bin"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_link_is_followed_and_a_hard_link_keeps_its_old_bytes() {
        let dir = scratch("links");
        let real = dir.join("real.bin");
        std::fs::write(&real, b"old").unwrap();
        let soft = dir.join("soft.bin");
        std::os::unix::fs::symlink(&real, &soft).unwrap();
        write_atomic(&soft, b"via link").unwrap();
        assert!(std::fs::symlink_metadata(&soft)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read(&real).unwrap(), b"via link");
        // A hard link is another name of the old inode: the rename gives the name a new file and
        // leaves the other name's bytes alone.
        let hard = dir.join("hard.bin");
        std::fs::hard_link(&real, &hard).unwrap();
        write_atomic(&hard, b"replaced").unwrap();
        assert_eq!(std::fs::read(&real).unwrap(), b"via link");
        assert_eq!(std::fs::read(&hard).unwrap(), b"replaced");
        // A special file is written in place.
        write_atomic(Path::new("/dev/null"), b"gone").unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
