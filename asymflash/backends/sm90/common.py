"""What every sm90 Gluon kernel shares: the Gluon import guard and version gate, dtype maps,
TMA descriptors and shared-memory layouts (host side), the input checks, and the small device
helpers both directions use (16-bit packing, tanh, tile loads, sequence bounds)."""

from __future__ import annotations

import functools
import typing

import torch

from ...core.params import AttnParams
from ...runtime.dispatch import SM90_TESTED_TRITON, sm90_triton_allowed
from ...runtime.launch import descriptor_token

try:  # Gluon is optional: a CPU-only or older triton must still import this module.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 - the
        # kernels import Gluon's Hopper ops from here: one place to adapt to Gluon's API
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.core import _unwrap_if_constexpr

    # Gluon's API moves between releases; kernels take the moved names from here.
    # A CTA-wide (or partition-wide) barrier: `thread_barrier` up to triton 3.6, `barrier` on.
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # TMA copies: `async_load` / `async_store` from 3.9, `async_copy_*` before.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # A shared buffer viewed with another dtype/shape/layout: `_reinterpret` up to 3.8,
    # `reinterpret` from 3.9. The kernels call the older name; on 3.9 it is given the new one.
    from triton.experimental.gluon.language._core import shared_memory_descriptor as _smem

    if not hasattr(_smem, "_reinterpret"):
        _smem._reinterpret = _smem.reinterpret
    # A struct of device values passed as one argument: `gluon.aggregate` from triton 3.8,
    # `triton.language.core._aggregate` before.
    _aggregate = getattr(gluon, "aggregate", None) or triton.language.core._aggregate

    def aggregate(cls):
        """Gluon's aggregate of `cls`, its field annotations resolved first: the kernel
        modules use `from __future__ import annotations`, which leaves them strings, and the
        aggregate checks each field's value against its annotation's type. A class without
        an `__init__` gets one that takes the fields in order (constexpr fields wrapped as
        constexprs), as Gluon's own aggregate does from triton 3.8."""
        cls.__annotations__ = typing.get_type_hints(cls)
        if "__init__" not in cls.__dict__:
            cls.__init__ = _positional_init(cls.__annotations__)
        return _aggregate(cls)

    def _positional_init(fields: dict):
        # The constructor reads the fields from a constexpr: its source is the same for every
        # class, and Triton keys its kernel cache on a function's source and the constexprs
        # it reads, so a changed field list must be one of those to recompile.
        layout = gl.constexpr(tuple((name, tp is gl.constexpr, getattr(tp, "__name__", str(tp)))
                                    for name, tp in fields.items()))

        def __init__(self, *values):
            if len(values) != len(layout.value):
                raise TypeError(f"{len(layout.value)} fields, {len(values)} values")
            for field, value in zip(layout.value, values):
                setattr(self, field[0], gl.constexpr(value) if field[1] else value)
        return gluon.constexpr_function(__init__)

    GLUON_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - any import failure means: no fast path
    GLUON_ERROR = f"triton.experimental.gluon (Hopper) not importable: {exc!r}"


@functools.lru_cache(maxsize=None)
def sm90_ptxas_major() -> int:
    """Major CUDA release of the ptxas Triton assembles sm_90a with: 12 (CUDA 12.9) up to
    triton 3.8, 13 from 3.9 (which takes its Blackwell ptxas for Hopper too). Runs
    `ptxas --version` once."""
    from triton.backends.nvidia.compiler import get_ptxas

    return int(get_ptxas(90).version.split(".")[0])


