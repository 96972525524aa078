//! `zerodp plan`: memory per device and per node, traffic and predicted times for every ZeRO stage
//! and offload choice, and a recommendation, before a run. The numbers come from
//! [`zerodp::planner::plan`]; this file only turns flags into a [`PlanInput`] and prints.

use anyhow::Context;
use zerodp::config;
use zerodp::limits::MAX_DEVICES;
use zerodp::planner::{
    self, config_precision, format_capacity, format_gb, format_seconds, interconnect,
    memory_chart_svg, parse_bandwidth, parse_bytes, parse_count, parse_latency, Algorithm,
    BufferOverrides, Cluster, Collective, ConfigKeys, GptShape, HostLinks, Link, ModelSize,
    Offload, Plan, PlanInput, PlanOption, Precision, INTERCONNECTS,
};

/// `zerodp plan`'s flags, boxed so that the subcommand enum stays small.
#[derive(clap::Args, Debug)]
#[command(after_help = interconnect_help())]
pub struct PlanArgs {
    #[command(flatten)]
    pub flags: Box<PlanFlags>,
}

#[derive(clap::Args, Debug)]
pub struct PlanFlags {
    /// Parameter count Ψ: 7.5e9, 70B, 350M.
    #[arg(long, value_name = "COUNT", conflicts_with_all = ["preset", "layers", "model_config"])]
    pub params: Option<String>,
    /// A Hugging Face GPT-2 or Llama `config.json` (or the model directory holding it): the model,
    /// from the config file alone.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["preset", "layers", "width", "heads", "vocab", "context"])]
    pub model_config: Option<std::path::PathBuf>,
    /// Elements of the largest unit (one stage-3 gather); estimated from Ψ when left out.
    #[arg(long, value_name = "COUNT", requires = "params")]
    pub largest_unit: Option<String>,
    /// A named GPT shape: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt3-2.7b, gpt3-6.7b, gpt3-13b, gpt3-175b.
    #[arg(long, value_name = "NAME", conflicts_with = "layers")]
    pub preset: Option<String>,
    /// GPT shape: transformer blocks.
    #[arg(long, requires_all = ["width", "heads"])]
    pub layers: Option<u64>,
    /// GPT shape: model width.
    #[arg(long, requires = "layers")]
    pub width: Option<u64>,
    /// GPT shape: attention heads.
    #[arg(long, requires = "layers")]
    pub heads: Option<u64>,
    /// GPT shape: vocabulary size.
    #[arg(long, default_value_t = 50257, requires = "layers")]
    pub vocab: u64,
    /// GPT shape: context length (positions).
    #[arg(long, default_value_t = 1024, requires = "layers")]
    pub context: u64,

    /// Nodes (machines; `--hosts` too).
    #[arg(long, alias = "hosts")]
    pub nodes: Option<u64>,
    /// Devices in total.
    #[arg(long)]
    pub devices: Option<u64>,
    /// Devices per node (default 8, or all devices when they fit one node; `--ranks-per-host`
    /// too).
    #[arg(long, alias = "ranks-per-host")]
    pub devices_per_node: Option<u64>,
    /// Memory per device: 80GiB, 80GB, 40GiB; or `gpu`, the memory free now on this process's
    /// GPU (the local rank's, as `train --device cuda` picks it; needs a `cuda` build).
    #[arg(long, default_value = "80GiB")]
    pub device_memory: String,
    /// Host memory per node (default 2TiB, a DGX H100).
    #[arg(long, default_value = "2TiB")]
    pub host_memory: String,
    /// Network between nodes (ib-hdr, ib-ndr, eth-100g, eth-200g, eth-400g; default ib-ndr) or,
    /// given nvlink or pcie, the link inside a node. Numbers: see the list below.
    #[arg(long, value_name = "PRESET")]
    pub interconnect: Option<String>,
    /// Link inside a node: nvlink or pcie.
    #[arg(long, value_name = "PRESET", default_value = "nvlink")]
    pub intra_node: String,
    /// Overrides the intra-node bandwidth per device: 450GB/s, 2.4e11.
    #[arg(long)]
    pub intra_bandwidth: Option<String>,
    /// Overrides the intra-node latency per ring step: 3us.
    #[arg(long)]
    pub intra_latency: Option<String>,
    /// Overrides the network bandwidth per node (all NICs): 400GB/s, 3200Gbps, 10Gbps
    /// (`--inter-host-bandwidth` too).
    #[arg(long, alias = "inter-host-bandwidth")]
    pub inter_bandwidth: Option<String>,
    /// Overrides the network latency per ring step: 5us.
    #[arg(long)]
    pub inter_latency: Option<String>,
    /// Sustained FLOP/s per device (default 4e14: H100 bf16 at ~40% of its 989 TFLOP/s dense peak;
    /// 6e13 for fp32).
    #[arg(long)]
    pub flops: Option<f64>,
    /// Adam updates per second the host sustains for the CPU step under optimizer offload, per
    /// node (default 2e9, a two-socket server), or `measure`: time zerodp's own CPU Adam on this
    /// machine, all cores, fp32 states with the 16-bit copy, as `train` runs it.
    #[arg(long, value_name = "PARAMS/S|measure")]
    pub host_adam_rate: Option<String>,
    /// Device-to-host copy bandwidth per device under offload (default 24GB/s, PCIe Gen4 x16).
    #[arg(long, value_name = "BANDWIDTH")]
    pub host_link_bandwidth: Option<String>,
    /// NVMe read/write bandwidth per node (default 12GB/s; `zerodp bench train --offload nvme`
    /// measures a disk's).
    #[arg(long, value_name = "BANDWIDTH")]
    pub nvme_bandwidth: Option<String>,

