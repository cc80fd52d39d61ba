"""Adapter exposing the dense float64 reference through the backend interface."""

from .reference import reference_backward as backward  # noqa: F401
from .reference import reference_forward as forward  # noqa: F401

TAKES_OFFSET = True  # see cp_attention.kernels.attn_forward(offset=)
