#!/bin/bash
# An A/B pair on one GPU machine: puts the engine-triton package of an earlier commit in
# ab_base/engine_triton (git-ignored), so that a device call can time both versions side by side:
#
#   bash tests/gpu/ab_base.sh REV          # here, before the call; carry ["ab_base"] with it
#   PYTHONPATH=$PWD/ab_base OUT=$OUT/old bash tests/gpu/run_all.sh moe-b1    # REV's kernels
#   OUT=$OUT/new bash tests/gpu/run_all.sh moe-b1                            # the tree's
#
# PYTHONPATH puts the copy ahead of the editable install, so only the Triton plugin differs
# (the core is the tree's): compare kernel changes this way, not changes to the core.
set -eu
rev=${1:?usage: bash tests/gpu/ab_base.sh REV}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rm -rf "$root/ab_base"
mkdir -p "$root/ab_base"
git -C "$root" archive "$rev" plugins/engine-triton/engine_triton \
  | tar -x -C "$root/ab_base" --strip-components=2
echo "ab_base/engine_triton: plugins/engine-triton/engine_triton at $(git -C "$root" rev-parse --short "$rev")"
