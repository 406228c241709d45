"""engine-llm-rocm: the AMD ROCm platform for the engine."""

__version__ = "0.1.0"
