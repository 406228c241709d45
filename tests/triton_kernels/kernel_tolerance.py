"""How far a kernel's output may honestly be from its torch reference: shared by the interpreter
tests here and the GPU tests in ``tests/gpu``.

The kernels compute in float32 and round once to the activation dtype, as the references do,
so most outputs are at most one rounding apart (``close``). A fused kernel that rounds an
intermediate value, as ``qk_norm_rotary`` rounds the normed q/k before rotating them, can see
that intermediate land one unit in the last place (ulp) away from the reference's: float32 sums
in another order put a value on the other side of a rounding boundary. Rotation then carries
that ulp into outputs that may be far smaller than their inputs (``x1 * cos - x2 * sin`` cancels),
so the allowance has to be measured on the inputs (``rotary_rounding_slack``), not the outputs.
"""

from __future__ import annotations

import torch

# bf16: one rounding apart at most (the kernels round once, from float32).
# float16: its 10-bit mantissa makes one rounding apart about 5e-3 at these magnitudes.
ONE_ROUNDING = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def close(out, expected, dtype, seed, slack: torch.Tensor | None = None) -> None:
    """``out`` within one rounding of ``expected``, plus a per-element ``slack`` where given;
    the failure message carries ``seed`` so the inputs can be replayed."""
    tol = ONE_ROUNDING[dtype]
    out, expected = out.cpu().float(), expected.cpu().float()
    if slack is None:
        torch.testing.assert_close(
            out, expected, atol=tol, rtol=tol, msg=lambda m: f"seed={seed}: {m}"
        )
        return
    allowed = tol + tol * expected.abs() + slack
    excess = (out - expected).abs() - allowed
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"seed={seed}: {int((excess > 0).sum())} of {excess.numel()} elements off; worst at "
        f"flat index {worst}: {out.flatten()[worst].item()} vs {expected.flatten()[worst].item()}"
        f" (allowed {allowed.flatten()[worst].item():.3g})"
    )


def close_to_scale(out, expected, dtype, seed) -> None:
    """``close`` measured against the outputs' scale: both divided by the largest reference
    magnitude (at least 1). For MoE experts driven past GPT-OSS's clamp (gate/up values near
    10, intermediates near 50): float32 sums in another order than the reference's, or a bf16
    rounding of one such intermediate, move an output by a small fraction of that scale,
    which an output near zero cannot absorb in an absolute tolerance meant for unit-sized
    values."""
    scale = max(1.0, float(expected.abs().max()))
    close(out.cpu().float() / scale, expected.cpu().float() / scale, dtype, seed)


def rotary_rounding_slack(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> torch.Tensor:
    """Per output element of rotating ``x`` ([T, heads * head_size], already rounded to its
    dtype): how far one ulp of difference in each rotated input can move it,
    ``|cos| * ulp(x_a) + |sin| * ulp(x_b)`` with ``ulp(v) <= eps * |v|``. Zero past ``rot_dim``."""
    tokens = x.shape[0]
    rot_dim = cos_sin_cache.shape[-1]
    eps = torch.finfo(x.dtype).eps
    cos, sin = cos_sin_cache[positions].float().abs().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    heads = x.float().abs().view(tokens, -1, head_size)
    rot = heads[..., :rot_dim]
    a, b = rot.chunk(2, dim=-1) if is_neox else (rot[..., 0::2], rot[..., 1::2])
    first, second = cos * a + sin * b, cos * b + sin * a
    if is_neox:
        rotated = torch.cat((first, second), dim=-1)
    else:
        rotated = torch.stack((first, second), dim=-1).flatten(-2)
    slack = torch.zeros_like(heads)
    slack[..., :rot_dim] = eps * rotated
    return slack.view(tokens, -1)


def qk_norm_rotary_slack(positions, query, key, cos_sin_cache, head_size, is_neox, q_weight,
                         k_weight, eps):  # fmt: skip
    """``rotary_rounding_slack`` for ``qk_norm_rotary``'s q and k outputs: nonzero only for the
    heads it norms, whose normed values it rounds before rotating them."""
    from engine.kernels import reference as ref

    def slack(x, weight):
        if weight is None:
            return None
        normed = ref.rms_norm(x.unflatten(-1, (-1, head_size)), weight, eps).flatten(-2)
        return rotary_rounding_slack(normed, positions, cos_sin_cache, head_size, is_neox)

    return slack(query, q_weight), slack(key, k_weight)
