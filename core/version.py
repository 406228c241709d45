"""Version numbers of the engine and of the plugin contract."""

__version__ = "0.1.0"

# The distribution on the package index (`pip install engine-llm`); the import name and the
# command are `engine`. The plugins are published as engine-llm-cpu, -cuda, -rocm, -tpu, -triton.
DISTRIBUTION_NAME = "engine-llm"
# The distributions' names before they were renamed engine-llm*, old -> new. An old one left
# installed next to its successor declares the same entry points, so every plugin lookup fails;
# the plugin manager's error names the old ones to uninstall.
FORMER_DISTRIBUTION_NAMES = {
    "engine": DISTRIBUTION_NAME,
    **{f"engine-{p}": f"{DISTRIBUTION_NAME}-{p}" for p in ("cpu", "cuda", "rocm", "tpu", "triton")},
}

# The plugin contract's version. A plugin declares the major version it was built against
# (``ENGINE_PLUGIN_API = "1"`` or ``"1.x"`` in its module); a different major is refused.
#
# History (minor versions only add; a plugin built for 1.0 runs unchanged on 1.1):
#   1.0  engine_platform, engine_attention_backends, engine_kernels, engine_models,
#        engine_add_cli_args.
#   1.1  engine_communicator(platform, group) and the Communicator contract of
#        engine.distributed (all_reduce ops, group ranks, all_to_all).
PLUGIN_API_VERSION = "1.1"
PLUGIN_API_MAJOR = int(PLUGIN_API_VERSION.split(".")[0])
PLUGIN_API_MINOR = int(PLUGIN_API_VERSION.split(".")[1])
