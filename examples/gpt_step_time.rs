//! Forward + backward time of one micro-batch through the GPT, unit by unit as the engine runs it.
//!
//! `cargo run --example gpt_step_time -- [preset] [batch] [steps] [fused|composite]` (defaults:
//! small 8 5 fused). `composite` runs the reference path built from primitive candle ops.

use std::time::Instant;

use candle_core::Tensor;
use zerodp::data::TokenBatch as Batch;
use zerodp::model::{GptConfig, GptModel};
use zerodp::rng::SplitMix64;
use zerodp::zero::unit::{ForwardMode, UnitModel};

/// CPU time of the whole process (all threads) in seconds, from /proc/self/stat (Linux; 0 elsewhere).
/// Under a loaded machine this is a steadier measure than wall time when running single-threaded.
fn process_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which is in parentheses): utime is the 12th, stime the 13th.
    let after = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|x| x.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    ticks / 100.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let preset = args.first().map(String::as_str).unwrap_or("small");
    let batch_size: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let steps: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(5);
    let cfg = GptConfig::preset(preset)?;
    let fused = args.get(3).map(String::as_str) != Some("composite");
    let model = GptModel::with_options(cfg.clone(), candle_core::DType::F32, fused)?;
    let spec = model.spec().clone();
    let params: Vec<Vec<f32>> = (0..spec.units.len())
        .map(|u| {
            let mut b = vec![0.0; spec.units[u].numel()];
            model.init_params(u, 0, &mut b);
            b
        })
        .collect();
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut rng = SplitMix64::new(1);
    let n = batch_size * cfg.context;
    let batch = Batch {
        tokens: (0..n).map(|_| rng.below(cfg.vocab_size) as u32).collect(),
        targets: (0..n).map(|_| rng.below(cfg.vocab_size) as u32).collect(),
        batch_size,
        seq_len: cfg.context,
        segment_starts: Vec::new(),
    };
    println!(
        "{preset} ({}): {} params, batch {batch_size} x {}, {} threads",
        if fused {
            "fused kernels"
        } else {
            "composite ops"
        },
        spec.num_params(),
        cfg.context,
        candle_core::utils::get_num_threads()
    );
    let (mut timed_wall, mut timed_cpu) = (0.0, 0.0);
    for step in 0..=steps {
        let t0 = Instant::now();
        let cpu0 = process_cpu_seconds();
        let mut x: Option<Tensor> = None;
        let mut saved = Vec::new();
        let mut loss = 0.0;
        for u in 0..spec.units.len() {
            let groups: Vec<&[f32]> = std::iter::once(u)
                .chain(spec.units[u].uses.iter().copied())
                .map(|g| params[g].as_slice())
                .collect();
            let out = model.forward(u, &groups, x.as_ref(), &batch, ForwardMode::Train)?;
            saved.push(out.saved);
            x = out.output;
            loss = out.loss.unwrap_or(loss);
        }
        let t_fwd = t0.elapsed();
        let mut up: Option<Tensor> = None;
        for u in (0..spec.units.len()).rev() {
            let s = saved.pop().flatten().ok_or("missing saved state")?;
            let (head, tail) = grads.split_at_mut(u);
            let mut slices: Vec<&mut [f32]> = vec![tail[0].as_mut_slice()];
            if !spec.units[u].uses.is_empty() {
                slices.push(head[0].as_mut_slice());
            }
            up = model.backward(u, s, up.as_ref(), 1.0, &mut slices)?;
        }
        let t_all = t0.elapsed();
        if step > 0 {
            timed_wall += t_all.as_secs_f64();
            timed_cpu += process_cpu_seconds() - cpu0;
        }
        println!(
            "step {step}{}: loss {loss:.4}  forward {:.1} ms  backward {:.1} ms  total {:.1} ms  {:.0} tokens/s",
            if step == 0 { " (warm-up)" } else { "" },
            t_fwd.as_secs_f64() * 1e3,
            (t_all - t_fwd).as_secs_f64() * 1e3,
            t_all.as_secs_f64() * 1e3,
            n as f64 / t_all.as_secs_f64()
        );
    }
    if steps > 0 {
        println!(
            "mean over {steps} timed steps: wall {:.1} ms ({:.0} tokens/s), process CPU {:.1} ms",
            timed_wall / steps as f64 * 1e3,
            (n * steps) as f64 / timed_wall,
            timed_cpu / steps as f64 * 1e3
        );
    }
    Ok(())
}
