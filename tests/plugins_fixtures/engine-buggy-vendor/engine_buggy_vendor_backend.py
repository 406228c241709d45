"""engine-buggy-vendor's attention backend: the torch reference, with the ``prefix`` bug."""

import os

from engine.attention_backends.torch_ref import TorchReferenceBackend


class BuggyBackend(TorchReferenceBackend):
    name = "buggy"
    supported_kv_cache_dtypes = ()

    def _prefill(self, query, kv_cache, md, i, seq_len):
        if "prefix" in os.environ.get("ENGINE_TEST_BUG", "").split(","):
            seq_len = query.shape[0]  # forgets the context before this chunk (the bug)
        return super()._prefill(query, kv_cache, md, i, seq_len)
