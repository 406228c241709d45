#!/bin/bash
# Tensor / pipeline parallelism on 2 or 4 GPUs (issue 21, items 1, 2 and 5), in steps that each
# fit one 10-minute device command:
#
#   OUT=/path/for/results bash tests/gpu/run_multi_gpu.sh [STEP ...]
#
# Steps (default: tests identity b1 nano comm pp kill; about 25 minutes on 4 H200s, so pick):
#   tests     tests/gpu/test_parallel_gpu.py: tiny models, TP=2 (graphs and eager), PP=2,
#             TP=2 x PP=2 (4 GPUs), kill a worker; greedy tokens equal one GPU's    (~4 min)
#   identity  Llama-3.1-8B shape, dummy weights: greedy tokens of TP=2 (and 4) against TP=1
#             on 16 fixed prompts, float32 (must be identical) and bfloat16 (match rate and
#             the largest logprob difference reported)                             (~5 min)
#   b1        batch-1 decode tok/s, TP=1/2/4 (engine bench latency, graphs on)      (~4 min)
#   nano      the 256-request nano workload, TP=2/4 (engine bench throughput; TP=1 is the
#             llama-nano step of run_all.sh)                                        (~6 min)
#   comm      the all-reduce share of a decode step, TP=2/4, batch 1 and 64 (eager steps:
#             collectives bracketed by CUDA events on every rank)                   (~3 min)
#   pp        PP=2 nano and batch-1; TP=2 x PP=2 when 4 GPUs are there              (~5 min)
#   kill      TP=2 on the 8B shape: SIGKILL a worker mid-run; the error must surface within
#             2 s, nothing may hang, no process may be left                          (~1 min)
#   ray       TP=2 through a local Ray cluster (pip install ray first)               (~2 min)
#
# Every benchmark's JSON goes to $OUT/<step>-*.json and one $OUT/results.json at the end; a
# step is skipped when less than a minute of DEADLINE (seconds, default 560) is left. NVLink
# multicast stays off (the device's rule): the variables below are exported for every worker.
set -u
source "$(dirname "$0")/common.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

install_engine
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
echo "$NGPU GPUs; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE; installed at $(elapsed)s"
TPS="2"
[ "$NGPU" -ge 4 ] && TPS="2 4"

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests identity b1 nano comm pp kill)

bench() {  # bench NAME TIMEOUT ARGS...: common.sh's, without bench.log and with INFO/WARNING left out
  local name=$1 limit=$2
  shift 2
  [ "$(left)" -lt 60 ] && { echo "SKIP $name: $(left)s left"; return; }
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  echo "=== $name (limit ${limit}s) at $(elapsed)s: engine bench $*"
  timeout -k 10 "$limit" python3 -m engine.cli.main bench "$@" --json "$OUT/$name.json" \
    >/tmp/$name.log 2>&1
  echo "rc=$? at $(elapsed)s"
  grep -vE "it/s\]|s/it\]|Loading|INFO|WARNING" /tmp/$name.log | tail -8
}

NANO=(--num-prompts 256 --min-input-len 100 --max-input-len 1024 --min-output-len 100
  --max-output-len 1024 --seed 0 --load-format dummy --dtype bfloat16)
B1=(--batch-sizes 1 --input-len 128 --output-len 512 --seed 3 --load-format dummy --dtype bfloat16)
COMM=(--batch-sizes 1,64 --input-len 128 --output-len 64 --num-iters 2 --seed 3
  --load-format dummy --dtype bfloat16 --enforce-eager)

for step in "${steps[@]}"; do
  case $step in
    tests)
      echo "=== multi-GPU tests at $(elapsed)s"
      timeout -k 10 $(($(left) - 30)) python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_parallel_gpu.py -m gpu >"$OUT/tests-parallel.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      tail -15 "$OUT/tests-parallel.log"
      ;;
    identity)
      [ "$(left)" -lt 120 ] && { echo "SKIP identity"; continue; }
      echo "=== greedy identity, Llama-3.1-8B shape, TP=1 vs $TPS at $(elapsed)s"
      timeout -k 10 $(($(left) - 20)) python3 - "$OUT" $TPS <<'EOF' 2>&1 | grep -vE "it/s\]|INFO|WARNING|Loading"
import json, random, sys, tempfile
from engine import LLM, SamplingParams
from engine.benchmarks.workload import write_builtin_model
out, tps = sys.argv[1], [int(t) for t in sys.argv[2:]]
path = write_builtin_model("llama-3.1-8b", tempfile.mkdtemp())
rng = random.Random(0)
prompts = [[rng.randrange(10, 128000) for _ in range(n)] for n in (1, 5, 17, 64, 128, 300, 777, 1000) * 2]
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1)
report = {}
for dtype in ("float32", "bfloat16"):
    runs = {}
    for tp in [1] + tps:
        llm = LLM(path, load_format="dummy", dtype=dtype, seed=0, max_model_len=2048,
                  max_num_seqs=16, tensor_parallel_size=tp)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[tp] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in
                     zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]
        llm.llm_engine.shutdown(); del llm
        import gc, torch; gc.collect(); torch.cuda.empty_cache()
    for tp in tps:
        same = sum(a[0] == b[0] for a, b in zip(runs[1], runs[tp]))
        tokens = sum(len(a[0]) for a in runs[1])
        agree = sum(x == y for a, b in zip(runs[1], runs[tp]) for x, y in zip(a[0], b[0]))
        # logprob differences up to each prompt's first diverging token
        diffs = []
        for a, b in zip(runs[1], runs[tp]):
            for x, y, lx, ly in zip(a[0], b[0], a[1], b[1]):
                diffs.append(abs(lx - ly))
                if x != y:
                    break
        r = {"identical_prompts": f"{same}/{len(prompts)}", "token_agreement": round(agree / tokens, 4),
             "max_logprob_diff": max(diffs)}
        report[f"{dtype}-tp{tp}"] = r
        print(dtype, f"TP={tp} vs TP=1:", r, flush=True)
