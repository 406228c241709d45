"""A plugin that supplies a communicator for the cpu platform, which engine-cpu already
supplies (two answers for one platform are an error naming both); with
``ENGINE_TEST_BAD_COMMUNICATOR=1`` it returns something that is not a Communicator."""

import os

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1.1"


@hookimpl
def engine_communicator(platform, group):
    if platform.name != "cpu":
        return None
    if os.environ.get("ENGINE_TEST_BAD_COMMUNICATOR") == "1":
        return "gloo"
    from engine.distributed import TorchDistributedCommunicator

    return TorchDistributedCommunicator(group, backend="gloo")
