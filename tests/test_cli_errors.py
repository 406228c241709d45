"""A user's mistake on the command line is one line on stderr (what, why, what to do) and a
non-zero exit, never a traceback; ``--log-level debug`` adds the traceback.

The CLI runs in a subprocess, as a user runs it, so what is checked is everything it prints.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest


def run_cli(*argv: str, cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "engine.cli.main", *argv],
        cwd=cwd,  # not the repository root, whose kernels/ shadows a package transformers probes
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def the_error_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The one error line of a failed run; checks there is no traceback and no other error."""
    err = result.stderr
    assert result.returncode == 2, (result.returncode, err)
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("engine") and "error:" in line]
    assert len(errors) == 1, err
    assert " ERROR " not in err, err  # no log line repeating it
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.fixture
def model_dir(tmp_path):
    """A directory that looks like a model (a config.json) with an architecture we lack."""
    path = tmp_path / "model"
    path.mkdir()
    config = {"architectures": ["FooForCausalLM"], "model_type": "llama", "vocab_size": 32}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_bad_model_path(tmp_path):
    result = run_cli("serve", str(tmp_path / "no-such-model"), "--port", "0", cwd=tmp_path)
    the_error_line(
        result, "no-such-model does not exist", "pass a Hugging Face model directory", ".gguf"
    )
    assert result.stdout == ""


def test_busy_port(tmp_path, model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("serve", str(model_dir), "--port", str(port), cwd=tmp_path)
    line = the_error_line(result, f"cannot listen on 127.0.0.1:{port}", "already listening")
    assert "--port" in line


def test_unknown_architecture(tmp_path, model_dir):
    result = run_cli("generate", "--model", str(model_dir), "Hello", cwd=tmp_path)
    the_error_line(
        result, "unsupported model architecture FooForCausalLM", "LlamaForCausalLM", "plugin"
    )


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["serve", "--port", "70000"], ["engine serve: error: argument --port", "0..65535"]),
        (["serve", "--dtype", "fp8"], ["argument --dtype: invalid choice: 'fp8'", "--help"]),
        (["serve", "MODEL", "--gpu-memory-utilization", "2"], ["gpu_memory_utilization"]),
        (["serve", "MODEL", "--chat-template", "none.jinja"], ["--chat-template none.jinja"]),
        (["serve", "/a", "--model", "/b"], ["the model is given twice"]),
        (["bench", "serve", "--base-url", "http://127.0.0.1:9"], ["cannot reach the server"]),
    ],
    ids=["port-range", "dtype-choice", "gpu-memory", "chat-template", "two-models", "no-server"],
)
def test_bad_flag_values(tmp_path, model_dir, argv, needles):
    argv = [str(model_dir) if a == "MODEL" else a for a in argv]
    result = run_cli(*argv, cwd=tmp_path)
    the_error_line(result, *needles)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # not the usage dump


def test_log_level_debug_adds_the_traceback(tmp_path):
    result = run_cli(
        "generate", "--model", str(tmp_path / "nope"), "Hi", "--log-level", "debug", cwd=tmp_path
    )
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert "ModelLoadError" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("engine: error: model path")


def test_a_closed_pipe_is_quiet(tmp_path):
    """`engine plugins | head -1` must not end in a BrokenPipeError traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli.main", "plugins"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.readline()
    proc.stdout.close()  # what head does once it has its line
    err = proc.stderr.read()
    proc.wait(60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
