"""The GPU scripts (tests/gpu/run_*.sh) parse, and share common.sh's bench and results file.

They run on a GPU machine; here ``python3`` and ``nvidia-smi`` on PATH are stand-ins that
answer the GPU commands (install, pytest, ``engine bench``) without doing them, so what runs
for real is the shell: step dispatch, ``bench`` and the merge into ``results.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parent / "gpu"
SCRIPTS = sorted(GPU.glob("*.sh"))

FAKE_PYTHON = """#!/bin/bash
echo "python3 $*" >> "$FAKE_LOG"
case "$1 $2" in
  "-m pip"|"-m pytest"|"-m engine_triton.quant_benchmark") exit 0 ;;
  "-m engine_triton.benchmark")
    prev=""; for a in "$@"; do [ "$prev" = --json ] && json=$a; prev=$a; done
    echo '{"moe copy GBps": 4000}' > "$json"
    exit 0 ;;
  "-m engine.cli.main")
    prev=""; for a in "$@"; do [ "$prev" = --json ] && json=$a; prev=$a; done
    echo '{"benchmark": "latency", "start_to_ready_s": 4, "results": [{"batch_size": 1,
      "output_tokens_per_s": 5, "decode_step_ms": 6}]}' > "$json"
    exit 0 ;;
esac
case "$*" in *"import setuptools"*|*"import torch"*) exit 0 ;; esac
if [ "$1" = tests/gpu/vllm_peer_mixed.py ]; then  # the vLLM kit: a RESULT and a JSON each
  for wl in ${3//,/ }; do
    json='{"shape": "'$2'", "workload": "'$wl'", "output_tok_s": 7}'
    echo "RESULT $json"
    echo "$json" > "$OUT/vllm_$2_$wl.json"
  done
  exit 0
fi
exec PYTHON "$@"
"""


def fake_gpu(tmp_path: Path, **env_extra: str) -> tuple[dict[str, str], Path, Path]:
    """A ``python3`` that logs its calls and fakes the benchmarks, an ``nvidia-smi``, first on
    PATH: (the scripts' environment, their $OUT, the call log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON.replace("PYTHON", sys.executable))
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho fake GPU\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), FAKE_LOG=str(log))
    env.update(env_extra)
    return env, out, log


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_gpu_scripts_parse(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="the scripts use coreutils' timeout")
def test_run_quant_benches_through_common_sh(tmp_path: Path) -> None:
    env, out, log = fake_gpu(tmp_path)
    run = subprocess.run(
        ["bash", str(GPU / "run_quant.sh"), "fp8-b1", "awq-b1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "fp8-b1: batch 1: 5 out tok/s, step 6 ms" in run.stdout
    assert (
        "=== awq-b1: engine bench latency --model llama-3.1-8b-awq"
        in (out / "bench.log").read_text()
    )
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"fp8-b1", "awq-b1"}
    assert not list(out.glob("*-b1.json"))  # merged into results.json, the parts removed
    assert "--quantization fp8" in log.read_text()


@pytest.mark.skipif(shutil.which("timeout") is None, reason="the scripts use coreutils' timeout")
def test_run_quant_int4gemm_step(tmp_path: Path) -> None:
    """``run_quant.sh int4gemm``: the int4-tile GEMM's tests, then its sweep with a budget
    inside DEADLINE and its JSON in $OUT (kept apart from the benchmarks' results.json)."""
    env, out, log = fake_gpu(tmp_path, DEADLINE="300")
    run = subprocess.run(
        ["bash", str(GPU / "run_quant.sh"), "int4gemm"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    calls = log.read_text()
    assert "-m pytest -q -p no:cacheprovider tests/triton_kernels/test_triton_int4gemm.py" in calls
    sweep = next(line for line in calls.splitlines() if "--int4-gemm-sweep" in line)
    budget = int(sweep.split("--budget-s ")[1].split()[0])
    assert 150 < budget <= 220  # DEADLINE 300 less the margin, nothing else having run
    assert f"--json {out}/int4gemm.json" in sweep
    assert json.loads((out / "results.json").read_text()) == {}


@pytest.mark.skipif(shutil.which("timeout") is None, reason="the scripts use coreutils' timeout")
def test_run_all_times_the_integer_experts(tmp_path: Path) -> None:
    """``moe-kernels-wna16`` runs the MoE sweep on 4-bit experts with zero points, and
    ``moe-wna16-b1`` / ``moe-wna16-nano`` the latency and throughput benchmarks on the
    Qwen3-30B-A3B-GPTQ-Int4 shape; all three land in results.json."""
    env, out, log = fake_gpu(tmp_path, DEADLINE="400")
    steps = ["moe-kernels-wna16", "moe-wna16-b1", "moe-wna16-nano"]
    run = subprocess.run(["bash", str(GPU / "run_all.sh"), *steps], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    sweep = next(c for c in calls if "-m engine_triton.benchmark" in c)
    assert "--moe-only --moe-wna16 w4-g128-zp" in sweep
    benches = [c for c in calls if "-m engine.cli.main bench" in c]
    assert len(benches) == 2
    assert all("--model qwen3-30b-a3b-gptq-int4" in c for c in benches)
    assert "latency" in benches[0] and "--batch-sizes 1" in benches[0]
    assert "throughput" in benches[1] and "--num-prompts 256" in benches[1]
    assert set(json.loads((out / "results.json").read_text())) == set(steps)


def test_ab_base_extracts_the_plugin_at_a_commit(tmp_path: Path) -> None:
    """``ab_base.sh REV`` leaves REV's ``engine_triton`` package (not the working tree's) in
    ``ab_base/``, replacing an earlier copy."""
    repo = tmp_path / "repo"
    pkg = repo / "plugins" / "engine-triton" / "engine_triton"
    pkg.mkdir(parents=True)
    (repo / "tests" / "gpu").mkdir(parents=True)
    shutil.copy(GPU / "ab_base.sh", repo / "tests" / "gpu" / "ab_base.sh")
    (pkg / "kernel.py").write_text("VERSION = 1\n")

    def git(*args: str) -> str:
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
        done = subprocess.run(["git", "-C", str(repo), *args], check=True, env=env,
                              capture_output=True, text=True)  # fmt: skip
        return done.stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    (pkg / "kernel.py").write_text("VERSION = 2\n")
    git("commit", "-qam", "two")
    (pkg / "kernel.py").write_text("VERSION = 3\n")  # uncommitted
    (repo / "ab_base" / "engine_triton").mkdir(parents=True)
    (repo / "ab_base" / "engine_triton" / "stale.py").write_text("")
    script = repo / "tests" / "gpu" / "ab_base.sh"
    out = subprocess.run(["bash", str(script), first], check=True, capture_output=True, text=True)
    assert first[:7] in out.stdout
    copy = repo / "ab_base" / "engine_triton"
    assert (copy / "kernel.py").read_text() == "VERSION = 1\n"
    assert not (copy / "stale.py").exists()
    subprocess.run(["bash", str(script), "HEAD"], check=True, capture_output=True)
    assert (copy / "kernel.py").read_text() == "VERSION = 2\n"


@pytest.mark.skipif(shutil.which("timeout") is None, reason="the scripts use coreutils' timeout")
def test_run_all_runs_the_vllm_kit_beside_ours(tmp_path: Path) -> None:
    """The ``vllm-llama`` step unpacks the kit, runs its three workloads in one engine start
    and merges their JSONs into ``results.json`` next to ours; without a kit it is skipped."""
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "vllm_peer.py").write_text("")
    (kit / "run_on_gpu.sh").write_text('echo "check $*" >> "$FAKE_LOG"\n')
    env, out, log = fake_gpu(tmp_path, PEER_KIT=str(kit), DEADLINE="400")
    run = subprocess.run(["bash", str(GPU / "run_all.sh"), "llama-b1", "vllm-llama"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert '"workload": "shared-prefix"' in run.stdout
    calls = log.read_text()
    assert "check check" in calls
    assert "tests/gpu/vllm_peer_mixed.py llama3-8b b1,mixed,shared-prefix" in calls
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"llama-b1"} | {
        f"vllm_llama3-8b_{w}" for w in ("b1", "mixed", "shared-prefix")
    }
    assert results["vllm_llama3-8b_mixed"]["output_tok_s"] == 7
    env["PEER_KIT"] = str(tmp_path / "none")
    run = subprocess.run(["bash", str(GPU / "run_all.sh"), "vllm-qwen"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0 and "SKIP vllm-qwen: no" in run.stdout
