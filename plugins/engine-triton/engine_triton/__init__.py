"""engine-llm-triton: a Triton attention backend and Triton kernel overrides for the engine.

It provides no platform of its own: its kernels serve the cuda and rocm platforms, and its
attention backend runs wherever Triton does (on the CPU only under ``TRITON_INTERPRET=1``).
"""

__version__ = "0.1.0"
