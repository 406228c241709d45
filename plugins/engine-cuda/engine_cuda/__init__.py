"""engine-llm-cuda: the NVIDIA CUDA platform for the engine."""

__version__ = "0.1.0"
