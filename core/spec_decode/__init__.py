"""Speculative decoding: proposers, draft verification and acceptance counters.

``SpeculativeConfig`` (``engine.config``) chooses a method; ``ProposerRegistry`` maps it to a
proposer class (``ngram``: prompt lookup on the host; ``draft_model``: a small model sharing
the tokenizer; ``eagle``/``eagle3``: an EAGLE head fed with the target's hidden states), each
answering "can I serve this configuration" with reasons. The scheduler reserves the slots
(``engine.scheduler``), the model runner scores the drafts in one forward and verifies them
(``engine.spec_decode.rejection``), and the scheduler keeps the accepted prefix and the
counters (``engine.spec_decode.stats``). See docs/speculative-decoding.md.

Importing this package imports no torch.
"""

from engine.spec_decode.registry import ProposerRegistry, check_request
from engine.spec_decode.stats import SpecDecodingStats

__all__ = ["ProposerRegistry", "SpecDecodingStats", "check_request"]
