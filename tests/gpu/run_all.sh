#!/bin/bash
# The GPU suite in one command: install, GPU tests, then the benchmarks of docs/benchmarks.md.
#
#   OUT=/path/for/results bash tests/gpu/run_all.sh [STEP ...]
#
# GPU_TEST_WORKERS=N runs the tests step on N pytest-xdist workers; GPU_TEST_PATHS (default
# "tests/triton_kernels tests/gpu") narrows it to the files a change touches.
# Steps (default: all, in this order): tests, kernels, qwen-nano, qwen-b1, llama-b1,
# llama-nano, profile; optional: conformance, spread, linear, cascade-kernels (cascade
# attention's shared pass, each launch configuration against the plain decode kernel), kprofile, serve (HTTP against
# offline: issue 12's workload, engine.benchmarks.http_vs_offline; SERVE_ARGS adds flags), the
# mixture-of-experts steps moe-kernels, moe-kernels-fp8 (FP8 experts), moe-kernels-wna16 (4-bit
# experts in groups of 128 with zero points: fused_moe_wna16), moe-kernels-gguf (GGUF stacks as a
# GPU runs them: Q4_K gate/up, Q6_K down, MOE_GGUF_SCHEME=gguf-q4k for all Q4_K), moe-wna16-b1 and moe-wna16-nano
# (the Qwen3-30B-A3B-GPTQ-Int4 shape, dummy packed weights), moe-b1, moe-fp8-b1 and
# moe-fp8-nano (the Qwen3-30B-A3B-FP8 shape: 128x128 block FP8, experts weight-only), moe-nano, mixtral-b1, gptoss-b1 and gptoss-nano (the gpt-oss-20b shape), spec-base, spec-ngram,
# spec-draft, spec-eagle, spec-eagle3 (speculative decoding on the Llama-3.1-8B shape, prompts
# holding the model's own greedy continuation; docs/speculative-decoding.md), the multi-LoRA
# steps lora-kernels, lora-b1, lora-nano, lora-kprofile, lora-b1-sep (Llama-3.1-8B with 8
# rank-16 adapters on every linear layer, requests spread evenly; compare with llama-b1 /
# llama-nano), llama-hf-b1 / llama-hf-nano (the llama steps through the transformers
# modeling backend, --model-impl transformers), and issue 20's llama-mixed (512 requests of
# --workload mixed) and llama-shared (256 behind one 2,000-token prefix, --workload
# shared-prefix); BENCH_ARGS adds flags to those two (e.g. the old --max-num-seqs 256); and
# vLLM 0.24.0 on the same machine (the kit of shared/peers/vllm copied to .peers/, carried:
# its README says how): vllm-qwen (nano-vllm's workload and batch 1 on the Qwen3-0.6B shape,
# beside qwen-nano / qwen-b1), vllm-llama (batch 1, the mixed and the shared-prefix
# workloads on the Llama-3.1-8B shape, beside llama-b1 / llama-mixed / llama-shared) and
# vllm-moe (batch 1 and nano-vllm's workload on the Qwen3-30B-A3B shape, beside moe-b1 /
# moe-nano; needs a kit built with vLLM's MoE library, docs/benchmarks.md says how;
# VLLM_MOE_CONFIG_AS=NVIDIA_H200 lends vLLM that GPU's tuned MoE configurations). Logs go to $OUT/tests.log,
# kernels.log, bench.log and profile.txt; every benchmark's JSON into $OUT/results.json (one
# object keyed by step). A step is skipped when less than a minute of DEADLINE (seconds,
# default 560) is left. Run from a copy of the repository on a machine with python3, torch
# and triton.
set -u
source "$(dirname "$0")/common.sh"

install_engine
show_device

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests kernels qwen-nano qwen-b1 llama-b1 llama-nano profile)

NANO=(--num-prompts 256 --min-input-len 100 --max-input-len 1024 --min-output-len 100
  --max-output-len 1024 --seed 0 --load-format dummy --dtype bfloat16)
B1=(--batch-sizes 1 --input-len 128 --output-len 512 --seed 3 --load-format dummy --dtype bfloat16)
SPEC=(--model llama-3.1-8b --input-len 128 --output-len 512 --seed 3 --load-format dummy
  --dtype bfloat16 --self-continuation --num-iters 2
  --model-loader-extra-config '{"dummy_init": "uniform"}')
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 256}'

