//! zerodp: ZeRO (Zero Redundancy Optimizer) sharded data-parallel training.
//!
//! Modules follow the data flow of a training step:
//!
//! * [`config`]: a DeepSpeed JSON config in, validated settings out (DeepSpeed's defaults in
//!   [`config::defaults`]). Depends on nothing else in the crate.
//! * [`zero`]: the unit contract a model implements ([`zero::unit::UnitModel`]), flat buffers and
//!   partitions, the stage 0-3 engine, the stage-3 fetch/release coordinator, loss scaling,
//!   clipping. Knows no model and no tensor library.
//! * [`optim`]: Adam/AdamW over flat shards (the one dispatch on their dtypes, [`optim::adam_update`])
//!   and the learning-rate schedulers.
//! * [`comm`]: the [`comm::Communicator`] trait, its asynchronous handles, backends and traces.
//!   Knows nothing of ZeRO.
//! * [`memory`]: the byte accountant the engine charges, per memory tier (below `zero`). Depends
//!   on nothing.
//! * [`offload`]: storage of the host and NVMe tiers (swap files, aligned buffers); storage only,
//!   below `zero`, whose optimizer step streams states through it.
//! * [`setup`]: the one mapping from resolved settings to the engine's configuration.
//! * [`checkpoint`]: sharded checkpoints (manifest, background atomic saves, resharding loads).
//! * [`trainer`]: the [`trainer::Trainer`], the one rank loop (launch, steps, reports, saves).
//! * [`planner`]: bytes, traffic and time per device before a run, from the engine's own rules.
//! * [`model`]: the candle helper that makes any candle model a unit model
//!   ([`model::CandleUnits`], [`model::Candle`]), the GPT, GPT-2 and Llama on it.
//! * [`data`]: what a run trains on: the byte corpus, text and JSONL through a `tokenizer.json`
//!   into a cached token file, and the seeded windows over either ([`data::DataLoader`]); serves
//!   the trainer, not a model.
//! * [`rng`]: the seeded generators of the initialisation and the data order. Depends on nothing.
//! * [`device`]: where a rank computes (`--device cpu|cuda|cuda:N`), which GPU a rank takes, and
//!   a GPU's memory for the pre-flight and the planner. Depends on nothing (cudarc's driver API
//!   under the `cuda` feature).
//! * [`limits`]: the upper bounds on user-given sizes (parameters, layers, devices, memory) that
//!   `model` and `planner` check before multiplying them. Depends on nothing.
//! * [`flat`]: the foundation below `comm`, `optim`, `zero` and `model`: the dtype tag, owned flat
//!   buffers and their typed views, zeroed huge-page memory, the deterministic slice kernels (casts
//!   with 16-bit rounding, accumulation, norms). Depends on nothing.
//! * [`plot`]: `train --metrics` files read back into runs and drawn as one SVG of curves
//!   (`zerodp plot`, `train --plot`). Depends on nothing but `atomic_file`.
//! * [`atomic_file`]: files and directories written under a temporary name and renamed into
//!   place, so that a failed or killed write leaves what was there before. Depends on nothing.
//! * [`outputs`]: the check every command's output paths pass before any work (not an input, not
//!   in a checkpoint, not a Hugging Face directory's weights), beside `atomic_file`, which then
//!   writes them.
//! * [`affinity`]: which cores a rank's threads are pinned to (the process's affinity mask shared
//!   out among in-process ranks). Depends on nothing.
//! * `prefetch` (crate-private): software prefetch hints for the streaming loops of `optim` and
//!   `model` (the CPU Adam, the element-wise kernels). Depends on nothing.
//!
//! Dependencies point one way: `flat` <- {`comm`, `optim`, `model`}, `config` <- `optim`, {`comm`, `memory`, `offload`} <- `zero` <- `setup`,
//! `checkpoint` <- {`trainer`, `planner`}; `model` implements `zero::unit` and is used by none of them. The
//! binary (`src/main.rs`, `src/cli`) uses the library and nothing in the library uses it.

pub mod affinity;
pub mod atomic_file;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod data;
pub mod device;
pub mod flat;
pub mod isa;
pub mod limits;
pub mod memory;
pub mod model;
pub mod offload;
pub mod optim;
pub mod outputs;
pub mod planner;
pub mod plot;
mod prefetch;
pub mod rng;
pub mod setup;
pub mod trainer;
pub mod zero;