    /// Sequences per device per micro-step (default: the config's, else 1).
    #[arg(long)]
    pub micro_batch: Option<u64>,
    /// Tokens per sequence (default: the model's context, else 2048).
    #[arg(long)]
    pub seq_len: Option<u64>,
    /// Micro-steps per optimizer step (default: the config's, else 1).
    #[arg(long)]
    pub grad_accum: Option<u64>,
    /// bf16, fp16 or fp32 (default: the config's, else bf16).
    #[arg(long, value_parser = ["bf16", "fp16", "fp32"])]
    pub precision: Option<String>,
    /// Plan with activation checkpointing (recompute in backward).
    #[arg(long)]
    pub activation_checkpointing: bool,
    /// A DeepSpeed config: stage, offload, buckets, precision and batch are read from it, and the
    /// recommendation says what to change in it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,

    /// table (for people) or json (for machines).
    #[arg(long, default_value = "table", value_parser = ["table", "json"])]
    pub format: String,
    /// Also write an SVG bar chart of memory per device by option.
    #[arg(long, value_name = "FILE.svg")]
    pub chart: Option<std::path::PathBuf>,
}

fn interconnect_help() -> String {
    let mut s =
        String::from("Interconnect presets (achievable bus bandwidth, latency per ring step):\n");
    for (name, _, what) in INTERCONNECTS {
        s.push_str(&format!("  {name:<9} {what}\n"));
    }
    s
}

pub fn run(args: PlanArgs) -> anyhow::Result<i32> {
    let args = args.flags;
    check_chart_path(&args)?;
    let input = build_input(&args)?;
    let plan = planner::plan(&input)?;
    if let Some(path) = &args.chart {
        let svg = memory_chart_svg(&plan, input.cluster.device_memory);
        zerodp::atomic_file::write_atomic(path, svg.as_bytes())
            .with_context(|| format!("writing the chart to {}", path.display()))?;
    }
    if args.format == "json" {
        outln!("{}", serde_json::to_string_pretty(&plan.options)?);
    } else {
        out!("{}", render_table(&input, &plan));
        if let Some(path) = &args.chart {
            outln!("chart written to {}", path.display());
        }
    }
    Ok(0)
}

/// `--chart` is checked before any work as every output is ([`zerodp::outputs`]): not
/// the `--config` or `--model-config` read (nor inside that model directory), not in or on a
/// checkpoint.
fn check_chart_path(args: &PlanFlags) -> anyhow::Result<()> {
    use zerodp::outputs::{check_outputs, NamedPath};
    let Some(chart) = &args.chart else {
        return Ok(());
    };
    let config_file = args
        .model_config
        .as_ref()
        .filter(|p| p.is_dir())
        .map(|d| d.join("config.json"));
    let inputs: Vec<NamedPath<'_>> = [
        ("--config", args.config.as_deref()),
        ("--model-config", args.model_config.as_deref()),
        ("--model-config", config_file.as_deref()),
    ]
    .into_iter()
    .filter_map(|(name, p)| p.map(|path| NamedPath { name, path }))
    .collect();
    let output = NamedPath {
        name: "--chart",
        path: chart,
    };
    check_outputs(&inputs, &[output])?;
    Ok(())
}

