//! A long document encoded in pieces, to the same ids as in one call.
//!
//! `tokenizers` holds about 300 bytes per token while it encodes (the tokens' strings, offsets and
//! alignments besides the ids): an 8 MB text file of 6 million tokens encoded in one call took
//! 1.6 GB, so a file of a few GB would not fit at all.
//! A document longer than the piece size is therefore cut at line ends and its pieces encoded
//! without special tokens (in parallel), then put together between the special tokens the
//! tokenizer's post-processor adds around a text (Llama's `<s>`).
//!
//! A cut is made only where it cannot change the ids: after a `\n` that has a non-space character
//! on either side (a line end inside a run of blank lines or before an indented line is passed
//! over), and only once the window of [`CHECK_BYTES`] on either side encodes, whole, to the ids
//! of its two halves. A tokenizer that merges across lines or marks the start of a text (Llama
//! 2's SentencePiece normaliser prepends `▁`) fails that check at every line end, and its
//! documents are encoded whole, as before.

use rayon::prelude::*;

use super::TextTokenizer;

/// Bytes of text on either side of a cut that must encode to the same ids cut and uncut.
pub(crate) const CHECK_BYTES: usize = 256;

/// Line ends checked in a row without a safe one before the rest of a document is encoded whole:
/// a tokenizer that no cut fits (Llama 2's) fails every check, and each costs three encodes.
const MAX_FAILED_CHECKS: usize = 32;

/// A line end (`cut` just after a `\n`) with a non-space character on either side.
fn plausible_cut(bytes: &[u8], cut: usize) -> bool {
    let spaced = |b: u8| b.is_ascii_whitespace();
    cut >= 2 && cut < bytes.len() && !spaced(bytes[cut - 2]) && !spaced(bytes[cut])
}

/// Id of the placeholder token used to find where a post-processor puts the text.
const PLACEHOLDER: u32 = u32::MAX;

impl TextTokenizer {
    /// The ids of `text` with the tokenizer's special tokens, as one `encode` call gives them;
    /// encoded in pieces of about `piece_bytes` where that gives the same ids. `progress` learns
    /// how many bytes of text each piece covered once it is encoded.
    pub(crate) fn encode_document(
        &self,
        text: &str,
        piece_bytes: usize,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<Vec<u32>, String> {
        let cuts = match text.len() > piece_bytes {
            true => self.safe_cuts(text, piece_bytes),
            false => Vec::new(),
        };
        let affixes = match cuts.is_empty() {
            true => None,
            false => self.special_affixes(),
        };
        let Some((prefix, suffix)) = affixes else {
            let ids = self.encode(text)?;
            progress(text.len() as u64);
            return Ok(ids);
        };
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(cuts)
            .chain(std::iter::once(text.len()))
            .collect();
        let pieces: Vec<Vec<u32>> = bounds
            .par_windows(2)
            .map(|w| {
                let ids = self.encode_plain(&text[w[0]..w[1]]);
                progress((w[1] - w[0]) as u64);
                ids
            })
            .collect::<Result<_, _>>()?;
        let mut ids = prefix;
        ids.extend(pieces.into_iter().flatten());
        ids.extend(suffix);
        Ok(ids)
    }

    /// The ids of `text` without special tokens.
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The special tokens the post-processor puts before and after a single text, found by
    /// post-processing a one-token placeholder (`None` if it cannot be found).
    fn special_affixes(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let token = tokenizers::Token::new(PLACEHOLDER, String::new(), (0, 0));
        let encoding = tokenizers::Encoding::from_tokens(vec![token], 0);
        let done = self.inner.post_process(encoding, None, true).ok()?;
        let ids = done.get_ids();
        let at = ids.iter().position(|&id| id == PLACEHOLDER)?;
        (ids.iter().filter(|&&id| id == PLACEHOLDER).count() == 1)
            .then(|| (ids[..at].to_vec(), ids[at + 1..].to_vec()))
    }

    /// Byte offsets where `text` may be cut (see the module docs), about `piece_bytes` apart:
    /// none for a tokenizer whose ids a cut at a line end would change.
    pub fn safe_cuts(&self, text: &str, piece_bytes: usize) -> Vec<usize> {
        let bytes = text.as_bytes();
        let mut cuts = Vec::new();
        let mut from = piece_bytes;
        while from < text.len() {
            let mut checks = 0;
            let Some(cut) = (from..text.len())
                .filter(|&c| bytes[c - 1] == b'\n' && plausible_cut(bytes, c))
                .take_while(|_| {
                    checks += 1;
                    checks <= MAX_FAILED_CHECKS
                })
                .find(|&c| self.cut_is_safe(text, c))
            else {
                break;
            };
            cuts.push(cut);
            from = cut + piece_bytes;
        }
        cuts
    }

    /// Whether cutting `text` at `cut` (just after a `\n`) leaves the ids as they are.
    fn cut_is_safe(&self, text: &str, cut: usize) -> bool {
        let mut lo = cut.saturating_sub(CHECK_BYTES);
        while !text.is_char_boundary(lo) {
            lo -= 1;
        }
        let mut hi = (cut + CHECK_BYTES).min(text.len());
        while !text.is_char_boundary(hi) {
            hi += 1;
        }
        let (Ok(whole), Ok(left), Ok(right)) = (
            self.encode_plain(&text[lo..hi]),
            self.encode_plain(&text[lo..cut]),
            self.encode_plain(&text[cut..hi]),
        ) else {
            return false;
        };
        whole.len() == left.len() + right.len()
            && whole[..left.len()] == left[..]
            && whole[left.len()..] == right[..]
    }
}
