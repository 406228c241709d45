# What the GPU scripts (run_all.sh, run_quant.sh, run_multi_gpu.sh) share; each sources this file
# after `set -u`. It leaves the shell in the repository root with $OUT made, starts the DEADLINE
# clock (seconds, default 560) and defines:
#   elapsed, left       seconds since the start / left before DEADLINE
#   install_engine      the repository and the CPU, CUDA and Triton plugins, editable, offline
#   show_device         the GPU, torch and triton versions, and the time the install took
#   bench NAME LIMIT ARGS...
#                       one `engine bench ARGS`, skipped when less than a minute is left, its
#                       output appended to $OUT/bench.log and its JSON named in JSONS
#   merge_results       $OUT/NAME.json of every NAME in JSONS into one $OUT/results.json (the
#                       device returns at most 8 files), removing the parts
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-results}
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=${DEADLINE:-560}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((DEADLINE - $(elapsed))); }
JSONS=()

install_engine() {
  # The pyproject files use PEP 639's SPDX `license = "..."`, which needs setuptools >= 77.
  python3 -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' \
    || { echo "INSTALL FAILED: setuptools >= 77 needed (pip install 'setuptools>=77')"; exit 1; }
  # Python packages the GPU image lacks (fastapi, uvicorn, pydantic, pyzmq, msgspec, gguf,
  # xgrammar...) travel as wheels in .whl/ (docs/testing.md says how to fetch them) and go
  # onto PYTHONPATH.
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >/tmp/wheels.log 2>&1 \
      || { echo "WHEELS FAILED"; tail -20 /tmp/wheels.log; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-deps --no-build-isolation --no-index \
    -e . -e plugins/engine-cpu -e plugins/engine-cuda -e plugins/engine-triton >/tmp/install.log 2>&1 \
    || { echo "INSTALL FAILED"; tail -20 /tmp/install.log; exit 1; }
}

show_device() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "installed at $(elapsed)s"
}

bench() {  # bench NAME TIMEOUT ARGS...: one benchmark, its JSON kept for results.json
  local name=$1 limit=$2
  shift 2
  [ "$(left)" -lt 60 ] && { echo "SKIP $name: $(left)s left"; return; }
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  echo "=== $name (limit ${limit}s) at $(elapsed)s: engine bench $*"
  echo "=== $name: engine bench $*" >>"$OUT/bench.log"
  timeout -k 10 "$limit" python3 -m engine.cli.main bench "$@" --json "$OUT/$name.json" >/tmp/$name.log 2>&1
  echo "rc=$? at $(elapsed)s"
  grep -vE "it/s\]|s/it\]|^Loading" /tmp/$name.log | tee -a "$OUT/bench.log" | tail -8
  JSONS+=("$name")
}

merge_results() {
  python3 - "$OUT" "${JSONS[@]}" <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
results = {}
for name in names:
    path = os.path.join(out, name + ".json")
    if os.path.exists(path):
        with open(path) as f:
            results[name] = json.load(f)
        os.remove(path)
with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
PY
}
