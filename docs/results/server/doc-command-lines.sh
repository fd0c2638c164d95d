#!/usr/bin/env bash
# docs/cli.md's and docs/server.md's example command lines, as a user types them, from the repository root
# (after `cargo build --release -p h2o-cli -p h2o-server`), in a scratch folder: prompt.txt is 45 KB of
# technical text (`head -c 45000 target/texts/techdoc.txt`, from scripts/study-texts.sh).
set -u
root=$PWD; mkdir -p target/doc-command-lines && head -c 45000 target/texts/techdoc.txt > target/doc-command-lines/prompt.txt && cd target/doc-command-lines
B=$root/target/release
M=${MODEL:-$HOME/.cache/h2o-llama/SmolLM2-135M-Instruct.Q4_1.gguf}
run() { local name=$1; shift; local t0=$(date +%s.%N); "$@" > out.$name 2> err.$name; local rc=$?; printf "%-28s rc=%d %5.1fs | %s\n" "$name" $rc $(echo "$(date +%s.%N) - $t0" | bc) "$(grep -E 'H2O|full attention|error' err.$name | tail -1 | cut -c1-150)"; }
run cli-demo $B/h2o-cli -n 32
run cli-file-16k $B/h2o-cli -f prompt.txt -c 16384 -n 64
run cli-file-16k-off $B/h2o-cli -f prompt.txt -c 16384 -n 64 --h2o off
run cli-file-json $B/h2o-cli -f prompt.txt --json
run cli-ppl $B/h2o-cli perplexity -f prompt.txt -c 2048 --chunks 1
run cli-eval $B/h2o-cli eval --tasks passkey --lengths 1024 --depths 50
run cli-hh $B/h2o-cli heavy-hitters -f prompt.txt --png hh.png
run cli-bench $B/h2o-cli bench -p 1024 -r 1
for args in "-c 32768 -np 4" "--chat-template-file $root/examples/templates/chatml-tools.jinja" "-m $M -c 2048"; do
  port=$((18000 + RANDOM % 1000))
  $B/h2o-server $args --port $port > srv.out 2> srv.err & pid=$!
  ok=no; for i in $(seq 1 120); do curl -s localhost:$port/health > /dev/null 2>&1 && { ok=yes; break; }; sleep 0.5; done
  resp=$(curl -s localhost:$port/completion -d '{"prompt":"The capital of France is","n_predict":8}' | python3 -c 'import json,sys; d=json.load(sys.stdin); print(repr(d.get("content"))[:60])' 2>&1)
  kill $pid; wait $pid 2>/dev/null
  echo "server [$args]: up=$ok completion=$resp | $(grep -iE 'h2o|error' srv.err | head -1 | cut -c1-150)"
done
