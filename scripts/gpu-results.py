#!/usr/bin/env python3
"""Turn the JSON files of tests/cpp/bench-h2o-prefill.cpp (one per model) into GPU results.

  python3 scripts/gpu-results.py --commit SHA --date 2026-11-22 \\
      --name qwen2.5-1.5b.json="Qwen2.5-1.5B shape (28 layers, random F16 weights)" ... \\
      --out docs/results FILE.json...

Writes OUT/gpu.json (settings, per-model medians, all repetitions, ratios and the ceiling) and
OUT/gpu-prefill.png (left: prefill tok/s against prompt length, H2O solid, stock dashed; right:
H2O / stock speed ratio, solid, and the ceiling, dotted), and prints a markdown table on stdout.

Ceiling: an attention-free prefill is estimated as stock's fastest median at N <= 4096, where
attention is a small share of prefill; ceiling(N) = that speed / stock's median at N, the most that a
prefill whose attention cost nothing could gain over stock. `of ceiling` = ratio / ceiling.

All inputs must share the device and the settings (n_batch, n_ubatch, h2o_local, h2o_heavy, reps,
n_gpu_layers). A file with no --name is named by its model_desc. Bad input (a missing or unreadable
file, a missing field, mismatched devices or settings, no rows): a one-line error, exit 2.
Needs matplotlib for the PNG (python3 -m pip install matplotlib).
"""

import argparse
import json
import os
import sys

CEILING_MAX_N = 4096
CEILING_METHOD = (
    "attention-free prefill estimated as stock's fastest median at N <= 4096 (where attention is a "
    "small share of prefill); ceiling(N) = that speed / stock's median at N, the most a prefill "
    "whose attention cost nothing could gain over stock"
)
SETTINGS = ("n_batch", "n_ubatch", "h2o_local", "h2o_heavy", "reps", "n_gpu_layers")
ROW_FIELDS = ("n", "stock_tps", "h2o_tps", "stock_median", "h2o_median",
              "stock_gpu_mib", "h2o_gpu_mib", "h2o_state_mib")
COLOURS = ("#c0392b", "#2471a3", "#1e8449", "#7d3c98", "#b9770e", "#555555")


class BadInput(Exception):
    pass


def fail(msg, code=2):
    print(f"gpu-results: error: {msg}", file=sys.stderr)
    sys.exit(code)


def number(v, what):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadInput(f"{what} is not a number: {v!r}")
    return v


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read: {e}")
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not JSON: {e}")
    if not isinstance(d, dict):
        raise BadInput(f"{path}: not a JSON object")
    for k in ("model_desc", "n_params", "device", "rows") + SETTINGS:
        if k not in d:
            raise BadInput(f"{path}: missing field '{k}'")
    if not isinstance(d["rows"], list) or not d["rows"]:
        raise BadInput(f"{path}: no rows")
    for i, r in enumerate(d["rows"]):
        if not isinstance(r, dict):
            raise BadInput(f"{path}: rows[{i}] is not an object")
        for k in ROW_FIELDS:
            if k not in r:
                raise BadInput(f"{path}: rows[{i}] has no '{k}'")
        for k in ROW_FIELDS:
            if k in ("stock_tps", "h2o_tps"):
                if not isinstance(r[k], list) or not r[k]:
                    raise BadInput(f"{path}: rows[{i}].{k} is not a non-empty list")
                for v in r[k]:
                    number(v, f"{path}: rows[{i}].{k}")
            else:
                number(r[k], f"{path}: rows[{i}].{k}")
        if r["n"] <= 0 or r["stock_median"] <= 0 or r["h2o_median"] <= 0:
            raise BadInput(f"{path}: rows[{i}] has a non-positive n or median")
    ns = [r["n"] for r in d["rows"]]
    if len(set(ns)) != len(ns):
        raise BadInput(f"{path}: a prompt length appears twice")
    return d


