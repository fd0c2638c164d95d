#!/usr/bin/env bash
# Load test of h2o-server: concurrent streaming clients with long prompts, each workload run with
# H2O sparse prefill, with full attention, and with full attention and flash attention on (which
# -fa auto leaves off with several slots), on a fresh server each time. Reports per
# run: requests ok/failed, time to first token (first streamed text) p50/p99, generated and
# prompt tokens per second, and the server's resident memory (VmRSS, sampled every second) after
# warm-up, to show whether it stays flat. Prints a markdown table; the raw records (every request,
# the RSS series, the server logs) go to $OUT_DIR.
#
# Two workloads (LOAD_MODES, both by default):
#   mixed  CONCURRENCY clients (16) for DURATION seconds (120), prompts of MIN_PROMPT..MAX_PROMPT
#          tokens (1024..6144), uniformly drawn
#   ttft   TTFT_ROUNDS rounds (3) of TTFT_CONCURRENCY requests (4) sent at the same moment,
#          prompts of TTFT_PROMPT tokens (4096), each round once the last one has ended: the
#          time-to-first-token comparison of H2O and full attention, both seeing the same arrivals
#
#   scripts/load-test.sh                                  # both workloads, default model
#   DURATION=30 CONCURRENCY=4 LOAD_MODES=mixed scripts/load-test.sh
#   MODEL=gemma3-270m H2O_FLAGS="--h2o-local 128 --h2o-heavy 128" scripts/load-test.sh -t 8
#   SERVER_BIN=target/release/h2o-server scripts/load-test.sh   # skip the build
#
# Other settings: NP (slots, default = the workload's clients), SLOT_CTX (context per slot,
# default MAX_PROMPT + GEN_TOKENS rounded up to 1024), GEN_TOKENS (64 per request), UB (1024),
# B (4096), H2O_FLAGS ("--h2o-local 256 --h2o-heavy 256"), TEXT_FILE (prompt text; default a
# generated ledger), WARMUP (seconds of warm-up excluded from the memory verdict; default: until
# every client's first request, or the first round, has ended), ATTENTIONS (the runs: "h2o full
# full-fa"), OUT_DIR (target/load-test). Arguments go to every h2o-server run.
#
# On a 2-core machine 16 clients with 1K-6K prompts keep the server busy for minutes with their
# first requests alone: the memory verdict needs a DURATION long enough for later ones (600 s).
#
# Prompts have the drawn number of tokens exactly (cut with the server's /tokenize and
# /detokenize) and differ from their first token (a request number and nonce, then text from a
# random offset), so no run is helped by a slot's cached prefix.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${SERVER_BIN:-}" ]]; then
    target="${CARGO_TARGET_DIR:-target}"
    export H2O_LLAMA_OBJ_CACHE="${H2O_LLAMA_OBJ_CACHE:-$PWD/$target/h2o-llama-objcache}"
    echo "== building h2o-server" >&2
    cargo build --release --locked -p h2o-server
    SERVER_BIN="$target/release/h2o-server"
fi
export SERVER_BIN

exec python3 - "$@" <<'PY'
import json, math, os, random, statistics, subprocess, sys, threading, time, urllib.error, urllib.request

ENV = os.environ
SERVER_BIN = ENV["SERVER_BIN"]
EXTRA_ARGS = sys.argv[1:]
MODEL = ENV.get("MODEL", "")
MODES = ENV.get("LOAD_MODES", "mixed ttft").split()
GEN_TOKENS = int(ENV.get("GEN_TOKENS", "64"))
UB, B = ENV.get("UB", "1024"), ENV.get("B", "4096")
H2O_FLAGS = ENV.get("H2O_FLAGS", "--h2o-local 256 --h2o-heavy 256").split()
OUT_DIR = ENV.get("OUT_DIR", "target/load-test")
# the server flags of each attention; full-fa is full attention with flash attention forced on,
# which -fa auto leaves off with several slots (see h2o-server --help)
ATTENTIONS = {"h2o": H2O_FLAGS, "full": [], "full-fa": ["-fa", "on"]}
RUNS = ENV.get("ATTENTIONS", "h2o full full-fa").split()
for a in RUNS:
    if a not in ATTENTIONS:
        sys.exit(f"load-test: unknown attention {a!r} in ATTENTIONS: use {', '.join(ATTENTIONS)}")
