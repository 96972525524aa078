#!/usr/bin/env python3
"""Checks a zerodp token file against Hugging Face `tokenizers` on the same inputs.

    pip install tokenizers
    python3 scripts/check_token_file.py DATA/.zerodp-tokens/tokens-<key>.json

Reads the manifest (`zerodp::data::token_data::Manifest`), re-tokenizes its files with the
tokenizer it names, following the documented stream (each document encoded on its own with the
tokenizer's special tokens, truncation and padding off; EOS between documents; a text file is
one document, a JSONL line one, blank lines and empty texts skipped), and compares the ids with
the `.u32` file beside the manifest. Exits 1 at the first difference, naming the token index.
"""

import array
import json
import pathlib
import sys

from tokenizers import Tokenizer


def documents(files, field):
    for f in files:
        path = pathlib.Path(f["path"])
        # Bytes decoded, not read_text: that would turn \r\n into \n, which zerodp keeps.
        text = path.read_bytes().decode("utf-8")
        if f["format"] == "text":
            yield text
            continue
        for line in text.split("\n"):
            if line.strip():
                yield json.loads(line)[field]


def expected_ids(manifest):
    tok = Tokenizer.from_file(manifest["tokenizer"])
    tok.no_truncation()
    tok.no_padding()
    eos = manifest["eos_id"]
    docs = [d for d in documents(manifest["files"], manifest["text_field"]) if d != ""]
    ids = array.array("I")
    for start in range(0, len(docs), 1024):
        for i, enc in enumerate(tok.encode_batch(docs[start:start + 1024])):
            if start + i > 0:
                ids.append(eos)
            ids.extend(enc.ids)
    return ids


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    manifest_path = pathlib.Path(sys.argv[1])
    manifest = json.loads(manifest_path.read_text())
    got = array.array("I")
    got.frombytes(manifest_path.with_suffix(".u32").read_bytes())
    if sys.byteorder != "little":
        got.byteswap()
    want = expected_ids(manifest)
    if got == want:
        print(f"equal: {len(got)} tokens, {manifest['documents']} documents")
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    print(f"DIFFERENT at token {first}: zerodp {list(got[first:first + 8])}, "
          f"tokenizers {list(want[first:first + 8])} ({len(got)} vs {len(want)} tokens)")
    sys.exit(1)


if __name__ == "__main__":
    main()
