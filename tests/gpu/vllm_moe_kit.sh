#!/bin/bash
# Build the vLLM 0.24.0 peer kit with vLLM's MoE library, for the vllm-moe step of run_all.sh.
#
#   KIT_DIR=.peers bash tests/gpu/vllm_moe_kit.sh [PATH/TO/shared/peers/vllm]
#
# The stock kit (shared/peers/vllm/build_kit.sh) deletes _moe_C_stable_libtorch.abi3.so to stay
# small, so MoE models do not run in it. This runs that script with one change: the MoE library
# is kept and cut down to sm_90 by the kit's own fatstrip.py, as the main library is (44 MB ->
# about 14 MB compressed; the kit grows from about 45 to about 59 MB). A device call carries at
# most 64 MiB, so carry the kit with the engine's small wheels only (docs/benchmarks.md,
# "Mixture of experts", has the call).
set -euo pipefail
PEER=${1:-$(cd "$(dirname "$0")/../../../shared/peers/vllm" && pwd)}
script=$(mktemp)
trap 'rm -f "$script"' EXIT
sed -e 's#\$V/_moe_C_stable_libtorch.abi3.so ##' \
    -e "s#\$(dirname \"\$0\")/fatstrip.py#$PEER/fatstrip.py#g" "$PEER/build_kit.sh" >"$script"
grep -q '_moe_C_stable_libtorch' "$script" && { echo "the kit script still names the MoE library: not changed as expected" >&2; exit 1; }
# after the main library's strip, strip the MoE library the same way
sed -i "s#^\(\$W/venv/bin/python $PEER/fatstrip.py .*_C_stable_libtorch.abi3.so\)\$#\1\n\$W/venv/bin/python $PEER/fatstrip.py \$V/_moe_C_stable_libtorch.abi3.so \$W/M.so 90 \&\& mv \$W/M.so \$V/_moe_C_stable_libtorch.abi3.so#" "$script"
grep -q 'M.so 90' "$script" || { echo "could not add the MoE library's strip to the kit script" >&2; exit 1; }
bash "$script"
cp "$PEER"/{vllm_peer.py,workloads.py,run_on_gpu.sh} "${KIT_DIR:-$PWD/.peers}/"
