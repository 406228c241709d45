"""Model loading: resolve a local directory / Hugging Face Hub id (cached, else downloaded:
``hub``) / GGUF file, read the config, build the model and stream its weights in (see
``model_loader``)."""

from engine.layers.weight_utils import ModelLoadError
from engine.loader.model_loader import (
    load_hf_config,
    load_model,
    locate_model,
    resolve_dtype,
    resolve_model_path,
)

__all__ = [
    "ModelLoadError",
    "load_hf_config",
    "load_model",
    "locate_model",
    "resolve_dtype",
    "resolve_model_path",
]
