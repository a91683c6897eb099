"""The suite of FlexAttention mods the flex tests run: each a factory of fresh random
captured tensors for given sizes, returning (score_mod, mask_mod, tensors that get grads)."""

from __future__ import annotations

import torch

BLOCK = 16  # BlockMask block size of the tests: several blocks at seqlen 17 and 113


def causal(sq, sk, heads, device):
    return None, lambda b, h, q, kv: q >= kv, []


def sliding_window(sq, sk, heads, device):
    return None, lambda b, h, q, kv: (q - kv <= 8) & (kv - q <= 3), []


def document(sq, sk, heads, device):
    n = max(sq, sk)
    doc = torch.randint(0, 4, (n,), device=device).sort().values

    def mask(b, h, q, kv):
        return doc[q] == doc[kv]
    return None, mask, []


def prefix_lm(sq, sk, heads, device):
    prefix = max(1, sk // 3)
    return None, lambda b, h, q, kv: (kv < prefix) | (q >= kv), []


def alibi(sq, sk, heads, device):
    slopes = torch.rand(heads, device=device)

    def score(s, b, h, q, kv):
        return s - slopes[h] * (q - kv).abs()
    return score, None, []


def softcap(sq, sk, heads, device):
    return (lambda s, b, h, q, kv: 0.5 * torch.tanh(s / 0.5)), None, []


def relative_bias(sq, sk, heads, device):
    table = (0.5 * torch.randn(heads, sq + sk, device=device)).requires_grad_(True)

    def score(s, b, h, q, kv):
        return s + table[h, q - kv + sk]
    return score, (lambda b, h, q, kv: q >= kv), [table]


def block_sparse(sq, sk, heads, device):
    nq, nk = -(-sq // BLOCK), -(-sk // BLOCK)
    keep = torch.rand(nq, nk, device=device) < 0.5

    def mask(b, h, q, kv):
        return keep[q // BLOCK, kv // BLOCK]
    return None, mask, []


def combined(sq, sk, heads, device):
    """Several ops at once: where, exp, sigmoid, min/max, remainder, a batch-dependent mask."""
    scale = torch.rand(2, heads, device=device) + 0.5

    def score(s, b, h, q, kv):
        t = torch.where(q % 3 == 0, s * scale[b, h], torch.clamp(s, -1.0, 2.0))
        return t + torch.sigmoid(s) - torch.exp(-((q - kv).abs().float()) / 16)

    def mask(b, h, q, kv):
        return ((q + b) // 2 >= kv // 2) | ~(kv % 5 != 0)
    return score, mask, []


MODS = {f.__name__: f for f in (causal, sliding_window, document, prefix_lm, alibi, softcap,
                                 relative_bias, block_sparse, combined)}


_TABLE = torch.linspace(-1.0, 1.0, 2 * 40).view(2, 40)

# Mods covering every op of the expression form, for the tracing and emission tests.
IR_MODS = {
    "arith": lambda s, b, h, q, kv: (s * 2 - 1) / (1 + (q - kv).abs()) + (-s),
    "transcendental": lambda s, b, h, q, kv: torch.exp(s / 4) + torch.exp2(s / 4)
    + torch.log(s.abs() + 1) + torch.tanh(s) + torch.sigmoid(s),
    "int_ops": lambda s, b, h, q, kv: s + (q - 7) // 3 + (kv - 5) % 4 + torch.floor(s),
    "minmax_where": lambda s, b, h, q, kv: torch.where(
        (q > kv) & ~(h == 1) | (b != 0), torch.maximum(s, s * s), torch.minimum(s, -s)),
    # one value (d = q - kv, negative indices wrapping, and h % 2) both indexes the table
    # and is used beside it
    "index_reuse": lambda s, b, h, q, kv: (lambda d, g: s + _TABLE[g, d] + 0.01 * d + g)(
        q - kv, h % 2),
    "clamp_cast": lambda s, b, h, q, kv: torch.clamp(s, min=-0.5) + q.float() * 0.01
    + (kv >= 3).to(torch.float32),
}


# ---------------------------------------------------------------- learned captured tensors

def _learned(*shape, device, dtype=torch.float32, positive=False):
    t = torch.rand(*shape, device=device) + 0.5 if positive else \
        0.5 * torch.randn(*shape, device=device)
    return t.to(dtype).requires_grad_(True)


def relative_table(sq, sk, hq, device):
    table = _learned(hq, sq + sk - 1, device=device)
    return (lambda s, b, h, i, j: s + table[h, i - j + sk - 1]), [table]


def head_scalar(sq, sk, hq, device):
    temp = _learned(hq, device=device, positive=True)
    return (lambda s, b, h, i, j: s * temp[h]), [temp]


def bias_twice(sq, sk, hq, device):
    """One Load used twice (gradients summed over uses) and a second Load of the same
    tensor at another position (its own scatter)."""
    bias = _learned(hq, sq + sk - 1, device=device)

    def mod(s, b, h, i, j):
        near = bias[h, i - j + sk - 1]
        return s + near * torch.tanh(near) - 0.5 * bias[h, j - i + sq - 1]
    return mod, [bias]


def rows_cols_scalar(sq, sk, hq, device):
    """Positions that vary along rows only, columns only, and not at all (a 0-dim tensor
    in bf16): the scatter reduces a tile's other axes before its atomics. (A bias of the
    row alone would have gradient 0: softmax ignores a shift of its row.)"""
    row, col = _learned(sq, device=device), _learned(2, sk, device=device)
    temp = _learned((), device=device, dtype=torch.bfloat16, positive=True)
    return (lambda s, b, h, i, j: s * (temp + row[i]) - torch.exp(col[b, j])), [row, col, temp]


def nested_index(sq, sk, hq, device):
    """A learned table read at positions that are themselves read from a tensor: the
    gradient lands where it was read, as torch's indexing backward puts it."""
    pos = torch.randint(0, 8, (max(sq, sk),), device=device)
    table = _learned(hq, 15, device=device)
    return (lambda s, b, h, i, j: s + table[h, pos[i] - pos[j] + 7]), [table]


# Mods whose captured tensors are learned, for the tests of captured-tensor gradients:
# each (sq, sk, heads, device) -> (score_mod, [tensors that get gradients]).
GRAD_MODS = {f.__name__: f for f in (relative_table, head_scalar, bias_twice,
                                      rows_cols_scalar, nested_index)}
