"""Random inputs for the conformance checks: kernel arguments and multi-step paged-attention
batches that follow the conventions in ``engine.attention_backends.interface``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention_backends.interface import BatchLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (rtol, atol) per compute dtype. Kernels compare against the reference computed on the CPU in
# the same dtype; attention against the reference computed in float32 from the same inputs.
KERNEL_TOLERANCE = {"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2), "float16": (2e-3, 2e-3)}
ATTENTION_TOLERANCE = {"float32": (1e-3, 1e-3), "bfloat16": (3e-2, 3e-2), "float16": (4e-3, 4e-3)}


def rope_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """A float32 ``[max_position, rot_dim]`` cos/sin cache in the layout the kernels expect."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def kernel_cases(name: str, dtype: torch.dtype, gen: torch.Generator) -> list[tuple[str, tuple]]:
    """``(case id, args)`` pairs for kernel ``name``, on the CPU (the caller moves tensors)."""

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def weight(h: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(h, generator=gen)).to(dtype)

    if name == "rms_norm":
        return [(f"T{t}-H{h}", (randn(t, h), weight(h), 1e-6)) for t, h in ((7, 64), (1, 256))]
    if name == "fused_add_rms_norm":
        return [
            (f"T{t}-H{h}", (randn(t, h), randn(t, h), weight(h), 1e-6))
            for t, h in ((7, 64), (1, 256))
        ]
    if name == "rotary_embedding":
        cases = []
        for is_neox in (True, False):
            for rot_dim in (64, 32):  # full and partial rotary
                positions = torch.randint(0, 64, (5,), generator=gen, dtype=torch.int64)
                args = (
                    positions,
                    randn(5, 4 * 64),
                    randn(5, 2 * 64),
                    rope_cache(64, rot_dim),
                    64,
                    is_neox,
                )
                cases.append((f"neox{int(is_neox)}-rot{rot_dim}", args))
        return cases
    if name == "qk_norm_rotary":
        # q and k are column slices of one fused qkv output (strided rows), 4 query / 2 KV heads.
        cases = []
        for norm in (True, False):
            for is_neox, rot_dim in ((True, 64), (False, 64), (True, 32)):
                qkv = randn(5, (4 + 2 * 2) * 64)
                positions = torch.randint(0, 64, (5,), generator=gen, dtype=torch.int64)
                weights = (weight(64), weight(64)) if norm else (None, None)
                args = (
                    positions,
                    qkv[:, : 4 * 64],
                    qkv[:, 4 * 64 : 6 * 64],
                    rope_cache(64, rot_dim),
                    64,
                    is_neox,
                    *weights,
                    1e-6,
                )
                cases.append((f"norm{int(norm)}-neox{int(is_neox)}-rot{rot_dim}", args))
        return cases
    if name in ("silu_and_mul", "gelu_tanh_and_mul"):
        return [(f"T{t}-I{i}", (randn(t, 2 * i),)) for t, i in ((7, 48), (1, 128))]
    if name == "write_kv_cache":
        num_blocks, block_size, kv_heads, head = 4, 8, 2, 32
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:6].to(torch.int64)
        slots[3] = -1  # a padding token: must not be written
        cache = randn(2, num_blocks, block_size, kv_heads, head)
        return [("T6-pad", (randn(6, kv_heads, head), randn(6, kv_heads, head), cache, slots))]
    if name == "linear":
        # Decode-sized (the Triton override's skinny kernel) and prefill-sized rows; odd sizes.
        cases = []
        for t, n, k, bias in ((3, 40, 72, True), (1, 33, 64, False), (20, 24, 48, True)):
            args = (randn(t, k), randn(n, k, scale=k**-0.5), randn(n) if bias else None)
            cases.append((f"T{t}-N{n}-K{k}-bias{int(bias)}", args))
        return cases
    if name == "argmax":
        # Odd vocabularies; a tie planted far apart (the first index wins), an all -inf row
        # (index 0), and rows of a padded-vocabulary view (row stride != V).
        cases = []
        for n, v in ((1, 4099), (5, 1000), (17, 333)):
            x = randn(n, v)
            x[0, v // 3] = x[0, v - 2] = x[0].max() + 1
            if n > 1:
                x[1] = float("-inf")
            cases.append((f"N{n}-V{v}", (x,)))
        cases.append(("N3-V999-view", (randn(3, 1024)[:, :999],)))
        return cases
    if name == "moe_topk_softmax":
        # Distinct logits, exactly representable in every dtype (multiples of 1/8 below 8), so
        # the chosen experts are unambiguous and must match exactly.
        cases = []
        for t, e, k, renorm in ((5, 8, 2, True), (3, 64, 8, False), (1, 60, 6, True)):
            logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)])
            logits = ((logits - e // 2).float() / 8).to(dtype)
            cases.append((f"T{t}-E{e}-top{k}-renorm{int(renorm)}", (logits, k, renorm)))
        return cases
    if name == "fused_moe":
        # Odd sizes; experts that get no token, one expert that gets most of them, and choices
        # held by another expert-parallel rank (-1); decode-sized and prefill-sized batches.
        cases = []
        for t, e, k, h, i in ((3, 8, 2, 40, 24), (1, 16, 8, 64, 48), (33, 8, 2, 48, 40)):
            x = randn(t, h)
            w13 = randn(e, 2 * i, h, scale=h**-0.5)
            w2 = randn(e, h, i, scale=i**-0.5)
            scores = torch.rand(t, e, generator=gen)
            scores[:, 1] += 0.5  # a popular expert
            scores[:, e - 1] = -1.0  # never chosen
            weights, ids = torch.topk(scores, k, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).float()
            ids = ids.to(torch.int32)
            ids[0, -1] = -1  # held elsewhere
            cases.append((f"T{t}-E{e}-top{k}-H{h}-I{i}", (x, w13, w2, weights, ids)))
        return cases
    if name == "add_lora_linear":
        return _lora_cases(randn, gen)
    raise KeyError(f"no conformance inputs for kernel {name!r}")


def _lora_cases(randn: Any, gen: torch.Generator) -> list[tuple[str, tuple]]:
    """Mixed batches: tokens of several adapter slots and tokens without one (-1), fused q/k/v
    and gate/up slices and a single one, odd sizes, decode- and prefill-sized batches, a rank
    padded past what the adapter uses (zero columns)."""
    from engine.lora.mapping import group_by_slot

    cases = []
    for t, k, slices, rank, slots in (
        (1, 64, (40, 24, 24), 16, 4),
        (7, 72, (48,), 8, 3),
        (40, 48, (56, 56), 16, 4),
    ):
        n, s = sum(slices), len(slices)
        x = randn(t, k)
        lora_a = randn(slots, s * rank, k, scale=k**-0.5)
        lora_b = randn(slots, n, rank, scale=rank**-0.5)
        lora_a[:, -2:] = 0  # the last slice's padded rank columns
        lora_b[..., -2:] = 0
        token_slots = torch.randint(-1, slots, (t,), generator=gen, dtype=torch.int32)
        token_slots[0] = slots - 1  # the decode case has an adapter
        sorted_tokens, starts = group_by_slot(token_slots.numpy(), slots)
        args = (
            randn(t, n),
            x,
            lora_a,
            lora_b,
            token_slots,
            torch.from_numpy(sorted_tokens),
            torch.from_numpy(starts),
            slices,
        )
        cases.append((f"T{t}-K{k}-N{'+'.join(map(str, slices))}-R{rank}-L{slots}", args))
    return cases


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value


@dataclass
class AttentionCase:
    """One attention configuration to check a backend on."""

    dtype: str
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA
    head_size: int = 64
    block_size: int = 16
    sliding_window: int | None = None
    logit_softcap: float | None = None

    @property
    def id(self) -> str:
        parts = [
            self.dtype,
            f"H{self.num_heads}/{self.num_kv_heads}",
            f"D{self.head_size}",
            f"B{self.block_size}",
        ]
        if self.sliding_window:
            parts.append(f"window{self.sliding_window}")
        if self.logit_softcap:
            parts.append(f"softcap{self.logit_softcap:g}")
        return "-".join(parts)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_size)


@dataclass
class PagedBatchPlan:
    """A multi-step schedule over a shared block pool, as the model runner would produce it.

    Each step is a list of ``(request, num_new_tokens)`` with decodes (1 token) first.
    """

    block_size: int
    num_blocks: int
    steps: list[list[tuple[int, int]]]
    gen: torch.Generator
    _tables: dict[int, list[int]] = field(default_factory=dict)
    _lens: dict[int, int] = field(default_factory=dict)
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free = torch.randperm(self.num_blocks, generator=self.gen).tolist()

    def layouts(self) -> list[BatchLayout]:
        """The ``BatchLayout`` of every step (allocating blocks in a shuffled order)."""
        out = []
        for step in self.steps:
            query_lens, seq_lens, tables, slots = [], [], [], []
            num_decodes = sum(1 for req, n in step if n == 1 and self._lens.get(req, 0) > 0)
            for req, n in step:
                start = self._lens.get(req, 0)
                table = self._tables.setdefault(req, [])
                while len(table) * self.block_size < start + n:
                    table.append(self._free.pop())
                for pos in range(start, start + n):
                    slots.append(
                        table[pos // self.block_size] * self.block_size + pos % self.block_size
                    )
                self._lens[req] = start + n
                query_lens.append(n)
                seq_lens.append(start + n)
                tables.append(list(table))
            out.append(
                BatchLayout(query_lens, seq_lens, tables, slots, self.block_size, num_decodes)
            )
        return out


def default_plan(block_size: int, gen: torch.Generator) -> PagedBatchPlan:
    """Three steps mixing full prefills, chunked prefill, decodes and a late arrival:
    step 1 prefills r0 (9), r1's first chunk (21) and r2 (3); step 2 decodes r0, r2 then
    finishes r1 (11) and starts r3 (6); step 3 decodes everyone."""
    steps = [
        [(0, 9), (1, 21), (2, 3)],
        [(0, 1), (2, 1), (1, 11), (3, 6)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
    ]
    need = sum(-(-(n) // block_size) + 1 for n in (11, 33, 5, 7))
    return PagedBatchPlan(block_size, need + 4, steps, gen)