@functools.lru_cache(maxsize=None)
def ptxas13_register_options(warp_specialized: bool) -> dict:
    """Compile options that keep CUDA 13's ptxas from spilling the backward's registers
    (none where Triton assembles sm_90a with CUDA 12's, whose SASS they would change).

    CUDA 13's ptxas, with the `--regAllocOptLevel=2` Triton passes it (Triton's own
    workaround of a ptxas 13 bug, left alone here), computes loop-invariant values such as
    the wgmma descriptors of a tile's K/V chunks once, in ordinary registers, and spills
    them, where CUDA 12.9's derived them inside the step loop in uniform registers: the same
    PTX spills several times more (docs/triton-versions.md has the numbers).
    warp_specialized: the bwd_ws kernel, whose partitions live under setmaxnreg budgets;
    LLVM's register-pressure scheduling (`sched4reg`, a Triton option from 3.9) hands ptxas
    PTX with fewer values live at once (d=128: 233 -> 84 local-memory instructions). The
    synchronous 8-warp bodies, at the 255-register limit, spilled more with it; there
    ptxas's `--register-usage-level` below its default of 5 (it inhibits the optimisations
    that raise register usage) spilled less (d=256: 16 -> 8)."""
    if sm90_ptxas_major() < 13:
        return {}
    if warp_specialized:
        from triton.backends.nvidia.compiler import CUDAOptions

        return {"sched4reg": True} if "sched4reg" in CUDAOptions.__dataclass_fields__ else {}
    from triton import knobs

    # after the user's TRITON_PTXAS_OPTIONS (read once), which the option would replace
    return {"ptx_options": " ".join(filter(None, (knobs.nvidia.ptxas_options,
                                                  "--register-usage-level=2")))}


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # compiled widths: tensor shapes are powers of two

GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# e4m3 tiles exist for the fp8 forward only (`fwd/host.py`, `forward_fp8`): kept out of
# GL_DTYPES, which is what `hopper_input_reason` accepts for every kernel.
TILE_DTYPES = {**GL_DTYPES, torch.float8_e4m3fn: "float8e4nv"}
SIG_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv"}


@functools.lru_cache(maxsize=None)
def _smem_layout_cached(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, TILE_DTYPES[dtype]))


def smem_layout(block, dtype):
    """The TMA/wgmma shared-memory layout of a tile; cached: building one costs ~30 us of
    host time, three per call (measured on the CI CPU), as much as a short kernel."""
    return _smem_layout_cached(tuple(block), dtype)


@functools.lru_cache(maxsize=None)
def layout_and_token(block: tuple, dtype):
    """(shared layout, launch.descriptor_token) of a default descriptor: one cache lookup on
    a (tuple, dtype) key per descriptor (hashing the layout itself costs more)."""
    layout = _smem_layout_cached(block, dtype)
    return layout, descriptor_token(dtype, block, layout)


def exp2_scales(params: AttnParams) -> tuple[float, float]:
    """(qk_scale, softcap_pre) of the Gluon kernels: exp2 takes s·qk_scale, s = q·k, or with
    softcap s = tanh(q·k·softcap_pre) (so S = c·tanh(q·k·scale/c) in log2 units, and the
    backward's chain-rule factor is 1 - tanh²)."""
    if params.softcap > 0:
        return params.softcap * LOG2E, params.softmax_scale / params.softcap
    return params.softmax_scale * LOG2E, 1.0


