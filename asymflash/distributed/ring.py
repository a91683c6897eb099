"""Ring attention: the keys and values go round the ring of ranks, one block per step.

Each rank holds a shard of the sequence (q, k, v of its tokens). At step s it holds the K/V
of rank r - s, attends its queries to them and folds the block's (out, lse) into a running
pair (`core.merge.merge_into`), while the next block is already in flight (`comm.Ring`):
after W steps every query has seen every key. The backward runs the same ring: dQ stays
home; the dK/dV of a block travel with it, each rank adding its contribution
(`attention_backward`, against the final out and lse), and arrive home after W shifts.

Which (query, key) pairs a step computes (`block_plan`): without causal, all. With causal
and contiguous shards, rank r needs the blocks of ranks < r in full and its own causally, so
late ranks do most of the work. With zigzag shards (`sharding.py`: chunks r and 2W-1-r),
rank r's own block is causal; a block from an earlier rank is needed in its first chunk
only, by all queries; one from a later rank by the second query chunk only, in full: every
step but the first costs every rank the same half block pair. With a sliding window the
plan is `window.WindowPlan`'s: each chunk pair cut to what the window reaches, skipped when
it reaches nothing.

Every accumulation (the forward merge, dQ, the travelling dK/dV) runs in a fixed order
(ring steps; for dK/dV, ranks in ring order), so deterministic=True stays bitwise
reproducible given a deterministic backward for each block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.merge import merge_into
from .comm import TAG_DKV, TAG_KV, Ring
from .window import WindowPlan, add_grads


@dataclass(frozen=True)
class Block:
    """The part of a step's block pair to compute: q_half = the second half of the local
    queries only; k_half = the first half of the block's keys only."""

    q_half: bool
    k_half: bool
    causal: bool


_FULL = Block(False, False, False)


def block_plan(step: int, rank: int, world: int, causal: bool, zigzag: bool):
    """What rank `rank` computes at ring step `step` (keys of rank (rank - step) mod world);
    None when nothing (contiguous causal, a later rank's keys)."""
    if not causal:
        return _FULL
    if step == 0:
        return Block(False, False, True)
    earlier = (rank - step) % world < rank
    if not zigzag:
        return _FULL if earlier else None
    return Block(False, True, False) if earlier else Block(True, False, False)


@dataclass(frozen=True)
class RingSpec:
    ring: Ring
    softmax_scale: float
    causal: bool  # the causal schedule of `block_plan`; False when `window` plans the steps
    zigzag: bool
    softcap: float
    deterministic: bool
    rows: object  # rows.DenseRows or rows.PackedRows
    window: WindowPlan | None = None


def _flat(t, keep: int = 2):
    """A contiguous accumulator as rows, keeping its last `keep` dims ((h, d): 2, (h,): 1):
    a view, so the window path's row updates land in it."""
    return t.view(-1, *t.shape[t.dim() - keep:])


def _keys(spec: RingSpec, blk: Block, k, v):
    if blk.k_half:
        rows = spec.rows
        return rows.take(k, "early", rows.tok), rows.take(v, "early", rows.tok)
    return k, v


def _rows(t):
    """q, k, v, out or dout as packed rows (rows, h, d)."""
    return t.reshape(-1, *t.shape[-2:])


def ring_forward(spec: RingSpec, q, k, v, sink=None):
    """(out fp32, lse fp32) of the local queries over all keys: out like q with v's head
    dim, lse (b, hq, s) dense or (hq, total) packed."""
    ring, rows = spec.ring, spec.rows
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    q_late = rows.take(q, "late", rows.tok) if spec.causal and spec.zigzag else None
    q_rows = _rows(q) if spec.window is not None else None
    for step in range(ring.world):
        # the next block's transfer starts before this block's compute: they overlap
        pending = ring.shift((k, v), TAG_KV) if step + 1 < ring.world else None
        blk = block_plan(step, ring.rank, ring.world, spec.causal, spec.zigzag)
        if spec.window is not None:
            spec.window.forward(step, q_rows, _rows(k), _rows(v), _flat(out), _flat(lse, 1),
                                spec)
        elif blk is not None:
            kb, vb = _keys(spec, blk, k, v)
            ob, lb = rows.attend(q_late if blk.q_half else q, kb, vb, blk.causal, blk.q_half,
                                 blk.k_half, spec)
            rows.merge(out, lse, ob, lb, blk.q_half)
        if pending is not None:
            k, v = pending.wait()
    if sink is not None:
        # the sink joins every row's normalisation and carries no value: one more partial
        # result, out = 0 and lse = sink[h], folded in once
        merge_into(out, lse, out.new_zeros(()), sink.float().expand_as(lse))
    return out, rows.final_lse(lse)


