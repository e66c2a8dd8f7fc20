"""Building blocks shared by model families, ready to be split over tensor-parallel ranks."""

from __future__ import annotations

from sgl.layers.activation import SUPPORTED_GATED_ACTIVATIONS, GatedActivation
from sgl.layers.attention import Attention
from sgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from sgl.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sgl.layers.longrope import LongRopeRotaryEmbedding
from sgl.layers.moe import SUPPORTED_MOE_SHARDS, FusedMoE, select_experts
from sgl.layers.norm import RMSNorm
from sgl.layers.rope import get_rope
from sgl.layers.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_inv_freq, rope_parameters
from sgl.layers.tp import TPGroup, get_tp_group, set_tp_group

__all__ = [
    "SUPPORTED_GATED_ACTIVATIONS",
    "SUPPORTED_MOE_SHARDS",
    "SUPPORTED_ROPE_TYPES",
    "Attention",
    "ColumnParallelLinear",
    "FusedMoE",
    "GatedActivation",
    "LongRopeRotaryEmbedding",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "TPGroup",
    "VocabParallelEmbedding",
    "get_rope",
    "get_tp_group",
    "rope_inv_freq",
    "rope_parameters",
    "select_experts",
    "set_tp_group",
]
