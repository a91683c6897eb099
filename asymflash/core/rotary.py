"""Rotary position embedding as flash-attn's kvcache path applies it (rotary_cos/rotary_sin).

The first rotary_dim = 2 * cos.shape[1] channels of each head are rotated by the angle of the
token's position; the rest pass through. Two pairings, as in flash-attn:
- interleaved (GPT-J): channels (2i, 2i + 1) form pair i;
- not interleaved (GPT-NeoX): channels (i, i + rotary_dim / 2) form pair i.
Pair i of a token at position p becomes (x·c − y·s, x·s + y·c) with c = cos[p, i],
s = sin[p, i], computed in fp32 and rounded to the input dtype once.
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, d) rotated at positions (batch, seqlen) (int); a new tensor."""
    half = cos.shape[1]
    rot = 2 * half
    c = cos.float()[positions].unsqueeze(2)  # (batch, seqlen, 1, half)
    s = sin.float()[positions].unsqueeze(2)
    part = x[..., :rot].float()
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., rot:]), dim=-1)
