#!/bin/bash
# The quantization GPU recipe in one command: install, the quantized-kernel tests, kernel
# timings, then the Llama-3.1-8B-shape benchmarks of docs/benchmarks.md (dummy weights).
#
#   OUT=/path/for/results bash tests/gpu/run_quant.sh [STEP ...]
#
# Steps (default: tests qkernels fp8-b1 awq-b1 fp8-nano awq-nano fp8-mixed awq-mixed; in this
# order); optional: bf16-mixed, kv-fp8 (the bf16 nano run with --kv-cache-dtype fp8: about
# twice the KV blocks), sweep (the kernel configurations of quant_benchmark --sweep),
# int4gemm (the int4-tile GEMM's tests, then quant_benchmark --int4-gemm-sweep: its
# configurations against dequantize + cuBLAS, table in the log, $OUT/int4gemm.json),
# vllm-mixed (the vLLM kit on the same mixed workload, FP8 then AWQ; needs .peers/ as its
# README describes, about 100 s of engine start each). Logs go to $OUT/*.log, every benchmark's JSON into $OUT/results.json.
# A step is skipped when less than a minute of DEADLINE (seconds, default 560) is left.
set -u
source "$(dirname "$0")/common.sh"

install_engine
show_device

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests qkernels fp8-b1 awq-b1 fp8-nano awq-nano fp8-mixed awq-mixed)

COMMON=(--seed 0 --load-format dummy --dtype bfloat16)
NANO=(--num-prompts 256 --min-input-len 100 --max-input-len 1024 --min-output-len 100
  --max-output-len 1024 "${COMMON[@]}")
MIXED=(--workload mixed --num-prompts 512 "${COMMON[@]}")
B1=(--batch-sizes 1 --input-len 128 --output-len 512 --seed 3 --load-format dummy --dtype bfloat16)
FP8=(--model llama-3.1-8b --quantization fp8)
AWQ=(--model llama-3.1-8b-awq)

for step in "${steps[@]}"; do
  case $step in
    tests)
      echo "=== quantization GPU tests at $(elapsed)s"
      timeout -k 10 $(($(left) - 30)) python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_quant_gpu.py tests/gpu/test_gguf_gpu.py tests/gpu/test_fp8_fusion_gpu.py \
        tests/triton_kernels/test_triton_quant.py tests/triton_kernels/test_triton_fp8_fusion.py \
        tests/triton_kernels/test_triton_gguf.py -m "gpu or triton" \
        >"$OUT/tests.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      tail -15 "$OUT/tests.log"
      ;;
    qkernels|sweep)
      [ "$(left)" -lt 90 ] && { echo "SKIP $step"; continue; }
      echo "=== quantized kernel timings at $(elapsed)s"
      extra=(); [ "$step" = sweep ] && extra=(--sweep --rows 1,16,256)
      timeout -k 10 $(($(left) - 60)) python3 -m engine_triton.quant_benchmark "${extra[@]}" \
        --json "$OUT/$step.json" >"$OUT/$step.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "M=    1|M=   16|M=  256|sweep|per decode|ms$" "$OUT/$step.log" | head -40
      JSONS+=("$step")
      ;;
    int4gemm)
      echo "=== int4-tile GEMM tests at $(elapsed)s"
      timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider \
        tests/triton_kernels/test_triton_int4gemm.py tests/triton_kernels/test_triton_int4pack.py \
        -m "gpu or triton" >"$OUT/int4gemm-tests.log" 2>&1
      echo "rc=$? at $(elapsed)s"; tail -5 "$OUT/int4gemm-tests.log"
      [ "$(left)" -lt 90 ] && { echo "SKIP int4gemm sweep"; continue; }
      echo "=== int4-tile GEMM sweep at $(elapsed)s"
      timeout -k 10 $(($(left) - 20)) python3 -m engine_triton.quant_benchmark --int4-gemm-sweep \
        --budget-s $(($(left) - 80)) --json "$OUT/int4gemm.json" >"$OUT/int4gemm.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      sed -n '/^shape /,$p' "$OUT/int4gemm.log"; grep -E "Traceback|Error" "$OUT/int4gemm.log" | head -5
      ;;
    fp8-b1) bench fp8-b1 200 latency "${FP8[@]}" "${B1[@]}" ;;
    awq-b1) bench awq-b1 200 latency "${AWQ[@]}" "${B1[@]}" ;;
    fp8-nano) bench fp8-nano 240 throughput "${FP8[@]}" "${NANO[@]}" ;;
    awq-nano) bench awq-nano 240 throughput "${AWQ[@]}" "${NANO[@]}" ;;
    fp8-mixed) bench fp8-mixed 300 throughput "${FP8[@]}" "${MIXED[@]}" ;;
    awq-mixed) bench awq-mixed 300 throughput "${AWQ[@]}" "${MIXED[@]}" ;;
    bf16-mixed) bench bf16-mixed 300 throughput --model llama-3.1-8b "${MIXED[@]}" ;;
    kv-fp8) bench kv-fp8 240 throughput --model llama-3.1-8b --kv-cache-dtype fp8 "${NANO[@]}" ;;
    vllm-mixed)
      [ -f .peers/vllm_peer.py ] || { echo "SKIP vllm-mixed: no .peers/ (see shared/peers/vllm/README.md)"; continue; }
      for shape in llama3-8b-fp8 llama3-8b-awq; do
        [ "$(left)" -lt 150 ] && { echo "SKIP vllm $shape"; continue; }
        echo "=== vllm $shape mixed at $(elapsed)s"
        PEER_KIT=.peers timeout -k 10 $(($(left) - 10)) bash .peers/run_on_gpu.sh check >/dev/null 2>&1
        PYTHONPATH=${PEER_HOME:-$HOME/vllm-peer}/site:${PYTHONPATH:-} PEER_KIT=.peers \
          timeout -k 10 $(($(left) - 10)) python3 tests/gpu/vllm_peer_mixed.py $shape mixed \
          >"$OUT/vllm_$shape.log" 2>&1
        echo "rc=$? at $(elapsed)s"
        grep -E "RESULT|^init |Traceback|Error" "$OUT/vllm_$shape.log" | cut -c1-400 | tail -5
      done
      ;;
    *) echo "unknown step $step" ;;
  esac
done

merge_results
python3 - "$OUT" <<'PY'
import json, os, sys
with open(os.path.join(sys.argv[1], "results.json")) as f:
    results = json.load(f)
for name, r in results.items():
    if name in ("qkernels", "sweep"):
        print(name, "decode-step matmuls (us, M=1):", r.get("decode_step_matmul_us_m1"))
        continue
    mem = r.get("memory", {})
    memtxt = (f"weights {mem.get('weights_gib')} GiB, KV {mem.get('kv_cache_gib')} GiB "
              f"({mem.get('num_kv_blocks')} blocks), GPU used {mem.get('gpu_used_gib')} GiB")
    if r.get("benchmark") == "throughput":
        print(f"{name}: {r['output_tokens_per_s']} out tok/s, {r['total_tokens_per_s']} total tok/s, "
              f"{r['elapsed_s']} s, ready {r['start_to_ready_s']} s; {memtxt}")
    else:
        for row in r.get("results", []):
            print(f"{name}: batch {row['batch_size']}: {row['output_tokens_per_s']} out tok/s, "
                  f"step {row['decode_step_ms']} ms, ready {r['start_to_ready_s']} s; {memtxt}")
PY
echo "done at $(elapsed)s"