def sink_grad(spec: RingSpec, sink, dout, out, lse, dlse):
    """d loss / d sink from this rank's rows: -sum(P_sink * D), P_sink = exp(sink - lse),
    D = rowsum(dout * out) - dlse; the group's gradient is the sum over its ranks (as for
    any parameter under context parallelism)."""
    rows = spec.rows
    d_rows = rows.final_lse((dout.float() * out.float()).sum(-1))
    if dlse is not None:
        d_rows = d_rows - dlse
    return -rows.head_sum(torch.exp(rows.per_head(sink) - lse) * d_rows)


def ring_backward(spec: RingSpec, dout, q, k, v, out, lse, dlse=None):
    """(dq, dk, dv) in fp32 for the local shard, given the final out and lse (and the
    gradient into lse, if any)."""
    ring, rows = spec.ring, spec.rows
    late = None
    if spec.causal and spec.zigzag:
        late = tuple(rows.take(t, "late", rows.tok) for t in (dout, q, out)) + tuple(
            None if t is None else rows.take(t, "late", rows.lse_tok) for t in (lse, dlse))
    if spec.window is not None:  # (dout, q, out, lse, dlse) as the window's rows, once
        home = (_rows(dout), _rows(q), _rows(out), rows.lse_rows(lse),
                None if dlse is None else rows.lse_rows(dlse))
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    moving = None  # the dK/dV of the block held, arriving from the previous rank
    for step in range(ring.world):
        pending = ring.shift((k, v), TAG_KV) if step + 1 < ring.world else None
        blk = block_plan(step, ring.rank, ring.world, spec.causal, spec.zigzag)
        grads = None
        if spec.window is not None:
            grads = spec.window.backward(step, *home[:2], _rows(k), _rows(v), *home[2:], spec)
        elif blk is not None:
            kb, vb = _keys(spec, blk, k, v)
            d_o, qb, ob, lb, dlb = late if blk.q_half else (dout, q, out, lse, dlse)
            grads = rows.backward(d_o, qb, kb, vb, ob, lb, dlb, blk.causal, blk.q_half,
                                  blk.k_half, spec)
        if moving is None:
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        else:
            dk, dv = moving.wait()  # waited on only after this step's compute
        if spec.window is not None:
            add_grads(grads, _flat(dq), _flat(dk), _flat(dv))
        elif grads is not None:
            rows.add(dq, grads[0], "late" if blk.q_half else None)
            rows.add(dk, grads[1], "early" if blk.k_half else None)
            rows.add(dv, grads[2], "early" if blk.k_half else None)
        if pending is not None:
            k, v = pending.wait()
        if ring.world == 1:
            return dq, dk, dv
        moving = ring.shift((dk, dv), TAG_DKV)
    dk, dv = moving.wait()  # W shifts: the dK/dV of this rank's own block
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, spec: RingSpec):
        out, lse = ring_forward(spec, q, k, v, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        # unused outputs get no gradient (None): lse's usually, out's when only lse is used
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dlse = None if dlse is None else dlse.float().contiguous()
        dq, dk, dv = ring_backward(ctx.spec, dout, q, k, v, out, lse, dlse)
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dsink = sink_grad(ctx.spec, sink, dout, out, lse, dlse).to(sink.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None


def run(q, k, v, sink, spec: RingSpec, grad: bool):
    """(out in q's dtype, lse fp32), through autograd when a gradient can flow."""
    if grad:
        return RingAttention.apply(q, k, v, sink, spec)
    with torch.no_grad():
        out, lse = ring_forward(spec, q, k, v, sink)
    return out.to(q.dtype), lse
