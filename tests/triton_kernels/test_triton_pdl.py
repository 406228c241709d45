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


def _is_call(node, name: str) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == name


def _pdl_launched_kernels(tree: ast.Module) -> set[str]:
    """Names of kernels launched as ``kernel[grid](..., **pdl_launch(...))``, or with ``**name``
    where ``name = pdl_launch(...)``."""
    holders = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _is_call(node.value, "pdl_launch")
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            pdl = any(
                kw.arg is None
                and (_is_call(kw.value, "pdl_launch") or getattr(kw.value, "id", None) in holders)
                for kw in node.keywords
            )
            if pdl and isinstance(node.func.value, ast.Name):
                names.add(node.func.value.id)
    return names


_MEMORY_OPS = {"load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max",
               "atomic_min"}  # fmt: skip


def _touches_memory(stmt) -> bool:
    for node in ast.walk(stmt):
        if isinstance(node, ast.Return):
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in _MEMORY_OPS:
            return True
    return False


def _root_name(expr) -> str | None:
    while isinstance(expr, (ast.BinOp, ast.Subscript, ast.Attribute)):
        expr = expr.left if isinstance(expr, ast.BinOp) else expr.value
    return getattr(expr, "id", None)


def _is_wait(stmt) -> bool:
    """``pdl_wait(USE_PDL)``, or ``if PREFETCH: t = pdl_prefetch_wait(<weights>, USE_PDL)``
    ``else: pdl_wait(USE_PDL)`` where the prefetched pointer is built from ``w_rows``."""
    if isinstance(stmt, ast.Expr) and _is_call(stmt.value, "pdl_wait"):
        return [getattr(a, "id", None) for a in stmt.value.args] == ["USE_PDL"]
    if not (isinstance(stmt, ast.If) and getattr(stmt.test, "id", None) == "PREFETCH"):
        return False
    body, orelse = stmt.body, stmt.orelse
    if len(body) != 1 or len(orelse) != 1 or not _is_wait(orelse[0]):
        return False
    call = body[0].value if isinstance(body[0], ast.Assign) else None
    return (
        _is_call(call, "pdl_prefetch_wait")
        and _root_name(call.args[0]) == "w_rows"
        and getattr(call.args[1], "id", None) == "USE_PDL"
    )


def test_every_pdl_launched_kernel_waits_first():
    """A kernel launched with ``launch_pdl`` starts before its predecessor finishes: it must
    take ``USE_PDL`` and wait (``pdl_wait(USE_PDL)``, or the weight prefetch then the wait)
    before anything touches memory: only index arithmetic may precede it (no load of an
    earlier kernel's output, no store, no early return)."""
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
            waits = [i for i, stmt in enumerate(body) if _is_wait(stmt)]
            assert waits, f"{module.__name__}.{name}: no pdl_wait(USE_PDL) at the top level"
            for stmt in body[: waits[0]]:
                assert not _touches_memory(stmt), (
                    f"{module.__name__}.{name}: line {stmt.lineno} touches memory (or returns) "
                    "before pdl_wait"
                )
    # The decode path's kernels are all covered (a rename must not silently drop one).
    assert {
        "_rms_norm_kernel",
        "_act_and_mul_kernel",
        "_silu_and_mul_quant_kernel",
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


@pytest.mark.parametrize("split", [1, 4])
def test_the_weight_prefetch_path_computes_the_same_product(split, device, seed, monkeypatch):
    """The one-row GEMVs' prefetch variant (first weight tile loaded before the wait, the first
    K step peeled out of the loop) on the interpreter: PDL itself is off here, so the launch
    options are forced to ``USE_PDL=False``, which still selects the prefetch variant."""
    from engine.kernels import quantized as qref
    from engine_triton.kernels import fp8_linear, linear

    calls = []

    def forced(device):
        calls.append(device)
        return {"USE_PDL": False}

    gen = torch.Generator().manual_seed(seed)
    n, k = 24, 512
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(linear, "pdl_launch", forced)
    cfg = linear.SkinnyConfig(8, 64, 4, 2, split_k=split)
    got = linear.skinny_linear(x.to(device), w.to(device), b.to(device), cfg)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)

    monkeypatch.setattr(fp8_linear, "pdl_launch", forced)
    monkeypatch.setattr(fp8_linear, "_skinny_config", lambda *a: (4, 64, 4, split, False))
    w8 = (torch.randn(n, k, generator=gen) * 16).to(torch.float8_e4m3fn)
    ws = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    got8 = fp8_linear.fp8_linear(x.to(device), w8.to(device), ws.to(device), None, b.to(device))
    want8 = qref.fp8_linear(x, w8, ws, None, b, False)
    torch.testing.assert_close(got8.float().cpu(), want8.float(), atol=2e-2, rtol=2e-2)
    assert len(calls) == 2  # both launches took the forced options
