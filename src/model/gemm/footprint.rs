//! What the `gemm` crate holds for the f32 products on this CPU, for the pre-flight's plan.
//!
//! The crate sizes its buffers from the CPU's caches and kernel shapes, so the same model holds a
//! different number of bytes on another CPU kind: a slab of the L2 cache's size per thread that
//! runs its tasks (allocated at the thread's first product and kept), and per product a buffer
//! for the packed right operand (`kc x nc` elements, `kc` from the L1 cache, `nc` from the L3 or
//! the operand's width) and the packed left one, allocated on the calling thread and freed when
//! the product ends. Both are computed here with the crate's own `kernel_params` and cache
//! table, rather than fitted on one CPU.

use super::super::gpt::GptConfig;

/// The `gemm` crate's memory for a model's f32 products on this CPU, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmFootprint {
    /// Per thread of a rank's compute pool: what the products write of its packing slab (the L2
    /// cache's size, allocated at the thread's first product).
    pub per_thread: u64,
    /// Per rank: the largest product's packing buffers, alive while it runs (products run one
    /// at a time on a rank's thread below [`super::two_products`]' pool size).
    pub per_rank: u64,
}

/// The f32 micro-kernel shape the `gemm` crate dispatches to on this CPU: rows (`MR`, a multiple
/// of the vector width) and columns (`NR`) of its register block.
fn kernel_shape() -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return (64, 6);
        }
        if std::is_x86_feature_detected!("fma") {
            return (16, 6);
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        return (16, 4);
    }
    #[allow(unreachable_code)]
    (8, 4)
}

/// Bytes one product `[m, k] @ [k, n]` touches of the crate's packing memory, as its
/// `gemm_basic_generic` sizes it (f32 elements, a cache line of alignment each): the packed
/// right and left operands it allocates on the calling thread (the left one planned whenever the
/// crate may prepack it, which depends on the operands' strides), and the part of each task
/// thread's L2 slab its left panels fill (`kc x mc`; the slab is allocated whole but only those
/// pages are ever written).
fn packing_bytes((m, n, k): (usize, usize, usize)) -> (u64, u64) {
    if m == 0 || n == 0 || k == 0 || (m <= 64 && n <= 64) {
        return (0, 0);
    }
    let (mr, nr) = kernel_shape();
    let p = gemm_common::cache::kernel_params(m, n, k, mr, nr, 4);
    let nc = match p.nc {
        0 => n.div_ceil(nr) * nr,
        nc => nc,
    };
    let rhs = p.kc * nc;
    let lhs = match m <= 2 * p.mc {
        true => p.kc * m.div_ceil(mr) * mr,
        false => 0,
    };
    (4 * (rhs + lhs) as u64 + 2 * 64, 4 * (p.kc * p.mc) as u64)
}

/// The products of one micro-step of zerodp's GPT on `tokens` rows, `(m, n, k)` for
/// `[m, k] @ [k, n]`: each linear layer's forward, input gradient and weight gradient, and the
/// LM head's over its chunks of rows.
pub fn gpt_products(gpt: &GptConfig, tokens: usize) -> Vec<(usize, usize, usize)> {
    let c = gpt.width;
    let inner = gpt.mlp_width.unwrap_or(4 * c);
    let layers = [(c, 3 * c), (c, c), (c, inner), (inner, c)];
    linear_products(&layers, (c, gpt.vocab_size), tokens)
}

/// [`gpt_products`] of a Llama-family decoder: q, k, v and o, gate, up and down, and the head.
pub fn llama_products(
    c: &crate::model::hf::LlamaConfig,
    tokens: usize,
) -> Vec<(usize, usize, usize)> {
    let (h, q, kv, i) = (
        c.hidden,
        c.heads * c.head_dim,
        c.kv_heads * c.head_dim,
        c.intermediate,
    );
    let layers = [(h, q), (h, kv), (q, h), (h, i), (i, h)];
    linear_products(&layers, (h, c.vocab_size), tokens)
}

/// The three products of each `(in, out)` linear layer on `tokens` rows, then the head's
/// (`(width, vocab)`) on one chunk of rows.
fn linear_products(
    layers: &[(usize, usize)],
    (width, vocab): (usize, usize),
    tokens: usize,
) -> Vec<(usize, usize, usize)> {
    let rows = tokens.min(crate::limits::lm_head_chunk_rows(vocab as u64) as usize);
    let head = (width, vocab, rows);
    let each = layers.iter().map(|&(inp, outp)| (inp, outp, tokens));
    each.chain(std::iter::once(head))
        .flat_map(|(inp, outp, m)| [(m, outp, inp), (m, inp, outp), (outp, inp, m)])
        .collect()
}

/// The `gemm` crate's memory for `products` on this CPU.
pub fn gemm_footprint(products: &[(usize, usize, usize)]) -> GemmFootprint {
    let slab = gemm_common::cache::CACHE_INFO[1].cache_bytes as u64;
    let each = products.iter().map(|&p| packing_bytes(p));
    let (per_rank, panels) = each.fold((0, 0), |(a, b), (c, d)| (a.max(c), b.max(d)));
    GemmFootprint {
        per_thread: panels.min(slab),
        per_rank,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_follows_the_operand_and_the_caches() {
        let gpt = GptConfig::small();
        let products = gpt_products(&gpt, 4 * 128);
        // Four linears and the head, three products each.
        assert_eq!(products.len(), 15);
        let f = gemm_footprint(&products);
        let slab = gemm_common::cache::CACHE_INFO[1].cache_bytes as u64;
        assert!(f.per_thread > 0 && f.per_thread <= slab, "{f:?}");
        // At least one packed right operand of the widest layer's kc rows, and never more than
        // both operands whole.
        let widest = products.iter().map(|&p| packing_bytes(p).0).max().unwrap();
        assert_eq!(f.per_rank, widest);
        assert!(f.per_rank >= 4 * 256 * 1024, "{f:?}");
        assert!(f.per_rank <= 4 * 2 * 1024 * 1024, "{f:?}");
        assert_eq!(packing_bytes((32, 32, 32)), (0, 0));
    }
}
