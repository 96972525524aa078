//! Observers every front end shares: the metrics lines of `--metrics`, rank 0's log lines, and a
//! record of every report (tests, benchmarks).
//!
//! `--metrics FILE` gets one JSON object per optimizer step and rank:
//!
//! | key | meaning |
//! | --- | --- |
//! | `rank`, `world_size`, `stage`, `step` | who and when (`step` counts from 1) |
//! | `tokens` | tokens trained on since the start of training, this step's global batch included |
//! | `loss` | the global-batch mean loss, the same on every rank |
//! | `lr` | the learning rate this step used (scheduler, else the optimizer's `lr`) |
//! | `grad_norm` | the global gradient norm before clipping (unscaled; `null` on a skipped step, whose norm is Inf/NaN) |
//! | `loss_scale` | the fp16 loss scale this step's loss was multiplied by (1 in bf16 and fp32) |
//! | `skipped` | whether the step was skipped because its gradients held Inf/NaN (no update; the scheduler does not advance) |
//! | `tokens_per_s` | the global batch's tokens over this rank's step time |
//! | `step_time_s` | this rank's step time |
//! | `phase_s` | where it went, in seconds: `forward`, `recompute` (forward again in backward), `backward`, `comm` (issuing and waiting for collectives), `optimizer` (the Adam step: the CPU Adam's share under offload) |
//! | `num_params` | Ψ, the model's parameter count (tied weights once) |
//! | `model_state_bytes` | what the rank holds after the step: `params`, `grads`, `master` (the fp32 master shard under bf16/fp16, 0 in fp32), `optimizer_states`, `buffers` (buckets, gradient and parameter scratch), `gather` (stage-3 pool), `total` |
//! | `offloaded_bytes` | what offload holds outside the device tier: `host` (master, Adam's moments, stage-3 parameter shards, NVMe stream buffers) and `nvme` (the swap file) |
//! | `nvme_io_bytes` | bytes this rank has `read` from and `written` to its NVMe swap file since the start (0 without NVMe offload) |
//! | `peak_bytes` | the largest `total` so far, gathered parameters in flight included |
//! | `device_tier_bytes` | what the device tier holds in GPU memory when it is there (one GPU without offload: parameters, gradients, master and moments; `model_state_bytes` are then its host mirror), else 0 |
//! | `eval_loss`, `eval_ppl`, `eval_tokens` | only on a step after which held-out data was scored: the mean token cross-entropy, its exponential and the tokens scored (the same on every rank) |
//! | `sent_bytes`, `recv_bytes`, `calls` | this rank's traffic in this step per collective (`all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, `all_to_all`), ring-algorithm byte counts |
//! | `inter_host_sent_bytes`, `inter_host_recv_bytes` | of those, the bytes to and from ranks on other hosts (all 0 on one host; in one process, hpZ's host groups stand for hosts) |

use super::{StepEvent, StepObserver, TrainerError};
use crate::comm::{CollectiveKind, TrafficCounters};
use crate::zero::StepReport;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One metrics line: what rank `e.rank` did in one optimizer step.
pub fn metrics_line(e: &StepEvent<'_>) -> serde_json::Value {
    let (r, world) = (e.report, e.world_size);
    let traffic = TrafficByKind::from_counters(&r.traffic);
    let m = r.memory;
    let mut line = serde_json::json!({
        "rank": e.rank,
        "world_size": world,
        "stage": e.stage.index(),
        "step": r.step,
        "tokens": r.step * (r.tokens * world) as u64,
        "loss": r.loss,
        "lr": r.lr,
        "grad_norm": r.grad_norm,
        "loss_scale": r.loss_scale,
        "skipped": r.skipped,
        "tokens_per_s": e.tokens_per_s,
        "step_time_s": r.elapsed.as_secs_f64(),
        "phase_s": {
            "forward": r.phases.forward,
            "recompute": r.phases.recompute,
            "backward": r.phases.backward,
            "comm": r.phases.comm,
            "optimizer": r.phases.optimizer,
        },
        "num_params": e.num_params,
        "model_state_bytes": {
            "params": m.params,
            "grads": m.grads,
            "master": m.master,
            "optimizer_states": m.optimizer_states,
            "buffers": m.buffers,
            "gather": m.gather,
            "total": m.total,
        },
        "offloaded_bytes": { "host": m.offloaded_host, "nvme": m.offloaded_nvme },
        "nvme_io_bytes": { "read": r.swap_io.0, "written": r.swap_io.1 },
        "peak_bytes": r.peak_bytes,
        "device_tier_bytes": r.device_tier_bytes,
        "sent_bytes": traffic.sent_bytes,
        "recv_bytes": traffic.recv_bytes,
        "inter_host_sent_bytes": traffic.inter_host_sent_bytes,
        "inter_host_recv_bytes": traffic.inter_host_recv_bytes,
        "calls": CollectiveKind::ALL
            .iter()
            .filter(|k| **k != CollectiveKind::Barrier)
            .map(|k| (k.name().to_string(), r.traffic.calls(*k)))
            .collect::<std::collections::BTreeMap<_, _>>(),
    });
    if let Some(eval) = e.eval {
        line["eval_loss"] = eval.loss.into();
        line["eval_ppl"] = eval.perplexity().into();
        line["eval_tokens"] = eval.tokens.into();
    }
    line
}