json.dump(report, open(f"{out}/identity.json", "w"), indent=2)
EOF
      ;;
    b1)
      for tp in 1 $TPS; do
        bench "b1-tp$tp" 200 latency --model llama-3.1-8b "${B1[@]}" --tensor-parallel-size $tp
      done
      ;;
    nano)
      for tp in $TPS; do
        bench "nano-tp$tp" 240 throughput --model llama-3.1-8b "${NANO[@]}" --tensor-parallel-size $tp
      done
      ;;
    comm)
      for tp in $TPS; do
        bench "comm-tp$tp" 200 latency --model llama-3.1-8b "${COMM[@]}" --tensor-parallel-size $tp
      done
      ;;
    pp)
      bench "nano-pp2" 240 throughput --model llama-3.1-8b "${NANO[@]}" --pipeline-parallel-size 2
      bench "b1-pp2" 200 latency --model llama-3.1-8b "${B1[@]}" --pipeline-parallel-size 2
      if [ "$NGPU" -ge 4 ]; then
        bench "nano-tp2pp2" 240 throughput --model llama-3.1-8b "${NANO[@]}" \
          --tensor-parallel-size 2 --pipeline-parallel-size 2
      fi
      ;;
    kill)
      [ "$(left)" -lt 90 ] && { echo "SKIP kill"; continue; }
      echo "=== kill a worker mid-run, Llama-3.1-8B shape TP=2, at $(elapsed)s"
      timeout -k 10 $(($(left) - 20)) python3 - "$OUT" <<'EOF' 2>&1 | grep -vE "it/s\]|INFO|Loading"
import json, os, signal, sys, tempfile, threading, time
import psutil
from engine import LLM, SamplingParams
from engine.benchmarks.workload import write_builtin_model
path = write_builtin_model("llama-3.1-8b", tempfile.mkdtemp())
llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=4096, tensor_parallel_size=2)
engine = llm.llm_engine
pids = [w["pid"] for w in engine.runner.workers]
result = {}
def run():
    try:
        llm.generate([{"prompt_token_ids": [11] * 200}] * 64,
                     SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
        result["error"] = None
    except BaseException as e:
        result["at"], result["error"] = time.monotonic(), repr(e)
t = threading.Thread(target=run); t.start()
while engine.get_stats().generation_tokens_total < 2000:
    time.sleep(0.01)
killed = time.monotonic(); os.kill(pids[1], signal.SIGKILL)
t.join(30)
engine.shutdown()
time.sleep(2)
left = [p for p in pids if psutil.pid_exists(p)]
r = {"hung": t.is_alive(), "error": result.get("error"),
     "seconds_to_error": round(result.get("at", float("nan")) - killed, 3), "processes_left": left}
print(r); json.dump(r, open(f"{sys.argv[1]}/kill.json", "w"), indent=2)
EOF
      ;;
    ray)
      echo "=== Ray TP=2 at $(elapsed)s"
      timeout -k 10 $(($(left) - 20)) python3 -m pytest -q -p no:cacheprovider \
        tests/test_ray_executor.py -m ray 2>&1 | tail -5
      bench "b1-ray-tp2" 200 latency --model llama-3.1-8b "${B1[@]}" --tensor-parallel-size 2 \
        --distributed-executor-backend ray
      ;;
    *) echo "unknown step $step" ;;
  esac
done

python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
results = {}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    name = os.path.basename(path)[:-5]
    if name == "results":
        continue
    with open(path) as f:
        results[name] = json.load(f)
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
for name, r in results.items():
    if r.get("benchmark") == "throughput":
        print(f"{name}: {r['output_tokens_per_s']} out tok/s, {r['total_tokens_per_s']} total tok/s, "
              f"ready {r['start_to_ready_s']} s")
    elif r.get("benchmark") == "latency":
        for row in r["results"]:
            extra = row.get("collectives")
            comm = (f", collectives {extra['collective_ms_per_step']} ms/step "
                    f"({100 * extra['share_of_worker_step']:.1f}% of the worker's step)") if extra else ""
            print(f"{name}: batch {row['batch_size']}: {row['output_tokens_per_s']} out tok/s, "
                  f"step {row['decode_step_ms']} ms{comm}")
    else:
        print(f"{name}: {r}")
EOF
echo "done at $(elapsed)s"
