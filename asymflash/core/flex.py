"""FlexAttention's semantics, in one place: what score_mod, mask_mod and a BlockMask mean.

For query i and key j of batch b and query head h (all integers, indices from 0):

    s = scale * q[b, h, i] . k[b, h // group, j]          (group = Hq / Hkv with enable_gqa)
    s = score_mod(s, b, h, i, j)                           (identity when None)
    allowed = block (i // BQ, j // BK) is full, or it is partial and mask_mod(b, h, i, j)
    out[b, h, i] = softmax over allowed j of s, applied to v;  lse in natural log

where a BlockMask lists, per (b, h, query block), the partial blocks (kv_num_blocks,
kv_indices) and the full ones (full_kv_num_blocks, full_kv_indices); an unlisted block is
empty. Without a BlockMask every block is full. A row with no allowed key (or whose
scores are all -inf) gives out = 0 and lse = -inf, as everywhere in asymflash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockLayout:
    """A BlockMask as a dense (Bm, Hm, q blocks, kv blocks) map of EMPTY/PARTIAL/FULL, Bm
    and Hm 1 when the mask broadcasts over batch / heads."""
    kinds: torch.Tensor        # uint8
    block_q: int
    block_k: int
    mask_mod: Optional[Callable]
    has_partial: bool = True   # whether any block is PARTIAL (mask_mod is ever evaluated)

    def element_kinds(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """(Bm, Hm, len(rows), len(cols)) kinds of the given query rows and key columns (on
        the layout's device, which may differ from the indices': a layout without a
        BlockMask is built on the CPU)."""
        dev = self.kinds.device
        r, c = (rows // self.block_q).long().to(dev), (cols // self.block_k).long().to(dev)
        return self.kinds[:, :, r][..., c]


def _mark(kinds, num, indices, value):
    if num is None or indices is None:
        return
    listed = torch.arange(indices.shape[-1], device=indices.device) < num[..., None].long()
    col = torch.where(listed, indices.long(), kinds.shape[-1])  # unlisted -> a spill column
    spill = torch.zeros(*kinds.shape[:-1], kinds.shape[-1] + 1, dtype=kinds.dtype,
                        device=kinds.device)
    spill.scatter_(-1, col, value)
    hit = spill[..., :-1] == value
    kinds[hit] = value


def block_layout(block_mask, seqlen_q: int, seqlen_k: int) -> BlockLayout:
    """The BlockLayout of a torch BlockMask (or of None: one full block)."""
    if block_mask is None:
        kinds = torch.full((1, 1, 1, 1), FULL, dtype=torch.uint8)
        return BlockLayout(kinds, max(seqlen_q, 1), max(seqlen_k, 1), None, False)
    block_q, block_k = (int(x) for x in block_mask.BLOCK_SIZE)
    num = block_mask.kv_num_blocks
    n_q = -(-seqlen_q // block_q)
    n_k = -(-seqlen_k // block_k)
    kinds = torch.zeros(*num.shape[:2], max(num.shape[2], n_q),
                        max(block_mask.kv_indices.shape[-1], n_k) if n_k else 0,
                        dtype=torch.uint8, device=num.device)
    _mark(kinds, num, block_mask.kv_indices, PARTIAL)
    _mark(kinds, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)
    kinds = kinds[:, :, :n_q, :n_k].contiguous()
    return BlockLayout(kinds, block_q, block_k, block_mask.mask_mod,
                       bool((kinds == PARTIAL).any()))


def _vmap_bhqk(fn, score: bool):
    """fn on (.., b, h, q_idx, kv_idx) vectors, vectorised over all four with torch.vmap
    (the mod itself sees one-element tensors, as torch's flex_attention gives it)."""
    lead = (0,) if score else ()
    dims = [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None),
            (0, None, None, None)]
    for d in dims:
        fn = torch.vmap(fn, in_dims=lead + d)
    return fn


def _indices(n, device):
    return torch.arange(n, dtype=torch.int32, device=device)


def apply_score_mod(score_mod, scores: torch.Tensor) -> torch.Tensor:
    """score_mod on a (B, H, M, N) score matrix, by calling the Python function itself."""
    if score_mod is None:
        return scores
    b, h, m, n = scores.shape
    dev = scores.device
    return _vmap_bhqk(score_mod, True)(scores, _indices(b, dev), _indices(h, dev),
                                       _indices(m, dev), _indices(n, dev))


def allowed_matrix(layout: BlockLayout, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                   device) -> torch.Tensor:
    """(B, H, M, N) boolean: which keys each query may attend to (the mask_mod is called
    directly, in partial blocks only)."""
    rows, cols = _indices(seqlen_q, device), _indices(seqlen_k, device)
    kinds = layout.element_kinds(rows, cols).to(device).expand(batch, heads, -1, -1)
    ok = kinds == FULL
    if layout.mask_mod is not None and bool((kinds == PARTIAL).any()):
        masked = _vmap_bhqk(layout.mask_mod, False)(_indices(batch, device),
                                                    _indices(heads, device), rows, cols)
        ok = ok | ((kinds == PARTIAL) & masked.to(torch.bool))
    elif layout.mask_mod is None:
        ok = ok | (kinds == PARTIAL)
    return ok


@dataclass(frozen=True)
class FlexProblem:
    """One flex call as every backend sees it: the traced mods (None: identity / no mask),
    the block layout, the softmax scale and the GQA group (query heads per kv head).
    deterministic: the caller asked for bitwise reproducible gradients (flash_attn_func's
    deterministic=True), which rules out atomics."""
    score: Optional[object]    # flex_ir.Mod of kind "score"
    mask: Optional[object]     # flex_ir.Mod of kind "mask"
    layout: BlockLayout
    scale: float
    group: int
    deterministic: bool = False

    def captured_values(self) -> tuple:
        """(score_mod's captured tensors, mask_mod's captured tensors)."""
        return (self.score.captured if self.score is not None else (),
                self.mask.captured if self.mask is not None else ())


def memo_by_identity(maxsize: int = 128):
    """Cache a function on its arguments: scalars (and frozen specs) by value, everything
    else (tensors, mods, BlockMasks, callables) by identity, the entry keeping those objects
    alive so an id cannot be reused while it is cached. For the per-call host work of the
    flex path (block layouts, composed mods, emitted kernels), which a repeated call would
    otherwise redo; a mutated-in-place BlockMask is not noticed (rebuild it instead)."""
    import collections
    import functools

    simple = (type(None), bool, int, float, str, torch.dtype)

    def part(x):
        if isinstance(x, simple):
            return x
        if isinstance(x, tuple) and all(isinstance(y, simple) for y in x):
            return x
        if type(x).__name__ == "MaskSpec":
            return (int(x.window_left), int(x.window_right))
        return ("id", id(x))

    def wrap(fn):
        cache: collections.OrderedDict = collections.OrderedDict()

        @functools.wraps(fn)
        def cached(*args):
            key = tuple(part(a) for a in args)
            hit = cache.get(key)
            if hit is not None:
                cache.move_to_end(key)
                return hit[1]
            value = fn(*args)
            cache[key] = (args, value)
            if len(cache) > maxsize:
                cache.popitem(last=False)
            return value

        cached.cache_clear = cache.clear
        return cached

    return wrap


# block_layout runs per call on the user's BlockMask (a few tensor ops): cached per mask.
block_layout = memo_by_identity(64)(block_layout)
