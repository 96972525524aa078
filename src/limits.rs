//! Upper bounds on the sizes a user gives (flags, config keys), checked before any arithmetic on
//! them. Within these bounds the products zerodp forms (bytes = elements × bytes per element ×
//! copies, totals over devices and kinds) stay far inside `u64`, so a size that would wrap is
//! refused with a message naming the flag and the limit instead of wrapping or panicking later.
//! Depends on nothing else in the crate: `model` and `planner` both check against it.

/// Parameters of one model: 1e15, about 6000 times GPT-3 (175e9) and 30 times the 32-trillion
/// parameter model ZeRO-Infinity reports. 16 bytes of model states per parameter is then 1.6e16
/// bytes, three orders of magnitude inside `u64`.
pub(crate) const MAX_PARAMS: u64 = 1_000_000_000_000_000;

/// Transformer blocks of one GPT: 100,000 (GPT-3 has 96). Each is one unit with its own
/// descriptors, so the bound also bounds what describing the model allocates.
pub(crate) const MAX_LAYERS: u64 = 100_000;

/// Positions (tokens per sequence) of one GPT: 2^31, as many as a batch number may count.
pub(crate) const MAX_CONTEXT: u64 = 1 << 31;

/// Devices in one planned cluster: 2^20.
pub const MAX_DEVICES: u64 = 1 << 20;

/// Bytes of memory of one device or one node, and of any per-device amount the planner adds up:
/// 2^60 (1 EiB), so that sums of a few of them and their differences fit `i64`.
pub(crate) const MAX_MEMORY_BYTES: u64 = 1 << 60;

/// Bytes of f32 logits the GPT's LM-head loss holds at a time: it computes the head's product and
/// the cross-entropy over chunks of rows rather than all `[tokens, vocab]` logits at once. Here
/// because the model computes with it and the planner counts it.
pub(crate) const LM_HEAD_CHUNK_BYTES: u64 = 32 << 20;

/// Rows of one LM-head chunk at vocabulary `vocab`: [`LM_HEAD_CHUNK_BYTES`] of f32 logits,
/// rounded up to a whole number of 32-row tasks (a byte vocabulary's micro-batch is one chunk).
pub(crate) fn lm_head_chunk_rows(vocab: u64) -> u64 {
    (LM_HEAD_CHUNK_BYTES / (4 * vocab.max(1)))
        .max(1)
        .div_ceil(32)
        * 32
}

/// The parameter count Ψ of a GPT-2-architecture shape (learned positions, tied LM head, 4x MLP,
/// biases everywhere): (vocab + context)·w + layers·(12w² + 13w) + 2w, or `None` when it does not
/// fit `u64`.
pub(crate) fn gpt_params(vocab: u64, context: u64, layers: u64, width: u64) -> Option<u64> {
    let w = width;
    let block = w
        .checked_mul(w)?
        .checked_mul(12)?
        .checked_add(w.checked_mul(13)?)?;
    vocab
        .checked_add(context)?
        .checked_mul(w)?
        .checked_add(layers.checked_mul(block)?)?
        .checked_add(w.checked_mul(2)?)
}

/// Refuses a GPT shape beyond [`MAX_CONTEXT`], [`MAX_LAYERS`] or [`MAX_PARAMS`], naming the flags to lower
/// (`--layers`, `--width`, `--context`: `train` and `plan` name the shape alike). Returns Ψ.
pub(crate) fn check_gpt_size(
    vocab: u64,
    context: u64,
    layers: u64,
    width: u64,
) -> Result<u64, String> {
    if context > MAX_CONTEXT {
        return Err(format!(
            "--context {context} is more than zerodp's limit of 2^31 positions"
        ));
    }
    if layers > MAX_LAYERS {
        return Err(format!(
            "--layers {layers} is more than zerodp's limit of {MAX_LAYERS} transformer blocks"
        ));
    }
    match gpt_params(vocab, context, layers, width) {
        Some(p) if p <= MAX_PARAMS => Ok(p),
        _ => {
            // In f64 for the message: exact enough, and never overflows.
            let (v, t, l, w) = (vocab as f64, context as f64, layers as f64, width as f64);
            let approx = (v + t) * w + l * (12.0 * w * w + 13.0 * w) + 2.0 * w;
            Err(format!(
                "a GPT of {layers} layers, width {width}, context {context} and vocabulary {vocab} \
                 would have {approx:.2e} parameters, more than zerodp's limit of {:.0e}; lower \
                 --width, --layers or --context",
                MAX_PARAMS as f64
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_count_and_overflow() {
        // GPT-2 small: 124,439,808 parameters with the tied head.
        assert_eq!(gpt_params(50257, 1024, 12, 768), Some(124_439_808));
        assert_eq!(gpt_params(256, 64, 3, 1 << 32), None);
        let e = check_gpt_size(256, 64, 3, 1 << 32).unwrap_err();
        assert!(e.contains("--width") && e.contains("1e15"), "{e}");
        let e = check_gpt_size(256, 64, 1_000_000, 8).unwrap_err();
        assert!(
            e.contains("--layers 1000000") && e.contains("100000"),
            "{e}"
        );
        assert_eq!(check_gpt_size(50257, 1024, 12, 768), Ok(124_439_808));
        let e = check_gpt_size(256, 1 << 32, 2, 8).unwrap_err();
        assert!(
            e.contains("--context 4294967296") && e.contains("2^31"),
            "{e}"
        );
    }
}
