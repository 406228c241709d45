"""Token embedding and the LM head, split over the tensor-parallel ranks by vocabulary rows.

Rank ``r`` of ``tp`` holds rows ``[r * P, (r + 1) * P)`` of the ``[vocab, hidden]`` matrix, with
``P = ceil(vocab / tp)``; the last rank's rows past the vocabulary are zero padding. The
embedding looks up the ids that fall in its rows and the ranks' partial embeddings are summed
(all-reduce); the LM head computes the logits of its rows and the ranks' logits are concatenated
(all-gather), padding dropped. With one rank both are a plain lookup / product.

A quantization method may keep the matrix quantized (``vocab_method``: GGUF's tied Q8_0 matrix
on the CPU, ``engine.quantization.gguf.GGUFVocabMethod``); the embedding then looks rows up and
a head tied to it multiplies through that method, and ``weight`` holds no data.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import linear_op
from engine.layers.weight_utils import (
    check_shape,
    materialize,
    narrow,
    new_parameter,
    set_weight_loader,
)
from engine.parallel import SINGLE_PROCESS, ParallelContext

if TYPE_CHECKING:
    from engine.kernels.registry import Kernels


class _VocabRows(nn.Module):
    """The vocabulary-row split shared by the embedding and the LM head."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None,
        parallel: ParallelContext | None,
    ) -> None:
        super().__init__()
        self.parallel = parallel or SINGLE_PROCESS
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        tp = self.parallel.tp_size
        self.rows_per_partition = math.ceil(vocab_size / tp)
        self.vocab_start = self.parallel.tp_rank * self.rows_per_partition
        self.vocab_end = min(self.vocab_start + self.rows_per_partition, vocab_size)
        self.weight = new_parameter((self.rows_per_partition, hidden_size), dtype)
        set_weight_loader(self.weight, self.weight_loader)
        #: the quantization method holding this matrix (None: ``weight`` in the model dtype);
        #: shared by an embedding and the LM head tied to it, owned by the embedding
        self.vocab_method: Any = None

    def process_weights_after_loading(self) -> None:
        """Repack a quantized matrix once loaded (only the method's owner does it)."""
        if self.vocab_method is not None and self.vocab_method.module is self:
            self.vocab_method.process_weights_after_loading(self)

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        """Copy this rank's rows of the checkpoint's ``[vocab, hidden]`` matrix."""
        check_shape("vocabulary matrix", (self.vocab_size, self.hidden_size), tuple(loaded.shape))
        n = self.vocab_end - self.vocab_start
        if self.parallel.tp_size == 1:
            self._adopt_or_copy(param, materialize(loaded))
            return
        param.data[:n].copy_(materialize(narrow(loaded, 0, self.vocab_start, n)))
        param.data[n:].zero_()

    @staticmethod
    def _adopt_or_copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Use the loaded tensor as the storage when it already fits (a memory-mapped or GGUF
        matrix of the right dtype): loading then never holds two copies of the largest matrix
        (Gemma's 262k-row table)."""
        if (
            loaded.dtype == param.dtype
            and loaded.device == param.device
            and loaded.is_contiguous()
            and not loaded.requires_grad
            and param.device.type != "meta"
        ):
            param.data = loaded
        else:
            param.data.copy_(loaded)


class VocabParallelEmbedding(_VocabRows):
    """Token id -> vector. ``embed_scale`` multiplies the result, rounded to the weight dtype
    first (Gemma scales by ``sqrt(hidden_size)`` that way)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        embed_scale: float | None = None,
        *,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden_size, dtype, parallel)
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_method is not None:  # single rank only (see GGUFVocabMethod)
            # The method applies the scale: a kernel may fold it into the lookup.
            return self.vocab_method.embedding(input_ids, scale=self.embed_scale)
        if self.parallel.tp_size == 1:
            x = F.embedding(input_ids, self.weight)
        else:
            mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            local = torch.where(mine, input_ids - self.vocab_start, 0)
            x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
            x = self.parallel.tp.all_reduce(x)
        if self.embed_scale is not None:
            # The scale rounded to the activations' dtype first, as transformers multiplies by
            # a tensor of that dtype; a Python number, so that no host-to-device copy runs
            # inside a CUDA graph capture (a device tensor made here would be one).
            x = x * round_to_dtype(self.embed_scale, x.dtype)
        return x


class ParallelLMHead(_VocabRows):
    """hidden [N, H] -> float32 logits [N, V]. ``tie(embedding)`` shares the embedding matrix
    (same row split); ``final_logit_softcap`` applies ``cap * tanh(logits / cap)`` (Gemma 2).
    The product goes through ``kernels.linear`` when ``kernels`` is given, else ``F.linear``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype | None = None,
        final_logit_softcap: float | None = None,
        *,
        kernels: Kernels | None = None,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden_size, dtype, parallel)
        self.final_logit_softcap = final_logit_softcap
        self._linear = linear_op(kernels)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding's weight as the output projection (no copy)."""
        self.weight = embedding.weight

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the raw logits, ``hidden @ weight.T`` (the CPU's prepacking
        replaces this method)."""
        if self.vocab_method is not None:  # tied to a quantized embedding
            return self.vocab_method.logits(hidden)
        return self._linear(hidden, self.weight, None)

    def forward(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits in float32, or with ``float32=False`` in the weights' dtype when no softcap
        applies (enough for an argmax, and it skips converting [N, V])."""
        logits = self.local_logits(hidden)
        if self.parallel.tp_size > 1:
            logits = self.parallel.tp.all_gather(logits, dim=-1)[..., : self.vocab_size]
        return self.finish_logits(logits, float32)

    def finish_logits(self, logits: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The upcast and softcap applied to raw ``hidden @ weight.T`` logits."""
        if not float32 and self.final_logit_softcap is None:
            return logits
        logits = logits.float()
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits


@functools.lru_cache(maxsize=32)
@functools.lru_cache(maxsize=64)
def round_to_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as a Python number (no device tensor, so safe during a
    graph capture; cached, so a recorded CPU plan sees no torch op for it either)."""
    return torch.tensor(value, dtype=dtype).item()
