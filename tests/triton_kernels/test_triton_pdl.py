"""Programmatic dependent launch (``engine_triton/kernels/pdl.py``): when it is used, and the
contract every kernel launched with it must keep (checked on the source, so it holds on
machines without a Hopper GPU too; tests/gpu checks the behaviour)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch


def _modules():
    from engine_triton.kernels import (
        activation,
        argmax,
        attention,
        fp8_linear,
        fused_moe,
        kv_cache,
        linear,
        norm,
        rotary,
        wna16_linear,
    )

    return [activation, argmax, attention, fp8_linear, fused_moe, kv_cache, linear, norm, rotary,
            wna16_linear]  # fmt: skip


def _pdl_launched_kernels(tree: ast.Module) -> set[str]:
    """Names of kernels launched as ``kernel[grid](..., **pdl_launch(...))``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            pdl = any(
                kw.arg is None
                and isinstance(kw.value, ast.Call)
                and getattr(kw.value.func, "id", None) == "pdl_launch"
                for kw in node.keywords
            )
            if pdl and isinstance(node.func.value, ast.Name):
                names.add(node.func.value.id)
    return names


def test_every_pdl_launched_kernel_waits_first():
    """A kernel launched with ``launch_pdl`` starts before its predecessor finishes: it must
    take ``USE_PDL`` and call ``pdl_wait(USE_PDL)`` before anything else (no load of an
    earlier kernel's output, no store, no early return before it)."""
    launched_anywhere = set()
    for module in _modules():
        tree = ast.parse(inspect.getsource(module))
        launched = _pdl_launched_kernels(tree)
        launched_anywhere |= launched
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name in launched:
            fn = defs[name]
            params = [a.arg for a in fn.args.args]
            assert "USE_PDL" in params, f"{module.__name__}.{name} lacks USE_PDL"
            body = fn.body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            first = body[0]
            assert (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Call)
                and getattr(first.value.func, "id", None) == "pdl_wait"
                and [getattr(a, "id", None) for a in first.value.args] == ["USE_PDL"]
            ), f"{module.__name__}.{name}: the first statement must be pdl_wait(USE_PDL)"
    # The decode path's kernels are all covered (a rename must not silently drop one).
    assert {
        "_rms_norm_kernel",
        "_act_and_mul_kernel",
        "_qk_norm_rotary_kernel",
        "_decode_kernel",
        "_skinny_kernel",
        "_fp8_skinny_kernel",
        "_wna16_gemv_kernel",
        "_argmax_kernel",
        "_decode_gate_up_kernel",
        "_decode_down_kernel",
    } <= launched_anywhere


def test_pdl_is_off_where_it_cannot_apply(monkeypatch):
    from engine_triton.kernels import pdl

    assert pdl.pdl_launch(torch.device("cpu")) == {}
    # Off by the switch, or in the interpreter, before any CUDA query (none on this machine).
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.pdl_enabled(torch.device("cuda"))
    monkeypatch.delenv(pdl.ENV)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_launch(torch.device("cuda")) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pdl_follows_the_device_capability():
    from engine_triton.kernels import pdl

    device = torch.device("cuda")
    expected = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
    assert pdl.pdl_enabled(device) == expected
    assert pdl.pdl_launch(device) == ({"USE_PDL": True, "launch_pdl": True} if expected else {})
