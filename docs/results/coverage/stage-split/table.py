#!/usr/bin/env python3
"""The stage split's table from run.sh's records: speed, share of the ceiling (stock's speed at
1K, from the stock records given), and where the threads' time went, as shares of the prefill's
thread time (wall seconds times threads)."""
import json
import statistics
import sys

if len(sys.argv) < 3:
    sys.exit("usage: table.py RUN.jsonl STOCK-1K.json... (threads: 2)")
recs = [json.loads(line) for line in open(sys.argv[1])]
ceiling = statistics.mean(json.load(open(p))["prefill_tokens_per_second"] for p in sys.argv[2:])
threads = 2
at8k = {r["cfg"]: r["rec"]["prefill_tokens_per_second"] for r in recs if r["n"] == 8192}
print(f"Stock at 1K: {ceiling:.1f} tok/s (mean of {len(sys.argv) - 2} runs).\n")
print("| N | configuration | prefill s | tok/s | share of the ceiling | speed / its speed at 8K "
      "| stage 1 | stage 2 | the estimate (1 + 2) | chunk part | memory part | whole op |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in recs:
    t = r["times"].split()
    parts = dict(zip(t[1::2], map(float, t[2::2])))
    rec = r["rec"]
    wall = rec["prefill_ms"] / 1000
    tps = rec["prefill_tokens_per_second"]
    budget = wall * threads

    def share(x):
        return f"{x:.1f} s, {100 * x / budget:.1f} %"

    print(f"| {r['n']:,} | {r['cfg']} | {wall:.1f} | {tps:.1f} | {tps / ceiling:.2f} "
          f"| {tps / at8k[r['cfg']]:.2f} | {share(parts['stage1'])} | {share(parts['stage2'])} "
          f"| {share(parts['stage1'] + parts['stage2'])} | {share(parts['intra'])} "
          f"| {share(parts['memory'])} | {share(parts['op'])} |")
