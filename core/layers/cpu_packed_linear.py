"""Linear layers with oneDNN-prepacked weights, for models on the CPU.

``F.linear`` on the CPU reorders the weight into oneDNN's blocked layout on every call (bf16) or
runs a plain GEMM that reaches about half the memory bandwidth (float32); for decode-sized
inputs both cost about as much as the product itself. ``pack_linears(model)`` reorders the
weight of every unquantized linear layer (and the LM head) once after loading: a linear layer
then runs ``OneDNNPackedLinearMethod`` (its ``LinearMethod`` is swapped, so its parallel style
— the all-reduce of a row-parallel layer — is untouched), the LM head's ``local_logits`` goes
through ``torch.ops.mkldnn._linear_pointwise`` on the packed weight. Measured on this project's 2-core
Zen 4, Gemma 3 270M: bf16 262k x 640 LM head 25 -> 12.5 ms at batch 1; float32 decode 10 -> 17
tok/s at batch 1 and 94 -> 168 tok/s at batch 32.

Numerics: in bf16/fp16 the results are bit-identical to ``F.linear`` (same oneDNN kernel;
tests/test_gguf_loader.py checks it). In float32 the GEMM library differs, so results differ in
the last bits (sums in another order); the float32 engine stays token-exact against transformers
on the real Gemma 3 model (tests/test_gguf_gemma3.py).

The packed weight replaces the plain one (whose storage is released), except for a tied LM head
whose matrix the embedding still needs (in float32 that head multiplies the plain matrix through
the same oneDNN op, see ``pack_linears``); packing is therefore the last step of loading.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from engine.layers.embedding import ParallelLMHead
from engine.layers.linear import UNQUANTIZED, LinearBase, LinearMethod

PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when oneDNN can pack ``dtype`` weights on ``device`` (a CPU with bf16/fp16 support
    in this torch build)."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    mkldnn = torch.ops.mkldnn
    try:
        if dtype == torch.bfloat16:
            return bool(mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(mkldnn._is_mkldnn_fp16_supported())
        return True
    except (AttributeError, RuntimeError):
        return False


def _packed_matmul(
    packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, out: int
) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], out)


class OneDNNPackedLinearMethod(LinearMethod):
    """An unquantized linear layer whose weight oneDNN prepacked (``layer.packed_weight``)."""

    name = "unquantized (oneDNN-packed)"

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _packed_matmul(layer.packed_weight, bias, x, layer.output_size_per_partition)


ONEDNN_PACKED = OneDNNPackedLinearMethod()


def _lm_head_local_logits(self: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
    return _packed_matmul(self.packed_weight, None, hidden, self.rows_per_partition)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def pack_linears(model: nn.Module, shared_weights: tuple[torch.Tensor, ...] = ()) -> int:
    """Prepack every unquantized linear layer and ``ParallelLMHead`` of ``model`` whose weight
    oneDNN can pack on its device; returns how many were packed. Idempotent.

    A ``ParallelLMHead`` whose weight is one of ``shared_weights`` (a tied embedding) is packed only in
    16-bit dtypes: packing keeps the plain matrix for the embedding, so the head then exists
    twice, and for float32 vocabularies the copy is too big (671 MB for Gemma's 262k x 640).
    A tied float32 head runs oneDNN's kernel on the plain matrix instead (no copy): Gemma's head
    at batch 1 / 32 took 67 / 207 ms through ``F.linear`` and 28 / 95 ms so (packed: 27 / 75).
    In 16-bit dtypes the plain matrix gains nothing over ``F.linear`` (bf16: 25.5 vs 27 ms).
    """
    count = 0
    shared = {id(w) for w in shared_weights}
    for module in model.modules():
        if getattr(module, "packed_weight", None) is not None:
            continue
        if getattr(module, "vocab_method", None) is not None:
            continue  # a head tied to a quantized embedding: its method multiplies
        if getattr(module, "keep_plain_weight", False):
            continue  # a MoE router (engine.models.moe): the platform's linear serves it
        linear = isinstance(module, LinearBase) and module.quant_method is UNQUANTIZED
        if linear or isinstance(module, ParallelLMHead):
            weight = module.weight
            if not packing_supported(weight.dtype, weight.device):
                continue
            if id(weight) in shared and weight.dtype == torch.float32:
                if not weight.is_contiguous():
                    continue
                module.packed_weight = weight.detach()  # the plain matrix, shared
            else:
                module.packed_weight = _pack(weight)
            if isinstance(module, ParallelLMHead):
                # Possibly tied to the embedding, which keeps using the plain matrix.
                module.local_logits = types.MethodType(_lm_head_local_logits, module)
            else:
                if module.bias is not None:
                    module.bias.data = module.bias.data.contiguous()
                module.quant_method = ONEDNN_PACKED
                # Release the plain copy; the parameter stays (with no elements) so that
                # named_parameters() still lists it.
                weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
            count += 1
    if count:
        return_freed_memory()
    return count


def return_freed_memory() -> None:
    """Give the heap pages of the released plain weights back to the OS. glibc keeps freed
    chunks of this size in its heap (its mmap threshold adapts upwards), so without a trim they
    stay in the resident set."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass  # not glibc: nothing to trim
