//! One run owns a save directory while it runs: `DIR/.zerodp.lock`, held with `flock` and holding
//! the owner's pid, host and start time (for the message a second run gets).
//!
//! Two runs saving into one directory would commit over each other's checkpoints, and the second
//! would find out only at its first save, after training a step. With the lock it is refused at
//! once, naming the run that owns the directory.
//!
//! Why `flock` and not only the file's existence: the kernel drops an `flock` when its holder
//! dies, however it dies (a crash, SIGKILL, the machine's OOM killer), so a lock file left
//! behind is recognised as stale without guessing from pids (which are reused, and mean nothing
//! on another host sharing the file system). A run that ends normally, by an error or by
//! SIGINT/SIGTERM removes the file; one that was killed leaves it, and the next run takes it over
//! and says so. On a file system without `flock` the pid decides: a live process on this host
//! (or any process on another host, which cannot be checked) keeps the directory.
//!
//! Under MPI one lock serves the job: rank 0, which commits the checkpoints, takes it, and every
//! rank learns the outcome before the first step ([`acquire_for_job`]). In-process ranks are
//! threads of the one process that took it.

use crate::comm::{CommError, Communicator, ReduceOp};
use crate::flat::Buffer;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The lock's file name inside a save directory. It is not part of any checkpoint: no manifest
/// lists it, and verification and loading never read it.
pub const LOCK_FILE: &str = ".zerodp.lock";

/// Why a save directory could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "{dir} is being written by another zerodp run (pid {pid}, started at {started}){host}; \
         wait for it to end or give another --save-dir (if that run is gone, remove {lock})",
        dir = .dir.display(),
        pid = .owner.pid_text(),
        started = .owner.started_text(),
        host = .owner.host_note(),
        lock = .dir.join(LOCK_FILE).display()
    )]
    Held { dir: PathBuf, owner: LockOwner },
    #[error("{path}: cannot take the save directory's lock: {source}", path = .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "rank 0 could not take the lock of {dir} (its error says why); no rank trained",
        dir = .dir.display()
    )]
    RankZeroFailed { dir: PathBuf },
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Who holds (or held) a lock, as its file records it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LockOwner {
    pub pid: u32,
    pub host: String,
    /// Seconds since the Unix epoch.
    pub started_unix: u64,
}

