"""A plugin that forgot @hookimpl on its hook."""

ENGINE_PLUGIN_API = "1"


def engine_platform():
    return None
