"""The real providers of `asymflash bench`: asymflash's backends and the peers it races.

Each provider is built lazily: nothing here imports a peer library at module import time, so
a missing or broken peer shows up as an "n/a (reason)" cell instead of killing the harness.
Peers that take BHSD (SDPA, FlexAttention) get transposed *views* made in make_fwd, outside
the timed region; their output is transposed back (a view, free) so every provider returns
BSHD like flash-attn.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

from . import model_calls
from .core import Provider, probe

# Peers in the order their columns appear (asymflash's backends come after them).
PEER_ORDER = ("FA2", "cuDNN", "SDPA-efficient", "Flex", "FA4", "FA3", "flash-attn2",
              "SDPA-math")


def _first(x):
    """Some libraries return (out, lse) or (out, lse, ...): keep the output."""
    return x[0] if isinstance(x, (tuple, list)) else x


def _import_reason(module: str) -> str | None:
    return probe(lambda: importlib.import_module(module))


def _needs_cuda(check=None):
    def available():
        if not torch.cuda.is_available():
            return "needs CUDA"
        return check() if check else None

    return available


def _bhsd(*tensors):
    return tuple(t.transpose(1, 2) for t in tensors)


# --------------------------------------------------------------------------------------------
# asymflash


def asymflash_providers(device: str) -> list:
    """One provider per asymflash backend that may apply on `device`."""
    names = []

    def list_backends():
        names.extend(importlib.import_module("asymflash.runtime.dispatch").backend_names(device))

    reason = probe(list_backends)
    if reason:  # still one column, so the table says why asymflash is missing
        return [Provider("asymflash", make_fwd=_never, available=lambda: reason,
                         is_asymflash=True)]
    providers = [_asymflash_backend(name) for name in names]
    if providers:  # the first backend is the one flash_attn_func picks where it can
        providers[0].headline = True
    if "sm90" in names:  # what deterministic=True costs, next to the default backward
        providers.append(_asymflash_backend("sm90", deterministic=True))
        # FA4's forward tricks, each on by its switch (asked for by name only)
        providers.append(_sm90_switched("exp2emu8", "ASYMFLASH_SM90_EXP2_EMU", "8",
                                        "one exponential in 8 on the FMA pipe"))
        providers.append(_sm90_switched("rescale8", "ASYMFLASH_SM90_RESCALE", "8",
                                        "O rescaled only when a row max grows by > 2^8"))
        # the conditional rescale is the default at d=256: its off column there
        providers.append(_sm90_switched("rescale0", "ASYMFLASH_SM90_RESCALE", "0",
                                        "O rescaled after every key block"))
    return providers


@contextlib.contextmanager
def switch_set(name: str, value: str):
    """The environment switch `name` set to `value` inside the block, as it was after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _sm90_switched(label: str, switch: str, value: str, what: str,
                   modes: tuple = ("fwd",)) -> Provider:
    """The sm90 backend with one switch on (FA4's forward tricks, per-thread slot releases):
    the table's on/off columns."""
    base = _asymflash_backend("sm90")

    @contextlib.contextmanager
    def context():
        with base.context(), switch_set(switch, value):
            yield

    return Provider(f"asymflash-sm90-{label}", base.make_fwd, base.available, context,
                    is_asymflash=True, modes=modes, opt_in=True,
                    description=f"the sm90 {' and '.join(modes)} with {switch}={value}: {what}")


def _never(q, k, v, causal):
    raise NotImplementedError("provider unavailable")


def _asymflash_backend(backend: str, deterministic: bool = False) -> Provider:
    def available():
        return _import_reason("asymflash") or _backend_reason(backend)

    def context():
        from ..runtime.dispatch import use_backend

        return use_backend(backend)

    def make_fwd(q, k, v, causal):
        from asymflash import flash_attn_func  # the public entry point, as users call it

        return lambda: flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)

    if deterministic:
        return Provider(f"asymflash-{backend}-det", make_fwd, available, context,
                        is_asymflash=True, modes=("bwd", "fwdbwd"),
                        description=f"the {backend} backend with deterministic=True")
    return Provider(f"asymflash-{backend}", make_fwd, available, context, is_asymflash=True,
                    description=f"asymflash.flash_attn_func forced to the {backend} backend",
                    make_model=model_calls.flash_api("asymflash"))


def _backend_reason(backend: str) -> str | None:
    return probe(lambda: importlib.import_module("asymflash.runtime.dispatch").get_backend(backend))


# --------------------------------------------------------------------------------------------
# torch SDPA, one provider per forced backend


def _sdpa_mask_kwargs(sq: int, sk: int, causal: bool) -> dict:
    if not causal:
        return {}
    if sq == sk:
        return {"is_causal": True}
    # is_causal aligns top-left; flash-attn (and asymflash) align bottom-right.
    from torch.nn.attention.bias import causal_lower_right

    return {"attn_mask": causal_lower_right(sq, sk)}


def sdpa_provider(label: str, backend: str, description: str, cuda: bool = True) -> Provider:
    def check():
        from torch.nn.attention import SDPBackend

        return None if hasattr(SDPBackend, backend) else f"torch has no SDPBackend.{backend}"

    def context():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, backend))

    def make_fwd(q, k, v, causal):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        qt, kt, vt = _bhsd(q, k, v)
        kwargs = _sdpa_mask_kwargs(q.shape[1], k.shape[1], causal)
        if k.shape[2] != q.shape[2]:
            kwargs["enable_gqa"] = True
        return lambda: sdpa(qt, kt, vt, **kwargs).transpose(1, 2)

    available = _needs_cuda(check) if cuda else check
    return Provider(label, make_fwd, available, context, description=description,
                    make_model=model_calls.sdpa(make_fwd))


