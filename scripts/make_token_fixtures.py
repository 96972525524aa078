#!/usr/bin/env python3
"""Makes the tokenized-data fixtures under tests/fixtures/tokens/ with Hugging Face `tokenizers`.

    pip install tokenizers
    python3 scripts/make_token_fixtures.py            # the fixtures of issue 36
    python3 scripts/make_token_fixtures.py families   # the families' layouts (issue 43)

Writes three small tokenizers (a GPT-2-style byte-level BPE trained on a few sentences, with
`<|endoftext|>`; the same model with a Llama-style template that puts `<s>` before every text and
has `</s>` as its end of sequence; and a Llama-3-style one, its pre-tokenizer a regex split with
look-ahead and Unicode classes, `<|begin_of_text|>` first, 300 ids), the text and JSONL inputs, and `expected.json`: the
token ids `zerodp`'s token file must hold for each case. The committed fixtures are what
`cargo test --test it data::token_data` reads, so the tests need no Python.

The token stream is the one `zerodp::data::token_data` documents: every document encoded on
its own with the tokenizer's special tokens (`encode(text)`, as `tokenizer(text)` does in
`transformers`), the documents joined with the EOS id between them (none after the last). A text
file is one document; a JSONL line is one document (its `text` field, or the field named), blank
lines skipped; a document with empty text is skipped.
"""

import json
import pathlib

from tokenizers import (
    Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers,
)

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokens"

TRAIN = [
    "The quick brown fox jumps over the lazy dog.",
    "Sharded data parallelism splits the optimizer states, the gradients and the parameters.",
    "ZeRO stage three gathers each unit's parameters just before it runs.",
    "Tokenizers turn text into ids; the model predicts the next id.",
    "Über naïve café: ünïcödé wörds, 日本語のテキスト, and emoji 🙂 too.",
]

TEXT = (
    "The quick brown fox jumps over the lazy dog.\n"
    "ZeRO shards the optimizer states across the data-parallel ranks.\n\n"
    "Über naïve café — 日本語 🙂\n"
    "  indented line with    spaces\tand a tab\n"
)

# Many short lines: with a small piece size the loader cuts this at line ends (where that keeps
# the ids) and must still give the ids of one `encode` call.
D_LINES = [
    "Line one of a longer file.",
    "'s at the start of a line, and 'll too.",
    "Numbers 1234567 and 3.14159 end here:",
    "Über naïve café, 日本語のテキスト 🙂",
    "    indented code: fn main() { println!(\"hi\"); }",
    "",
    "After a blank line; tabs\there.",
    "trailing spaces   ",
    "UPPER lower MiXeD 42nd",
    "<|endoftext|> inside a text is the special token.",
]
D_TEXT = "\n".join(D_LINES * 3) + "\n"

JSONL_ROWS = [
    {"text": "First document: the gradients are reduced.", "id": 1},
    {"text": "Second one, with ünïcödé and a newline\ninside.", "id": 2},
    {"text": "", "id": 3},
    {"text": "Third: stage 3 partitions the parameters too.", "id": 4},
]

BODY_ROWS = [
    {"body": "A field with another name.", "text": 7},
    {"body": "The loader reads the field the user names."},
]


def byte_level_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 200 + 1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN * 4, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


