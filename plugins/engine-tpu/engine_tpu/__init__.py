"""engine-llm-tpu: the Google TPU platform for the engine, through torch_xla (PJRT)."""

__version__ = "0.1.0"
