//! What a `zerodp train` process holds beyond the engine's ledger: the activations of zerodp's own
//! GPT ([`crate::model::GptModel`], candle on the CPU) or Llama-family decoder, candle's copies of
//! the weights they compute with, and the runtime of the process (binary, allocator, threads,
//! training text).
//!
//! The engine's ledger counts the model states and the engine's buffers exactly; the model's memory
//! is the model's business and the ledger does not see it. A pre-flight check that stopped there
//! planned 1.14x (stage 3) to 1.47x (stage 1, two ranks) less than the process's peak resident set.
//! The rules below were read off the model's code and checked against a counting allocator
//! (`tests/unit_memory.rs`, unit by unit). The Llama family's are the live heap within 1-2%. The
//! GPT's embeddings and the weights its graphs keep are exact; its blocks' and head's transients
//! are planned high, on purpose: the process keeps one heap that is never trimmed
//! ([`crate::model::keep_freed_buffers`]), whose high-water mark, the resident set, lies above the
//! live heap by what freed blocks of other sizes leave unusable, 3-10 MB a rank on the grid's
//! GPTs, and the exact rules (block graph 16nc, backward max(8nc, 5nc + the attention kernel's
//! scratch per thread)) planned the grid 0.87-1.01x of it. Until that heap is modelled, the high
//! rules below and the fitted [`PROCESS_BASE_BYTES`] stand for it, measured within 10% of the
//! resident set by `scripts/preflight_rss.sh`.
//!
//! # zerodp's GPT, per micro-batch
//! `n` = micro-batch × sequence tokens, `c` = width, `V` = vocabulary, `T` = context, `H` = heads,
//! `P` = micro-batch·H·seq² (one attention-probability tensor). The model always computes in f32,
//! whatever the training precision (16-bit parameters are widened first), so every count below is
//! 4 bytes an element.
//!
//! * A training forward of the embeddings or the head builds a candle graph: the embeddings keep
//!   nc and the tokens; the head 2nc and the targets (its loss runs over chunks of
//!   r = [`crate::limits::lm_head_chunk_rows`] rows and keeps no logits). A block runs without a
//!   graph ([`crate::model::GptModel`]'s direct blocks) and keeps 16nc (planned 17nc): ln_1, qkv
//!   3nc, attention, the residual, ln_2, c_fc 4nc, GELU 4nc, and its output.
//! * Each forward copies the weights it reads ([`crate::model::GptModel`]'s `param_tensor`, a
//!   block's flat copy), and a kept graph holds them until its backward: 12c²+13c per block, (V+T)c
//!   for the embeddings, 2c + (V+T)c for the head (the embeddings' group, tied, a second copy). At
//!   stage 3 the ledger already counts the copies of units that keep their graph (its `gather`
//!   kind): they are not counted twice.
//! * Backward allocates, above the graph: candle's gradient store (each gradient is a zeros tensor
//!   plus the sum, alive together for a moment), the parameter gradients, and the kernels' scratch.
//!   A block's backward is planned at the largest of 9nc+4c² and 6nc+3P+3c², plus 4nc (it
//!   allocates at most max(8nc, 5nc + one attention scratch per thread)); the head at the largest
//!   of rV+2nc+Vc (with a bf16 run's head packing), 2nc+6Vc and 6nc+2Vc, plus max(nc, Vc) (it
//!   allocates the largest of rV+Vc+nc,
//!   3Vc+nc and 4nc+Vc); the embeddings 6nc + 3Vc + Tc, exactly.
//! * A forward without a graph (activation checkpointing, or a stage-3 unit recomputed in backward)
//!   is planned at its weight copies plus max(12nc, 8nc+2P) for a block (it allocates max(10nc,
//!   4nc + the scratches), no copies), and keeps only its output, which the engine holds as the
//!   next unit's input until that unit is recomputed.
//!
//! # A Llama-family decoder, per micro-batch
//! ([`crate::model::llama::Llama`] on its fused CPU kernels: Llama, Qwen2/3, Mistral, Gemma.) Its
//! units are candle graphs, each op a node that keeps its output, so the rules count tensors:
//! `q` = heads·head_dim, `kv` = key/value heads·head_dim, `I` = the MLP's width. Checked per unit
//! against a counting allocator (`tests/unit_memory.rs`, within 1-2%).
//!
//! * A block's graph keeps per row 7c + 4q + 5kv + 3I: its input copy, the norms, the
//!   projections, the rotated queries and keys, their concatenation with the values (q + 2kv: the
//!   attention kernel reads each key/value head for its query heads, nothing is repeated), the
//!   attention output, the residuals and the MLP's gate, up and product; the options add their
//!   biases' outputs (q + 2kv, c, 2I + c) and Qwen3's head norms (q + kv).
//! * Its backward peaks either in attention, n(6c + 4q + 6kv) above the MLP's and the output
//!   projection's weight gradients (3cI + cq + c), or in the MLP, n(6c + 5I) + cI: candle's
//!   gradient store makes each gradient as zeros plus the sum.
//! * Without a graph it peaks in the MLP with n(3c + 3q + 4kv + 3I) alive.
//! * The embeddings keep their rows (nc + n, and a tensor more for Gemma's scale or a padding
//!   token); their backward holds 6nc + 2Vc. The head keeps 2nc + n; its backward the larger of
//!   rV + nc + Vc (a chunk's logits, the input and the table's gradients, and in a bf16 run the
//!   table's bf16 panels in both layouts and a chunk's: `TrainProcess::head_packing`) and
//!   3Vc + 2nc (the table's gradient added into the store's zeros, the panels freed).
//!
//! The engine runs the units forward then backward (see [`crate::zero::schedule`]); the step's peak
//! is the fullest moment of that walk, with the gradient of the current unit's output (nc) held
//! between backward visits.
//!
//! # The process
//! Ranks are threads of one process: the process holds every rank's share plus, once, the binary and
//! its libraries and what it touches once training starts ([`PROCESS_BASE_BYTES`]: code, stacks,
//! the malloc arena's retained free blocks), the training text with its window order (4 bytes a window per cached epoch, two
//! epochs), and the products' packing memory on the path they run on this CPU
//! (`crate::model::products_footprint`, computed by the caller): on the gemm crate a slab per pool
//! thread and the largest product's buffers per rank, both sized by the crate's own rules for this
//! CPU's caches; on zerodp's AVX512-BF16 kernels the bf16 panels of the fullest product, the LM
//! head's backward (its token table in both layouts beside a chunk's logits gradient). The base
//! cannot be counted from the code and is fitted to `scripts/preflight_rss.sh`'s measurements.

