"""PyTorch side: the config, the models, the attention forms, position encodings, checkpoints."""
from .attention import EAGER, ATTENTION_FORMS, AttentionCore, AttentionSettings, BiasedAttention, attention_heads, layer_bias
from .plans import DEFAULT_BLOCK, BlockPlan, block_plan
from .checkpoint import (checkpoint_card, checkpoint_config, file_sha256, load_checkpoint, model_for, non_finite_tensor, read_checkpoint,
                         save_checkpoint)
from .config import ARCHS, ModelConfig
from .model import Block, DecoderLM, build_model

__all__ = [
    "ARCHS", "ATTENTION_FORMS", "BlockPlan", "DEFAULT_BLOCK", "EAGER", "AttentionCore", "AttentionSettings", "BiasedAttention",
    "Block", "DecoderLM", "ModelConfig", "attention_heads", "block_plan", "build_model", "layer_bias", "load_checkpoint",
    "checkpoint_card", "checkpoint_config", "file_sha256", "model_for", "non_finite_tensor", "read_checkpoint", "save_checkpoint",
]