for step in "${steps[@]}"; do
  case $step in
    tests)
      echo "=== GPU tests at $(elapsed)s"
      # GPU_TEST_WORKERS=N spreads the test files over N pytest-xdist processes on the one GPU
      # (the tests size their KV caches by block count, so they fit side by side).
      xdist=()
      [ "${GPU_TEST_WORKERS:-1}" -gt 1 ] && xdist=(-n "$GPU_TEST_WORKERS" --dist loadfile)
      timeout -k 10 $(($(left) - 30)) python3 -m pytest -q -p no:cacheprovider "${xdist[@]}" \
        -rfE ${GPU_TEST_PATHS:-tests/triton_kernels tests/gpu} -m "gpu or triton" ${GPU_TEST_ARGS:-} \
        >"$OUT/tests.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      tail -40 "$OUT/tests.log"
      ;;
    conformance)  # the conformance kit on cuda and on triton (reports: conformance-*.md)
      for plugin in cuda triton; do
        [ "$(left)" -lt 60 ] && { echo "SKIP conformance $plugin"; continue; }
        echo "=== conformance $plugin at $(elapsed)s"
        timeout -k 10 $(($(left) - 30)) python3 -m pytest -q -p no:cacheprovider -rs \
          --engine-conformance=$plugin --engine-conformance-report="$OUT/conformance-$plugin.md" \
          -m conformance tests/gpu >"$OUT/conformance-$plugin.log" 2>&1
        echo "rc=$? at $(elapsed)s"
        tail -4 "$OUT/conformance-$plugin.log"
      done
      ;;
    kernels)
      [ "$(left)" -lt 90 ] && { echo "SKIP kernels"; continue; }
      echo "=== kernel sweeps at $(elapsed)s"
      timeout -k 10 $(($(left) - 60)) python3 -m engine_triton.benchmark --json "$OUT/kernels.json" \
        >"$OUT/kernels.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -A3 -E "^(decode|prefill)" "$OUT/kernels.log"
      JSONS+=("kernels")
      ;;
    spread)  # decode bandwidth with the used blocks packed vs spread over a full-size cache
      echo "=== spread check at $(elapsed)s"
      timeout -k 10 120 python3 -m engine_triton.benchmark --spread-only --json "$OUT/spread.json" 2>&1 | tail -3
      JSONS+=("spread")
      ;;
    linear)  # skinny GEMM vs F.linear on the decode matmuls (fills the kernel's TUNED table)
      echo "=== linear sweep at $(elapsed)s"
      timeout -k 10 150 python3 -m engine_triton.benchmark --linear-only --json "$OUT/linear.json" \
        >"$OUT/linear.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -A12 -E "^per decode step" "$OUT/linear.log"
      JSONS+=("linear")
      ;;
    moe-kernels)  # fused MoE kernel per layer vs the bytes it must read (fills its tuning)
      echo "=== moe kernel sweep at $(elapsed)s"
      timeout -k 10 $(($(left) - 30)) python3 -m engine_triton.benchmark --moe-only \
        --json "$OUT/moe-kernels.json" >"$OUT/moe-kernels.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "^(moe|qwen|mixtral|gpt-oss)|T=|best|ERROR" "$OUT/moe-kernels.log"
      JSONS+=("moe-kernels")
      ;;
    moe-kernels-fp8)  # the same sweep with FP8 experts (fused_moe_fp8, 128x128 block scales)
      echo "=== moe fp8 kernel sweep at $(elapsed)s"
      timeout -k 10 $(($(left) - 30)) python3 -m engine_triton.benchmark --moe-only --moe-fp8 block \
        --json "$OUT/moe-kernels-fp8.json" >"$OUT/moe-kernels-fp8.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "^(moe|qwen|mixtral)|T=|best|ERROR" "$OUT/moe-kernels-fp8.log"
      JSONS+=("moe-kernels-fp8")
      ;;
    moe-kernels-wna16)  # the same sweep with 4-bit experts (fused_moe_wna16, groups of 128)
      echo "=== moe wna16 kernel sweep at $(elapsed)s"
      timeout -k 10 $(($(left) - 30)) python3 -m engine_triton.benchmark --moe-only \
        --moe-wna16 w4-g128-zp --json "$OUT/moe-kernels-wna16.json" >"$OUT/moe-kernels-wna16.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "^(moe|qwen|mixtral)|T=|best|ERROR" "$OUT/moe-kernels-wna16.log"
      JSONS+=("moe-kernels-wna16")
      ;;
    moe-kernels-gguf)  # GGUF experts as a GPU runs them (Q4_K gate/up, Q6_K down; float offsets)
      echo "=== moe gguf kernel sweep at $(elapsed)s"
      timeout -k 10 $(($(left) - 30)) python3 -m engine_triton.benchmark --moe-only \
        --moe-wna16 ${MOE_GGUF_SCHEME:-gguf-q4k-q6k} --json "$OUT/moe-kernels-gguf.json" \
        >"$OUT/moe-kernels-gguf.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "^(moe|qwen|mixtral)|T=|best|ERROR" "$OUT/moe-kernels-gguf.log"
      JSONS+=("moe-kernels-gguf")
      ;;
    cascade-kernels)  # cascade attention's shared pass at the 8B shape vs the plain decode kernel
      echo "=== cascade kernel sweep at $(elapsed)s"
      timeout -k 10 $(($(left) - 30)) python3 -m engine_triton.benchmark --cascade-only \
        --json "$OUT/cascade-kernels.json" >"$OUT/cascade-kernels.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "^cascade|ERROR|Error" "$OUT/cascade-kernels.log"
      grep -A3 -E "^cascade .* B=" "$OUT/cascade-kernels.log" | grep -v "^cascade"
      JSONS+=("cascade-kernels")
      ;;
    lora-kernels)  # the LoRA op per 8B projection vs the base projection, in CUDA graphs
      echo "=== lora kernel sweep at $(elapsed)s"
      timeout -k 10 $(($(left) - 30)) python3 -m engine_triton.benchmark --lora-only \
        --json "$OUT/lora-kernels.json" >"$OUT/lora-kernels.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "per decode step|ERROR|Error" "$OUT/lora-kernels.log"
      JSONS+=("lora-kernels")
      ;;
    lora-b1) bench lora-b1 240 latency --model llama-3.1-8b "${B1[@]}" --num-loras 8 --lora-rank 16 ;;
    lora-nano) bench lora-nano 300 throughput --model llama-3.1-8b "${NANO[@]}" --num-loras 8 --lora-rank 16 ;;
    lora-b1-sep)  # the same with a separate shrink kernel (no shrink in the base GEMM)
      bench lora-b1-sep 240 latency --model llama-3.1-8b "${B1[@]}" --num-loras 8 --lora-rank 16 \
        --enable-lora --max-loras 8 --max-lora-rank 16 --no-lora-fused-shrink ;;
    lora-kprofile)  # the LoRA kernels' share of a decode step, batch 1 and 256
      for spec in 1:128 256:800; do
        [ "$(left)" -lt 60 ] && { echo "SKIP lora-kprofile $spec"; continue; }
        echo "=== lora kernel profile $spec at $(elapsed)s"
        timeout -k 10 150 python3 -m engine.benchmarks.kernel_profile --model llama-3.1-8b \
          --batch-size ${spec%:*} --context-len ${spec#*:} --load-format dummy --dtype bfloat16 \
          --steps 10 --num-loras 8 --lora-rank 16 2>&1 | grep -vE "it/s\]|s/it\]|^Loading" \
          | tee -a "$OUT/lora-kprofile.log" | grep -E "batch|LoRA|lora" | head -12
      done
      ;;
    moe-b1) bench moe-b1 240 latency --model qwen3-30b-a3b "${B1[@]}" ;;
    moe-fp8-b1) bench moe-fp8-b1 240 latency --model qwen3-30b-a3b-fp8 "${B1[@]}" ;;
    moe-fp8-nano) bench moe-fp8-nano 300 throughput --model qwen3-30b-a3b-fp8 "${NANO[@]}" ;;
    moe-wna16-b1) bench moe-wna16-b1 240 latency --model qwen3-30b-a3b-gptq-int4 "${B1[@]}" ;;
    moe-wna16-nano) bench moe-wna16-nano 300 throughput --model qwen3-30b-a3b-gptq-int4 "${NANO[@]}" ;;
    moe-nano) bench moe-nano 300 throughput --model qwen3-30b-a3b "${NANO[@]}" ;;
    mixtral-b1) bench mixtral-b1 240 latency --model mixtral-8x7b "${B1[@]}" ;;
    gptoss-b1) bench gptoss-b1 240 latency --model gpt-oss-20b "${B1[@]}" ;;
    gptoss-nano) bench gptoss-nano 300 throughput --model gpt-oss-20b "${NANO[@]}" ;;
    qwen-nano) bench qwen-nano 200 throughput --model qwen3-0.6b "${NANO[@]}" ;;
    qwen-b1) bench qwen-b1 150 latency --model qwen3-0.6b "${B1[@]}" ;;
    llama-b1)  # a fresh Triton cache: start-to-ready of the 8B shape, cold
      TRITON_CACHE_DIR=$(mktemp -d) bench llama-b1 200 latency --model llama-3.1-8b "${B1[@]}" ;;
    llama-nano) bench llama-nano 240 throughput --model llama-3.1-8b "${NANO[@]}" ;;
    llama-mixed) bench llama-mixed 300 throughput --model llama-3.1-8b --workload mixed \
      --num-prompts 512 --seed 0 --load-format dummy --dtype bfloat16 ${BENCH_ARGS:-} ;;
    llama-shared) bench llama-shared 240 throughput --model llama-3.1-8b --workload shared-prefix \
      --num-prompts 256 --seed 0 --load-format dummy --dtype bfloat16 ${BENCH_ARGS:-} ;;
    spec-base) bench spec-base 240 latency "${SPEC[@]}" --batch-sizes 1,32,128 ;;
    spec-ngram) bench spec-ngram 300 latency "${SPEC[@]}" --batch-sizes 1,32,128 \
      --speculative-config "$NGRAM" ;;
    spec-draft) bench spec-draft 240 latency "${SPEC[@]}" --batch-sizes 1 \
      --speculative-config '{"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 4}' ;;
    spec-eagle) bench spec-eagle 200 latency "${SPEC[@]}" --batch-sizes 1 \
      --speculative-config '{"method": "eagle", "model": "eagle-llama-3.1-8b", "num_speculative_tokens": 4}' ;;
    spec-eagle3) bench spec-eagle3 200 latency "${SPEC[@]}" --batch-sizes 1 \
      --speculative-config '{"method": "eagle3", "model": "eagle3-llama-3.1-8b", "num_speculative_tokens": 4}' ;;
    llama-hf-b1) bench llama-hf-b1 200 latency --model llama-3.1-8b "${B1[@]}" --model-impl transformers ;;
    llama-hf-nano) bench llama-hf-nano 300 throughput --model llama-3.1-8b "${NANO[@]}" --model-impl transformers ;;
    kprofile)  # GPU time per kernel of one step (torch.profiler); KPROFILE_SPECS entries are
      # MODEL:BATCH:CONTEXT[:PHASE[:QUANTIZATION]], e.g. llama-3.1-8b:1:128:decode:fp8
      specs=${KPROFILE_SPECS:-"qwen3-0.6b:256:800 qwen3-0.6b:1:128 llama-3.1-8b:1:128 llama-3.1-8b:256:800"}
      for spec in $specs; do
        spec=${spec//:/ }
        set -- $spec
        [ "$(left)" -lt 60 ] && { echo "SKIP kprofile $spec"; continue; }
        echo "=== kernel profile $spec at $(elapsed)s"
        quant=(); [ -n "${5:-}" ] && quant=(--quantization $5)
        timeout -k 10 120 python3 -m engine.benchmarks.kernel_profile --model $1 --batch-size $2 \
          --context-len $3 --phase ${4:-decode} "${quant[@]}" --load-format dummy --dtype bfloat16 --steps 10 2>&1 \
          | grep -vE "it/s\]|s/it\]|^Loading" | tee -a "$OUT/kprofile.log" | head -${KPROFILE_LINES:-30}
      done
      ;;
    serve)  # engine serve (1 and 4 front ends) loaded by engine bench serve, against offline
      [ "$(left)" -lt 120 ] && { echo "SKIP serve"; continue; }
      echo "=== serve vs offline at $(elapsed)s"
      timeout -k 10 $(($(left) - 10)) python3 -m engine.benchmarks.http_vs_offline \
        --shape qwen3-0.6b --num-prompts 512 --input-len 256 --output-len 256 \
        --api-server-count ${SERVE_API_SERVERS:-1,4} --num-workers ${SERVE_WORKERS:-6} \
        --engine-args "--dtype bfloat16" --out "$OUT/serve" ${SERVE_ARGS:-} >"$OUT/serve.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "^\||requests x|^\$" "$OUT/serve.log"
      rm -rf "$OUT/serve/model"
      ;;
    profile)  # where the host time of a throughput step goes (cProfile, top functions)
      [ "$(left)" -lt 60 ] && { echo "SKIP profile"; continue; }
      echo "=== profile at $(elapsed)s"
      timeout -k 10 $(($(left) - 10)) python3 -m cProfile -o /tmp/bench.prof \
        -m engine.benchmarks.throughput --model qwen3-0.6b "${NANO[@]}" --num-prompts 128 \
        >/tmp/profile-run.log 2>&1
      python3 -c "import pstats; pstats.Stats('/tmp/bench.prof').sort_stats('tottime').print_stats(45)" \
        >"$OUT/profile.txt" 2>&1
      grep -E "Throughput|Steps" /tmp/profile-run.log
      ;;
    vllm-qwen | vllm-llama | vllm-moe)  # vLLM beside us: one engine start, then each workload
      kit=${PEER_KIT:-.peers}
      [ -f "$kit/vllm_peer.py" ] || { echo "SKIP $step: no $kit/ (see shared/peers/vllm/README.md)"; continue; }
      [ "$(left)" -lt 150 ] && { echo "SKIP $step: $(left)s left"; continue; }
      case $step in
        vllm-qwen) shape=qwen3-0.6b wls=nano,b1 ;;
        vllm-llama) shape=llama3-8b wls=b1,mixed,shared-prefix ;;
        vllm-moe) shape=qwen3-30b-a3b wls=${VLLM_MOE_WORKLOADS:-b1,nano} ;;  # a kit with vLLM's MoE library
      esac
      echo "=== $step ($shape: $wls) at $(elapsed)s"
      timeout -k 10 $(($(left) - 10)) bash "$kit/run_on_gpu.sh" check >/dev/null 2>&1
      # VLLM_MOE_CONFIG_AS=NVIDIA_H200: vLLM's tuned fused-MoE configurations for that GPU, under
      # this GPU's name (vLLM 0.24.0 ships none for Qwen3-30B-A3B's experts on an H100 and warns
      # "Using default MoE config"), through its VLLM_TUNED_CONFIG_FOLDER.
      tuned=()
      if [ -n "${VLLM_MOE_CONFIG_AS:-}" ]; then
        configs=${PEER_HOME:-$HOME/vllm-peer}/site/vllm/model_executor/layers/fused_moe/configs
        here=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
        folder=$(mktemp -d)
        for f in "$configs"/*"device_name=$VLLM_MOE_CONFIG_AS".json "$configs"/*"device_name=$VLLM_MOE_CONFIG_AS",*.json; do
          [ -f "$f" ] && cp "$f" "$folder/$(basename "${f/device_name=$VLLM_MOE_CONFIG_AS/device_name=$here}")"
        done
        echo "vLLM's $VLLM_MOE_CONFIG_AS MoE configurations as $here's: $(ls "$folder" | wc -l) files"
        tuned=(VLLM_TUNED_CONFIG_FOLDER="$folder")
      fi
      env "${tuned[@]}" PYTHONPATH=${PEER_HOME:-$HOME/vllm-peer}/site:${PYTHONPATH:-} PEER_KIT="$kit" OUT="$OUT" \
        timeout -k 10 $(($(left) - 10)) python3 tests/gpu/vllm_peer_mixed.py $shape $wls \
        >"$OUT/vllm_$shape.log" 2>&1
      echo "rc=$? at $(elapsed)s"
      grep -E "RESULT|^init |Traceback|Error" "$OUT/vllm_$shape.log" | cut -c1-300 | tail -5
      for wl in ${wls//,/ }; do JSONS+=("vllm_${shape}_$wl"); done
      ;;
    *) echo "unknown step $step" ;;
  esac
done

merge_results
python3 - "$OUT" <<'EOF'
import json, os, sys
with open(os.path.join(sys.argv[1], "results.json")) as f:
    results = json.load(f)
for name, r in results.items():
    if name in ("kernels", "spread", "linear", "moe-kernels", "moe-kernels-fp8", "moe-kernels-wna16",
                "moe-kernels-gguf", "lora-kernels"):
        continue
    if r.get("benchmark") == "throughput":
        print(f"{name}: {r['output_tokens_per_s']} out tok/s, {r['total_tokens_per_s']} total tok/s, "
              f"{r['elapsed_s']} s, ready {r['start_to_ready_s']} s, split {r['step_split']}")
    else:
        for row in r.get("results", []):
            extra = ""
            if "acceptance_rate" in row:
                extra = (f", acceptance {row['acceptance_rate']}, mean length "
                         f"{row['mean_acceptance_length']}, {row['tokens_per_step']} tok/step")
            print(f"{name}: batch {row['batch_size']}: {row['output_tokens_per_s']} out tok/s, "
                  f"step {row['decode_step_ms']} ms, ready {r['start_to_ready_s']} s{extra}")
EOF
echo "done at $(elapsed)s"
