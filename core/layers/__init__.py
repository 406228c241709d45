"""Model building blocks: linear (plain and fused), rotary embedding, RMSNorm, gated
activations, embeddings/LM head, and the paged ``Attention`` layer. Compute-heavy ops go through
the platform's bound ``Kernels``; attention through the selected backend."""

from engine.layers.activation import GatedActivation
from engine.layers.attention import Attention
from engine.layers.embedding import LMHead, VocabEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear, MergedLinear, QKVLinear
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.layers.weight_utils import ModelLoadError, load_named_weights

__all__ = [
    "Attention",
    "GatedActivation",
    "LMHead",
    "Linear",
    "MergedLinear",
    "ModelLoadError",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "VocabEmbedding",
    "load_named_weights",
    "rope_parameters",
]