# Strided q, k, v (views of a fused QKV projection, transposed (batch, heads, seqlen, dim)
# tensors): read in place through descriptors with their own strides; with the switch at 0
# (and where TMA cannot address them) the kernels read contiguous copies (`tma_ready`).
def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` where the kernels' descriptors can read it as it is, else a contiguous 16-byte
    aligned copy: a copy costs a read and a write of the tensor, the portable kernels that
    strided inputs took before cost far more on Hopper."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    if tma_layout_reason(t, "") is None:  # read in place: see docs/tuning.md
        return t
    return t.clone(memory_format=torch.contiguous_format)


def row_head_strides(t: torch.Tensor) -> tuple[int, int]:
    """(row stride, head stride) of a (rows, heads, dim) tensor, in elements, as a TMA
    descriptor walks it; a dimension of size 1 takes its dense stride (torch leaves any
    value there)."""
    rows, heads, dim = t.shape
    head_stride = t.stride(1) if heads > 1 else dim
    return (t.stride(0) if rows > 1 else heads * head_stride), head_stride


def rows_dense(t: torch.Tensor) -> bool:
    """Whether the heads of a row lie side by side (head stride = dim), so the tensor reads
    as a (rows, heads·dim) matrix with its own row stride (`tma_rows`)."""
    return row_head_strides(t)[1] == t.shape[2]


def tma_layout_reason(t: torch.Tensor, name: str) -> str | None:
    """Why a (rows, heads, dim) tensor cannot be read in place by TMA, or None: the base and
    the row and head strides must be 16-byte multiples, the dim contiguous."""
    rows, heads, dim = t.shape
    size = t.element_size()
    row_stride, head_stride = row_head_strides(t)
    if dim > 1 and t.stride(2) != 1:
        return f"{name}'s head dim is not contiguous"
    if t.data_ptr() % 16:
        return f"{name} is not 16-byte aligned (TMA)"
    if row_stride <= 0 or head_stride <= 0 or (row_stride * size) % 16 or \
            (head_stride * size) % 16:
        return (f"{name}'s strides ({row_stride}, {head_stride}) are not positive 16-byte "
                "multiples (TMA)")
    return None


def tma_rows(t: torch.Tensor, block, layout=None) -> "TensorDescriptor":
    """TMA descriptor of a packed (rows, heads, dim) tensor seen as (rows, heads * dim), so
    a head is a column offset and one descriptor serves all heads and sequences. The heads of
    a row must lie side by side (`rows_dense`); the rows may be strided (a fused QKV view).

    Built without TensorDescriptor's own checks (~10 us each, several per call): what they
    verify, a 16-byte aligned non-empty tensor with 16-byte aligned rows, is already
    guaranteed by `hopper_input_reason` (heads * dim is a multiple of 64 here).
    """
    desc = object.__new__(TensorDescriptor)
    cols = t.shape[1] * t.shape[2]
    row_stride = t.stride(0) if t.shape[0] > 1 else cols
    desc.base, desc.shape, desc.strides = t, [t.shape[0], cols], [row_stride, 1]
    desc.block_shape, desc.padding = list(block), "zero"
    if layout is None:  # the layout and its launch.specialization_key token, cached
        desc.layout, desc.asym_token = layout_and_token(tuple(block), t.dtype)
    else:
        desc.layout = layout
        desc.asym_token = descriptor_token(t.dtype, tuple(block), layout)
    return desc


def tma_heads(t: torch.Tensor, rows: int, width: int) -> "TensorDescriptor":
    """TMA descriptor of a packed (rows, heads, dim) tensor as it is, with a box of `rows`
    rows of one head, `width` >= dim wide: the TMA unit fills the columns past dim with
    zeros, so head dims between the compiled widths need no zero-padded copy. Needs 16-byte
    row strides (dim a multiple of 8 at 16 bits). Any row and head strides TMA can address
    (`tma_layout_reason`): a transposed (batch, heads, seqlen, dim) tensor is read in place."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape = t, list(t.shape)
    desc.strides = [*row_head_strides(t), 1]
    desc.block_shape, desc.padding = [rows, 1, width], "zero"
    desc.layout, desc.asym_token = layout_and_token((rows, 1, width), t.dtype)
    return desc


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def hopper_input_reason(q, k, v, sink, head_dims, direction: str) -> str | None:
    """What every sm90 Gluon kernel needs of its inputs (None = all there), or why not.

    direction ("forward" / "backward") only words the message; head_dims is what the
    kernel's tiles were built for.
    """
    if GLUON_ERROR is not None:
        return GLUON_ERROR
    if not sm90_triton_allowed(triton.__version__):  # the version gate: runtime/dispatch.py
        return (f"sm90 Gluon {direction} verified on a GPU with triton {SM90_TESTED_TRITON}, "
                f"found {triton.__version__}")
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return f"sm90 {direction} needs CUDA tensors"
    if _capability(q.device) != (9, 0):
        return f"sm90 {direction} needs an sm_90 (Hopper) GPU"
    if q.dtype not in GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"sm90 {direction} supports bf16/fp16 q, k, v of one dtype, "
                f"got {q.dtype}/{k.dtype}/{v.dtype}")
    d, dv = q.shape[-1], v.shape[-1]
    if head_dims is not None and (d not in head_dims or dv != d):
        return (f"sm90 {direction} supports head_dim == head_dim_v in {head_dims}, "
                f"got {d}/{dv}")
    # Any layout with a contiguous head dim: what TMA cannot read in place is copied first
    # (tma_ready).
    if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (q, k, v)):
        return f"sm90 {direction} needs q, k, v with a contiguous head dim"
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv != 0:
        return f"nheads_q {hq} is not a multiple of nheads_kv {hkv}"
    if q.shape[0] == 0 or k.shape[0] == 0:
        return "empty q or k"
    if sink is not None and (sink.dtype != torch.float32 or sink.numel() != hq):
        return "sink must be fp32 of shape (nheads_q,)"
    return None


def kernel_head_dim(d: int, dv: int) -> int | None:
    """Head dim of the compiled kernel that computes head dims (d, dv), or None.

    64, 128 and 256 (with dv == d) run as they are. Other widths from 72 to 256 (e.g. 96,
    192/128) run zero-padded to the next of 128/256 on both sides: the padded columns add 0 to
    q·k and produce output columns that are dropped. That wastes MMA work ((128 - 96) / 128 at
    d=96; 192/128 runs the 256/256 kernel) but beats the portable kernel by far on Hopper.
    Widths up to 64 other than 64 itself stay on the portable kernel."""
    if d == dv and d in SUPPORTED_HEAD_DIMS:
        return d
    width = max(d, dv)
    if width <= 64 or width > 256:
        return None
    return 128 if width <= 128 else 256


# The q·k head dim of the builds that hold it as two pieces, a 128-wide one and this much
# more (Gluon's tensors are powers of two): DeepSeek-V3's 192 (128 + 64 rope) beside a V of
# at most 128, with q and k read as 64-column TMA boxes (`piece_cols`), so no MMA runs on the
# zero columns a 256-wide build would carry.
PIECE_HI = 64


def forward_widths(d: int, dv: int) -> tuple[int, int] | None:
    """(head dim, head dim of V) of the kernels (forward and backward) that compute (d, dv),
    or None.

    kernel_head_dim's width on both sides, except that a V of at most 128 next to a wider
    q·k runs a build with a 128-wide V (padding V to 256 would double the P·V work for
    nothing): 192/128 (q and k in pieces, `PIECE_HI`) where q·k is at most 192 wide
    (DeepSeek-V3's 192/128), 256/128 above."""
    width = kernel_head_dim(d, dv)
    if width == 256 and dv <= 128 and d != dv:
        return (128 + PIECE_HI if d <= 128 + PIECE_HI else 256), 128
    return None if width is None else (width, width)


def piece_cols(width: int) -> int:
    """Columns of a q / k box at kernel head dim `width`: the whole head, or at 192 the
    64-column piece (three per head; TMA boxes are powers of two)."""
    return PIECE_HI if width == 128 + PIECE_HI else width


def pad_head_dim(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


if GLUON_ERROR is None:

    @gluon.jit
    def to_16bit(x, dtype: gl.constexpr):
        """x.to(dtype) for a 16-bit dtype, two neighbouring elements per cvt with the first in
        the low half. `x.to(dtype)` converts element by element and packs each pair high-first,
        so every register of P (and dSᵀ) needed a PRMT half swap before it could be a wgmma A
        operand: 32 of ~450 instructions per key block at d=64 (sm_90a SASS)."""
        if dtype == gl.bfloat16:
            return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                             dtype=gl.bfloat16, is_pure=True, pack=2)
        else:
            return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                             dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def tanh(x):
        # tanh.approx has ~5e-4 relative error, i.e. 0.025 in a logit capped at 50: use the
        # exact-ish identity tanh(x) = 1 - 2 / (2^(2x·log2 e) + 1) (ex2 + rcp, MUFU twice).
        e = gl.exp2(x * (2.0 * 1.4426950408889634))
        return 1.0 - 2.0 / (e + 1.0)

    @gluon.constexpr_function
    def heads_axis(block_shape) -> bool:
        """A (rows, heads, dim) descriptor (`tma_heads`) rather than (rows, heads·dim)."""
        return len(block_shape) == 3

    @gluon.constexpr_function
    def tile_layout(layout):
        """The 2-D shared layout of a descriptor's tile (the same bytes as its 3-D box)."""
        return gl.NVMMASharedLayout(layout.swizzle_byte_width, layout.element_bitwidth, 2,
                                    layout.transposed, layout.fp4_padded)

    def _tiles_in(src_dtype, src_shape, dtype, shape) -> int:
        """How many [shape] tiles of dtype a buffer of src_shape and src_dtype holds."""
        src, tile = src_dtype.primitive_bitwidth, dtype.primitive_bitwidth
        for n in src_shape:
            src *= n
        for n in shape:
            tile *= n
        if src % tile:
            raise ValueError(f"a {shape} {dtype} tile does not divide a {src_shape} "
                             f"{src_dtype} buffer")
        return src // tile

    @builtin
    def leading_tile(buf, dtype, shape, layout, _semantic=None):
        """The first bytes of shared buffer `buf` seen as one [shape] tile of dtype in layout.

        Up to triton 3.7 and from 3.9 a reinterpretation may be smaller than its source; 3.8's
        verifier wants both the same size ("source and result must have the same logical
        storage size"). So a smaller tile is taken as tile 0 of the buffer reinterpreted as a
        stack of such tiles: the same address, the same code (a builtin, not a jit function:
        triton 3.6 passes no layout into one)."""
        dtype, layout = _unwrap_if_constexpr(dtype), _unwrap_if_constexpr(layout)
        shape = [int(_unwrap_if_constexpr(n)) for n in _unwrap_if_constexpr(shape)]
        count = _tiles_in(buf.dtype, [int(_unwrap_if_constexpr(n)) for n in buf.shape],
                          dtype, shape)
        if count == 1:
            return buf._reinterpret(dtype, shape, layout, _semantic=_semantic)
        stack = buf._reinterpret(dtype, [count, *shape], layout, _semantic=_semantic)
        return stack.index(0, _semantic=_semantic)

    @builtin
    def row_tile(buf, start, rows, dtype, layout, _semantic=None):
        """Rows [start, start + rows) of shared buffer `buf` as a tile of dtype in layout.

        Triton 3.8 reinterprets no slice of a buffer ("source and result must not be
        subviews"); where dtype and layout are the buffer's own the slice needs none, and
        is the same address either way."""
        dtype, layout = _unwrap_if_constexpr(dtype), _unwrap_if_constexpr(layout)
        tile = buf.slice(start, rows, _semantic=_semantic)
        if dtype == buf.dtype and layout == buf.layout:
            return tile
        shape = [int(_unwrap_if_constexpr(n)) for n in tile.shape]
        return tile._reinterpret(dtype, shape, layout, _semantic=_semantic)

    @gluon.jit
    def copy_rows(desc, row, head, WIDTH: gl.constexpr, bar, dst, pred):
        """TMA-load one tile of head `head` from rows [row, row + box) into dst [box, WIDTH].

        A (rows, heads·dim) descriptor reads column head·WIDTH; a (rows, heads, dim) one reads
        (row, head, 0), and the TMA unit zero-fills the columns from dim up to WIDTH (head
        dims between the compiled widths, without padded copies of q, k, v).
        """
        if heads_axis(desc.block_shape):
            tma_load(
                desc, [row, head, 0], bar, dst._reinterpret(desc.dtype, desc.block_shape,
                                                            desc.layout), pred=pred)
        else:
            tma_load(desc, [row, head * WIDTH], bar, dst, pred=pred)

    # Kernel head dim 192 (`PIECE_HI`): q and k as a 128-wide and a 64-wide piece, each
    # head read as three 64-column TMA boxes (`piece_cols`).
    PIECE = gl.constexpr(PIECE_HI)

    @gluon.jit
    def piece_col(head, col, WIDTH: gl.constexpr):
        """Column of a 64-column piece at `col` of head `head` in a (rows, heads·WIDTH)
        tensor: head·WIDTH + col (the q and k boxes of `copy_piece`, the backward's dQ
        pieces' reduces)."""
        return head * WIDTH + col

    @gluon.jit
    def copy_piece(desc, row, head, col, WIDTH: gl.constexpr, bar, dst, pred):
        """TMA-load the 64-column box at column `col` of head `head`, rows [row, row + box),
        into dst [box, 64]: `copy_rows` for one piece of a head (a (rows, heads, dim) box
        zero-fills columns past dim, as there)."""
        if heads_axis(desc.block_shape):
            tma_load(desc, [row, head, col], bar,
                     dst._reinterpret(desc.dtype, desc.block_shape, desc.layout), pred=pred)
        else:
            tma_load(desc, [row, piece_col(head, col, WIDTH)], bar, dst, pred=pred)

    @gluon.jit
    def load_pieces(desc, lo, hi, bar, row, head, ROWS: gl.constexpr, WIDTH: gl.constexpr,
                    pred):
        """TMA-load rows [row, row + ROWS) of head `head` (WIDTH = 192 columns) as three
        64-column boxes: columns 0-127 into `lo` [ROWS, 128] (its two 128-byte swizzle
        column blocks, which lie one after the other: NVMMA tiles wider than their swizzle
        are stored block by block), 128-191 into `hi` [ROWS, 64]. Arrives on `bar` with the
        bytes of all three (`expect` here)."""
        mbarrier.expect(bar, 3 * desc.block_type.nbytes, pred=pred)
        copy_pieces(desc, lo, hi, bar, row, head, ROWS, WIDTH, pred)

    @gluon.jit
    def copy_pieces(desc, lo, hi, bar, row, head, ROWS: gl.constexpr, WIDTH: gl.constexpr,
                    pred):
        """`load_pieces` without the `expect` (the caller's covers these bytes)."""
        halves = lo._reinterpret(desc.dtype, [2, ROWS, PIECE], lo.layout)
        copy_piece(desc, row, head, 0, WIDTH, bar, halves.index(0), pred)
        copy_piece(desc, row, head, PIECE, WIDTH, bar, halves.index(1), pred)
        copy_piece(desc, row, head, 2 * PIECE, WIDTH, bar, hi, pred)

    @gluon.jit
    def sequence(batch, seqlen_q, seqlen_k, cu_q_ptr, cu_k_ptr, used_k_ptr,
                  UNIFORM: gl.constexpr, HAS_SEQUSED: gl.constexpr):
        """First packed query/key row and the query/key lengths of one sequence."""
        if UNIFORM:
            q_start = batch * seqlen_q
            k_start = batch * seqlen_k
        else:
            q_start = gl.load(cu_q_ptr + batch)
            seqlen_q = gl.load(cu_q_ptr + batch + 1) - q_start
            k_start = gl.load(cu_k_ptr + batch)
            seqlen_k = gl.load(cu_k_ptr + batch + 1) - k_start
        if HAS_SEQUSED:
            seqlen_k = gl.load(used_k_ptr + batch)
        return q_start, k_start, seqlen_q, seqlen_k
