#!/usr/bin/env python3
"""The headroom study's main rows as one markdown table, from `h2o-cli coverage --json` records
(scripts/coverage-study.sh writes them): for each way of choosing the memory and each way of
spending the budget, the share of each query's attention covered (mean over the records' texts,
then the lowest text's mean and the mean 10th percentile), and the estimator's cost as a share
of full attention's multiply-adds.

Usage: scripts/study-table.py [--by-text] RECORD.json [RECORD.json ...]
  --by-text  instead: the mean share covered on each text, for today's policies, the design
             coverage selection was built on and the oracles (the rows of BY_TEXT)"""
import json
import sys

ROWS = [
    ("today: seed rule (h2o, sink 0)", "fixed"),
    ("today: hybrid (sink), the default", "fixed"),
    ("today: query (sink)", "fixed"),
    ("key bounds of blocks (Quest), per tile", "across heads"),
    ("mean keys of blocks, per tile", "across heads"),
    ("antidiagonal keys (stride 8), per tile", "across heads"),
    ("last 64 queries (vertical), per chunk", "across heads"),
    ("sampled queries (1 in 16) per tile", "across heads"),
    ("sampled queries (1 in 8) per tile", "across heads"),
    ("sampled queries (1 in 4) in 16 principal key directions, per tile", "across heads"),
    ("two stages: every query's 8 largest channels (SparQ) name 4 H candidates, all queries rank them, per tile", "across heads"),
    ("two stages: sampled queries (1 in 16) + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile", "fixed"),
    ("two stages: sampled queries (1 in 16) + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile", "across one head's tiles"),
    ("two stages: sampled queries (1 in 16) + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile", "across heads"),
    ("two stages: sampled queries (1 in 16) + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile", "across heads and layers"),
    ("two stages: sampled queries (1 in 8) + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile", "across heads"),
    ("two stages: sampled queries (1 in 4) + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile", "across heads"),
    ("two stages: sampled queries (1 in 4) + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile, local window tapered", "across heads"),
    ("oracle: per chunk", "fixed"),
    ("oracle: per chunk", "across heads"),
    ("oracle: per tile", "fixed"),
    ("oracle: per tile, in blocks", "across heads"),
    ("oracle: per tile", "across heads"),
    ("oracle: per tile", "across heads and layers"),
    ("oracle: per query", "fixed"),
]

BY_TEXT = [
    ("today: seed rule (h2o, sink 0)", "fixed"),
    ("today: hybrid (sink), the default", "fixed"),
    ("two stages: sampled queries (1 in 16) + 0 by scores + 0 from the previous tile name 4 H candidates, all queries rank them, per tile", "across heads"),
    ("oracle: per chunk", "fixed"),
    ("oracle: per tile", "across heads"),
    ("oracle: per query", "fixed"),
]


def by_text(paths):
    records = [json.load(open(p)) for p in paths]
    texts = [r["text"].split("/")[-1].removesuffix(".txt") for r in records]
    print(f"{records[0]['n_tokens']} tokens each; the attention outside the query's chunk (sinks included), mean over layers: "
          + ", ".join(f"{t} {sum(l['far_mean'] for l in r['layers']) / len(r['layers']):.3f}"
                      for t, r in zip(texts, records)) + "\n")
    print("| memory chosen by | budget | " + " | ".join(texts) + " |")
    print("|---|---|" + "---:|" * len(texts))
    for strategy, budget in BY_TEXT:
        found = [next((x for x in r["rows"] if x["strategy"] == strategy and x["budget"] == budget), None)
                 for r in records]
        cells = [f"{f['coverage_mean']:.4f}" if f else "–" for f in found]
        print(f"| {strategy} | {budget} | " + " | ".join(cells) + " |")


def main(paths):
    records = [json.load(open(p)) for p in paths]
    texts = [r["text"].split("/")[-1].removesuffix(".txt") for r in records]
    n = records[0]["n_tokens"]
    print(f"{len(records)} texts ({', '.join(texts)}), {n} tokens each, layers "
          f"{', '.join(str(l['layer']) for l in records[0]['layers'])}\n")
    print("| memory chosen by | budget | covered, mean | lowest text | p10 | cost (of full attention) |")
    print("|---|---|---:|---:|---:|---:|")
    for strategy, budget in ROWS:
        found = [next((x for x in r["rows"] if x["strategy"] == strategy and x["budget"] == budget), None)
                 for r in records]
        if any(f is None for f in found):
            continue
        means = [f["coverage_mean"] for f in found]
        p10 = sum(f["coverage_p10"] for f in found) / len(found)
        cost = found[0]["cost_share"]
        print(f"| {strategy} | {budget} | {sum(means) / len(means):.4f} | {min(means):.4f} | {p10:.4f} | "
              f"{100 * cost:.1f} % |")


if __name__ == "__main__":
    per_text = sys.argv[1:2] == ["--by-text"]
    paths = sys.argv[2:] if per_text else sys.argv[1:]
    if not paths:
        sys.exit(__doc__)
    (by_text if per_text else main)(paths)
