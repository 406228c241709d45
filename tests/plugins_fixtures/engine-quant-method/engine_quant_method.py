"""A vendor plugin bringing a quantization method (``vendor-awq``: checkpoints whose
quantization_config says ``quant_method: vendor-awq``, laid out as AWQ's GEMM format) and its
own ``wna16_linear`` kernel for the cpu platform (the reference's arithmetic, counting calls so
a test can tell it ran)."""

from engine.hookspecs import hookimpl

ENGINE_PLUGIN_API = "1"

CALLS = {"prepack": 0, "linear": 0}


def _method_class():
    from engine.quantization.awq import AWQConfig

    class VendorAWQConfig(AWQConfig):
        name = "vendor-awq"
        checkpoint_formats = ("vendor-awq",)
        description = "a vendor's AWQ-layout INT4 checkpoints"

    return VendorAWQConfig


class VendorW4:
    def prepack(self, *args, **kwargs):
        from engine.kernels.quantized import wna16_linear

        CALLS["prepack"] += 1
        return wna16_linear.prepack(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        from engine.kernels.quantized import wna16_linear

        CALLS["linear"] += 1
        return wna16_linear(*args, **kwargs)


@hookimpl
def engine_quantization_methods(registry):
    registry.register("vendor-awq", _method_class())


@hookimpl
def engine_kernels(registry):
    registry.register("wna16_linear", VendorW4(), platforms=("cpu",), priority=50)
