"""Helpers for copying checkpoint tensors into parameters, and the error every loader raises.

Parameters that need more than a plain copy (a slice of a fused projection, an offset) carry a
``weight_loader(param, tensor[, shard_id])`` attribute; ``load_named_weights`` dispatches each
checkpoint tensor to it. Tensors are copied into the existing parameter storage one at a time,
so loading never holds a second full copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn


class ModelLoadError(ValueError):
    """A model cannot be loaded: bad path, unsupported architecture, or weights that do not
    match the config. The message names the file, tensor or architecture at fault."""


def check_shape(what: str, expected: Sequence[int], got: Sequence[int]) -> None:
    """Raise ``ModelLoadError`` when a checkpoint tensor does not fit its destination."""
    if tuple(expected) != tuple(got):
        raise ModelLoadError(f"{what}: expected shape {tuple(expected)}, got {tuple(got)}")


def narrow(tensor: Any, dim: int, start: int, length: int) -> Any:
    """``tensor.narrow(dim, start, length)`` for a torch tensor or a lazy checkpoint tensor
    (anything with ``shape`` and ``narrow``): a lazy one reads only the narrowed part when it is
    materialised, so a tensor-parallel rank reads only its shard of the checkpoint."""
    return tensor.narrow(dim, start, length)


def materialize(tensor: Any) -> torch.Tensor:
    """A torch tensor for ``tensor`` (a lazy checkpoint tensor reads its data now)."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    return tensor.materialize()


def default_weight_loader(param: torch.Tensor, loaded: Any) -> None:
    """Copy ``loaded`` into ``param`` whole (casting to its dtype and device)."""
    check_shape("shape mismatch", param.shape, tuple(loaded.shape))
    param.data.copy_(materialize(loaded))


def init_dummy_parameter(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    """The dummy-weights rule (``--load-format dummy``): normal(0, 0.02) matrices, zero biases,
    unit vectors (norm scales). Integer and FP8 parameters belong to a quantization method,
    which fills them itself (``LinearMethod.init_dummy_weights``)."""
    if not param.dtype.is_floating_point or param.element_size() == 1:
        raise ModelLoadError(
            f"dummy weights: parameter {name!r} is {param.dtype}; its quantization method must "
            "fill it (LinearMethod.init_dummy_weights)"
        )
    if param.dim() >= 2:
        param.data.normal_(0.0, 0.02, generator=generator)
    elif name.endswith("bias"):
        param.data.zero_()
    else:
        param.data.fill_(1.0)


def set_weight_loader(param: nn.Parameter, loader: Callable[..., None]) -> nn.Parameter:
    """Attach a custom ``weight_loader`` to ``param`` and return it."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def new_parameter(shape: Sequence[int], dtype: torch.dtype | None) -> nn.Parameter:
    """An uninitialised, frozen parameter on the current default device (inference only:
    the loader or the dummy initialiser fills every parameter)."""
    return nn.Parameter(torch.empty(tuple(shape), dtype=dtype), requires_grad=False)


# (name fragment of our fused parameter, name fragment in the checkpoint, shard id)
StackedMapping = Sequence[tuple[str, str, object]]


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping = (),
    ignore: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load checkpoint tensors into ``module``'s parameters by name.

    ``stacked`` maps checkpoint names onto fused parameters, e.g.
    ``(".qkv_proj.", ".q_proj.", "q")``. Names for which ``ignore`` is true are skipped (tied
    heads, rotary ``inv_freq`` buffers); any other unknown name is an error. Returns the names
    of the parameters that are fully loaded (a fused parameter counts once all shards arrived).
    """
    params = dict(module.named_parameters())
    shards_needed: dict[str, set[object]] = {}
    for ours, _, shard in stacked:
        for name in params:
            if ours in name:
                shards_needed.setdefault(name, set()).add(shard)
    shards_seen: dict[str, set[object]] = {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        if ignore(hf_name):
            continue
        name, shard = hf_name, None
        for ours, theirs, shard_id in stacked:
            if theirs in hf_name:
                name, shard = hf_name.replace(theirs, ours), shard_id
                break
        param = params.get(name)
        if param is None:
            raise ModelLoadError(
                f"checkpoint tensor {hf_name!r} does not belong to this model "
                f"({type(module).__name__})"
            )
        loader = getattr(param, "weight_loader", None)
        try:
            if shard is not None:
                loader(param, tensor, shard)
                shards_seen.setdefault(name, set()).add(shard)
            elif loader is not None:
                loader(param, tensor)
            else:
                default_weight_loader(param, tensor)
        except ModelLoadError as e:
            raise ModelLoadError(f"checkpoint tensor {hf_name!r}: {e}") from None
        if shard is None or shards_seen[name] == shards_needed.get(name, {shard}):
            loaded.add(name)
    return loaded
