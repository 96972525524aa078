//! `zerodp ckpt`: what a checkpoint holds, verified, and its full weights in one file or as a
//! Hugging Face model directory.

use anyhow::bail;
use std::path::PathBuf;
use zerodp::checkpoint::{consolidate, inspect};
use zerodp::outputs::{check_outputs, NamedPath};

#[derive(clap::Subcommand, Debug)]
pub enum CkptCommand {
    /// Print what a checkpoint holds and verify every file's size and checksum.
    Inspect(InspectArgs),
    /// Write the full model weights into one safetensors file with the model's parameter names
    /// (loads with `train --init` and any safetensors reader), streaming one parameter at a time.
    Consolidate(ConsolidateArgs),
    /// Write a Hugging Face model directory (config.json, model.safetensors, the tokenizer files
    /// of the model directory trained from) that `transformers` loads (GPT-2, Llama).
    Export(super::hf_model::ExportArgs),
}

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// A --save-dir (its `latest` checkpoint) or one checkpoint directory.
    pub dir: PathBuf,
    /// `table` or `json`.
    #[arg(long, default_value = "table")]
    pub format: String,
}

#[derive(clap::Args, Debug)]
pub struct ConsolidateArgs {
    /// A --save-dir (its `latest` checkpoint) or one checkpoint directory.
    pub dir: PathBuf,
    /// The safetensors file to write (outside any checkpoint; written under a temporary name and
    /// renamed into place).
    pub out: PathBuf,
    /// `fp32` (the master weights exactly) or `bf16`.
    #[arg(long, default_value = "fp32")]
    pub dtype: String,
}

pub fn run(cmd: CkptCommand) -> anyhow::Result<i32> {
    match cmd {
        CkptCommand::Inspect(a) => run_inspect(a),
        CkptCommand::Consolidate(a) => run_consolidate(a),
        CkptCommand::Export(a) => super::hf_model::run_export(a),
    }
}

fn run_inspect(a: InspectArgs) -> anyhow::Result<i32> {
    if a.format != "table" && a.format != "json" {
        bail!("--format must be table or json, got {}", a.format);
    }
    let i = inspect(&a.dir)?;
    let bad = i.problems.iter().filter(|(_, p)| p.is_some()).count();
    if a.format == "json" {
        outln!("{}", serde_json::to_string_pretty(&i)?);
    } else {
        let m = &i.manifest;
        outln!("checkpoint {}", i.dir.display());
        outln!(
            "  step {} (Adam step {}), world size {}, ZeRO stage {}, {}, seed {}",
            m.step,
            m.counters.adam_step,
            m.world_size,
            m.stage,
            m.precision,
            m.seed
        );
        if let Some(s) = &m.counters.policy.scaler {
            outln!("  fp16 loss scale {}", s.loss_scale());
        }
        let params: usize = m.model.units.iter().map(|u| u.numel).sum();
        outln!(
            "  model: {} units, {} parameters (master weights, Adam m and v in F32)",
            m.model.units.len(),
            params
        );
        // `problems` follows the manifest's file list, one entry per file.
        for (f, (name, problem)) in m.files.iter().zip(&i.problems) {
            let status = problem.as_deref().unwrap_or("ok");
            outln!(
                "  {name}: {} bytes, crc32 {:08x}: {status}",
                f.bytes,
                f.crc32
            );
        }
    }
    if bad > 0 {
        bail!("{bad} of {} files failed verification", i.problems.len());
    }
    Ok(0)
}

fn run_consolidate(a: ConsolidateArgs) -> anyhow::Result<i32> {
    let bf16 = match a.dtype.as_str() {
        "fp32" => false,
        "bf16" => true,
        other => bail!("--dtype must be fp32 or bf16, got {other}"),
    };
    // Before any work: the output must not be the checkpoint read, lie in it or in any other
    // checkpoint, or be one of a checkpoint's files (see `zerodp::outputs`).
    let input = NamedPath {
        name: "checkpoint",
        path: &a.dir,
    };
    let output = NamedPath {
        name: "output",
        path: &a.out,
    };
    check_outputs(&[input], &[output])?;
    let bytes = consolidate(&a.dir, &a.out, bf16)?;
    errln!("wrote {} ({bytes} bytes, {})", a.out.display(), a.dtype);
    Ok(0)
}
