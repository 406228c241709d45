"""Model building blocks: the linear-layer family (parallel styles x quantization methods),
rotary embedding, RMSNorm, gated
activations, embeddings/LM head, and the paged ``Attention`` layer. Compute-heavy ops go through
the platform's bound ``Kernels``; attention through the selected backend."""

from engine.layers.activation import GatedActivation
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardLayout,
    UnquantizedLinearMethod,
)
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.layers.weight_utils import ModelLoadError, load_named_weights

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "GatedActivation",
    "LinearBase",
    "LinearMethod",
    "MergedColumnParallelLinear",
    "ModelLoadError",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "ShardLayout",
    "UnquantizedLinearMethod",
    "VocabParallelEmbedding",
    "load_named_weights",
    "rope_parameters",
]