def model_entry(path, d, name):
    rows = sorted(d["rows"], key=lambda r: r["n"])
    small = [r["stock_median"] for r in rows if r["n"] <= CEILING_MAX_N]
    free = max(small) if small else None  # attention-free prefill tok/s estimate
    out = []
    for r in rows:
        ratio = r["h2o_median"] / r["stock_median"]
        ceiling = free / r["stock_median"] if free is not None else None
        out.append({
            "n": int(r["n"]),
            "stock_tps_median": round(r["stock_median"], 1),
            "h2o_tps_median": round(r["h2o_median"], 1),
            "stock_tps_all": [round(v, 1) for v in r["stock_tps"]],
            "h2o_tps_all": [round(v, 1) for v in r["h2o_tps"]],
            "ratio": round(ratio, 3),
            "ceiling": round(ceiling, 3) if ceiling is not None else None,
            "ratio_over_ceiling": round(ratio / ceiling, 3) if ceiling is not None else None,
            "stock_gpu_mib": round(r["stock_gpu_mib"], 1),
            "h2o_gpu_mib": round(r["h2o_gpu_mib"], 1),
            "h2o_state_mib": round(r["h2o_state_mib"], 3),
        })
    return {"name": name, "file": os.path.basename(path), "model_desc": d["model_desc"],
            "n_params": d["n_params"], "rows": out}


def dump(result):
    """JSON with one line per row, so that the file reads as a table."""
    head = {k: v for k, v in result.items() if k != "models"}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},")
    lines.append('  "models": [')
    for mi, m in enumerate(result["models"]):
        lines.append("    {")
        for k, v in m.items():
            if k != "rows":
                lines.append(f"      {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},")
        lines.append('      "rows": [')
        for ri, r in enumerate(m["rows"]):
            sep = "," if ri + 1 < len(m["rows"]) else ""
            lines.append(f"        {json.dumps(r)}{sep}")
        lines.append("      ]")
        lines.append("    }" + ("," if mi + 1 < len(result["models"]) else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def k_label(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def settings_line(s):
    ngl = s["n_gpu_layers"]
    where = "all layers on the GPU" if ngl < 0 or ngl >= 99 else f"{ngl} layers on the GPU"
    lh = (f"L = H = {s['h2o_local']}" if s["h2o_local"] == s["h2o_heavy"]
          else f"L = {s['h2o_local']}, H = {s['h2o_heavy']}")
    return (f"-b {s['n_batch']} -ub {s['n_ubatch']}, {lh}, {where}, "
            f"flash attention on, medians of {s['reps']}")


def plot(result, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    except ImportError:
        fail("matplotlib is not installed; it is needed for the PNG: python3 -m pip install matplotlib",
             1)

    models = result["models"]
    all_n = sorted({r["n"] for m in models for r in m["rows"]})
    ticks, t = [], 1024
    while t <= all_n[-1]:
        if t >= all_n[0]:
            ticks.append(t)
        t *= 2
    if not ticks:
        ticks = all_n

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6), dpi=100)
    for i, m in enumerate(models):
        c = COLOURS[i % len(COLOURS)]
        n = [r["n"] for r in m["rows"]]
        ax1.plot(n, [r["h2o_tps_median"] / 1000 for r in m["rows"]], "-o", color=c, lw=2, ms=4)
        ax1.plot(n, [r["stock_tps_median"] / 1000 for r in m["rows"]], "--o", color=c, lw=1.6,
                 ms=3, mfc="white")
        ax2.plot(n, [r["ratio"] for r in m["rows"]], "-o", color=c, lw=2, ms=4)
        ce = [(r["n"], r["ceiling"]) for r in m["rows"] if r["ceiling"] is not None]
        if ce:
            ax2.plot([a for a, _ in ce], [b for _, b in ce], ":", color=c, lw=1.8)
    ax2.axhline(1.0, color="#888888", lw=1.2, zorder=0)

    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: k_label(int(round(v)))))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(all_n[0] / 1.25, all_n[-1] * 1.25)
        ax.grid(True, color="#cccccc", lw=0.7)
        ax.set_xlabel("prompt length N (tokens, log scale)")
    ax1.set_ylim(bottom=0)
    ax1.set_ylabel("prefill speed (thousand tok/s)")
    ax1.set_title("prefill speed: H2O (solid) and stock (dashed)")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel("H2O / stock prefill speed")
    ax2.set_title("H2O / stock (solid); ceiling, attention free (dotted)")

    s = result["settings"]
    fig.suptitle(f"GPU prefill, {result['device']}: {settings_line(s)}", fontsize=12)

    handles = [Line2D([], [], color=COLOURS[i % len(COLOURS)], lw=2.5, label=m["name"])
               for i, m in enumerate(models)]
    styles = [Line2D([], [], color="black", lw=2, ls="-", label="solid: H2O (left), H2O / stock (right)"),
              Line2D([], [], color="black", lw=1.6, ls="--", label="dashed: stock"),
              Line2D([], [], color="black", lw=1.8, ls=":", label="dotted: ceiling")]
    ncol = min(len(models), 3)
    model_rows = -(-len(models) // ncol)
    row_h = 0.042
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False, fontsize=9.5,
               bbox_to_anchor=(0.5, row_h), handlelength=2.5, columnspacing=2.5)
    fig.legend(handles=styles, loc="lower center", ncol=3, frameon=False, fontsize=9.5,
               bbox_to_anchor=(0.5, 0.0), handlelength=2.5, columnspacing=2.5)
    fig.tight_layout(rect=(0, row_h * (model_rows + 1) + 0.01, 1, 0.97))
    fig.savefig(png)
    plt.close(fig)


