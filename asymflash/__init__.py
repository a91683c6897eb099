"""asymflash: exact attention for PyTorch, in Triton and Gluon."""

from .api.backward import attention_backward
from .api.combine import flash_attn_combine
from .api.dense import flash_attn_func, flash_attn_varlen_func
from .api.flex import flex_attention
from .api.kvcache import flash_attn_with_kvcache
from .api.packed import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .reference import attention_ref
from .runtime.startup import prefetch_triton_key

prefetch_triton_key()

__version__ = "0.1.0"
__all__ = [
    "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "attention_ref",
    "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_combine", "attention_backward",
    "flex_attention", "__version__",
]
