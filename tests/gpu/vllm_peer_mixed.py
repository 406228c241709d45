"""Run the vLLM comparison kit (shared/peers/vllm, copied to .peers/ as its README says) on the
engine's mixed workload, so both engines see exactly the same 512 requests.

    PEER_KIT=.peers PYTHONPATH=$HOME/vllm-peer/site python3 tests/gpu/vllm_peer_mixed.py \
        llama3-8b-fp8 mixed

The kit's ``vllm_peer.main`` runs unchanged; only its workload lookup learns ``mixed``
(``engine.benchmarks.workload.mixed_workload(512, vocab, seed=0)``, which imports nothing
heavy). Nothing of vLLM enters the engine: this is a measuring instrument.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.environ.get("PEER_KIT", ".peers")))

import vllm_peer  # noqa: E402

from engine.benchmarks.workload import mixed_workload  # noqa: E402

_kit_requests = vllm_peer.requests


def requests(name: str, vocab: int):
    if name == "mixed":
        work = mixed_workload(512, vocab, seed=0)
        return work.prompts, work.output_lens
    return _kit_requests(name, vocab)


vllm_peer.requests = requests

if __name__ == "__main__":
    vllm_peer.main()
