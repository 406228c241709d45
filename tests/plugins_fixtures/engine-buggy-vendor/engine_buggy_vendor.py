"""A vendor plugin (simulated device on the host CPU) with bugs switched on by
``ENGINE_TEST_BUG`` (comma-separated), for the conformance kit's own tests:

* ``heavy`` — detection imports torch;
* ``gather`` — the communicator's all_gather concatenates in reverse rank order;
* ``prefix`` — the attention backend ignores cached context in prefill chunks (attends only
  over the tokens of this step, the classic chunked-prefill / prefix-caching bug);
* ``config`` — check_config accepts every dtype.

Without ``ENGINE_TEST_BUG`` it conforms.
"""

import os

from engine.hookspecs import hookimpl
from engine.platforms.interface import Platform

ENGINE_PLUGIN_API = "1.1"


def _bugs() -> set[str]:
    return set(os.environ.get("ENGINE_TEST_BUG", "").split(","))


class BuggyVendorPlatform(Platform):
    name = "buggyvendor"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = ("float32", "bfloat16")
    priority = 200

    @classmethod
    def unavailable_reasons(cls):
        if "heavy" in _bugs():
            import torch  # noqa: F401  (the bug)
        return [] if os.environ.get("BUGGY_VENDOR_DEVICE") == "1" else ["no buggy device"]

    @classmethod
    def total_memory(cls, index=0):
        import psutil

        return int(psutil.virtual_memory().total)

    @classmethod
    def free_memory(cls, index=0):
        import psutil

        return int(psutil.virtual_memory().available)

    @classmethod
    def peak_memory(cls, index=0):
        import psutil

        return int(psutil.Process().memory_info().rss)

    @classmethod
    def check_config(cls, config):
        return [] if "config" in _bugs() else super().check_config(config)

    @classmethod
    def default_attention_backends(cls, config=None):
        return ["buggy"]


def _communicator(group):
    from engine.distributed import TorchDistributedCommunicator

    class ReversedGather(TorchDistributedCommunicator):
        def all_gather(self, tensor, dim=0):
            import torch

            out = super().all_gather(tensor, dim)
            if self.world_size == 1 or "gather" not in _bugs():
                return out
            return torch.cat(list(reversed(out.chunk(self.world_size, dim=dim))), dim=dim)

    return ReversedGather(group, backend="gloo")


@hookimpl
def engine_platform():
    return BuggyVendorPlatform


@hookimpl
def engine_attention_backends():
    return {"buggy": "engine_buggy_vendor_backend:BuggyBackend"}


@hookimpl
def engine_communicator(platform, group):
    return _communicator(group) if platform.name == "buggyvendor" else None