# --------------------------------------------------------------------------------------------
# FlexAttention


@functools.cache
def _compiled_flex():
    """The one compiled flex_attention, reused by every cell.

    Every new shape recompiles (dynamic=False: static shapes give the fast kernels); the
    default limit of 8 recompiles would make dynamo quietly run the unfused eager path for
    later shapes, which would be measured as "Flex" while being something else.
    """
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 10_000)
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 100_000)
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True  # if we still hit it: an error cell
    # The backward is timed by replaying it on one graph (retain_graph=True), which compiled
    # backwards refuse when they donate (reuse) their saved buffers: a memory saving only.
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=32)
def _causal_block_mask(sq: int, sk: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    shift = sk - sq  # bottom-right alignment, as flash-attn

    def causal(b, h, q_idx, kv_idx):
        return q_idx + shift >= kv_idx

    return create_block_mask(causal, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=device)


def flex_provider(seqlens=None) -> Provider:
    """seqlens: the query lengths Flex runs at (None = all). Each new shape costs a fresh
    torch.compile (seconds to tens of seconds), which a full grid cannot afford everywhere;
    the cells left out are listed n/a with this reason, never dropped."""

    def make_fwd(q, k, v, causal):
        if seqlens is not None and q.shape[1] not in seqlens:
            raise NotImplementedError(
                f"not run at seqlen {q.shape[1]} (each shape recompiles; --flex-seqlens all)")
        flex = _compiled_flex()
        qt, kt, vt = _bhsd(q, k, v)
        kwargs = {}
        if causal:
            kwargs["block_mask"] = _causal_block_mask(q.shape[1], k.shape[1], str(q.device))
        if k.shape[2] != q.shape[2]:
            kwargs["enable_gqa"] = True
        return lambda: flex(qt, kt, vt, **kwargs).transpose(1, 2)

    def check():
        return _import_reason("torch.nn.attention.flex_attention")

    return Provider("Flex", make_fwd, _needs_cuda(check),
                    description="torch.compile(flex_attention), block mask for causal",
                    make_model=model_calls.flex(_compiled_flex))


# --------------------------------------------------------------------------------------------
# flash-attn packages (BSHD already)


def _flash_attn_provider(label: str, module: str, description: str,
                         make_model=None) -> Provider:
    def make_fwd(q, k, v, causal):
        func = importlib.import_module(module).flash_attn_func
        return lambda: _first(func(q, k, v, causal=causal))

    def check():
        # getattr too: flash-attn-4 installs flash_attn/ as a namespace package holding only
        # cute/, so `import flash_attn` alone does not mean flash-attn 2 is there.
        return probe(lambda: importlib.import_module(module).flash_attn_func)

    return Provider(label, make_fwd, _needs_cuda(check), description=description,
                    make_model=make_model)


def fa4_provider() -> Provider:
    # flash_attn.cute.flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...)
    # returns (out, lse); lse is None unless return_lse=True.
    return _flash_attn_provider("FA4", "flash_attn.cute",
                                "flash-attn-4 (flash_attn.cute.flash_attn_func)",
                                model_calls.fa4)


def fa3_provider() -> Provider:
    return _flash_attn_provider("FA3", "flash_attn_interface",
                                "flash-attn 3 (flash_attn_interface.flash_attn_func)",
                                model_calls.flash_api("flash_attn_interface"))


def flash_attn2_provider() -> Provider:
    # Labelled apart from "FA2", which by the benchmark's convention is torch SDPA's flash.
    return _flash_attn_provider("flash-attn2", "flash_attn",
                                "flash-attn 2 package (flash_attn.flash_attn_func)",
                                model_calls.flash_api("flash_attn", paged_arg="block_table"))


# --------------------------------------------------------------------------------------------
# The default line-ups


def gpu_providers(device: str = "cuda", flex_seqlens=None) -> list:
    peers = [
        sdpa_provider("FA2", "FLASH_ATTENTION", "torch SDPA, FLASH_ATTENTION backend (FA2)"),
        sdpa_provider("cuDNN", "CUDNN_ATTENTION", "torch SDPA, CUDNN_ATTENTION backend"),
        sdpa_provider("SDPA-efficient", "EFFICIENT_ATTENTION",
                      "torch SDPA, EFFICIENT_ATTENTION backend (xformers-style)"),
        flex_provider(flex_seqlens),
        fa4_provider(),
        fa3_provider(),
        flash_attn2_provider(),
    ]
    return peers + asymflash_providers(device)


def cpu_providers() -> list:
    math = sdpa_provider("SDPA-math", "MATH", "torch SDPA, MATH backend on CPU", cuda=False)
    return [math] + asymflash_providers("cpu")


def select(providers: list, names: list | None) -> list:
    """Keep the providers named (case-insensitive); "asymflash" names all its backends.
    Opt-in providers (a backend's variants) run only when named.

    Raises ValueError for a name that matches nothing, listing the known ones.
    """
    if not names:
        return [p for p in providers if not p.opt_in]
    keep, unknown = [], []
    for name in names:
        low = name.lower()
        hits = [p for p in providers if p.name.lower() == low
                or (low == "asymflash" and p.is_asymflash and not p.opt_in)]
        if not hits:
            unknown.append(name)
        keep.extend(p for p in hits if p not in keep)
    if unknown:
        known = ", ".join(p.name for p in providers)
        raise ValueError(f"unknown provider(s) {', '.join(unknown)}; known here: {known}")
    return [p for p in providers if p in keep]  # the usual column order, not the CLI's