/// What rank 0 logs about a step besides the progress bar: fp16 scale changes and skipped steps
/// with the units whose gradients held Inf/NaN.
pub fn step_log_line(r: &StepReport) -> Option<String> {
    match (&r.scale_message, r.skipped) {
        (Some(m), true) => Some(format!(
            "step {}: {m} (Inf/NaN gradients in: {})",
            r.step,
            r.non_finite_units.join(", ")
        )),
        (Some(m), false) => Some(format!("step {}: {m}", r.step)),
        (None, true) => Some(format!(
            "step {}: skipped, gradients held Inf/NaN in: {}",
            r.step,
            r.non_finite_units.join(", ")
        )),
        (None, false) => None,
    }
}

/// Writes every rank's metrics lines ([`metrics_line`]) to a file, one whole line per write,
/// flushed at once: a reader (or a run stopped by a signal) never sees a torn line. If a write
/// fails (a full disk), the file is cut back to its last whole line, a warning is printed once,
/// and training goes on without metrics: a log that cannot be written is no reason to lose a run.
pub struct MetricsFile {
    path: PathBuf,
    state: Mutex<MetricsState>,
}

struct MetricsState {
    file: File,
    /// Bytes of whole lines written so far.
    good_len: u64,
    /// The first write error; nothing is written after it.
    failed: Option<String>,
    line: String,
}