/// The offload rates: the defaults, each replaced by its flag; `--host-adam-rate measure` times
/// zerodp's CPU Adam here.
/// `--device-memory`: a size, or `gpu` for the memory free on this process's GPU now.
fn device_memory(arg: &str) -> anyhow::Result<u64> {
    if !arg.eq_ignore_ascii_case("gpu") {
        return Ok(parse_bytes(arg, "--device-memory")?);
    }
    let why = "--device-memory gpu reads the free memory of this process's GPU; give a size \
               instead (80GiB) to plan for another machine";
    let gpu = zerodp::device::resolve(zerodp::device::ComputeDevice::Cuda(None))
        .context(why)?
        .context(why)?;
    errln!(
        "--device-memory gpu: cuda:{} ({}) has {} free of {}",
        gpu.ordinal,
        gpu.name,
        format_gb(gpu.free_bytes),
        format_gb(gpu.total_bytes)
    );
    Ok(gpu.free_bytes)
}

fn host_links(args: &PlanFlags) -> anyhow::Result<HostLinks> {
    let mut h = HostLinks::default();
    if let Some(b) = &args.host_link_bandwidth {
        h.device_to_host = parse_bandwidth(b, "--host-link-bandwidth")?;
    }
    if let Some(b) = &args.nvme_bandwidth {
        h.nvme = parse_bandwidth(b, "--nvme-bandwidth")?;
    }
    match args.host_adam_rate.as_deref().map(str::trim) {
        None => {}
        Some("measure") => {
            h.host_adam_params_per_s = super::bench_adam::host_adam_rate()?;
            h.host_adam_measured = true;
        }
        Some(text) => {
            let rate = parse_count(text, "--host-adam-rate")? as f64;
            if rate <= 0.0 {
                anyhow::bail!(
                    "--host-adam-rate {text}: give a positive rate in parameters per second, such as 2e9, or `measure`"
                );
            }
            h.host_adam_params_per_s = rate;
        }
    }
    Ok(h)
}

/// The model a Hugging Face config describes (`FILE`, or `DIR/config.json`): a GPT-2 or a
/// Llama-family decoder, its parameters, units and activations by its own shape.
fn hf_model_size(path: &std::path::Path) -> anyhow::Result<ModelSize> {
    let file = match path.is_dir() {
        true => path.join("config.json"),
        false => path.to_path_buf(),
    };
    let cfg = zerodp::model::hf::HfConfig::read(&file)?;
    let Some(l) = &cfg.llama else {
        // A GPT-2's MLP width and untied head are not in the planner's shape: its parameters and
        // units come from the model's own layout (its activations stay the 4x MLP's estimate).
        use zerodp::zero::unit::UnitModel;
        let model = zerodp::model::GptModel::new(cfg.gpt.clone())?;
        let mut size = ModelSize::from_gpt(cfg.gpt.shape())?;
        let units: Vec<u64> = model
            .spec()
            .units
            .iter()
            .map(|u| u.numel() as u64)
            .collect();
        size.params = model.spec().num_params() as u64;
        size.largest_unit = units.iter().copied().max().unwrap_or(0);
        size.unit_numels = units;
        return Ok(size);
    };
    Ok(ModelSize::from_gpt(l.shape(l.context))?)
}

/// The model of `--params`, `--model-config`, `--preset` or `--layers/--width/--heads`.
fn model_size(args: &PlanFlags) -> anyhow::Result<ModelSize> {
    Ok(if let Some(p) = &args.params {
        let largest = args
            .largest_unit
            .as_deref()
            .map(|l| parse_count(l, "--largest-unit"))
            .transpose()?;
        ModelSize::from_count(parse_count(p, "--params")?, largest)?
    } else if let Some(path) = &args.model_config {
        hf_model_size(path)?
    } else if let Some(name) = &args.preset {
        ModelSize::from_gpt(GptShape::preset(name)?)?
    } else if let (Some(layers), Some(width), Some(heads)) = (args.layers, args.width, args.heads) {
        ModelSize::from_gpt(GptShape {
            layers,
            width,
            heads,
            vocab: args.vocab,
            context: args.context,
            llama: None,
        })?
    } else {
        anyhow::bail!(
            "no model given: pass --params 7.5e9 [--largest-unit N], --preset gpt2-xl, --model-config config.json, or --layers L --width W --heads H [--vocab V --context C]"
        );
    })
}

