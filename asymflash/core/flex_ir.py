"""The expression form of a score_mod / mask_mod: a small tree every backend can compile.

A mod is a pure elementwise function of five scalars (score, b, h, q_idx, kv_idx) and of
tensors it captured, read at integer positions computed from those scalars. `flex_trace.py`
turns a user's Python function into this form; here are the nodes, their evaluation on
broadcast torch tensors (the tiled torch backend) and the symbolic derivative with respect to
score (the backward's dS through score_mod). Nodes are frozen dataclasses: hashable, so a
tree is its own cache key, and equal subtrees compare equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

INPUTS = ("score", "b", "h", "q_idx", "kv_idx")

# name -> arity. Anything a traced mod uses outside this set is refused by name.
UNARY = ("neg", "abs", "exp", "exp2", "log", "tanh", "sigmoid", "floor", "not")
BINARY = ("add", "sub", "mul", "div", "floordiv", "remainder", "minimum", "maximum",
          "eq", "ne", "lt", "le", "gt", "ge", "and", "or")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
OPS = UNARY + BINARY + ("where", "cast")


@dataclass(frozen=True)
class Input:
    name: str               # one of INPUTS
    dtype: torch.dtype      # score: float32; indices: int32


@dataclass(frozen=True)
class Const:
    value: Union[bool, int, float]
    dtype: torch.dtype


@dataclass(frozen=True)
class Load:
    """captured[slot][index...]: one element of a captured tensor (index empty for a
    one-element tensor)."""
    slot: int
    index: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class Op:
    name: str               # one of OPS
    args: tuple
    dtype: torch.dtype      # the result's dtype, as torch's promotion gives it


Node = Union[Input, Const, Load, Op]


@dataclass(frozen=True)
class Mod:
    """A traced mod: its tree and the tensors it captured (slot i is captured[i])."""
    kind: str               # "score" or "mask"
    root: Node
    captured: tuple

    def signature(self) -> tuple:
        """What compiled code depends on: the tree and each captured tensor's dtype and
        rank (not its values or sizes: those are kernel arguments)."""
        return (self.kind, self.root,
                tuple((t.dtype, t.dim()) for t in self.captured))


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def children(node) -> tuple:
    if isinstance(node, Op):
        return node.args
    if isinstance(node, Load):
        return node.index
    return ()


def uses(node, name: str) -> bool:
    """Whether the tree reads input `name`."""
    if isinstance(node, Input):
        return node.name == name
    return any(uses(c, name) for c in children(node))


# ---------------------------------------------------------------- evaluation on tensors

def _floordiv(a, b):
    return torch.div(a, b, rounding_mode="floor")


_TORCH = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2,
    "log": torch.log, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "floor": torch.floor,
    "not": torch.logical_not,
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
    "floordiv": _floordiv, "remainder": torch.remainder,
    "minimum": torch.minimum, "maximum": torch.maximum,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt,
    "ge": torch.ge, "and": torch.logical_and, "or": torch.logical_or,
}


def evaluate(root, inputs: dict, captured, memo=None):
    """The tree on broadcastable tensors: inputs maps each name in INPUTS to a tensor
    (e.g. b (B,1,1,1), h (1,H,1,1), q_idx (1,1,M,1), kv_idx (1,1,1,N), score (B,H,M,N)).
    Differentiable in score and in captured tensors that require grad."""
    memo = {} if memo is None else memo
    device = inputs["score"].device

    def ev(node):
        key = id(node)
        if key in memo:
            return memo[key][1]
        if isinstance(node, Input):
            val = inputs[node.name]
        elif isinstance(node, Const):
            val = torch.tensor(node.value, dtype=node.dtype, device=device)
        elif isinstance(node, Load):
            t = captured[node.slot]
            val = t.reshape(()) if not node.index else t[tuple(ev(i).long()
                                                               for i in node.index)]
        elif node.name == "where":
            c, x, y = (ev(a) for a in node.args)
            val = torch.where(c, x.to(node.dtype), y.to(node.dtype))
        elif node.name == "cast":
            val = ev(node.args[0]).to(node.dtype)
        else:
            args = [ev(a) for a in node.args]
            if node.name not in COMPARISONS and node.name not in ("and", "or", "not"):
                args = [a.to(node.dtype) for a in args]
            val = _TORCH[node.name](*args)
        memo[key] = (node, val)  # keep the node alive: its id must not be reused
        return val

    return ev(root)


# ---------------------------------------------------------------- derivative

_F32 = torch.float32
ZERO = Const(0.0, _F32)
ONE = Const(1.0, _F32)


def _c(x: float) -> Const:
    return Const(float(x), _F32)


def _add(a, b):
    if a == ZERO:
        return b
    if b == ZERO:
        return a
    return Op("add", (a, b), _F32)


def _mul(a, b):
    if a == ZERO or b == ZERO:
        return ZERO
    if a == ONE:
        return b
    if b == ONE:
        return a
    return Op("mul", (a, b), _F32)


def _sub(a, b):
    if b == ZERO:
        return a
    return Op("sub", (a, b), _F32)


def _div(a, b):
    if a == ZERO:
        return ZERO
    return Op("div", (a, b), _F32)


def _where(c, a, b):
    if a == b:
        return a
    return Op("where", (c, a, b), _F32)


def _f(node):
    """node as float32 (the derivative is computed in the score's dtype)."""
    return node if node.dtype == _F32 else Op("cast", (node,), _F32)


def derivative(root, wrt=None) -> Node:
    """d root / d score (wrt None) or d root / d a Load's value (wrt that Load) as a tree
    (float32), symbolic. A Load's derivative sums over every place the equal Load occurs,
    as autograd sums over uses. Index arithmetic is integer and carries no gradient, so a
    Load whose index reads another Load gets the gradient at the position it read (as
    torch's indexing backward gives), and the inner Load none. Gradients follow torch's
    conventions where they are a choice: abs'(0) = 0, and minimum/maximum split a tie
    evenly between their arguments."""
    memo: dict = {}

    def d(node):
        key = id(node)
        if key in memo:
            return memo[key][1]
        out = _d(node)
        memo[key] = (node, out)
        return out

    def _d(node):
        if isinstance(node, Input):
            return ONE if wrt is None and node.name == "score" else ZERO
        if isinstance(node, Load) and node == wrt:
            return ONE
        if isinstance(node, (Const, Load)) or not is_float(node.dtype):
            return ZERO  # integer and boolean values carry no gradient
        name, args = node.name, node.args
        if name == "cast":
            return d(args[0])
        if name == "where":
            return _where(args[0], d(args[1]), d(args[2]))
        if name in ("floor", "floordiv"):
            return ZERO
        da = d(args[0])
        if name == "neg":
            return ZERO if da == ZERO else Op("neg", (da,), _F32)
        if name == "abs":
            a = _f(args[0])
            sign = Op("where", (Op("gt", (a, ZERO), torch.bool), ONE,
                                Op("where", (Op("lt", (a, ZERO), torch.bool), _c(-1), ZERO),
                                   _F32)), _F32)
            return _mul(sign, da)
        if name == "exp":
            return _mul(node, da)
        if name == "exp2":
            return _mul(_mul(node, _c(math.log(2.0))), da)
        if name == "log":
            return _div(da, _f(args[0]))
        if name == "tanh":
            return _mul(_sub(ONE, Op("mul", (node, node), _F32)), da)
        if name == "sigmoid":
            return _mul(_mul(node, _sub(ONE, node)), da)
        db = d(args[1]) if len(args) > 1 else ZERO
        if name == "add":
            return _add(da, db)
        if name == "sub":
            return _sub(da, db) if db != ZERO else da
        if name == "mul":
            return _add(_mul(da, _f(args[1])), _mul(_f(args[0]), db))
        if name == "div":
            a, b = _f(args[0]), _f(args[1])
            return _sub(_div(da, b), _div(_mul(a, db), Op("mul", (b, b), _F32)))
        if name == "remainder":  # a - floor(a / b) * b: the floor is locally constant
            if db == ZERO:
                return da
            q = Op("floor", (Op("div", (_f(args[0]), _f(args[1])), _F32),), _F32)
            return _sub(da, _mul(q, db))
        if name in ("minimum", "maximum"):
            a, b = _f(args[0]), _f(args[1])
            first, second = ("lt", "gt") if name == "minimum" else ("gt", "lt")
            tie = _mul(_add(da, db), _c(0.5))
            return _where(Op(first, (a, b), torch.bool), da,
                          _where(Op(second, (a, b), torch.bool), db, tie))
        raise NotImplementedError(f"asymflash: no derivative rule for op {name!r}")

    return d(root)


def loads_of(root, slots) -> list:
    """The distinct Loads of captured slots `slots` in the tree, in first-use order: each
    reads its own position, so each is its own gradient target."""
    found: list = []
    seen: set = set()

    def walk(node):
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, Load) and node.slot in slots and node not in found:
            found.append(node)
        for c in children(node):
            walk(c)

    walk(root)
    return found