impl MetricsFile {
    /// Create `path`, replacing what was there: a new file renamed into place
    /// ([`crate::atomic_file::AtomicFile::publish`]) rather than the old one truncated, so that a
    /// hard link to the old file keeps its bytes. The lines are then appended as the run goes.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        let file = crate::atomic_file::AtomicFile::create(path)?.publish()?;
        Ok(MetricsFile {
            path: path.to_path_buf(),
            state: Mutex::new(MetricsState {
                file,
                good_len: 0,
                failed: None,
                line: String::new(),
            }),
        })
    }

    /// Continues `path` for a run resumed after optimizer step `step`: the whole lines of steps up
    /// to `step` are kept and the rest dropped (the resumed run trains those steps again), in a
    /// new file renamed into place as [`MetricsFile::create`] does; the run's lines then follow.
    /// A job restarted any number of times so ends with the file an unbroken run writes.
    pub fn resume(path: &Path, step: u64) -> std::io::Result<Self> {
        let old = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let kept: Vec<u8> = old
            .split_inclusive(|&b| b == b'\n')
            .filter(|line| line.ends_with(b"\n") && line_step(line).is_some_and(|s| s <= step))
            .flatten()
            .copied()
            .collect();
        let mut new = crate::atomic_file::AtomicFile::create(path)?;
        new.write_all(&kept)?;
        let file = new.publish()?;
        Ok(MetricsFile {
            path: path.to_path_buf(),
            state: Mutex::new(MetricsState {
                file,
                good_len: kept.len() as u64,
                failed: None,
                line: String::new(),
            }),
        })
    }

    /// The write error that stopped the metrics, if any.
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// Whole lines written so far, in bytes.
    pub fn bytes_written(&self) -> u64 {
        self.lock().good_len
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MetricsState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The `step` of one metrics line (`None` for a line that is not one).
fn line_step(line: &[u8]) -> Option<u64> {
    let value: serde_json::Value = serde_json::from_slice(line).ok()?;
    value.get("step")?.as_u64()
}

impl StepObserver for MetricsFile {
    fn on_step(&self, e: &StepEvent<'_>) -> Result<(), TrainerError> {
        let value = metrics_line(e);
        let mut st = self.lock();
        if st.failed.is_some() {
            return Ok(());
        }
        let st = &mut *st;
        st.line.clear();
        st.line.push_str(&value.to_string());
        st.line.push('\n');
        match st.file.write_all(st.line.as_bytes()) {
            Ok(()) => st.good_len += st.line.len() as u64,
            Err(err) => {
                // Cut a partly written line off, so the file stays whole lines.
                let _ = st.file.set_len(st.good_len);
                let _ = st.file.seek(SeekFrom::Start(st.good_len));
                let msg = format!(
                    "metrics file {}: {err}; training goes on, metrics from rank {} step {} on are \
                     not recorded",
                    self.path.display(),
                    e.rank,
                    e.report.step
                );
                eprintln_quiet(&format!("warning: {msg}"));
                st.failed = Some(msg);
            }
        }
        Ok(())
    }
}

/// A line to stderr that cannot panic (a closed or full stderr loses the line, nothing else).
pub fn eprintln_quiet(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}

/// Keeps every rank's reports, in step order: `reports()[rank][step]`.
#[derive(Default)]
pub struct ReportLog {
    reports: Mutex<Vec<Vec<StepReport>>>,
}

impl ReportLog {
    pub fn new() -> Self {
        ReportLog::default()
    }
    /// The reports per rank.
    pub fn into_reports(self) -> Vec<Vec<StepReport>> {
        self.reports.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

impl StepObserver for ReportLog {
    fn on_step(&self, e: &StepEvent<'_>) -> Result<(), TrainerError> {
        let mut all = self.reports.lock().unwrap_or_else(|e| e.into_inner());
        if all.len() < e.world_size {
            all.resize_with(e.world_size, Vec::new);
        }
        all[e.rank].push(e.report.clone());
        Ok(())
    }
}

/// Bytes sent and received per collective kind (keys as in [`CollectiveKind::name`]); barriers,
/// which move nothing, are left out.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct TrafficByKind {
    pub sent_bytes: BTreeMap<String, u64>,
    pub recv_bytes: BTreeMap<String, u64>,
    /// Of those, to and from other hosts.
    #[serde(default)]
    pub inter_host_sent_bytes: BTreeMap<String, u64>,
    #[serde(default)]
    pub inter_host_recv_bytes: BTreeMap<String, u64>,
}

impl TrafficByKind {
    pub(crate) fn from_counters(t: &TrafficCounters) -> Self {
        let mut out = TrafficByKind::default();
        for kind in CollectiveKind::ALL {
            if kind == CollectiveKind::Barrier {
                continue;
            }
            let name = kind.name().to_string();
            out.sent_bytes.insert(name.clone(), t.sent(kind));
            out.recv_bytes.insert(name.clone(), t.recv(kind));
            let k = kind as usize;
            out.inter_host_sent_bytes
                .insert(name.clone(), t.inter_host_sent_bytes[k]);
            out.inter_host_recv_bytes
                .insert(name, t.inter_host_recv_bytes[k]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traffic_by_kind_names_every_collective_but_barrier() {
        let mut t = TrafficCounters::default();
        t.sent_bytes[CollectiveKind::ReduceScatter as usize] = 7;
        t.recv_bytes[CollectiveKind::AllGather as usize] = 9;
        let k = TrafficByKind::from_counters(&t);
        assert_eq!(k.sent_bytes["reduce_scatter"], 7);
        assert_eq!(k.recv_bytes["all_gather"], 9);
        assert_eq!(k.sent_bytes.len(), 5);
        assert!(k.sent_bytes.contains_key("all_to_all"));
        assert!(!k.sent_bytes.contains_key("barrier"));
    }
}
