//! The contract between the engine and a model: an ordered list of **units** (FSDP's word: a block
//! whose parameters are gathered, used and released together) plus a loss computed by the last unit.
//!
//! # Implementing it
//! A model on candle does not implement [`UnitModel`] by hand: it implements
//! [`crate::model::CandleUnits`] (the layout, the initial values, a batch type and each unit's
//! forward on tensors) and is wrapped in [`crate::model::Candle`], which does the rest of this
//! contract (tensors from the flat slices, backward, gradient write-back); the GPT reference model
//! is built that way. Implement [`UnitModel`] directly for compute written by hand or on another
//! tensor library (the engine tests' toy model in `tests/it/common.rs` does).
//!
//! # What a unit is
//! A unit is the granularity of ZeRO-3: its parameters are all-gathered together before it runs
//! and released together after it (one all-gather and one reduce-scatter per unit, as in FSDP2).
//! Choose units so that the largest fits the gather budget and there are enough of them to overlap
//! communication with compute: a transformer block each, the embeddings and the head on their own.
//! Units run in order in forward (`0, 1, ..., n-1`) and in reverse in backward; activations flow
//! from one unit to the next as [`UnitModel::Act`].
//!
//! # Tied weights
//! A unit may read the parameters of other units ([`UnitSpec::uses`]), for example a language
//! model's head reusing the token embedding. The parameters have one owner (they are stored,
//! sharded and updated once); the reader receives the owner's flat buffer after its own in
//! `params`, and adds its gradient contribution into the owner's gradient slice in `grads`. The
//! engine reduces the owner's gradient only after its last use in backward.
//!
//! # Train and NoGrad
//! [`ForwardMode::Train`] asks for a forward whose [`UnitForward::saved`] lets
//! [`UnitModel::backward`] run later; [`ForwardMode::NoGrad`] asks only for the output (or the
//! loss) and must keep nothing for backward. The engine runs `NoGrad` where it will recompute:
//! under activation checkpointing, and at stage 3 for units whose gathered parameters it will not
//! keep until their backward, a unit's forward-pass run is `NoGrad` and the unit runs again in
//! `Train` just before its backward, with the same parameters and input, so it must compute the
//! same values both times. (The last unit always runs `Train`: its backward comes next.)
//!
//! # What the engine guarantees
//! * `params` holds exactly the unit's own flat buffer and then each used unit's, unpadded, in
//!   [`ParamSpec`] order, as `f32` (under bf16/fp16 training they are the 16-bit values widened).
//! * `grads` has the same lengths; the model *adds* into it (the engine zeroes, accumulates over
//!   micro-batches, reduces and shards).
//! * `backward(unit)` is called once per `Train` forward of that unit, with what that forward
//!   saved, in reverse unit order; a unit run `NoGrad` in forward is run again in `Train` mode just
//!   before its backward (stage 3 and activation checkpointing), with the same input.
//! * Every rank calls the model with the same parameters and its own micro-batches; the model must
//!   be deterministic given those, so that every world size trains alike.
//! * The batch is a type of the model's choosing ([`UnitModel::Batch`]); the engine never looks
//!   inside it, and asks [`UnitModel::batch_counts`] only for reports.
//!
//! * Between two calls of [`UnitModel::parameters_changed`] every call passes unit `u` the same
//!   parameter values (the engine calls it after each optimizer step that updated them, and after
//!   loading or restoring them), so a model may keep a copy of a unit's parameters between calls,
//!   on a GPU for example, and drop it there.
//!
//! The engine owns every parameter and gradient as flat `f32` buffers, one per unit, laid out as the
//! concatenation of the unit's [`ParamSpec`]s in order (row-major, no padding; the engine adds the
//! padding it needs for sharding). A model never keeps parameters between calls: each call gets the
//! gathered flat parameters it needs as slices, which is what lets stage 3 release them afterwards.

/// One parameter tensor inside a unit's flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Full name, for example `h.0.attn.c_attn.weight` (names follow the safetensors layout the
    /// model documents).
    pub name: String,
    pub shape: Vec<usize>,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One unit: its own parameters and the other units whose parameters it also reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitSpec {
    pub name: String,
    pub params: Vec<ParamSpec>,
    /// Units (by index) whose parameters this unit reads too: tied weights, such as a GPT's LM head
    /// that reuses the token embedding of unit 0. Stage 3 gathers them before this unit runs, and the
    /// gradient contributions of every use are summed into the owner's gradient before it is reduced.
    pub uses: Vec<usize>,
}

impl UnitSpec {
    /// Number of parameter elements this unit owns.
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }
    /// Element offset of each parameter inside the unit's flat buffer.
    pub fn offsets(&self) -> Vec<usize> {
        let mut off = 0;
        self.params
            .iter()
            .map(|p| {
                let o = off;
                off += p.numel();
                o
            })
            .collect()
    }
}

/// For tests: unit `i` of one 1-D parameter of `numel` elements, reading the units `uses`.
#[cfg(test)]
pub(crate) fn test_unit(i: usize, numel: usize, uses: Vec<usize>) -> UnitSpec {
    UnitSpec {
        name: format!("u{i}"),
        params: vec![ParamSpec {
            name: format!("p{i}"),
            shape: vec![numel],
        }],
        uses,
    }
}

/// The whole model's layout: units in forward order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    pub units: Vec<UnitSpec>,
}