/// The intra-node and inter-node links: the presets (`--intra-node`, InfiniBand NDR between nodes,
/// or the one `--interconnect` names), then each bandwidth and latency given.
fn links(args: &PlanFlags) -> anyhow::Result<(Link, Link)> {
    let mut intra = interconnect(&args.intra_node)?;
    let mut inter = interconnect("ib-ndr")?;
    if let Some(name) = &args.interconnect {
        let link = interconnect(name)?;
        if matches!(name.to_ascii_lowercase().as_str(), "nvlink" | "pcie") {
            intra = link;
        } else {
            inter = link;
        }
    }
    if let Some(b) = &args.intra_bandwidth {
        intra.bandwidth = parse_bandwidth(b, "--intra-bandwidth")?;
    }
    if let Some(l) = &args.intra_latency {
        intra.latency = parse_latency(l, "--intra-latency")?;
    }
    if let Some(b) = &args.inter_bandwidth {
        inter.bandwidth = parse_bandwidth(b, "--inter-bandwidth")?;
    }
    if let Some(l) = &args.inter_latency {
        inter.latency = parse_latency(l, "--inter-latency")?;
    }
    Ok((intra, inter))
}

/// Flags and config into the planner's input.
pub fn build_input(args: &PlanFlags) -> anyhow::Result<PlanInput> {
    let model = model_size(args)?;
    let cli_precision = match args.precision.as_deref() {
        Some("bf16") => Some(Precision::Bf16),
        Some("fp16") => Some(Precision::Fp16),
        Some("fp32") => Some(Precision::Fp32),
        _ => None,
    };
    let (nodes, devices_per_node) = layout(args)?;
    let keys = match &args.config {
        Some(path) => Some(load_config(
            path,
            args,
            &model,
            nodes * devices_per_node,
            cli_precision,
        )?),
        None => None,
    };
    let precision = cli_precision
        .or_else(|| keys.as_ref().map(|k| k.precision))
        .unwrap_or(Precision::Bf16);
    let (intra, inter) = links(args)?;
    let default_flops = if precision == Precision::Fp32 {
        60e12
    } else {
        400e12
    };
    let cluster = Cluster {
        nodes,
        devices_per_node,
        device_memory: device_memory(&args.device_memory)?,
        host_memory: parse_bytes(&args.host_memory, "--host-memory")?,
        intra,
        inter,
        host: host_links(args)?,
        device_flops: args.flops.unwrap_or(default_flops),
    };
    let seq_len = args
        .seq_len
        .unwrap_or_else(|| model.shape.map(|s| s.context).unwrap_or(2048));
    Ok(PlanInput {
        cluster,
        precision,
        micro_batch: args
            .micro_batch
            .or_else(|| keys.as_ref().map(|k| k.micro_batch))
            .unwrap_or(1),
        seq_len,
        grad_accum: args
            .grad_accum
            .or_else(|| keys.as_ref().map(|k| k.grad_accum))
            .unwrap_or(1),
        activation_checkpointing: args.activation_checkpointing,
        buffers: keys
            .as_ref()
            .map(|k| k.buffers)
            .unwrap_or(BufferOverrides::default()),
        dtypes: keys.as_ref().map(|k| k.dtypes).unwrap_or_default(),
        configured: keys.as_ref().map(ConfigKeys::choice),
        process: None,
        model,
    })
}

/// Resolves the DeepSpeed config with zerodp's config reader for this cluster's world size (its
/// `"auto"` values filled from the flags as `train` would) and prints its warnings.
fn load_config(
    path: &std::path::Path,
    args: &PlanFlags,
    model: &ModelSize,
    world_size: u64,
    precision: Option<Precision>,
) -> anyhow::Result<ConfigKeys> {
    let ctx = config::ResolveContext {
        world_size: world_size as usize,
        world_size_source: "the planned cluster (--devices / --nodes)".into(),
        micro_batch: args.micro_batch.map(|m| m as usize),
        hidden_size: model.shape.map(|s| s.width as usize),
        precision_override: precision.map(config_precision),
        ..config::ResolveContext::default()
    };
    let loaded = config::load_file(path, &ctx).with_context(|| {
        format!(
            "resolving {} for {world_size} devices (--micro-batch fills a missing or \"auto\" micro-batch)",
            path.display()
        )
    })?;
    for w in &loaded.warnings {
        errln!("warning: {w}");
    }
    Ok(ConfigKeys::from_settings(&loaded.settings))
}

