"""asymflash: exact attention for PyTorch, in Triton and Gluon."""

from .interface import flash_attn_func, flash_attn_varlen_func
from .reference import attention_ref

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "attention_ref", "__version__"]
