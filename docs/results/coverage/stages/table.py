#!/usr/bin/env python3
"""The table of run.sh's record: medians per length and configuration, what skipping each stage
saves, and what the speed targets leave the estimator in the same run."""
import json, re, statistics, sys

runs = [json.loads(l) for l in open(sys.argv[1])]
targets = {4096: 1.35, 8192: 1.8, 16384: 3.0}
cfgs = list(dict.fromkeys(r["cfg"] for r in runs))
lengths = sorted({r["n"] for r in runs})

def wall(n, c):  # seconds of prefill, median over repetitions
    return statistics.median(n / r["rec"]["prefill_tokens_per_second"] for r in runs if r["n"] == n and r["cfg"] == c)

def thread_s(n, c, key):
    vals = []
    for r in runs:
        if r["n"] == n and r["cfg"] == c and r["times"]:
            m = re.search(key + r" ([0-9.]+)", r["times"])
            vals.append(float(m.group(1)))
    return statistics.median(vals) if vals else float("nan")

print("| N | " + " | ".join(f"{c} s" for c in cfgs) + " |")
print("|---:|" + "---:|" * len(cfgs))
for n in lengths:
    print(f"| {n} | " + " | ".join(f"{wall(n, c):.2f}" for c in cfgs) + " |")
print()
print("| N | hybrid / stock | coverage / stock | coverage ÷ hybrid | stage 1 (wall, share of coverage) | stage 2 (wall, share) |"
      " no stages ÷ hybrid | target leaves ÷ hybrid | stage 1 thread-s share | intra share | stage 2 share |")
print("|---:|" + "---:|" * 10)
for n in lengths:
    st, hy, co = wall(n, "stock"), wall(n, "hybrid"), wall(n, "coverage")
    s1 = co - wall(n, "coverage-no-stage1")
    s2 = co - wall(n, "coverage-no-stage2")
    floor = wall(n, "coverage-no-stages")
    leave = st / targets[n] / hy
    threads = 2 * co
    print(f"| {n} | {st/hy:.2f}× | {st/co:.2f}× | {co/hy:.2f}× | {s1:.2f} s ({s1/co:.1%}) | {s2:.2f} s ({s2/co:.1%}) |"
          f" {floor/hy:.2f}× | {leave:.2f}× | {thread_s(n, 'coverage', 'stage1')/threads:.1%} |"
          f" {thread_s(n, 'coverage', 'intra')/threads:.1%} | {thread_s(n, 'coverage', 'stage2')/threads:.1%} |")