/// Nodes and devices per node from whichever of --nodes, --devices, --devices-per-node were given.
fn layout(args: &PlanFlags) -> anyhow::Result<(u64, u64)> {
    let positive = |v: Option<u64>, flag: &str| -> anyhow::Result<Option<u64>> {
        match v {
            Some(0) => anyhow::bail!("{flag} must be at least 1"),
            other => Ok(other),
        }
    };
    let nodes = positive(args.nodes, "--nodes")?;
    let devices = positive(args.devices, "--devices")?;
    let per_node = positive(args.devices_per_node, "--devices-per-node")?;
    let (n, g) = match (nodes, devices, per_node) {
        (Some(n), Some(d), Some(g)) if n.checked_mul(g) != Some(d) => {
            anyhow::bail!(
                "--nodes {n} x --devices-per-node {g} is {}, not --devices {d}; give two of the three",
                n as u128 * g as u128
            )
        }
        (Some(n), _, Some(g)) => (n, g),
        (Some(n), Some(d), None) => {
            if d % n != 0 {
                anyhow::bail!(
                    "--devices {d} does not split evenly over --nodes {n}; give --devices-per-node"
                );
            }
            (n, d / n)
        }
        (None, Some(d), Some(g)) => {
            if d % g != 0 {
                anyhow::bail!("--devices {d} is not a multiple of --devices-per-node {g}");
            }
            (d / g, g)
        }
        (None, Some(d), None) if d <= 8 => (1, d),
        (None, Some(d), None) => {
            if d % 8 != 0 {
                anyhow::bail!("--devices {d} is not a multiple of 8 devices per node; give --devices-per-node or --nodes");
            }
            (d / 8, 8)
        }
        (Some(n), None, None) => (n, 8),
        (None, None, Some(g)) => (1, g),
        (None, None, None) => (1, 8),
    };
    if n.checked_mul(g).is_none_or(|d| d > MAX_DEVICES) {
        anyhow::bail!(
            "{n} node(s) x {g} devices per node is more than zerodp's limit of {MAX_DEVICES} \
             devices; lower --devices, --nodes or --devices-per-node"
        );
    }
    Ok((n, g))
}

/// The human-readable report: what is planned, the options' table, their traffic, the
/// recommendation and the notes.
pub fn render_table(input: &PlanInput, plan: &Plan) -> String {
    let mut out = String::new();
    describe_input(&mut out, input, plan);
    options_table(&mut out, plan);
    traffic_lines(&mut out, plan);
    recommendation(&mut out, plan);
    out
}

/// A decoder's widths as the plan's first line gives them.
fn describe_shape(s: &GptShape) -> String {
    let attention = match &s.llama {
        Some(l) => format!(
            "Llama-family {} layers x {} wide, {} heads of {} ({} key/value), MLP {}",
            s.layers, s.width, s.heads, l.head_dim, l.kv_heads, l.intermediate
        ),
        None => format!(
            "GPT {} layers x {} wide, {} heads",
            s.layers, s.width, s.heads
        ),
    };
    format!(", {attention}, vocab {}, context {}", s.vocab, s.context)
}

/// The model, the cluster and the step planned for.
fn describe_input(out: &mut String, input: &PlanInput, plan: &Plan) {
    let c = &input.cluster;
    let m = &input.model;
    out.push_str(&format!(
        "model: {:.4e} params ({}), largest unit {:.3e} elements{}\n",
        m.params as f64,
        plan.precision.name(),
        m.largest_unit as f64,
        m.shape.as_ref().map(describe_shape).unwrap_or_default()
    ));
    out.push_str(&format!(
        "cluster: {} devices = {} node(s) x {}, {} per device, {} host per node; intra {:.0} GB/s {:.0} us, network {:.0} GB/s/node {:.0} us; {:.0} TFLOP/s per device\n",
        c.world_size(),
        c.nodes,
        c.devices_per_node,
        format_capacity(c.device_memory),
        format_capacity(c.host_memory),
        c.intra.bandwidth / 1e9,
        c.intra.latency * 1e6,
        c.inter.bandwidth / 1e9,
        c.inter.latency * 1e6,
        c.device_flops / 1e12
    ));
    out.push_str(&format!(
        "step: micro-batch {} x seq {} x accumulation {} = {} tokens per device; activation checkpointing {}\n\n",
        input.micro_batch,
        input.seq_len,
        input.grad_accum,
        plan.tokens_per_step_per_device,
        if input.activation_checkpointing { "on" } else { "off" }
    ));
}