use super::model::{GptShape, LlamaDims};

/// Bytes of an f32, the dtype zerodp's GPT computes in.
const F32: u64 = 4;

/// The process outside the ranks: the binary's resident pages and shared libraries (about 8.4 MB
/// of a release build at the pre-flight; a test build's are larger), the main thread, the parsed
/// config and the model description, and what the process adds once training starts: the code
/// pages of the step, the ranks' and communication threads' stacks, and the free blocks the one
/// malloc arena keeps (freed blocks of up to 32 MiB stay for reuse and the heap is never trimmed:
/// [`crate::model::keep_freed_buffers`]). Fitted to the `scripts/preflight_rss.sh` grid (a 2-core
/// AMD EPYC, Zen 4, release binary). A constant rather than the resident set read at the check, so
/// that the same run is planned the same every time.
pub const PROCESS_BASE_BYTES: u64 = 12_400_000;

/// What a build with the `cuda` feature holds beyond [`PROCESS_BASE_BYTES`] before any GPU work: the
/// CUDA 13.0 libraries it links (cudart, cuBLAS and cuBLASLt, cuRAND) are loaded and relocated at
/// start, GPU or not. Measured as the peak resident set of the same CPU run of the `demo` model with
/// and without the feature (194 MiB against 39 MiB, NVIDIA's PyPI wheels of the libraries). On a
/// GPU the driver and the CUDA context add host memory of their own, not counted here.
pub const CUDA_LIBRARIES_BYTES: u64 = 163_000_000;

