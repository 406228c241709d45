"""One of two vendor plugins claiming the same device with the same priority."""

from engine.hookspecs import hookimpl
from engine.platforms.interface import Platform

ENGINE_PLUGIN_API = "1"


class DupVendorAPlatform(Platform):
    name = "dupvendora"
    device_type = "cpu"
    priority = 200


@hookimpl
def engine_platform():
    return DupVendorAPlatform
