#!/usr/bin/env python3
"""How much a slot save or restore holds up the other slots of h2o-server.

Starts h2o-server with two slots of SLOT_CTX tokens and a --slot-save-path, fills slot 0 with a
prompt of N tokens, then streams a long generation on slot 1 and, while it runs, saves slot 0 to
a file and restores it. Every streamed token's arrival time is recorded, and for the save and the
restore it reports how long the operation took (the server's own figure and the HTTP round trip),
the longest gap between two tokens of slot 1 that overlaps it, and slot 1's typical gap outside
the operations: a save that stalls the other slots only for its own duration gives a longest gap
close to its own time plus one typical gap.

    scripts/slot-save-stall.py [N]            # N = 16384 by default
    SERVER_BIN=target/release/h2o-server TEXT_FILE=target/texts/manual.txt scripts/slot-save-stall.py 8192

Settings (environment): SERVER_BIN (default target/release/h2o-server, built if missing),
TEXT_FILE (prompt text, repeated as needed; default the server's own tokens of a generated
ledger), GEN_TOKENS (tokens streamed on slot 1, 1500), PORT (8089), OUT (JSON record, default
target/slot-save-stall-N.json). Extra arguments after N go to h2o-server.
Progress goes to stderr; the JSON record to OUT and stdout.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg):
    print(f"slot-save-stall: {msg}", file=sys.stderr, flush=True)


def post(url, body, timeout=3600):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        sys.exit(f"slot-save-stall: {url}: HTTP {e.code}: {e.read().decode(errors='replace')}")


def wait_healthy(base, proc, timeout=600):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"slot-save-stall: h2o-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    sys.exit("slot-save-stall: h2o-server did not become healthy")


def prompt_ids(base, n):
    text_file = os.environ.get("TEXT_FILE")
    if text_file:
        with open(text_file, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        entries = []
        for i in range(n // 20 + 10):
            entries.append(
                f"Entry {i}: crate {i * 7919 % 10007} of bolts moved by clerk {i % 37} "
                f"from dock {i % 11} to shelf {i * 31 % 97}.\n"
            )
        text = "".join(entries)
    ids = []
    while len(ids) < n:
        ids += post(base + "/tokenize", {"content": text})["tokens"]
    return ids[:n]


def stream_tokens(base, times, done, gen_tokens):
    body = {
        "prompt": "The history of the lighthouse keepers of the northern coast",
        "n_predict": gen_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "id_slot": 1,
        "cache_prompt": False,
    }
    req = urllib.request.Request(
        base + "/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if line.startswith(b"data: "):
                times.append(time.monotonic())
    done.set()


def slot_op(base, action, filename):
    t0 = time.monotonic()
    reply = post(f"{base}/slots/0?action={action}", {"filename": filename})
    t1 = time.monotonic()
    ms = reply.get("timings", {}).get(f"{action}_ms")
    return {"start": t0, "end": t1, "round_trip_ms": (t1 - t0) * 1e3, "server_ms": ms,
            "n_bytes": reply.get("n_written", reply.get("n_read"))}


def overlapping_gap(times, start, end):
    """The longest gap between consecutive tokens whose interval overlaps [start, end]."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps) if gaps else None


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    extra = sys.argv[2:]
    gen_tokens = int(os.environ.get("GEN_TOKENS", "1500"))
    port = os.environ.get("PORT", "8089")
    slot_ctx = (n + 1024 + 1023) // 1024 * 1024
    server = os.environ.get("SERVER_BIN", os.path.join(ROOT, "target/release/h2o-server"))
    if not os.path.exists(server):
        log("building h2o-server")
        subprocess.run(["cargo", "build", "--release", "--bin", "h2o-server"], cwd=ROOT, check=True)
    out = os.environ.get("OUT", os.path.join(ROOT, f"target/slot-save-stall-{n}.json"))
    save_dir = tempfile.mkdtemp(prefix="slot-save-stall-", dir=os.path.join(ROOT, "target"))
    base = f"http://127.0.0.1:{port}"
    cmd = [server, "--port", port, "-c", str(2 * slot_ctx), "--parallel", "2",
           "--slot-save-path", save_dir] + extra
    log(" ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    try:
        wait_healthy(base, proc)
        ids = prompt_ids(base, n)
        log(f"prefill of {len(ids)} tokens on slot 0")
        t = time.monotonic()
        post(base + "/completion", {"prompt": ids, "n_predict": 1, "id_slot": 0,
                                     "cache_prompt": True, "temperature": 0})
        log(f"prefill took {time.monotonic() - t:.1f} s; streaming {gen_tokens} tokens on slot 1")
        times, done = [], threading.Event()
        th = threading.Thread(target=stream_tokens, args=(base, times, done, gen_tokens))
        th.start()
        while len(times) < 100 and not done.is_set():
            time.sleep(0.05)
        save = slot_op(base, "save", "slot0.bin")
        log(f"save: {save['server_ms']} ms in the server, {save['round_trip_ms']:.1f} ms round trip")
        n_at_save = len(times)
        while len(times) < n_at_save + 100 and not done.is_set():
            time.sleep(0.05)
        restore = slot_op(base, "restore", "slot0.bin")
        log(f"restore: {restore['server_ms']} ms in the server, {restore['round_trip_ms']:.1f} ms round trip")
        th.join()
        if done.is_set() and (save["end"] > times[-1] or restore["end"] > times[-1]):
            log("warning: the stream ended before an operation did: raise GEN_TOKENS")
        windows = [(save["start"], save["end"]), (restore["start"], restore["end"])]
        outside = [b - a for a, b in zip(times, times[1:])
                   if not any(b >= s and a <= e for s, e in windows)]
        typical = statistics.median(outside)
        record = {"n_tokens": n, "slot_ctx": slot_ctx, "state_bytes": save["n_bytes"],
                  "tokens_streamed": len(times),
                  "typical_gap_ms": typical * 1e3,
                  "tokens_per_s_outside": 1 / typical}
        for name, op in (("save", save), ("restore", restore)):
            gap = overlapping_gap(times, op["start"], op["end"])
            record[name] = {
                "tokens_during": sum(op["start"] <= t <= op["end"] for t in times),
                "server_ms": op["server_ms"],
                "round_trip_ms": op["round_trip_ms"],
                "longest_gap_ms": gap * 1e3 if gap else None,
                "stall_beyond_op_ms": (gap - typical) * 1e3 - op["round_trip_ms"] if gap else None,
            }
        text = json.dumps(record, indent=1)
        with open(out, "w") as f:
            f.write(text + "\n")
        print(text)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        for f in os.listdir(save_dir):
            os.remove(os.path.join(save_dir, f))
        os.rmdir(save_dir)


if __name__ == "__main__":
    main()
