"""Named kernels with torch reference implementations; plugins override them per platform."""

from engine.kernels.registry import KERNEL_NAMES, KernelError, KernelImpl, KernelRegistry, Kernels

__all__ = ["KERNEL_NAMES", "KernelError", "KernelImpl", "KernelRegistry", "Kernels"]
