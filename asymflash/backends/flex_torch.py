"""FlexAttention in tiled torch: the CPU path, and the fallback on any device.

Queries are processed in chunks (one BlockMask query block, or as many rows as fit a fixed
score budget); a chunk's scores cover only the key blocks that are not empty for it, so
memory is O(seqlen) per chunk and block sparsity saves work here too. The mods are the
traced expression trees (core/flex_ir.py), evaluated on broadcast index tensors; the
backward recomputes each chunk, takes d score_mod / d score from the symbolic derivative and
the gradients of captured tensors from torch autograd through the tree.
"""

from __future__ import annotations

import torch

from ..core import flex_ir
from ..core.flex import FULL, PARTIAL

NAME = "cpu"
_SCORE_BUDGET = 1 << 22  # fp32 scores per chunk (16 MiB) when the mask has one block


def unsupported_flex(q, k, v, problem, need_grad: bool):
    return None  # plain torch: every device, dtype and mod


def _chunks(problem, seqlen_q: int, seqlen_k: int, batch_heads: int, device):
    """(rows, cols) index tensors: the query rows of a chunk and the keys it may see."""
    if seqlen_k == 0:
        return  # no keys: every row keeps out 0, lse -inf
    layout = problem.layout
    kinds = layout.kinds.to(device)
    n_q = kinds.shape[2]
    if n_q <= 1 and kinds.shape[3] <= 1:
        step = max(1, _SCORE_BUDGET // max(1, batch_heads * seqlen_k))
        cols = torch.arange(seqlen_k, device=device, dtype=torch.int32)
        for r0 in range(0, seqlen_q, step):
            rows = torch.arange(r0, min(r0 + step, seqlen_q), device=device, dtype=torch.int32)
            if bool((kinds != 0).any()):
                yield rows, cols
        return
    bq, bk = layout.block_q, layout.block_k
    for qb in range(n_q):
        visit = (kinds[:, :, qb] != 0).flatten(0, 1).any(0).nonzero().flatten()
        if visit.numel() == 0:
            continue  # an empty row of blocks: out 0, lse -inf from the initial values
        rows = torch.arange(qb * bq, min((qb + 1) * bq, seqlen_q), device=device,
                            dtype=torch.int32)
        cols = (visit[:, None] * bk + torch.arange(bk, device=device)).flatten()
        yield rows, cols[cols < seqlen_k].to(torch.int32)


def _inputs(score, batch, heads, rows, cols):
    dev = score.device
    return {"score": score,
            "b": torch.arange(batch, device=dev, dtype=torch.int32).view(-1, 1, 1, 1),
            "h": torch.arange(heads, device=dev, dtype=torch.int32).view(1, -1, 1, 1),
            "q_idx": rows.view(1, 1, -1, 1), "kv_idx": cols.view(1, 1, 1, -1)}


def _expand_kv(t, group: int):
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _chunk_scores(problem, qf, kf, rows, cols, captured):
    """Raw scores, modded scores and the allowed mask of one chunk (all (B, H, R, C))."""
    raw = qf[:, :, rows.long()] @ kf[:, :, cols.long()].transpose(-1, -2) * problem.scale
    batch, heads = raw.shape[:2]
    inputs = _inputs(raw, batch, heads, rows, cols)
    s = raw
    if problem.score is not None:
        s = flex_ir.evaluate(problem.score.root, inputs, captured[0]).to(torch.float32)
        s = s.expand_as(raw)
    kinds = problem.layout.element_kinds(rows.to(problem.layout.kinds.device),
                                         cols.to(problem.layout.kinds.device)).to(raw.device)
    ok = kinds == FULL
    partial = kinds == PARTIAL
    if bool(partial.any()):
        if problem.mask is None:
            ok = ok | partial
        else:
            m = flex_ir.evaluate(problem.mask.root, inputs, captured[1])
            ok = ok | (partial & m)
    return raw, s, ok.expand_as(raw), inputs


def flex_forward(q, k, v, problem):
    """(out in q's dtype, lse fp32 natural log), both (B, H, M[, Dv])."""
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k, dv = k.shape[2], v.shape[-1]
    qf = q.float()
    kf, vf = (_expand_kv(t.float(), problem.group) for t in (k, v))
    captured = problem.captured_values()
    out = torch.zeros(batch, heads, seqlen_q, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for rows, cols in _chunks(problem, seqlen_q, seqlen_k, batch * heads, q.device):
        _, s, ok, _ = _chunk_scores(problem, qf, kf, rows, cols, captured)
        s = s.masked_fill(~ok, float("-inf"))
        m = s.amax(-1, keepdim=True)
        # A row with no allowed key has max -inf: shift by 0 so exp gives 0, not NaN.
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        r = rows.long()
        lse[:, :, r] = torch.where(denom > 0, m + torch.log(denom),
                                   torch.full_like(m, float("-inf"))).squeeze(-1)
        out[:, :, r] = (p / torch.where(denom > 0, denom, torch.ones_like(denom))) @ \
            vf[:, :, cols.long()]
    return out.to(q.dtype), lse


def flex_backward(dout, dlse, q, k, v, out, lse, problem, captured_need_grad):
    """(dq, dk, dv, grads of the score_mod's captured tensors (None where not needed))."""
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k, group = k.shape[2], problem.group
    qf = q.float()
    kf, vf = (_expand_kv(t.float(), group) for t in (k, v))
    do = dout.float()
    delta = (do * out.float()).sum(-1)
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    captured = problem.captured_values()
    score_caps = list(captured[0])
    wanted = [i for i, need in enumerate(captured_need_grad) if need]
    leaves = {}
    for i in wanted:
        leaves[i] = score_caps[i] = score_caps[i].detach().requires_grad_(True)
    dcap = {i: torch.zeros_like(leaves[i], dtype=torch.float32) for i in wanted}
    dmod = flex_ir.derivative(problem.score.root) if problem.score is not None else None
    for rows, cols in _chunks(problem, seqlen_q, seqlen_k, batch * heads, q.device):
        r, c = rows.long(), cols.long()
        with torch.enable_grad() if wanted else torch.no_grad():
            raw, s, ok, inputs = _chunk_scores(problem, qf, kf, rows, cols,
                                               (tuple(score_caps), captured[1]))
        lse_c = lse[:, :, r, None]
        live = ok & ~torch.isinf(lse_c)
        p = torch.where(live, torch.exp(s.detach() - torch.where(live, lse_c, 0.0)), 0.0)
        dp = do[:, :, r] @ vf[:, :, c].transpose(-1, -2)
        ds = p * (dp - delta[:, :, r, None] + (0.0 if dlse is None else dlse[:, :, r, None]))
        if wanted:
            grads = torch.autograd.grad(s, [leaves[i] for i in wanted], ds,
                                        allow_unused=True)
            for i, g in zip(wanted, grads):
                if g is not None:
                    dcap[i] += g.float()
        if dmod is not None:
            dm = flex_ir.evaluate(dmod, inputs, tuple(t.detach() for t in score_caps))
            ds = torch.where(p > 0, ds * dm, 0.0)  # masked scores may have inf/nan slopes
        ds = ds * problem.scale
        dq[:, :, r] += ds @ kf[:, :, c]
        dk[:, :, c] += ds.transpose(-1, -2) @ qf[:, :, r]
        dv[:, :, c] += p.transpose(-1, -2) @ do[:, :, r]
    if group > 1:
        b, hkv = k.shape[:2]
        dk = dk.view(b, hkv, group, seqlen_k, -1).sum(2)
        dv = dv.view(b, hkv, group, seqlen_k, -1).sum(2)
    grads = [dcap[i].to(captured[0][i].dtype) if i in dcap else None
             for i in range(len(captured[0]))]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grads
