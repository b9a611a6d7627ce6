#!/usr/bin/env bash
# The "Routing v2" simulator campaign of docs/benchmarks.md: every workload x engine config x
# worker count x seed, one `kvgate simulate` run each (policies in one process, -j 1, no plots),
# then one bench.slo_table per (workload, config, workers) over the seeds.
#
#   bench/routing_v2_sweep.sh                      # everything, results under bench/results/rv2/
#   SEEDS="0 1" WORKERS=8 CONFIGS=pb WORKLOADS="mt mc" bench/routing_v2_sweep.sh
#   BOUNDS=1 bench/routing_v2_sweep.sh             # + each run's latency bounds (bound.json):
#                                                  # slo_table then prints what no policy can beat
#
# Environment: SEEDS (default "0 1 2 3 4"), WORKERS ("8 32"), CONFIGS ("default pb"),
# WORKLOADS ("ssp gsp mt mc az"; also "ta", tool agents), BOUNDS (set: also bench.latency_bound per run), POLICIES
# (default kv_aware, slo_aware and the four peer baselines), OURS (the policies compared, as
# POLICIES names them; default slo_aware,kv_aware), OUT (bench/results/rv2),
# TRACES (../shared/traces), KVGATE (kvgate), PYTHON (python). Runs already present are not run again.
#
# Scaling with workers (k = workers / 8): bursts get k x the requests, arrivals k x the rate
# (mt: k x the session rate with k/2 x the sessions beyond 8 workers, to bound the run time).
# Seeds: the synthetic workloads take --seed; a trace's seed s is a window of it (the arrivals
# and lengths are the trace's own, --seed alone would change only the prompt text):
#   mc (Mooncake, 3993 requests over 1022 s): 1600 requests from start_s = 100 s x s (8 workers)
#      or 150 s x s (32 workers, time_scale 1/4); the windows overlap
#   az (Azure code, 8819 requests over 57 min): 1500 requests from start_s = 600 s x s (8
#      workers) or 550 s x s (32 workers, time_scale 1/4)
# (32 workers: the same number of trace requests at 4x the rate, to bound the run time)
set -euo pipefail
SEEDS=${SEEDS:-"0 1 2 3 4"}
WORKERS=${WORKERS:-"8 32"}
CONFIGS=${CONFIGS:-"default pb"}
WORKLOADS=${WORKLOADS:-"ssp gsp mt mc az"}
POLICIES=${POLICIES:-kv_aware,slo_aware,sglang_cache_aware,dynamo_kv,llmd_default,llmd_kv_util}
OURS=${OURS:-slo_aware,kv_aware}
OUT=${OUT:-bench/results/rv2}
TRACES=${TRACES:-../shared/traces}
KVGATE=${KVGATE:-kvgate}
PYTHON=${PYTHON:-python}
PB="-e prefill_token_s=1.25e-4 -e num_gpu_blocks=192000"

args() {  # workload workers seed -> simulate arguments
  local w=$1 n=$2 s=$3 k=$(( $2 / 8 ))
  case $w in
    ssp) echo "-w shared-system-prompt -p num_requests=$((256 * k)) --seed $s" ;;
    gsp) echo "-w generated-shared-prefix -p groups=$((64 * k)) --seed $s" ;;
    mt) if [ "$k" = 1 ]; then ns=200; else ns=$((100 * k)); fi
        echo "-w multi-turn -p sessions=$ns -p turns=8 -p system_len=2048 -p user_len=1024
              -p output_len=300 -p think_s=5 -p rate=$($PYTHON -c "print(1.5 * $k)")
              -e max_model_len=32768 --seed $s" ;;
    ta) echo "-w tool-agent -p sessions=$((120 * k)) -p rate=$((3 * k)) -e max_model_len=32768 --seed $s" ;;
    mc) if [ "$k" = 1 ]; then m=1600; st=$((100 * s)); else m=1600; st=$((150 * s)); fi
        echo "-w mooncake --trace $TRACES/synthetic_trace.jsonl -e max_model_len=200000
              -p max_requests=$m -p start_s=$st -p time_scale=$($PYTHON -c "print(1 / $k)")" ;;
    az) if [ "$k" = 1 ]; then m=1500; st=$((600 * s)); else m=1500; st=$((550 * s)); fi
        echo "-w azure --trace $TRACES/AzureLLMInferenceTrace_code.csv
              -p max_requests=$m -p start_s=$st -p time_scale=$($PYTHON -c "print(1 / $k)")" ;;
    *) echo "unknown workload $w" >&2; exit 2 ;;
  esac
}

for n in $WORKERS; do
  for c in $CONFIGS; do
    eng=""; [ "$c" = pb ] && eng=$PB
    for w in $WORKLOADS; do
      dirs=()
      for s in $SEEDS; do
        name=$w-$c-n$n-s$s
        dirs+=("$OUT/$name")
        if [ ! -f "$OUT/$name/results.json" ]; then
          # shellcheck disable=SC2046
          nice -n 10 $KVGATE simulate $(args "$w" "$n" "$s") $eng -n "$n" --policies "$POLICIES" \
            -j 1 --no-plots --no-progress --out-dir "$OUT" --name "$name" > /dev/null
        fi
        if [ -n "${BOUNDS:-}" ] && [ ! -f "$OUT/$name/bound.json" ]; then
          # shellcheck disable=SC2046
          $PYTHON -m bench.latency_bound $(args "$w" "$n" "$s") $eng -n "$n" \
            --out "$OUT/$name/bound.json" > /dev/null
        fi
      done
      slo=2000; [ "$c" = pb ] && slo=6250
      echo "#### $w, $c, $n workers, seeds $SEEDS"
      $PYTHON -m bench.slo_table "${dirs[@]}" --ours "$OURS" --slo-ttft-ms $slo
      echo
    done
  done
done