/// The `zerodp train` process a plan is for: what it holds beyond its ranks' model states, buffers
/// and activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TrainProcess {
    /// Bytes of the training text, held in memory for the whole run.
    pub corpus_bytes: u64,
    /// Rayon threads each rank computes on.
    pub threads_per_rank: u64,
    /// Whether the run saves checkpoints (`--save-dir`): each rank then holds a staging copy of
    /// its shard of the master weights and Adam's m and v for the whole run.
    pub checkpoint_staging: bool,
    /// The units compute on a GPU (`--device cuda`): their activations and weight copies are in
    /// its memory, not this process's (the GPU pre-flight checks them there).
    pub compute_on_gpu: bool,
    /// Bytes the gemm crate holds per thread of a rank's pool for the model's f32 products on
    /// this CPU (its L2-sized packing slab); 0 where the products run on zerodp's bf16 or AMX
    /// kernels.
    pub gemm_per_thread: u64,
    /// Bytes of the fullest product's packing buffers on this CPU, per rank: the gemm crate's, or
    /// the bf16 panels of zerodp's AVX512-BF16 products (`crate::model::products_footprint`).
    pub gemm_per_rank: u64,
    /// Bytes the LM head's backward packs beside its own tensors, at that moment only: the bf16
    /// panels of zerodp's AVX512-BF16 products (`GemmFootprint::head_backward`); 0 elsewhere.
    pub head_packing: u64,
    /// The binary was built with the `cuda` feature and holds the CUDA libraries
    /// ([`CUDA_LIBRARIES_BYTES`]).
    pub cuda_build: bool,
    /// The ranks that are threads of this process and share its base: 0 for every rank of the
    /// world (the in-process backend); 1 under MPI, where each process holds its own.
    pub ranks_in_process: u64,
}

impl TrainProcess {
    /// Bytes of the process overhead per rank for `world` ranks whose windows are `context + 1`
    /// tokens: the process-wide part (the process itself, the corpus and its window orders)
    /// shared out over the ranks in the process, plus each rank's pool threads.
    pub(crate) fn overhead_per_rank(&self, world: u64, context: u64) -> u64 {
        let sharing = match self.ranks_in_process {
            0 => world.max(1),
            n => n,
        };
        let windows = self.corpus_bytes / (context + 1).max(1);
        let data = self.corpus_bytes + 2 * 4 * windows;
        let pool = self.threads_per_rank.max(1) * self.gemm_per_thread + self.gemm_per_rank;
        let libraries = match self.cuda_build {
            true => CUDA_LIBRARIES_BYTES,
            false => 0,
        };
        (PROCESS_BASE_BYTES + libraries + data).div_ceil(sharing) + pool
    }
}

/// The checkpoint staging buffer of one rank holding `shard` elements: the fp32 master, m and v,
/// plus the page that starts the file image (`crate::checkpoint`).
pub(crate) fn checkpoint_staging_bytes(shard: u64) -> u64 {
    3 * F32 * shard + 2 * 4096
}

/// What zerodp's GPT holds beyond the engine's ledger at the fullest moment of a micro-step, in
/// bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GptStepMemory {
    /// Graph tensors, inputs kept for recomputation, the output gradient and backward's transient
    /// gradients and scratch.
    pub activations: u64,
    /// candle's f32 copies of the weights, held by the graphs alive at that moment (not those the
    /// ledger counts).
    pub param_copies: u64,
}

impl GptStepMemory {
    pub fn total(&self) -> u64 {
        self.activations + self.param_copies
    }
}

/// What one unit of zerodp's GPT or Llama holds beyond the engine's ledger, in f32 elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitMemory {
    /// Activations a training forward's graph keeps until backward (its input copy and its output
    /// included).
    pub graph: u64,
    /// Weight copies the graph keeps.
    pub copies: u64,
    /// Backward's transient peak above the graph.
    pub backward: u64,
    /// A forward without a graph: its transient peak beside the input, weight copies excluded.
    pub no_grad: u64,
}