impl LockOwner {
    /// This process, now.
    pub(crate) fn this_process() -> Self {
        LockOwner {
            pid: std::process::id(),
            host: hostname(),
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    fn pid_text(&self) -> String {
        match self.pid {
            0 => "unknown".into(),
            p => p.to_string(),
        }
    }

    /// The start time as `YYYY-MM-DD HH:MM:SS UTC`.
    pub fn started_text(&self) -> String {
        match self.started_unix {
            0 => "an unknown time".into(),
            t => utc_text(t),
        }
    }

    fn host_note(&self) -> String {
        if self.host.is_empty() || self.host == hostname() {
            String::new()
        } else {
            format!(" on host {}", self.host)
        }
    }

    /// Whether the recorded process may still be running: on this host, whether the pid exists;
    /// on another host it cannot be told, so yes.
    fn may_be_alive(&self) -> bool {
        if !self.host.is_empty() && self.host != hostname() {
            return true;
        }
        let Ok(pid) = libc::pid_t::try_from(self.pid) else {
            return false;
        };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let r = unsafe { libc::kill(pid, 0) };
        pid > 0 && (r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
    }
}

/// A save directory's lock, held until dropped (which removes the file and releases it).
#[derive(Debug)]
pub struct SaveDirLock {
    path: PathBuf,
    file: File,
}

/// A lock just taken, and the record of the run it was taken over from, if one had died
/// holding it.
#[derive(Debug)]
pub struct Acquired {
    pub lock: SaveDirLock,
    /// The dead run's record; `Some(default)` when the left-over file could not be read.
    pub took_over: Option<LockOwner>,
}

impl SaveDirLock {
    /// Takes `dir`'s lock (the directory must exist), or says who holds it.
    pub fn acquire(dir: &Path) -> Result<Acquired, LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        // A holder removes the file before releasing it, so the file locked here may have been
        // unlinked meanwhile: then lock the new one (a few tries; each loses only to a release).
        for _ in 0..100 {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                // Never truncated on open: the holder's record must stay readable.
                .truncate(false)
                .mode(0o644)
                .open(&path)
                .map_err(io)?;
            match try_flock(&file) {
                Ok(true) if !is_linked_at(&file, &path) => continue,
                Ok(true) => return claim(dir, path.clone(), file, true),
                Ok(false) => {
                    return Err(LockError::Held {
                        dir: dir.to_path_buf(),
                        owner: read_owner_waiting(&file).unwrap_or_default(),
                    })
                }
                Err(e) if flock_unsupported(&e) => return claim(dir, path.clone(), file, false),
                Err(e) => return Err(io(e)),
            }
        }
        Err(io(std::io::Error::other(
            "the lock file kept being replaced",
        )))
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SaveDirLock {
    fn drop(&mut self) {
        // Removed while still held, and only if it is still this lock's file; closing the file
        // then releases the flock.
        if is_linked_at(&self.file, &self.path) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The lock is ours (`flocked`) or there is no flock here: record this process in it, after
/// reading what a previous owner left. Without flock, a previous owner that may be alive keeps it.
fn claim(dir: &Path, path: PathBuf, file: File, flocked: bool) -> Result<Acquired, LockError> {
    let previous = read_owner(&file);
    let me = LockOwner::this_process();
    if let (false, Some(Some(owner))) = (flocked, &previous) {
        if owner.pid != me.pid && owner.may_be_alive() {
            return Err(LockError::Held {
                dir: dir.to_path_buf(),
                owner: owner.clone(),
            });
        }
    }
    let written = serde_json::to_vec(&me)
        .map_err(std::io::Error::other)
        .and_then(|text| file.set_len(0).map(|()| text))
        .and_then(|text| file.write_all_at(&text, 0))
        .and_then(|()| file.sync_all());
    if let Err(source) = written {
        let _ = std::fs::remove_file(&path);
        return Err(LockError::Io { path, source });
    }
    Ok(Acquired {
        lock: SaveDirLock { path, file },
        took_over: previous.map(Option::unwrap_or_default),
    })
}

/// `None` for an empty file (a fresh lock), `Some(None)` for one that cannot be parsed.
fn read_owner(file: &File) -> Option<Option<LockOwner>> {
    let len = file.metadata().map_or(0, |m| m.len()).min(4096);
    if len == 0 {
        return None;
    }
    let mut buf = vec![0u8; len as usize];
    let n = file.read_at(&mut buf, 0).unwrap_or(0);
    Some(serde_json::from_slice(&buf[..n]).ok())
}

/// The holder's record; a holder that took the lock a moment ago may not have written it yet.
fn read_owner_waiting(file: &File) -> Option<LockOwner> {
    for _ in 0..20 {
        if let Some(owner) = read_owner(file) {
            return owner;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// `flock(LOCK_EX | LOCK_NB)`: `Ok(false)` when another open file holds it.
fn try_flock(file: &File) -> std::io::Result<bool> {
    // SAFETY: flock on a file descriptor this `File` owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        _ => Err(e),
    }
}

fn flock_unsupported(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOLCK) | Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
    )
}

/// Whether `path` still names the open `file` (not removed or replaced since it was opened).
fn is_linked_at(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Takes `dir`'s lock for a job whose ranks are processes: rank 0 takes it, and every rank learns
/// whether it did (a collective; every rank calls it before the first step). Rank 0 gets the
/// lock or its own error, the other ranks `None` or [`LockError::RankZeroFailed`].
pub fn acquire_for_job(dir: &Path, comm: &dyn Communicator) -> Result<Option<Acquired>, LockError> {
    let mine = (comm.rank() == 0).then(|| SaveDirLock::acquire(dir));
    let failed = matches!(mine, Some(Err(_)));
    let all = comm
        .all_reduce(
            Buffer::F32(vec![f32::from(u8::from(failed))]),
            ReduceOp::Max,
        )
        .wait_one()?;
    match mine {
        Some(result) => result.map(Some),
        None if all.get_f32(0) > 0.0 => Err(LockError::RankZeroFailed {
            dir: dir.to_path_buf(),
        }),
        None => Ok(None),
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// `secs` since the epoch as `YYYY-MM-DD HH:MM:SS UTC` (the civil calendar from days, after
/// Howard Hinnant's `civil_from_days`), so that no date crate is needed for one message.
fn utc_text(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zerodp-lock-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_held_lock_refuses_a_second_taker_and_is_removed_on_drop() {
        let dir = scratch("held");
        let first = SaveDirLock::acquire(&dir).unwrap();
        assert!(first.took_over.is_none());
        let e = SaveDirLock::acquire(&dir).unwrap_err();
        let text = e.to_string();
        let want = format!(
            "is being written by another zerodp run (pid {}, started at ",
            std::process::id()
        );
        assert!(text.contains(&want), "{text}");
        assert!(text.contains(&dir.display().to_string()), "{text}");
        drop(first);
        assert!(!dir.join(LOCK_FILE).exists());
        let again = SaveDirLock::acquire(&dir).unwrap();
        assert!(again.took_over.is_none());
        drop(again);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_lock_left_by_a_dead_process_is_taken_over() {
        let dir = scratch("stale");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        let dead = LockOwner {
            pid: child.id(),
            host: hostname(),
            started_unix: 1_700_000_000,
        };
        std::fs::write(dir.join(LOCK_FILE), serde_json::to_vec(&dead).unwrap()).unwrap();
        let a = SaveDirLock::acquire(&dir).unwrap();
        assert_eq!(a.took_over.as_ref(), Some(&dead));
        assert_eq!(dead.started_text(), "2023-11-14 22:13:20 UTC");
        drop(a);
        // An unreadable left-over is taken over too.
        std::fs::write(dir.join(LOCK_FILE), b"garbage").unwrap();
        let a = SaveDirLock::acquire(&dir).unwrap();
        assert_eq!(a.took_over, Some(LockOwner::default()));
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn ranks_as_processes_take_one_lock_and_all_learn_the_outcome() {
        let dir = scratch("job");
        let outcomes = |dir: &Path| {
            crate::comm::run_ranks(3, Default::default(), |comm, _| {
                let r = acquire_for_job(dir, &*comm);
                Ok::<_, CommError>(r.map(|a| a.is_some()).map_err(|e| e.to_string()))
            })
            .unwrap()
        };
        assert_eq!(outcomes(&dir), [Ok(true), Ok(false), Ok(false)]);
        assert!(
            !dir.join(LOCK_FILE).exists(),
            "released when rank 0 dropped it"
        );
        let held = SaveDirLock::acquire(&dir).unwrap();
        let got = outcomes(&dir);
        assert!(got[0].as_ref().unwrap_err().contains("is being written"));
        for r in &got[1..] {
            assert!(r.as_ref().unwrap_err().contains("rank 0 could not take"));
        }
        drop(held);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc_text(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc_text(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc_text(1_735_689_599), "2024-12-31 23:59:59 UTC");
    }
}
