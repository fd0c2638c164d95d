#!/usr/bin/env python3
"""Markdown tables from `h2o-cli perplexity --json` records: one row per record (text and
window), one column per H2O configuration, each cell "Δ ppl whole window / second half (KLD)".

Usage: scripts/quality-table.py RECORD.json [RECORD.json ...]
A record's text is named by its file name (ppl-MODEL-TEXT-N.json) or else its `file` field."""
import json
import os
import re
import sys


def label(h2o):
    sel = h2o["select"]
    if sel == "coverage":
        sel = f"coverage/{h2o['tile_samples']}"
        if h2o.get("tile_sketch", 1) > 1:
            sel += f" sketch/{h2o['tile_sketch']}"
        if h2o.get("coverage", 1.0) < 1.0:
            sel += f"@{h2o['coverage']:g}"
        if h2o.get("tile_pool", 0) > 0:
            sel += f" pool/{h2o['tile_pool']}"
    return f"{sel} L{h2o['local']} H{h2o['heavy']} sink {h2o['sink']} tail {h2o['dense_tail']}"


def cell(shape):
    w, h = shape["whole"], shape["second_half"]
    return f"{w['delta_ppl_percent']:+.2f} % / {h['delta_ppl_percent']:+.2f} % ({w['kld_mean']:.4f})"


def main(paths):
    rows, columns = [], []
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        m = re.match(r"ppl-(?P<model>[^-]+(?:-[0-9]+m)?)-(?P<text>\w+)-(?P<n>\d+)\.json$", os.path.basename(p))
        name = f"{m['text']}, {int(m['n']) // 1024}K" if m else f"{r['file']}, {r['n_ctx']}"
        shapes = r.get("shapes") or [{"h2o": r["h2o"], "whole": r["whole"], "second_half": r["second_half"]}]
        cells = {}
        for s in shapes:
            lab = label(s["h2o"])
            if lab not in columns:
                columns.append(lab)
            cells[lab] = cell(s)
        rows.append((name, r["whole"]["ppl_full"], cells))
    print("| text, window | full attention ppl (whole) | " + " | ".join(f"`{c}`" for c in columns) + " |")
    print("|---|---:|" + "---:|" * len(columns))
    for name, full, cells in rows:
        print(f"| {name} | {full:.4f} | " + " | ".join(cells.get(c, "–") for c in columns) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