# Llama 3's split: the pattern the `tokenizers` Rust crate runs through fancy-regex (zerodp builds
# it without Oniguruma), then byte-level without its own regex.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def llama3_style():
    """300 ids in all, so that it fits the tiny GPT-2 fixture (vocab_size 300) of
    tests/fixtures/hf/gpt2-tiny."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN * 4, trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    assert tok.get_vocab_size() == 300, tok.get_vocab_size()
    return tok


def sentencepiece_style():
    """Llama 2's layout: no pre-tokenizer, a normaliser that prepends `▁` and replaces spaces,
    `<s>` first. Its ids change when a text is cut, so the loader must encode it whole."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    alphabet = sorted(set("▁".join(TRAIN + [TEXT, D_TEXT]).replace(" ", "▁")) | {"▁"})
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + 3 + 150,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator([t.replace(" ", "▁") for t in TRAIN * 4], trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


# Qwen2's split (also Qwen2.5's and Qwen3's): Llama 3's with single digits, after NFC.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen2_style():
    """Qwen2's layout: NFC, the regex split, byte-level without its own regex, no BOS."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN * 4, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def metaspace_style(prepend):
    """Mistral's layout (`prepend` "first": the Metaspace pre-tokenizer, `▁` before the first
    piece only) or Gemma's (`prepend` None: spaces replaced by `▁` in the normaliser, nothing
    prepended), both a BPE with byte fallback (`<0xNN>` for what the vocabulary lacks) and `<s>`
    first."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if prepend:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme=prepend, split=False
        )
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    # The alphabet of the training sentences only: the rest of a text (an em dash, a tab) falls
    # back to its bytes.
    alphabet = sorted(set("▁".join(TRAIN).replace(" ", "▁")) | {"▁"})
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + 3 + 256 + 120,
        special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator([t.replace(" ", "▁") for t in TRAIN * 4], trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def families():
    """The families' layouts (issue 43): tokenizer_qwen2.json, tokenizer_mistral.json and
    tokenizer_gemma.json, and expected_families.json: for each, the token stream of a.txt and
    b.jsonl and the ids of d.txt. The fixtures above keep their bytes."""
    toks = {
        "tokenizer_qwen2.json": (qwen2_style(), "<|endoftext|>"),
        "tokenizer_mistral.json": (metaspace_style("first"), "</s>"),
        "tokenizer_gemma.json": (metaspace_style(None), "</s>"),
    }
    a = (OUT / "a.txt").read_text(encoding="utf-8")
    b = jsonl_docs(OUT / "b.jsonl", "text")
    d = (OUT / "d.txt").read_text(encoding="utf-8")
    expected = {}
    for name, (tok, eos) in toks.items():
        tok.save(str(OUT / name), pretty=False)
        back = Tokenizer.from_file(str(OUT / name))
        expected[name] = {
            "eos": eos,
            "stream": stream(back, eos, [a] + b),
            "pieces": back.encode(d).ids,
            "vocab": back.get_vocab_size(),
        }
        fallback = sum(1 for i in back.encode(a).ids if back.id_to_token(i).startswith("<0x"))
        print(name, len(expected[name]["stream"]), "ids,", fallback, "byte-fallback ids in a.txt")
    (OUT / "expected_families.json").write_text(json.dumps(expected) + "\n")


def with_bos(base):
    tok = Tokenizer.from_str(base.to_str())
    tok.add_special_tokens(["<s>", "</s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def stream(tok, eos, docs):
    ids = []
    for i, doc in enumerate(d for d in docs if d != ""):
        if i > 0:
            ids.append(tok.token_to_id(eos))
        ids.extend(tok.encode(doc).ids)
    return ids


def jsonl_docs(path, field):
    docs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            docs.append(json.loads(line)[field])
    return docs


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "a.txt").write_text(TEXT, encoding="utf-8")
    (OUT / "b.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in JSONL_ROWS[:2])
        + "\n"
        + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in JSONL_ROWS[2:]),
        encoding="utf-8",
    )
    (OUT / "c.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in BODY_ROWS), encoding="utf-8"
    )
    gpt2 = byte_level_bpe()
    llama = with_bos(gpt2)
    llama3 = llama3_style()
    gpt2.save(str(OUT / "tokenizer.json"), pretty=False)
    llama3.save(str(OUT / "tokenizer_regex.json"), pretty=False)
    sp = sentencepiece_style()
    sp.save(str(OUT / "tokenizer_sp.json"), pretty=False)
    (OUT / "d.txt").write_text(D_TEXT, encoding="utf-8")
    llama.save(str(OUT / "tokenizer_bos.json"), pretty=False)
    a = TEXT
    b = jsonl_docs(OUT / "b.jsonl", "text")
    c = jsonl_docs(OUT / "c.jsonl", "body")
    expected = {
        "gpt2_text_and_jsonl": {
            "tokenizer": "tokenizer.json", "files": ["a.txt", "b.jsonl"], "field": "text",
            "eos": "<|endoftext|>", "ids": stream(gpt2, "<|endoftext|>", [a] + b),
        },
        "bos_named_field": {
            "tokenizer": "tokenizer_bos.json", "files": ["c.jsonl", "a.txt"], "field": "body",
            "eos": "</s>", "ids": stream(llama, "</s>", c + [a]),
        },
        "regex_split": {
            "tokenizer": "tokenizer_regex.json", "files": ["a.txt", "b.jsonl"], "field": "text",
            "eos": "<|end_of_text|>", "ids": stream(llama3, "<|end_of_text|>", [a] + b),
        },
        "pieces": {
            name: tok.encode(D_TEXT).ids
            for name, tok in [("tokenizer.json", gpt2), ("tokenizer_bos.json", llama),
                              ("tokenizer_regex.json", llama3), ("tokenizer_sp.json", sp)]
        },
        "vocab": {"tokenizer.json": gpt2.get_vocab_size(), "tokenizer_bos.json": llama.get_vocab_size()},
    }
    (OUT / "expected.json").write_text(json.dumps(expected) + "\n")
    for name, case in expected.items():
        if "ids" in case:
            print(name, len(case["ids"]), "ids")


if __name__ == "__main__":
    import sys

    families() if sys.argv[1:] == ["families"] else main()
