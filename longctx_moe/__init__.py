"""longctx_moe: MoE language-model training on long, variable-length packed data."""

__version__ = "0.1.0"