/// One row per option, columns aligned.
fn options_table(out: &mut String, plan: &Plan) {
    let header = [
        "option",
        "params",
        "grads",
        "master",
        "m+v",
        "states",
        "buffers",
        "activ.",
        "total",
        "fits",
        "margin",
        "host/node",
        "comm/step",
        "comm",
        "compute",
        "step",
    ];
    let rows: Vec<Vec<String>> = plan.options.iter().map(row).collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| -> String {
        let mut l = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i == 0 {
                l.push_str(&format!("{cell:<w$}"));
            } else {
                l.push_str(&format!("  {cell:>w$}"));
            }
        }
        l.trim_end().to_string() + "\n"
    };
    out.push_str(&line(header.iter().map(|s| s.to_string()).collect()));
    out.push_str(&line(widths.iter().map(|w| "-".repeat(*w)).collect()));
    for r in rows {
        out.push_str(&line(r));
    }
}

/// Each option's collectives per step (the offload rows move the same).
fn traffic_lines(out: &mut String, plan: &Plan) {
    out.push_str("\ntraffic per device per step (offload rows move the same collectives):\n");
    for o in plan
        .options
        .iter()
        .filter(|o| o.offload_optimizer == Offload::None)
    {
        let parts: Vec<String> = o
            .collectives
            .iter()
            .map(|t| {
                format!(
                    "{} {} {} in {} call(s), {} {}",
                    collective_name(t.op),
                    t.what,
                    format_gb(t.bytes_per_device),
                    t.calls,
                    format_seconds(t.predicted_s),
                    match t.algorithm {
                        Algorithm::Ring => "ring",
                        Algorithm::Hierarchical => "hierarchical",
                    }
                )
            })
            .collect();
        out.push_str(&format!("  {}: {}\n", o.label, parts.join("; ")));
    }
}

/// The recommendation with its reasons and config advice, and the plan's notes.
fn recommendation(out: &mut String, plan: &Plan) {
    out.push('\n');
    let rec = &plan.recommendation;
    match &rec.label {
        Some(l) => out.push_str(&format!("recommendation: {l}\n")),
        None => out.push_str("recommendation: none fits\n"),
    }
    for r in &rec.reasons {
        out.push_str(&format!("  - {r}\n"));
    }
    if !rec.config_advice.is_empty() {
        out.push_str("config:\n");
        for a in &rec.config_advice {
            out.push_str(&format!("  - {a}\n"));
        }
    }
    out.push_str("notes:\n");
    for n in &plan.notes {
        out.push_str(&format!("  - {n}\n"));
    }
}

fn collective_name(c: Collective) -> &'static str {
    match c {
        Collective::AllReduce => "all-reduce",
        Collective::ReduceScatter => "reduce-scatter",
        Collective::AllGather => "all-gather",
    }
}

fn row(o: &PlanOption) -> Vec<String> {
    let b = &o.bytes_per_device;
    let margin = if o.device_margin_bytes >= 0 {
        format_gb(o.device_margin_bytes as u64)
    } else {
        format!("-{}", format_gb(o.device_margin_bytes.unsigned_abs()))
    };
    let fits = match (o.fits_device, o.fits_host) {
        (true, true) => "yes",
        (false, _) => "no",
        (true, false) => "no (host)",
    };
    vec![
        o.label.clone(),
        format_gb(b.params),
        format_gb(b.grads),
        format_gb(b.master),
        format_gb(b.adam_m + b.adam_v),
        format_gb(b.model_states),
        format_gb(o.buffer_bytes()),
        format_gb(b.activations),
        format_gb(b.total),
        fits.to_string(),
        margin,
        if o.bytes_per_node.host + o.bytes_per_node.nvme == 0 {
            "-".to_string()
        } else if o.bytes_per_node.nvme > 0 {
            format!(
                "{} +{} nvme",
                format_gb(o.bytes_per_node.host),
                format_gb(o.bytes_per_node.nvme)
            )
        } else {
            format_gb(o.bytes_per_node.host)
        },
        format_gb(o.comm_bytes_per_step),
        format_seconds(o.predicted_comm_s),
        format_seconds(o.predicted_compute_s),
        format_seconds(o.predicted_step_s),
    ]
}
