#!/usr/bin/env bash
# Prefill speed of N synthetic tokens: the local CPU against every layer on two h2o-rpc-servers
# on this machine (run from the repository root after `cargo build --release -p h2o-cli --bins`).
# ST: threads of each server (2); REPS: rounds (1 2); WHERES: which runs (local local-repack rpc).
N=${1:-4096}
B=target/release
$B/h2o-rpc-server -p 50121 -t ${ST:-2} > /dev/null 2>&1 & S1=$!
$B/h2o-rpc-server -p 50122 -t ${ST:-2} > /dev/null 2>&1 & S2=$!
sleep 1
for rep in ${REPS:-1 2}; do
 for h2o in on off; do
  for where in ${WHERES:-local local-repack rpc}; do
   extra=""
   case $where in
    local) extra="--no-repack";;
    local-repack) extra="";;
    rpc) extra="--no-repack --rpc 127.0.0.1:50121,127.0.0.1:50122 --n-gpu-layers 99";;
   esac
   tps=$($B/h2o-cli --synthetic-prompt $N -c $((N+128)) -n 0 -t 2 --h2o $h2o $extra --json 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["timings"]["prefill_tokens_per_second"] if "timings" in d else d["prefill_tokens_per_second"],1), d.get("peak_rss_bytes",0)//1048576)' 2>&1)
   echo "N=$N rep=$rep h2o=$h2o $where prefill_tok_s,peak_MiB=$tps"
  done
 done
done
kill $S1 $S2