impl ModelSpec {
    /// Ψ: the number of parameters (tied parameters counted once).
    pub fn num_params(&self) -> usize {
        self.units.iter().map(UnitSpec::numel).sum()
    }
    /// The largest unit, in elements (what one stage-3 gather must hold).
    pub fn largest_unit(&self) -> usize {
        self.units.iter().map(UnitSpec::numel).max().unwrap_or(0)
    }
}

/// How much data a micro-batch holds, for reports (tokens/s, samples/s); the engine computes
/// nothing from it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchCounts {
    /// Samples (sequences, images, rows).
    pub samples: usize,
    /// Tokens (sequence models), or the samples again for models without tokens.
    pub tokens: usize,
}

impl std::ops::Add for BatchCounts {
    type Output = BatchCounts;
    fn add(self, o: BatchCounts) -> BatchCounts {
        BatchCounts {
            samples: self.samples + o.samples,
            tokens: self.tokens + o.tokens,
        }
    }
}

/// Whether a forward must be differentiable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardMode {
    /// Keep what backward needs in [`UnitForward::saved`].
    Train,
    /// No graph; `saved` is `None`. Used by stage 3 and activation checkpointing in the forward
    /// pass (the unit is run again in `Train` mode during backward), and by evaluation.
    NoGrad,
}

/// What a unit's forward returns.
pub struct UnitForward<A, S> {
    /// The activation passed to the next unit; `None` from the last unit.
    pub output: Option<A>,
    /// The mean loss over the micro-batch; `Some` only from the last unit.
    pub loss: Option<f32>,
    /// What backward needs; `Some` only in [`ForwardMode::Train`].
    pub saved: Option<S>,
}

/// Errors from a model's compute.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unit {unit}: {message}")]
    Compute { unit: String, message: String },
    #[error(
        "unit {unit}: expected {expected} parameter slices of lengths {lengths:?}, got {got:?}"
    )]
    ParamShape {
        unit: String,
        expected: usize,
        lengths: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("{0}")]
    Invalid(String),
}

/// A model the engine can train unit by unit.
///
/// `params` and `grads` in every call hold one slice per parameter group the unit reads: first the
/// unit's own flat buffer, then the flat buffer of each unit in [`UnitSpec::uses`], in that order.
pub trait UnitModel: Send + Sync {
    /// One rank's micro-batch: whatever the model reads (token ids and targets, images and
    /// labels, ...).
    type Batch;
    /// An activation flowing between units (cheap to clone).
    type Act: Clone + Send;
    /// What a unit keeps from its forward for its backward.
    type Saved: Send;

    fn spec(&self) -> &ModelSpec;

    /// How many samples and tokens `batch` holds (for reports only).
    fn batch_counts(&self, batch: &Self::Batch) -> BatchCounts;

    /// The terms `batch`'s mean loss averages (a language model's trained targets: chat data
    /// trains on the answers only). With [`crate::zero::EngineConfig::loss_per_token`] a step's
    /// loss weighs each micro-batch by it, so that the step's loss is the mean over every term of
    /// the global batch. [default: `batch_counts(batch).tokens`]
    fn loss_tokens(&self, batch: &Self::Batch) -> usize {
        self.batch_counts(batch).tokens
    }

    /// Deterministic initial values of unit `unit`'s own flat parameters (length `spec().units[unit]
    /// .numel()`), a function of `seed` alone, so that every rank and every world size starts equal.
    fn init_params(&self, unit: usize, seed: u64, out: &mut [f32]);

    /// Run unit `unit`. `input` is `None` for the first unit (which reads its input from the
    /// batch); the last unit returns the loss (typically reading its targets from the batch).
    fn forward(
        &self,
        unit: usize,
        params: &[&[f32]],
        input: Option<&Self::Act>,
        batch: &Self::Batch,
        mode: ForwardMode,
    ) -> Result<UnitForward<Self::Act, Self::Saved>, ModelError>;

    /// The parameters the next calls pass differ from those passed so far (an optimizer step
    /// updated them, or they were loaded or restored): a model keeping copies of parameters
    /// between calls (a GPU model keeping them on the device) drops them here. In-process ranks
    /// share one model, so it is called once per rank, each time with the same new values about
    /// to come from every rank. [default: nothing is kept]
    fn parameters_changed(&self) {}

    /// The device tier in this model's device memory, when the model holds it there
    /// ([`crate::zero::device_tier`]): the engine then keeps parameters, gradients and Adam's
    /// state in it, and `forward` and `backward` read and add to the tier instead of `params` and
    /// `grads`, which the engine passes empty while it does. [default: none]
    fn device_tier(&self) -> Option<&dyn crate::zero::DeviceTier> {
        None
    }

    /// Backward of unit `unit` from what its `Train` forward saved. `grad_output` is the gradient of
    /// the objective with respect to the unit's output (`None` for the last unit, whose objective is
    /// `loss * loss_weight`). Adds (`+=`) the parameter gradients into `grads` and returns the
    /// gradient with respect to the unit's input (`None` for the first unit).
    fn backward(
        &self,
        unit: usize,
        saved: Self::Saved,
        grad_output: Option<&Self::Act>,
        loss_weight: f32,
        grads: &mut [&mut [f32]],
    ) -> Result<Option<Self::Act>, ModelError>;
}
