"""A plugin that raises while it is imported."""

ENGINE_PLUGIN_API = "1"

raise RuntimeError("the vendor library libfoo.so could not be loaded")
