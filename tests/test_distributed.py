"""The communicator contract: torch.distributed over real gloo process groups on the CPU, the
engine_communicator hook, and the single-process identities."""

from __future__ import annotations

import pytest
from plugin_helpers import FIXTURES, install_fake_dist

from engine.errors import PluginLoadError
from engine.plugins import PluginManager


@pytest.mark.timeout(180)
def test_cpu_communicator_on_three_gloo_ranks_and_a_subgroup(plugin_env) -> None:
    """Every operation on all three ranks, then on the subgroup of ranks 1 and 2 (where group
    rank 0 is global rank 1: broadcast sources and send/recv peers are group ranks)."""
    from engine.testing.distributed import run_communicator_check

    run_communicator_check("cpu", world_size=3, seed=7)


def test_each_builtin_platform_supplies_its_communicator_through_the_hook(plugin_env) -> None:
    from engine.distributed import TorchDistributedCommunicator
    from engine_rocm.communicator import RcclCommunicator
    from engine_tpu.communicator import XlaCommunicator

    pm = PluginManager.from_env({})
    by_name = {e.name: e.cls for e in pm.platforms()}
    expected = {
        "cpu": ("engine-llm-cpu", TorchDistributedCommunicator, "gloo"),
        "cuda": ("engine-llm-cuda", TorchDistributedCommunicator, "nccl"),
        "rocm": ("engine-llm-rocm", RcclCommunicator, "nccl"),
        "tpu": ("engine-llm-tpu", XlaCommunicator, None),
    }
    for name, (provider, cls, backend) in expected.items():
        entry = pm.communicator_entry(by_name[name], group=None)
        assert entry.provider == provider and type(entry.communicator) is cls, (name, entry)
        assert getattr(entry.communicator, "backend", None) == backend


def test_platform_default_serves_when_no_plugin_answers(plugin_env, monkeypatch) -> None:
    from engine.distributed import TorchDistributedCommunicator

    install_fake_dist(FIXTURES / "engine-dup-vendor-a", plugin_env)
    pm = PluginManager.from_env({"ENGINE_PLUGINS": "cpu,dupvendora"})
    platform = next(e.cls for e in pm.platforms() if e.name == "dupvendora")
    entry = pm.communicator_entry(platform)
    assert entry.plugin is None and entry.provider == "dupvendora platform default"
    assert isinstance(entry.communicator, TorchDistributedCommunicator)
    assert entry.communicator.backend == "gloo"


def test_two_plugins_answering_for_one_platform_is_an_error_naming_both(plugin_env) -> None:
    install_fake_dist(FIXTURES / "engine-extra-communicator", plugin_env)
    pm = PluginManager.from_env({"ENGINE_PLUGINS": "cpu,extracomm"})
    cpu = pm.resolve_platform("cpu")
    with pytest.raises(PluginLoadError) as err:
        pm.communicator(cpu)
    msg = str(err.value)
    assert "Two plugins supply a communicator for platform 'cpu'" in msg
    assert "engine-llm-cpu" in msg and "engine-extra-communicator" in msg
    assert "ENGINE_PLUGINS" in msg


def test_a_hook_returning_something_else_is_refused(plugin_env, monkeypatch) -> None:
    install_fake_dist(FIXTURES / "engine-extra-communicator", plugin_env)
    monkeypatch.setenv("ENGINE_TEST_BAD_COMMUNICATOR", "1")
    pm = PluginManager.from_env({"ENGINE_PLUGINS": "extracomm"})
    cpu = next(e.cls for e in PluginManager.from_env({"ENGINE_PLUGINS": "cpu"}).platforms())
    with pytest.raises(PluginLoadError, match="must return an instance of engine.distributed"):
        pm.communicator(cpu)


def test_worker_process_groups_take_the_hooks_communicator(plugin_env) -> None:
    """A worker's tensor/pipeline/world communicators are what ``engine_communicator``
    answers (here a plugin's, not the platform's default)."""
    from engine.executor.process_groups import communicator_for

    install_fake_dist(FIXTURES / "engine-extra-communicator", plugin_env)
    pm = PluginManager.from_env({"ENGINE_PLUGINS": "extracomm"})
    cpu = next(e.cls for e in PluginManager.from_env({"ENGINE_PLUGINS": "cpu"}).platforms())
    entry = pm.communicator_entry(cpu)
    assert entry.provider == "engine-extra-communicator"
    calls = []
    original = pm.communicator_entry

    def spy(platform, group=None):
        calls.append((platform, group))
        return original(platform, group)

    pm.communicator_entry = spy  # type: ignore[method-assign]
    comm = communicator_for(pm, cpu, None)
    assert calls == [(cpu, None)] and type(comm) is type(entry.communicator)


def test_single_process_communicator_is_identity() -> None:
    import torch

    from engine.distributed import TorchDistributedCommunicator

    comm = TorchDistributedCommunicator(backend="gloo")
    t = torch.arange(4.0)
    assert comm.world_size == 1 and comm.rank == 0
    outs = (comm.all_reduce(t), comm.all_reduce(t, op="max"), comm.all_gather(t),
            comm.reduce_scatter(t), comm.broadcast(t), comm.all_to_all(t))  # fmt: skip
    for out in outs:
        assert torch.equal(out, torch.arange(4.0))
    with pytest.raises(ValueError, match="allowed: sum, max, min"):
        comm.all_reduce(t, op="mean")


def test_a_communicator_must_implement_the_contract() -> None:
    from engine.distributed import Communicator

    class Partial(Communicator):
        def all_reduce(self, tensor, op="sum"):
            return tensor

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_a_group_of_one_is_an_identity_and_has_no_peer() -> None:
    import torch

    from engine.distributed import SingleProcessCommunicator
    from engine.parallel import SINGLE_PROCESS

    comm = SINGLE_PROCESS.tp
    assert isinstance(comm, SingleProcessCommunicator) and (comm.world_size, comm.rank) == (1, 0)
    t = torch.arange(6.0).view(2, 3)
    for out in (comm.all_reduce(t, op="min"), comm.all_gather(t, 1), comm.reduce_scatter(t, 1),
                comm.broadcast(t), comm.all_to_all(t)):  # fmt: skip
        assert out is t
    with pytest.raises(RuntimeError, match="no other rank"):
        comm.send(t, dst=1)
    with pytest.raises(ValueError, match="broadcast from rank 1 in a group of one rank"):
        comm.broadcast(t, src=1)
