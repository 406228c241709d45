"""Version numbers of the engine and of the plugin contract."""

__version__ = "0.1.0"

# The distribution on the package index (`pip install engine-llm`); the import name and the
# command are `engine`. The plugins are published as engine-llm-cpu, -cuda, -rocm, -tpu, -triton.
DISTRIBUTION_NAME = "engine-llm"

# The plugin contract's version. A plugin declares the major version it was built against
# (``ENGINE_PLUGIN_API = "1"`` or ``"1.x"`` in its module); a different major is refused.
PLUGIN_API_VERSION = "1.0"
PLUGIN_API_MAJOR = int(PLUGIN_API_VERSION.split(".")[0])
