"""Run the vLLM comparison kit (shared/peers/vllm, copied to .peers/ as its README says) on the
engine's mixed workload (512 requests) or shared-prefix workload (256), so both engines see
exactly the same requests, and on the engine's built-in mixture-of-experts shapes.

    PEER_KIT=.peers PYTHONPATH=$HOME/vllm-peer/site python3 tests/gpu/vllm_peer_mixed.py \
        llama3-8b-fp8 mixed
    ... python3 tests/gpu/vllm_peer_mixed.py qwen3-30b-a3b b1,nano

The kit's ``vllm_peer.main`` runs unchanged; only its workload lookup learns ``mixed`` and
``shared-prefix`` (``engine.benchmarks.workload.named_workload(name, n, vocab, seed=0)``, which
imports nothing heavy), and its shape lookup learns the built-in shapes it lacks
(``qwen3-30b-a3b``, ``mixtral-8x7b``): their model folder is the very ``config.json`` that
``engine bench --model NAME --load-format dummy`` runs (``write_builtin_model``). The kit's
stock build drops vLLM's MoE library; these shapes need a kit built with it (stripped to sm_90
like the main library: docs/benchmarks.md, "Mixture of experts", says how). Nothing of vLLM
enters the engine: this is a measuring instrument.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.environ.get("PEER_KIT", ".peers")))

import vllm_peer  # noqa: E402

from engine.benchmarks.workload import (  # noqa: E402
    BUILTIN_SHAPES,
    builtin_shape,
    named_workload,
    write_builtin_model,
)

_kit_requests = vllm_peer.requests
_kit_make_model_dir = vllm_peer.make_model_dir
_KIT_SHAPES = frozenset(vllm_peer.SHAPES)


def requests(name: str, vocab: int):
    if name == "mixed":  # the 512 requests
        work = named_workload(name, 512, vocab, seed=0)
        return work.prompts, work.output_lens
    if name == "shared-prefix":  # 256 requests behind one 2,000-token system prompt
        work = named_workload(name, 256, vocab, seed=0)
        return work.prompts, work.output_lens
    return _kit_requests(name, vocab)


def make_model_dir(shape: str, root: str) -> tuple[str, int]:
    """The kit's own shapes as the kit writes them; the engine's built-in shapes the kit lacks
    (the MoE ones) from the engine's own config, so both engines load the same config.json."""
    if shape in _KIT_SHAPES:
        return _kit_make_model_dir(shape, root)
    name = builtin_shape(shape)
    if name is None:
        known = sorted(_KIT_SHAPES | set(BUILTIN_SHAPES))
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(known)}")
    return write_builtin_model(name, root), BUILTIN_SHAPES[name]["vocab_size"]


def _register_builtin_shape(shape: str) -> None:
    # vllm_peer.main reads SHAPES[shape] for its engine arguments; a built-in shape has none.
    if shape not in _KIT_SHAPES and builtin_shape(shape) is not None:
        vllm_peer.SHAPES[shape] = {}


vllm_peer.requests = requests
vllm_peer.make_model_dir = make_model_dir

if __name__ == "__main__":
    if len(sys.argv) > 1:
        _register_builtin_shape(sys.argv[1])
    vllm_peer.main()
