//! `zerodp config check FILE`: resolve and validate a DeepSpeed config, print the settings as a
//! table (or one JSON object) and then the warnings. Errors go to stderr with exit status 1.

use std::path::PathBuf;

use zerodp::config::{self, Loaded, Precision, ResolveContext, Settings};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The DeepSpeed config file (JSON; comments and trailing commas are fine).
    pub file: PathBuf,
    /// Data-parallel world size the batch sizes are checked against.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Fills `train_batch_size: "auto"`.
    #[arg(long)]
    pub train_batch_size: Option<usize>,
    /// Fills `train_micro_batch_size_per_gpu: "auto"`.
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Model hidden size: fills "auto" bucket sizes the way Hugging Face does.
    #[arg(long)]
    pub hidden_size: Option<usize>,
}

pub fn run(args: CheckArgs) -> anyhow::Result<i32> {
    let ctx = ResolveContext {
        world_size: args.world_size.unwrap_or(1),
        world_size_source: if args.world_size.is_some() {
            "--world-size".into()
        } else {
            "the default 1 (no --world-size given)".into()
        },
        train_batch_size: args.train_batch_size,
        micro_batch: args.micro_batch,
        hidden_size: args.hidden_size,
        check_mode: true,
        ..ResolveContext::default()
    };
    if ctx.world_size == 0 {
        errln!("error: --world-size must be at least 1");
        return Ok(1);
    }
    let loaded = match config::load_file(&args.file, &ctx) {
        Ok(l) => l,
        Err(e) => {
            errln!("error: {e}");
            return Ok(1);
        }
    };
    match args.format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&loaded.to_json())?),
        Format::Table => out!("{}", table(&loaded, &ctx.world_size_source)),
    }
    Ok(0)
}

/// The resolved settings as aligned `key  value` lines, then the warnings.
pub fn table(loaded: &Loaded, world_size_source: &str) -> String {
    let s = &loaded.settings;
    let mut rows = batch_and_zero_rows(s, world_size_source);
    if s.zero_optimization.stage == 3 {
        rows.extend(stage3_rows(s));
    }
    rows.extend(training_rows(s));
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (k, v) in rows {
        out.push_str(&format!("{k:width$}  {v}\n"));
    }
    if loaded.warnings.is_empty() {
        out.push_str("\nno warnings\n");
    } else {
        out.push_str(&format!("\n{} warning(s):\n", loaded.warnings.len()));
        for w in &loaded.warnings {
            out.push_str(&format!("  - {w}\n"));
        }
    }
    out
}

/// `v`, or "auto (unresolved)" where the key at `path` was left `"auto"` (a stage-3 key under
/// either of its names).
fn unresolved_or(s: &Settings, path: &str, v: String) -> String {
    let alt = path.replace("stage3_", "");
    if s.unresolved
        .iter()
        .any(|u| u == path || u.replace("stage3_", "") == alt)
    {
        "auto (unresolved)".to_string()
    } else {
        v
    }
}

/// The stage, precision, batch sizes, world size, offload and reduction rows.
fn batch_and_zero_rows(s: &Settings, world_size_source: &str) -> Vec<(String, String)> {
    let z = &s.zero_optimization;
    let un = |path: &str, v: String| unresolved_or(s, path, v);
    vec![
        ("zero stage".into(), z.stage.to_string()),
        (
            "precision".into(),
            match s.precision.as_str() {
                "bf16" if s.bf16.bf16_master_weights_and_grads => {
                    "bf16, no fp32 master (bf16_master_weights_and_grads: Adam rounds the bf16 \
                     parameters stochastically)"
                        .into()
                }
                p => p.into(),
            },
        ),
        (
            "train_batch_size".into(),
            un("train_batch_size", s.batch.train_batch_size.to_string()),
        ),
        (
            "train_micro_batch_size_per_gpu".into(),
            un(
                "train_micro_batch_size_per_gpu",
                s.batch.micro_batch_per_gpu.to_string(),
            ),
        ),
        (
            "gradient_accumulation_steps".into(),
            un(
                "gradient_accumulation_steps",
                s.batch.gradient_accumulation_steps.to_string(),
            ),
        ),
        (
            "world size".into(),
            format!("{} (from {world_size_source})", s.batch.world_size),
        ),
        (
            "offload_optimizer".into(),
            offload_optimizer_row(&z.offload_optimizer),
        ),
        (
            "offload_param".into(),
            match z.offload_param.device.as_str() {
                "nvme" => format!(
                    "{}, max_in_cpu {} (the first units whose shards fit stay in memory)",
                    offload("nvme", &z.offload_param.nvme_path),
                    z.offload_param.max_in_cpu
                ),
                device => offload(device, &z.offload_param.nvme_path),
            },
        ),
        (
            "reduce_bucket_size".into(),
            un(
                "zero_optimization.reduce_bucket_size",
                reduce_bucket_row(z.reduce_bucket_size),
            ),
        ),
        ("overlap_comm".into(), z.overlap_comm.to_string()),
        (
            "contiguous_gradients".into(),
            z.contiguous_gradients.to_string(),
        ),
    ]
}

