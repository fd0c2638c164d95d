#!/usr/bin/env python3
"""Where a decode step's attention is, and how well cheap estimates find it.

Reads the decode-step captures that `tests/decode_study.rs` writes (one file per step and layer:
the query, and every cached key up to it, of the default model after a long prompt) and prints,
for each way of choosing BUDGET positions between the first block and the recent window, the
share of each query head's attention that the step then covers (mean over heads, layers and
steps, and the 10th percentile). Usage:

    DECODE_STUDY_TEXT=target/texts/techdoc.txt DECODE_STUDY_N=8064 \\
        DECODE_STUDY_DIR=target/decode-study/techdoc \\
        cargo test --release --test decode_study -- --ignored
    scripts/decode-study.py target/decode-study/techdoc [BUDGET ...]

Needs numpy.
"""
import glob
import sys

import numpy as np

B = 16    # GGML_H2O_DECODE_BLOCK
LOCAL = 256


def load(path):
    raw = open(path, "rb").read()
    n, n_head, n_head_kv, d, dv = (int(x) for x in np.frombuffer(raw[:20], dtype=np.uint32))
    scale = float(np.frombuffer(raw[20:24], dtype=np.float32)[0])
    a = np.frombuffer(raw[24:], dtype=np.float32).astype(np.float64)
    q = a[: n_head * d].reshape(n_head, d)
    k = a[n_head * d : n_head * d + n * n_head_kv * d].reshape(n, n_head_kv, d)
    return n, n_head, n_head_kv, d, q * scale, k


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def top(score, cand, budget):
    """The budget candidates of largest score (stable: ties to the earlier position)."""
    return cand[np.argsort(-score, kind="stable")[:budget]]


def least_gap(u):
    """Each position's gap below its head's best estimate, the least over the heads (the op's rule)."""
    return (u.max(1, keepdims=True) - u).min(0)


def study(files, budget):
    res = {}

    def add(name, v):
        res.setdefault(name, []).append(v)

    for path in files:
        n, n_head, n_head_kv, d, q, k = load(path)
        group = n_head // n_head_kv
        n_full = n // B
        sink_blocks = min(1, n_full)
        recent_block = max(min(max(n - LOCAL, 0) // B, n_full), sink_blocks)
        cand = np.arange(sink_blocks * B, recent_block * B)
        base = np.zeros(n, bool)
        base[: sink_blocks * B] = True
        base[recent_block * B :] = True
        for g in range(n_head_kv):
            kg = k[:, g, :]
            qs = q[g * group : (g + 1) * group]
            attn = np.stack([softmax(kg @ qr) for qr in qs])

            def covered(sel):
                m = base.copy()
                m[sel] = True
                return attn[:, m].sum(1).mean()

            add("sinks and recent window only", covered(np.array([], int)))
            add("oracle: positions", covered(top(attn[:, cand].sum(0), cand, budget)))
            nb = recent_block - sink_blocks
            blocks = (np.arange(nb)[:, None] * B + np.arange(B)[None, :]) + sink_blocks * B
            bsum = attn[:, sink_blocks * B : recent_block * B].reshape(group, nb, B).sum(2).sum(0)
            add("oracle: blocks of 16", covered(blocks[np.argsort(-bsum, kind="stable")[: budget // B]].ravel()))
            # Quest: per block the channel minima and maxima bound q.k; softmax shares summed
            kb = kg[sink_blocks * B : recent_block * B].reshape(nb, B, d)
            lo, hi = kb.min(1), kb.max(1)
            score = sum(softmax(np.maximum(qr * hi, qr * lo).sum(1)) for qr in qs)
            add("Quest bounds, blocks of 16", covered(blocks[np.argsort(-score, kind="stable")[: budget // B]].ravel()))
            # sketches: products on a quarter of the channels, chosen by key energy or by PCA
            prompt_keys = kg[: n_full * B]
            channels = np.sort(np.argsort(-(prompt_keys ** 2).sum(0), kind="stable")[: d // 4])
            u = np.stack([kg[cand][:, channels] @ qr[channels] for qr in qs])
            add("sketch (d/4 channels of most key energy), sum of shares",
                covered(top(sum(softmax(x) for x in u), cand, budget)))
            add("sketch (d/4 channels of most key energy), least gap below the head's best",
                covered(top(-least_gap(u), cand, budget)))
            # the same sketch in 8 bits: each position's channels scaled by their largest magnitude, each head's
            # query by its own, products summed as integers (what VNNI dot products compute)
            ks8 = kg[cand][:, channels]
            sk = np.abs(ks8).max(1, keepdims=True)
            sk[sk == 0] = 1
            kq = np.round(ks8 / sk * 127)
            u8 = []
            for qr in qs:
                qc = qr[channels]
                sq = np.abs(qc).max() or 1.0
                u8.append((kq @ np.round(qc / sq * 127)) * sk[:, 0] * sq / 127 ** 2)
            add("sketch in 8 bits (a scale per position, per query head), least gap below the head's best",
                covered(top(-least_gap(np.stack(u8)), cand, budget)))
            # two levels: Quest bounds on the sketch's channels over pages of `page` positions name the
            # pages that hold `factor` x budget positions, least bound gap first; the sketch's least gap
            # chooses among their positions only, so that a step estimates a fraction of the positions
            ks = kg[cand][:, channels]
            for page, factor in ((64, 4), (64, 2), (256, 4)):
                n_pages = -(-len(cand) // page)
                pad = np.full((n_pages * page - len(cand), len(channels)), np.nan)
                kp = np.concatenate([ks, pad]).reshape(n_pages, page, len(channels))
                lo, hi = np.nanmin(kp, 1), np.nanmax(kp, 1)
                bound = np.stack([np.maximum(qr[channels] * hi, qr[channels] * lo).sum(1) for qr in qs])
                page_gap = (bound.max(1, keepdims=True) - bound).min(0)
                keep = np.zeros(len(cand), bool)
                for p in np.argsort(page_gap, kind="stable"):
                    if keep.sum() >= factor * budget:
                        break
                    keep[p * page : (p + 1) * page] = True
                add(f"two levels: pages of {page} holding {factor}x the budget, then the sketch's least gap",
                    covered(top(-least_gap(u[:, keep]), cand[keep], budget)))
                add(f"two levels: pages of {page} holding {factor}x the budget: share of positions estimated",
                    keep.mean())
            _, vecs = np.linalg.eigh(prompt_keys.T @ prompt_keys)
            basis = vecs[:, ::-1][:, : d // 4]
            up = np.stack([(kg[cand] @ basis) @ (basis.T @ qr) for qr in qs])
            add("PCA sketch (d/4 components), sum of shares", covered(top(sum(softmax(x) for x in up), cand, budget)))
            mx = np.abs(kg[cand]).max(1, keepdims=True)
            k4 = np.round(kg[cand] / mx * 7) / 7 * mx
            add("4-bit keys, sum of shares", covered(top(sum(softmax(k4 @ qr) for qr in qs), cand, budget)))
    return res


def main():
    files = sorted(glob.glob(sys.argv[1] + "/*.bin"))
    if not files:
        sys.exit(f"no captures in {sys.argv[1]}: see this script's usage")
    for budget in [int(b) for b in sys.argv[2:]] or [1024]:
        print(f"budget {budget} positions, {len(files)} captures: covered share of attention (mean, p10)")
        for name, v in study(files, budget).items():
            print(f"  {name:75s} {np.mean(v):.4f}  {np.percentile(v, 10):.4f}")


if __name__ == "__main__":
    main()
