"""Multi-LoRA serving: adapters in the PEFT format served side by side on one base model.

* ``request``: ``LoRARequest`` (vLLM's ``vllm.lora.request.LoRARequest``);
* ``config``: ``LoRAConfig`` (``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``);
* ``peft``: reading and validating PEFT adapter directories;
* ``layers``: ``LoRALinearMethod``, the wrapper that adds ``x @ A @ B`` to a linear layer's
  output slices whatever ``LinearMethod`` computes the base output;
* ``mapping``: the per-token adapter slots of a step, in fixed device buffers;
* ``model_manager``: the device side (wrapping, slots, host cache, per-step mapping);
* ``registry``: the engine side (adapter ids, requests in flight, deferred removal);
* ``scheduling``: the scheduler's adapter limit per step (device-free).

Importing this package imports neither torch nor the model code.
"""

from engine.lora.config import LoRAConfig
from engine.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