def substitute(root, name: str, replacement):
    """root with every Input `name` replaced by `replacement` (composes mods)."""
    memo: dict = {}

    def sub(node):
        key = id(node)
        if key in memo:
            return memo[key][1]
        if isinstance(node, Input) and node.name == name:
            out = replacement
        elif isinstance(node, Op):
            out = Op(node.name, tuple(sub(a) for a in node.args), node.dtype)
        elif isinstance(node, Load):
            out = Load(node.slot, tuple(sub(i) for i in node.index), node.dtype)
        else:
            out = node
        memo[key] = (node, out)
        return out

    return sub(root)


def shift_slots(root, offset: int):
    """root with its captured slots renumbered by +offset (to concatenate two mods)."""
    if offset == 0:
        return root
    if isinstance(root, Load):
        return Load(root.slot + offset, tuple(shift_slots(i, offset) for i in root.index),
                    root.dtype)
    if isinstance(root, Op):
        return Op(root.name, tuple(shift_slots(a, offset) for a in root.args), root.dtype)
    return root


def compose_scores(outer: Mod, inner: Mod) -> Mod:
    """score -> outer(inner(score)): built-in modifiers (softcap, ALiBi) under a user's."""
    inner_root = inner.root
    outer_root = shift_slots(outer.root, len(inner.captured))
    return Mod("score", substitute(outer_root, "score", inner_root),
               inner.captured + outer.captured)