REQUEST_TIMEOUT = float(ENV.get("REQUEST_TIMEOUT", "900"))

WORKLOADS = {
    "mixed": dict(
        clients=int(ENV.get("CONCURRENCY", "16")),
        duration=float(ENV.get("DURATION", "120")),
        lengths=(int(ENV.get("MIN_PROMPT", "1024")), int(ENV.get("MAX_PROMPT", "6144"))),
    ),
    "ttft": dict(
        clients=int(ENV.get("TTFT_CONCURRENCY", "4")),
        rounds=int(ENV.get("TTFT_ROUNDS", "3")),
        lengths=(int(ENV.get("TTFT_PROMPT", "4096")),) * 2,
    ),
}


def log(msg):
    print(f"load-test: {msg}", file=sys.stderr, flush=True)


def corpus():
    if ENV.get("TEXT_FILE"):
        with open(ENV["TEXT_FILE"], encoding="utf-8") as f:
            text = f.read()
        if len(text) < 20000:
            text = text * (20000 // max(len(text), 1) + 1)
        return text
    # a ledger of varied sentences (not one repeated line, so that attention has something to pick)
    rng = random.Random(1234)
    people = ["Ada", "Bram", "Chidi", "Dana", "Eun", "Farid", "Greta", "Hugo", "Ines", "Jomo"]
    goods = ["barrels of oil", "crates of tea", "bolts of silk", "sacks of grain", "casks of wine", "bales of wool"]
    ports = ["Lisbon", "Mombasa", "Osaka", "Valparaiso", "Bergen", "Surat", "Halifax", "Tunis"]
    verbs = ["loaded", "counted", "weighed", "sold", "shipped", "inspected", "stored", "returned"]
    lines = []
    for day in range(1, 6000):
        lines.append(
            f"Day {day}: {rng.choice(people)} {rng.choice(verbs)} {rng.randint(2, 900)} {rng.choice(goods)} "
            f"bound for {rng.choice(ports)}, and the harbour master noted a tide of {rng.randint(1, 9)}.{rng.randint(0, 9)} metres."
        )
    return "\n".join(lines)


TEXT = corpus()


class Server:
    def __init__(self, name, args):
        os.makedirs(OUT_DIR, exist_ok=True)
        self.log_path = os.path.join(OUT_DIR, f"{name}.server.log")
        self.log_file = open(self.log_path, "w")
        cmd = [SERVER_BIN, "--port", "0"] + (["-m", MODEL] if MODEL else []) + args + EXTRA_ARGS
        log("starting " + " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log_file)
        self.base = None
        deadline = time.monotonic() + 900  # the first run may download the default model
        while self.base is None:
            if self.proc.poll() is not None:
                sys.exit(f"load-test: h2o-server exited with {self.proc.returncode}:\n{open(self.log_path).read()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                sys.exit(f"load-test: h2o-server did not start listening; see {self.log_path}")
            for line in open(self.log_path):
                if line.startswith("h2o-server: listening on "):
                    self.base = line.split("listening on ", 1)[1].strip()
            time.sleep(0.2)

    def rss_kib(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


def post(base, path, body, timeout=REQUEST_TIMEOUT):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def call(base, path, body):
    try:
        with post(base, path, body, timeout=120) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"load-test: {path} failed: HTTP {e.code}: {e.read().decode()}")


def make_prompt(base, rng, n_tokens, number):
    """A prompt of n_tokens tokens as the server counts them (its /tokenize, BOS included)."""
    head = f"Ledger extract {number} (ref {rng.getrandbits(48):012x}).\n"
    # no question at the end: a model asked one may answer with end-of-text at once, leaving no
    # first token to time; text cut mid-ledger is continued
    tail = "\nDay"
    fixed = len(call(base, "/tokenize", {"content": head + tail, "add_special": True})["tokens"])
    # plenty of text (at least one character per token), cut to the tokens that fit
    n_chars = 8 * n_tokens
    start = rng.randrange(0, max(len(TEXT) - n_chars, 1))
    body = TEXT[start : start + n_chars]
    while len(body) < n_chars:  # a long prompt on a short TEXT_FILE wraps around
        body += "\n" + TEXT[: n_chars - len(body)]
    tokens = call(base, "/tokenize", {"content": body})["tokens"][: max(n_tokens - fixed, 0)]
    return head + call(base, "/detokenize", {"tokens": tokens})["content"] + tail


def one_request(base, prompt):
    body = {"prompt": prompt, "max_tokens": GEN_TOKENS, "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    rec = {"start": t0, "ok": False, "ttft": None, "total": None, "prompt_tokens": None, "completion_tokens": None, "error": None}
    try:
        with post(base, "/v1/completions", body) as r:
            done = False
            for raw in r:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = chunk["error"].get("message")
                    break
                choices = chunk.get("choices") or []
                if rec["ttft"] is None and choices and choices[0].get("text"):
                    rec["ttft"] = time.monotonic() - t0
                if chunk.get("usage"):
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    rec["completion_tokens"] = chunk["usage"]["completion_tokens"]
            rec["ok"] = done and rec["error"] is None
            if rec["ok"] and rec["ttft"] is None:  # the model ended at once: no text, first token = end
                rec["ttft"] = time.monotonic() - t0
    except urllib.error.HTTPError as e:
        rec["error"] = f"HTTP {e.code}: {e.read()[:300].decode('utf-8', 'replace')}"
    except Exception as e:  # a dropped connection, a timeout: a failed request, not a crash
        rec["error"] = repr(e)
    rec["total"] = time.monotonic() - t0
    return rec


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)  # nearest rank
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def run(workload, attention):
    w = WORKLOADS[workload]
    clients, (lo, hi) = w["clients"], w["lengths"]
    duration, rounds = w.get("duration", 0.0), w.get("rounds", 0)
    np_ = int(ENV.get("NP", clients))
    slot_ctx = int(ENV.get("SLOT_CTX", ((hi + GEN_TOKENS + 64 + 1023) // 1024) * 1024))
    args = ["-np", str(np_), "-c", str(slot_ctx * np_), "-ub", UB, "-b", B, "--queue", str(4 * clients)]
    args += ATTENTIONS[attention]
    name = f"{workload}-{attention}"
    server = Server(name, args)
    try:
        rss = []  # (seconds since start, KiB)
        records = []
        lock = threading.Lock()
        t_start = time.monotonic()
        deadline = t_start + duration
        first_round_s = 0.0
        first_done = {}  # client -> seconds at which its first request ended
        stop_sampling = threading.Event()

        def sample_rss():
            while not stop_sampling.is_set():
                kib = server.rss_kib()
                if kib is not None:
                    rss.append((time.monotonic() - t_start, kib))
                stop_sampling.wait(1.0)

        def client(i):
            rng = random.Random(f"{workload}-{i}")  # the same prompts for both attentions
            n = 0
            while time.monotonic() < deadline:
                prompt = make_prompt(server.base, rng, rng.randint(lo, hi), f"{i}.{n}")
                n += 1
                rec = one_request(server.base, prompt)
                with lock:
                    records.append(rec)
                    first_done.setdefault(i, time.monotonic() - t_start)

        def burst(r, i, start):
            rng = random.Random(f"{workload}-{r}-{i}")
            prompt = make_prompt(server.base, rng, rng.randint(lo, hi), f"{r}.{i}")
            start.wait()
            rec = one_request(server.base, prompt)
            with lock:
                records.append(rec)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        if rounds:  # bursts: `clients` requests at once, the next burst when all have ended
            log(f"{name}: {rounds} rounds of {clients} requests at once, prompts {lo}..{hi} tokens, -np {np_}, -c {slot_ctx * np_}")
            for r in range(rounds):
                start = threading.Barrier(clients)
                threads = [threading.Thread(target=burst, args=(r, i, start)) for i in range(clients)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                log(f"{name}: round {r + 1}/{rounds} done at {time.monotonic() - t_start:.0f} s")
                if r == 0:
                    first_round_s = time.monotonic() - t_start
        else:  # closed loop: each client sends its next request when its last one has ended
            log(f"{name}: {clients} clients, {duration:.0f} s, prompts {lo}..{hi} tokens, -np {np_}, -c {slot_ctx * np_}")
            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.monotonic() - t_start
        stop_sampling.set()
        sampler.join()
    finally:
        server.stop()

    ok = [r for r in records if r["ok"]]
    failed = [r for r in records if not r["ok"]]
    ttft = [r["ttft"] for r in ok]
    gen = sum(r["completion_tokens"] or 0 for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    # warm-up: until every slot has served a request (the first round; the first request of
    # every client), since a slot's KV cells and H2O undo log are touched as it first fills
    warmup = float(ENV.get("WARMUP", first_round_s if rounds else max(first_done.values(), default=wall)))
    before = [kib for t, kib in rss if t <= warmup]
    after = [kib for t, kib in rss if t > warmup]
    at_warm = before[-1] if before else (after[0] if after else 0)
    peak_after = max(after) if after else at_warm
    growth_mib = (peak_after - at_warm) / 1024
    # flat: after warm-up, RSS grows by less than 5% (and less than 32 MiB on small servers);
    # no verdict when no request started after the warm-up (the run was too short to reuse slots)
    reused = any(r["start"] - t_start > warmup for r in records)
    flat = (growth_mib < max(0.05 * at_warm / 1024, 32)) if reused and after else None
    result = {
        "workload": workload, "attention": attention, "clients": clients, "np": np_, "slot_ctx": slot_ctx,
        "prompt_range": [lo, hi], "wall_s": wall, "ok": len(ok), "failed": len(failed),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "gen_tok_s": gen / wall, "prompt_tok_s": prompt_tokens / wall,
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else 0,
        "rss_at_warmup_mib": at_warm / 1024, "rss_peak_after_warmup_mib": peak_after / 1024,
        "rss_final_mib": (rss[-1][1] / 1024) if rss else 0, "rss_growth_mib": growth_mib, "rss_flat": flat,
        "warmup_s": warmup, "errors": sorted({str(r["error"])[:200] for r in failed})[:5],
    }
    with open(os.path.join(OUT_DIR, f"{name}.json"), "w") as f:
        json.dump({"summary": result, "requests": records, "rss_kib": rss}, f, indent=1)
    series = " ".join(f"{kib / 1024:.0f}" for t, kib in rss[:: max(1, len(rss) // 12)])
    empty = sum(1 for r in ok if not r["completion_tokens"])
    log(f"{name}: {len(ok)} ok ({empty} without generated text), {len(failed)} failed; RSS MiB over the run: {series}")
    for e in result["errors"]:
        log(f"{name}: error: {e}")
    return result


results = []
for workload in MODES:
    if workload not in WORKLOADS:
        sys.exit(f"load-test: unknown workload {workload!r} in LOAD_MODES: use mixed, ttft")
    for attention in RUNS:
        results.append(run(workload, attention))

with open(os.path.join(OUT_DIR, "summary.json"), "w") as f:
    json.dump(results, f, indent=1)

print()
print(f"h2o-server load test, {GEN_TOKENS} tokens generated per request, -ub {UB} -b {B}, H2O: {' '.join(H2O_FLAGS)}")
print()
print("| workload | attention | clients | prompt tokens (mean) | ok | failed | TTFT p50 s | TTFT p99 s | gen tok/s | prompt tok/s | RSS after warm-up MiB | RSS peak after MiB | growth MiB | flat |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in results:
    lo, hi = r["prompt_range"]
    span = f"{lo}" if lo == hi else f"{lo}-{hi}"
    print(
        f"| {r['workload']} | {r['attention']} | {r['clients']} | {span} ({r['mean_prompt_tokens']:.0f}) | {r['ok']} | {r['failed']} "
        f"| {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['gen_tok_s']:.1f} | {r['prompt_tok_s']:.0f} "
        f"| {r['rss_at_warmup_mib']:.0f} | {r['rss_peak_after_warmup_mib']:.0f} | {r['rss_growth_mib']:+.0f} | { {True: 'yes', False: 'NO', None: 'n/a'}[r['rss_flat']] } |"
    )
print()
for workload in MODES:
    by = {r["attention"]: r for r in results if r["workload"] == workload}
    if "h2o" not in by:
        continue
    h = by["h2o"]["ttft_p50_s"]
    for other in ("full", "full-fa"):
        f = by[other]["ttft_p50_s"] if other in by else float("nan")
        if h == h and f == f and h > 0:  # not NaN
            print(f"{workload}: TTFT p50 H2O {h:.2f} s vs {other} {f:.2f} s: {f / h:.2f}x")
print(f"\nRaw records: {OUT_DIR}/ (flat = RSS grows less than max(5%, 32 MiB) after the warm-up, when every")
print("slot has served a request; n/a = no request started after it: raise DURATION or TTFT_ROUNDS)")
PY