def fmt_tps(v):
    return f"{v:,.1f}"


def table(result):
    out = ["| model | N | stock tok/s | H2O tok/s | H2O / stock | ceiling | of ceiling "
           "| stock GPU MiB | H2O GPU MiB | H2O state MiB |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for m in result["models"]:
        for r in m["rows"]:
            ce = "–" if r["ceiling"] is None else f"{r['ceiling']:.3f}"
            oc = "–" if r["ratio_over_ceiling"] is None else f"{100 * r['ratio_over_ceiling']:.0f}%"
            out.append(f"| {m['name']} | {k_label(r['n'])} | {fmt_tps(r['stock_tps_median'])} "
                       f"| {fmt_tps(r['h2o_tps_median'])} | {r['ratio']:.3f} | {ce} | {oc} "
                       f"| {r['stock_gpu_mib']:g} | {r['h2o_gpu_mib']:g} | {r['h2o_state_mib']:.3f} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(
        description="bench-h2o-prefill JSON files -> OUT/gpu.json, OUT/gpu-prefill.png, a markdown table")
    ap.add_argument("--commit", required=True, help="build commit of the measured tree")
    ap.add_argument("--date", required=True, help="date measured, e.g. 2026-11-22")
    ap.add_argument("--name", action="append", default=[], metavar="FILE=NAME",
                    help="display name for an input file (matched by basename); repeatable")
    ap.add_argument("--out", required=True, help="output folder (gets gpu.json and gpu-prefill.png)")
    ap.add_argument("files", nargs="+", metavar="FILE.json")
    a = ap.parse_args()

    try:
        names = {}
        for spec in a.name:
            f, sep, n = spec.partition("=")
            if not sep or not f or not n.strip():
                raise BadInput(f"--name {spec!r}: expected FILE=NAME")
            names[os.path.basename(f)] = n.strip()
        bases = [os.path.basename(p) for p in a.files]
        if len(set(bases)) != len(bases):
            raise BadInput("two input files share a basename")
        for f in names:
            if f not in bases:
                raise BadInput(f"--name {f}=...: {f} is not among the input files")
        if not os.path.isdir(a.out):
            raise BadInput(f"--out {a.out}: no such folder")

        data = [(p, load(p)) for p in a.files]
        p0, d0 = data[0]
        for p, d in data[1:]:
            if d["device"] != d0["device"]:
                raise BadInput(f"devices differ: {p0} has {d0['device']!r}, {p} has {d['device']!r}")
            for k in SETTINGS:
                if d[k] != d0[k]:
                    raise BadInput(f"{k} differs: {p0} has {d0[k]!r}, {p} has {d[k]!r}")
    except BadInput as e:
        fail(str(e))

    settings = {k: d0[k] for k in SETTINGS if k != "n_gpu_layers"}
    settings["flash_attn"] = "on"
    settings["n_gpu_layers"] = d0["n_gpu_layers"]
    result = {
        "device": d0["device"],
        "build_commit": a.commit,
        "measured": a.date,
        "settings": settings,
        "ceiling_method": CEILING_METHOD,
        "models": [model_entry(p, d, names.get(os.path.basename(p), d["model_desc"]))
                   for p, d in data],
    }

    png = os.path.join(a.out, "gpu-prefill.png")
    plot(result, png)
    with open(os.path.join(a.out, "gpu.json"), "w", encoding="utf-8") as f:
        f.write(dump(result))
    print(table(result))


if __name__ == "__main__":
    main()
