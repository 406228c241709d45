"""Run the vLLM comparison kit (shared/peers/vllm, copied to .peers/ as its README says) on the
engine's mixed workload (512 requests) or shared-prefix workload (256), so both engines see
exactly the same requests.

    PEER_KIT=.peers PYTHONPATH=$HOME/vllm-peer/site python3 tests/gpu/vllm_peer_mixed.py \
        llama3-8b-fp8 mixed

The kit's ``vllm_peer.main`` runs unchanged; only its workload lookup learns ``mixed`` and
``shared-prefix`` (``engine.benchmarks.workload.named_workload(name, n, vocab, seed=0)``, which
imports nothing heavy). Nothing of vLLM enters the engine: this is a measuring instrument.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.environ.get("PEER_KIT", ".peers")))

import vllm_peer  # noqa: E402

from engine.benchmarks.workload import named_workload  # noqa: E402

_kit_requests = vllm_peer.requests


def requests(name: str, vocab: int):
    if name == "mixed":  # the 512 requests
        work = named_workload(name, 512, vocab, seed=0)
        return work.prompts, work.output_lens
    if name == "shared-prefix":  # 256 requests behind one 2,000-token system prompt
        work = named_workload(name, 256, vocab, seed=0)
        return work.prompts, work.output_lens
    return _kit_requests(name, vocab)


vllm_peer.requests = requests

if __name__ == "__main__":
    vllm_peer.main()