/// Stage 3's gathering rows.
fn stage3_rows(s: &Settings) -> Vec<(String, String)> {
    let z = &s.zero_optimization;
    let un = |path: &str, v: String| unresolved_or(s, path, v);
    vec![
        (
            "prefetch_bucket_size".into(),
            un(
                "zero_optimization.stage3_prefetch_bucket_size",
                z.prefetch_bucket_size.to_string(),
            ),
        ),
        (
            "param_persistence_threshold".into(),
            un(
                "zero_optimization.stage3_param_persistence_threshold",
                z.param_persistence_threshold.to_string(),
            ),
        ),
        (
            "max_live_parameters".into(),
            z.max_live_parameters.to_string(),
        ),
        (
            "max_reuse_distance".into(),
            z.max_reuse_distance.to_string(),
        ),
        ("sub_group_size".into(), z.sub_group_size.to_string()),
        (
            "zero_hpz_partition_size".into(),
            zeropp_row(z.stage, "hpZ", {
                let h = z.zero_hpz_partition_size;
                (h > 1).then(|| format!("{h} ranks per host"))
            }),
        ),
        (
            "zero_quantized_weights".into(),
            zeropp_row(z.stage, "qwZ", {
                z.zero_quantized_weights
                    .then(|| "int8 all-gathers".to_string())
            }),
        ),
        (
            "zero_quantized_gradients".into(),
            zeropp_row(z.stage, "qgZ", {
                z.zero_quantized_gradients
                    .then(|| "int8 all-to-alls within, then across hosts".to_string())
            }),
        ),
    ]
}

/// A ZeRO++ key's row: off, or what it does and whether this stage acts on it.
fn zeropp_row(stage: u8, name: &str, on: Option<String>) -> String {
    match (on, stage) {
        (None, _) => "off".into(),
        (Some(what), 3) => format!("{what} ({name}: acted on)"),
        (Some(what), _) => format!("{what} ({name}: no effect below stage 3)"),
    }
}

/// The loss scale (fp16), optimizer, scheduler, clipping, dtypes and logging rows.
fn training_rows(s: &Settings) -> Vec<(String, String)> {
    let un = |path: &str, v: String| unresolved_or(s, path, v);
    let mut rows = Vec::new();
    if s.precision == Precision::Fp16 {
        let f = &s.fp16;
        let scale = if f.is_dynamic() {
            format!(
                "dynamic, initial 2^{}, window {}, hysteresis {}, min {}",
                f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale
            )
        } else {
            format!("static {}", f.loss_scale)
        };
        rows.push(("loss scale".into(), scale));
    }
    // Optimizer and scheduler rows come from the JSON form, where unresolved "auto" is null.
    let json = s.to_json();
    rows.push((
        "optimizer".into(),
        match &s.optimizer {
            Some(o) => format!(
                "{:?} {}",
                o.kind,
                params(
                    &json["optimizer"],
                    &["lr", "betas", "eps", "weight_decay", "adam_w_mode"]
                )
            ),
            None => "none in config".into(),
        },
    ));
    rows.push((
        "scheduler".into(),
        match &s.scheduler {
            Some(_) => format!(
                "{} {}",
                json["scheduler"]["type"].as_str().unwrap_or("?"),
                params(&json["scheduler"]["params"], &[])
            ),
            None => "none (constant lr)".into(),
        },
    ));
    rows.push((
        "gradient_clipping".into(),
        un("gradient_clipping", s.gradient_clipping.to_string()),
    ));
    rows.push((
        "communication_data_type".into(),
        s.communication_data_type.as_str().into(),
    ));
    rows.push((
        "grad_accum_dtype".into(),
        s.grad_accum_dtype.as_str().into(),
    ));
    rows.push((
        "steps_per_print".into(),
        s.steps_per_print.map_or("never".into(), |v| v.to_string()),
    ));
    rows.push(("comms_logger".into(), s.comms_logger.enabled.to_string()));
    rows
}

/// The `reduce_bucket_size` row: the elements, and what 0 means (DeepSpeed accepts it).
fn reduce_bucket_row(elems: u64) -> String {
    match elems {
        0 => "0 (no bucket: each unit's gradient is reduced on its own, one collective per unit, \
              as DeepSpeed reduces each gradient on its own at 0)"
            .into(),
        n => n.to_string(),
    }
}

/// A float as people write it in configs: `0.001`, `1e-8`.
fn num(v: f64) -> String {
    if v != 0.0 && v.abs() < 1e-3 {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

/// The `offload_optimizer` row: the device (and path), and a partial offload's ratio.
fn offload_optimizer_row(o: &zerodp::config::OffloadOptimizerSettings) -> String {
    let device = offload(o.device.as_str(), &o.nvme_path);
    match o.ratio < 1.0 && o.device.as_str() != "none" {
        true => format!(
            "{device}, ratio {} (partial: the last units' optimizer states, DeepSpeed's rule)",
            o.ratio
        ),
        false => device,
    }
}

fn offload(device: &str, path: &Option<PathBuf>) -> String {
    match path {
        Some(p) if device == "nvme" => format!("nvme ({})", p.display()),
        _ => device.to_string(),
    }
}

/// `key value, key value` for the keys of a JSON object (all of them when `keys` is empty);
/// null (an unresolved "auto") prints as `auto?`.
fn params(v: &serde_json::Value, keys: &[&str]) -> String {
    let Some(obj) = v.as_object() else {
        return String::new();
    };
    let show = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "auto?".to_string(),
        serde_json::Value::Number(n) => n.as_f64().map_or(n.to_string(), num),
        serde_json::Value::Array(items) => {
            let parts: Vec<String> = items
                .iter()
                .map(|i| i.as_f64().map_or(i.to_string(), num))
                .collect();
            format!("[{}]", parts.join(", "))
        }
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut out = Vec::new();
    for (k, val) in obj {
        if keys.is_empty() || keys.contains(&k.as_str()) {
            out.push(format!("{k} {}", show(val)));
        }
    }
    out.join(", ")
}