/// Every unit's [`UnitMemory`] in forward order (the embeddings, the blocks, the head) for
/// `micro_batch` sequences of `seq` tokens: the rules the pre-flight walks a step with.
/// `head_packing`: f32 elements the head's products pack while it walks its chunks of rows in
/// backward ([`TrainProcess::head_packing`]), beside that moment's tensors.
pub fn unit_memory(
    shape: &GptShape,
    micro_batch: u64,
    seq: u64,
    head_packing: u64,
) -> Vec<UnitMemory> {
    if let Some(l) = &shape.llama {
        return llama_units(shape, l, micro_batch * seq, head_packing);
    }
    let (c, v, t, h) = (shape.width, shape.vocab, shape.context, shape.heads);
    let n = micro_batch * seq;
    let nc = n * c;
    let probs = micro_batch * h * seq * seq;
    let vc = v * c;
    let embeddings = UnitMemory {
        graph: nc + n,
        copies: (v + t) * c,
        backward: 6 * nc + 3 * vc + t * c,
        no_grad: nc + n,
    };
    let block = UnitMemory {
        graph: 17 * nc,
        copies: shape.block_params(),
        backward: [9 * nc + 4 * c * c, 6 * nc + 3 * probs + 3 * c * c]
            .into_iter()
            .max()
            .unwrap_or(0)
            + 4 * nc,
        no_grad: (12 * nc).max(8 * nc + 2 * probs),
    };
    // The loss runs over chunks of r rows: r·V logits (and in backward their gradient, in place)
    // alive at a time, never n·V.
    let rv = n.min(crate::limits::lm_head_chunk_rows(v)) * v;
    let head = UnitMemory {
        graph: 2 * nc + n,
        // ln_f and the embeddings' whole group (the tied token table and the positions).
        copies: 2 * c + vc + t * c,
        backward: [
            rv + 2 * nc + vc + head_packing,
            2 * nc + 6 * vc,
            6 * nc + 2 * vc,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            + nc.max(vc),
        no_grad: 2 * nc + rv,
    };
    let mut out = vec![embeddings];
    out.extend(std::iter::repeat_n(block, shape.layers as usize));
    out.push(head);
    out
}

/// The units of a Llama-family decoder on `n` rows ([`crate::model::llama::Llama`] on its fused
/// CPU kernels, every op a candle graph node), in f32 elements; see the module's notes.
fn llama_units(shape: &GptShape, l: &LlamaDims, n: u64, head_packing: u64) -> Vec<UnitMemory> {
    let (c, v, i) = (shape.width, shape.vocab, l.intermediate);
    let (q, kv) = l.qk(shape.heads);
    // Gemma's scaled embeddings and rows of the padding token cut from the graph are a tensor
    // each (the planner cannot know whether the data holds that token, so it counts it).
    let extra = (u64::from(l.embed_scale) + u64::from(l.pad_rows)) * n * c;
    let embeddings = UnitMemory {
        graph: n * c + n + extra,
        copies: v * c,
        backward: 6 * n * c + 2 * (n * c).max(v * c) + extra,
        no_grad: n * c + n + extra,
    };
    let mut row = 7 * c + 4 * q + 5 * kv + 3 * i;
    row += u64::from(l.qkv_bias) * (q + 2 * kv) + u64::from(l.o_bias) * c;
    row += u64::from(l.mlp_bias) * (2 * i + c) + u64::from(l.qk_norm) * (q + kv);
    let attention_phase = n * (6 * c + 4 * q + 6 * kv) + 3 * c * i + c * q + c;
    let mlp_phase = n * (6 * c + 5 * i) + c * i;
    let block = UnitMemory {
        graph: n * row,
        copies: shape.block_params(),
        backward: attention_phase.max(mlp_phase),
        no_grad: n * (3 * c + 3 * q + 4 * kv + 3 * i).max(c + 4 * q + 4 * kv),
    };
    let rv = n.min(crate::limits::lm_head_chunk_rows(v)) * v;
    let vc = v * c;
    let head = UnitMemory {
        graph: 2 * n * c + n,
        copies: c + vc,
        backward: (rv + n * c + vc + head_packing).max(3 * vc + 2 * n * c),
        no_grad: 2 * n * c + rv + vc,
    };
    let mut out = vec![embeddings];
    out.extend(std::iter::repeat_n(block, shape.layers as usize));
    out.push(head);
    out
}

/// The fullest moment of one micro-step of zerodp's GPT of `shape` on `micro_batch` sequences of
/// `seq` tokens, beyond the engine's ledger. `recompute[u]`: unit `u` runs its forward without a
/// graph and again in backward (the engine's rule); `copies_in_ledger[u]`: the ledger already
/// counts the weights unit `u`'s kept graph holds (stage 3). Both have one entry per unit (the
/// embeddings, the blocks, the head); missing entries count as false. `head_packing`: bytes the
/// head's backward packs beside its tensors ([`TrainProcess::head_packing`]).
pub fn gpt_step_memory(
    shape: &GptShape,
    micro_batch: u64,
    seq: u64,
    recompute: &[bool],
    copies_in_ledger: &[bool],
    head_packing: u64,
) -> GptStepMemory {
    let units = unit_memory(shape, micro_batch, seq, head_packing.div_ceil(F32));
    let last = units.len() - 1;
    let nc = micro_batch * seq * shape.width;
    let flag = |v: &[bool], u: usize| v.get(u).copied().unwrap_or(false);
    let copies = |u: usize| match flag(copies_in_ledger, u) {
        true => 0,
        false => units[u].copies,
    };
    // Held now: activations and weight copies; the peak as (total, activations, copies).
    let (mut acts, mut held_copies) = (0u64, 0u64);
    let mut peak = (0u64, 0u64, 0u64);
    let mut see = |a: u64, w: u64| {
        if a + w > peak.0 {
            peak = (a + w, a, w);
        }
    };
    // Whether the current input is a tensor of its own (a no-grad forward's output) rather than
    // part of the previous unit's graph, and so whether keeping it for a recomputation costs.
    let mut loose = false;
    let mut kept_input_loose = vec![false; units.len()];
    for (u, m) in units.iter().enumerate() {
        if u != last && flag(recompute, u) {
            see(acts + m.no_grad, held_copies + copies(u));
            kept_input_loose[u] = loose;
            // Its output is kept as the next unit's input (or copied into that unit's graph).
            acts += nc;
            loose = true;
        } else {
            acts += m.graph;
            held_copies += copies(u);
            if loose {
                // A training forward copies its input into its graph and drops the original.
                acts = acts.saturating_sub(nc);
                loose = false;
            }
            see(acts, held_copies);
        }
    }
    for (u, m) in units.iter().enumerate().rev() {
        if u != last && flag(recompute, u) {
            acts += m.graph;
            held_copies += copies(u);
            if kept_input_loose[u] {
                // The kept input is dropped once copied into the recomputed graph.
                acts = acts.saturating_sub(nc);
            }
        }
        see(acts + m.backward, held_copies);
        acts = acts.saturating_sub(m.graph);
        held_copies = held_copies.saturating_sub(copies(u));
        // This unit's input gradient replaces its output gradient.
        if u > 0 {
            acts += nc;
        }
        if u < last {
            acts = acts.saturating_sub(nc);
        }
    }
    GptStepMemory {
        activations: peak.1 * F32,
        param_copies: peak.2 * F32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo() -> GptShape {
        GptShape {
            layers: 3,
            width: 128,
            heads: 4,
            vocab: 256,
            context: 64,
            llama: None,
        }
    }

    #[test]
    fn a_kept_graph_holds_every_unit_until_backward() {
        let s = demo();
        let units = s.layers as usize + 2;
        let m = gpt_step_memory(&s, 4, 64, &vec![false; units], &[], 0);
        // The fullest moment is the last block's backward: every graph but the head's (freed by
        // then) is alive, with its weight copies, and the block's backward scratch on top.
        let nc = 4 * 64 * 128;
        let graphs = 2 * nc + 4 * 64 + 3 * 19 * nc;
        assert!(m.activations > graphs * 4, "{m:?}");
        assert_eq!(m.param_copies, (s.num_params() - 2 * 128) * 4);
        // Checkpointing keeps the inputs only, and one unit's copies at a time.
        let mut rec = vec![true; units];
        rec[units - 1] = false;
        let c = gpt_step_memory(&s, 4, 64, &rec, &[], 0);
        assert!(c.total() * 5 < m.total() * 3, "{c:?} vs {m:?}");
        assert!(c.param_copies <= (s.block_params() + 2 * 128 + 256 * 128) * 4);
    }

    #[test]
    fn the_heads_packing_counts_at_its_chunk_moment_only() {
        let s = demo();
        let head = |packing: u64| unit_memory(&s, 4, 64, packing)[s.layers as usize + 1].backward;
        let (nc, vc) = (4 * 64 * 128, 256 * 128);
        let rv = 4 * 64 * 256;
        // The chunks' moment (a chunk's logits, two gradients and the table's) is below the
        // store's accumulation of the table's gradient here: panels that fit under it add nothing.
        let chunks = rv + 2 * nc + vc;
        assert_eq!(head(0), 6 * vc + 2 * nc + nc.max(vc));
        assert_eq!(head(6 * vc + 2 * nc - chunks), head(0));
        // Larger panels make the chunks' moment the fullest.
        assert_eq!(head(200_000), chunks + 200_000 + nc.max(vc));
        // Every other unit is untouched.
        assert_eq!(
            unit_memory(&s, 4, 64, 200_000)[..4],
            unit_memory(&s, 4, 64, 0)[..4]
        );
    }

    #[test]
    fn copies_the_ledger_counts_are_not_counted_again() {
        let s = demo();
        let units = s.layers as usize + 2;
        let mut ledger = vec![true; units];
        ledger[units - 1] = false;
        let kept = gpt_step_memory(&s, 4, 64, &vec![false; units], &[], 0);
        let m = gpt_step_memory(&s, 4, 64, &vec![false; units], &ledger, 0);
        // At stage 3 the ledger holds the kept graphs' copies; only the head's are the model's, and
        // they are freed before the fullest moment.
        assert_eq!(m.param_copies, 0);
        assert_eq!(m.activations, kept.activations);
    }

    #[test]
    fn process_overhead_shares_the_process_and_counts_each_rank() {
        let p = TrainProcess {
            corpus_bytes: 1_000_000,
            threads_per_rank: 2,
            gemm_per_thread: 1 << 20,
            gemm_per_rank: 3 << 20,
            head_packing: 5 << 20,
            ..TrainProcess::default()
        };
        // The corpus, two epochs of window orders (4 bytes a window) and the estimated process.
        let shared = 1_000_000 + 8 * (1_000_000 / 65) + PROCESS_BASE_BYTES;
        // Each rank's two pool threads hold a slab each, and the rank one product's buffers.
        let gemm = 2 * (1 << 20) + (3 << 20);
        assert_eq!(p.overhead_per_rank(1, 64), shared + gemm);
        assert_eq!(p.overhead_per_rank(4, 64), shared.div_ceil(4) + gemm);
        // Under MPI every process holds its own.
        let mpi = TrainProcess {
            ranks_in_process: 1,
            ..p
        };
        assert_eq!(mpi.overhead_per_rank(4, 64), p.overhead_per_rank(1, 64));
        // A cuda build holds the CUDA libraries, shared like the rest of the process.
        let cuda = TrainProcess {
            cuda_build: true,
            ..p
        };
        assert_eq!(
            cuda.overhead_per_rank(1, 64),
            p.overhead_per_rank(1, 64) + CUDA_LIBRARIES_BYTES
        );
        // Products on zerodp's own kernels hold no gemm packing memory.
        let bf16 = TrainProcess {
            gemm_per_thread: 0,
            gemm_per_rank: 0,
            head_packing: 0,
            ..p
        };
        assert_eq!(
            p.overhead_per_rank(2, 64) - bf16.overhead_per_rank(2, 64),
            gemm
        );
    }
}
