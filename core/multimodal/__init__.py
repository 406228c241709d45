"""Image inputs: what a request carries (``inputs``), loading images from URLs (``media``),
preprocessing them with the model's processor (``processing``), the encoder-cache accounting the
scheduler does (``encoder_cache``) and the device side the model runner uses (``runner``)."""

from engine.multimodal.inputs import ImageInputSpec, MultiModalFeature, hash_pixel_values

__all__ = ["ImageInputSpec", "MultiModalFeature", "hash_pixel_values"]
