"""PyTorch side: the config, the models, the attention forms, position encodings, checkpoints."""
from .attention import EAGER, ATTENTION_FORMS, AttentionCore, AttentionSettings, BiasedAttention, attention_heads, layer_bias
from .blocked import DEFAULT_BLOCK
from .checkpoint import file_sha256, load_checkpoint, non_finite_tensor, read_checkpoint, save_checkpoint
from .config import ARCHS, ModelConfig
from .model import Block, DecoderLM, build_model

__all__ = [
    "ARCHS", "ATTENTION_FORMS", "DEFAULT_BLOCK", "EAGER", "AttentionCore", "AttentionSettings", "BiasedAttention",
    "Block", "DecoderLM", "ModelConfig", "attention_heads", "build_model", "layer_bias", "load_checkpoint",
    "file_sha256", "non_finite_tensor", "read_checkpoint", "save_checkpoint",
]
