"""Single-device MoE transformer modules (no ranks here; parallelism is applied to a built model)."""

from longctx_moe.model.config import ModelConfig
from longctx_moe.model.flops import model_flops
from longctx_moe.model.transformer import ForwardOutput, Transformer, build_model

__all__ = ["ForwardOutput", "ModelConfig", "Transformer", "build_model", "model_flops"]