def and_masks(first: Mod, second: Mod) -> Mod:
    root = Op("and", (first.root, shift_slots(second.root, len(first.captured))), torch.bool)
    return Mod("mask", root, first.captured + second.captured)


# ---------------------------------------------------------------- a string form

def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.rpartition(".")[2])


def _const_value(value):
    """Floats by their hex form: exact, and inf / nan survive the round trip."""
    return ("f", float.hex(value)) if isinstance(value, float) else value


def dumps(*roots) -> str:
    """Trees (or None) as one string, a node table in dependency order with each shared
    subtree once: the hashable, process-independent form torch.compile passes to the flex
    custom ops. loads(dumps(*roots)) gives equal trees."""
    table: list = []
    seen: dict = {}

    def put(node) -> int:
        key = id(node)
        if key in seen:
            return seen[key][1]
        if isinstance(node, Input):
            entry = ("i", node.name, str(node.dtype))
        elif isinstance(node, Const):
            entry = ("c", _const_value(node.value), str(node.dtype))
        elif isinstance(node, Load):
            entry = ("l", node.slot, str(node.dtype), tuple(put(i) for i in node.index))
        else:
            entry = ("o", node.name, str(node.dtype), tuple(put(a) for a in node.args))
        table.append(entry)
        seen[key] = (node, len(table) - 1)
        return len(table) - 1

    refs = tuple(-1 if r is None else put(r) for r in roots)
    return repr((tuple(table), refs))


def loads(text: str) -> tuple:
    """The trees of dumps(*roots), None where a root was None."""
    import ast

    table, refs = ast.literal_eval(text)
    nodes: list = []
    for entry in table:
        kind, dtype = entry[0], _dtype(entry[2])
        if kind == "i":
            nodes.append(Input(entry[1], dtype))
        elif kind == "c":
            value = entry[1]
            value = float.fromhex(value[1]) if isinstance(value, tuple) else value
            nodes.append(Const(value, dtype))
        elif kind == "l":
            nodes.append(Load(entry[1], tuple(nodes[i] for i in entry[3]), dtype))
        else:
            nodes.append(Op(entry[1], tuple(nodes[i] for i in entry[3]), dtype))
    return tuple(None if r < 0 else nodes[r] for r in refs)
