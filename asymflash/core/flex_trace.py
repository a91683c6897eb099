"""From a user's score_mod / mask_mod (plain torch ops) to the expression form of flex_ir.

The mod is traced once with make_fx on one-element tensors (score fp32, indices int32), so
its aten ops come out in one canonical spelling; captured tensors appear as graph constants
that are the user's very tensors (so their gradients reach them). Each aten op is mapped to
an IR op; anything else is refused with its name. Traces are cached per function, the
identity and metadata of the tensors in its closure, defaults and referenced globals, and
the values of the Python scalars there (a trace bakes them in as constants).
"""

from __future__ import annotations

import collections
import functools
import inspect

import torch

from .flex_ir import INPUTS, Const, Input, Load, Mod, Op

aten = torch.ops.aten

_BINARY = {
    aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub",
    aten.sub.Scalar: "sub", aten.mul.Tensor: "mul", aten.mul.Scalar: "mul",
    aten.div.Tensor: "div", aten.div.Scalar: "div",
    aten.floor_divide.default: "floordiv", aten.floor_divide.Scalar: "floordiv",
    aten.remainder.Tensor: "remainder", aten.remainder.Scalar: "remainder",
    aten.minimum.default: "minimum", aten.maximum.default: "maximum",
    aten.eq.Tensor: "eq", aten.eq.Scalar: "eq", aten.ne.Tensor: "ne", aten.ne.Scalar: "ne",
    aten.lt.Tensor: "lt", aten.lt.Scalar: "lt", aten.le.Tensor: "le", aten.le.Scalar: "le",
    aten.gt.Tensor: "gt", aten.gt.Scalar: "gt", aten.ge.Tensor: "ge", aten.ge.Scalar: "ge",
    aten.logical_and.default: "and", aten.logical_or.default: "or",
    aten.bitwise_and.Tensor: "and", aten.bitwise_and.Scalar: "and",
    aten.bitwise_or.Tensor: "or", aten.bitwise_or.Scalar: "or",
}
_UNARY = {
    aten.neg.default: "neg", aten.abs.default: "abs", aten.exp.default: "exp",
    aten.exp2.default: "exp2", aten.log.default: "log", aten.tanh.default: "tanh",
    aten.sigmoid.default: "sigmoid", aten.floor.default: "floor",
    aten.logical_not.default: "not", aten.bitwise_not.default: "not",
}
_IDENTITY = {aten.detach.default, aten.alias.default, aten.clone.default}
_BOOLEAN_ONLY = {"and", "or", "not"}  # bitwise ops are accepted on booleans only

SUPPORTED = sorted({*(f"{op}" for op in _BINARY.values()), *_UNARY.values(), "where",
                    "minimum/maximum/clamp", "abs", "to(dtype)", "captured[index]"})


class ModTraceError(TypeError):
    """A mod that cannot be turned into kernel code (an unsupported op, data-dependent
    control flow...)."""


def _example_inputs(kind: str, device):
    idx = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4)]
    return ([torch.zeros(1, dtype=torch.float32, device=device)] + idx) if kind == "score" \
        else idx


def trace(fn, kind: str, device="cpu") -> Mod:
    """The expression form of `fn` (a score_mod if kind == "score", else a mask_mod), traced
    on `device`, where the tensors it captures live (one-element tensors cannot mix
    devices)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    names = INPUTS if kind == "score" else INPUTS[1:]
    what = "score_mod" if kind == "score" else "mask_mod"
    try:
        # no_grad: the graph holds the forward ops only (no autograd detach nodes)
        with torch.no_grad():
            gm = make_fx(fn)(*_example_inputs(kind, device))
    except Exception as exc:  # noqa: BLE001 - any tracing failure gets one clear message
        raise ModTraceError(
            f"asymflash: {what} {_name(fn)} could not be traced with one-element tensors "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); a mod "
            "must be a pure function of its arguments in torch ops, with no Python control "
            "flow on tensor values and no .item()") from exc
    return _Converter(gm, names, kind, what, _name(fn), device).run()


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class _Converter:
    def __init__(self, gm, names, kind, what, fn_name, device):
        self.gm, self.names, self.kind, self.what, self.fn_name = gm, names, kind, what, fn_name
        self.device = device
        self.env: dict = {}      # fx node -> IR node, or ("tensor", t) for a captured tensor
        self.slots: list = []    # captured tensors in slot order

    def fail(self, detail: str):
        raise ModTraceError(f"asymflash: {self.what} {self.fn_name}: {detail}; supported: "
                            f"{', '.join(SUPPORTED)}")

    def slot(self, t: torch.Tensor) -> int:
        for i, s in enumerate(self.slots):
            if s is t:
                return i
        self.slots.append(t)
        return len(self.slots) - 1

    def arg(self, a):
        """An IR node for an fx argument (a graph value or a Python scalar)."""
        if isinstance(a, torch.fx.Node):
            val = self.env[a]
            if isinstance(val, tuple):  # a captured tensor used whole: one element only
                t = val[1]
                if t.numel() != 1:
                    self.fail(f"captured tensor of shape {tuple(t.shape)} used without "
                              "indexing (index it with the mod's arguments)")
                return Load(self.slot(t), (), t.dtype)
            return val
        if isinstance(a, bool):
            return Const(a, torch.bool)
        if isinstance(a, int):
            return Const(a, torch.int64)
        if isinstance(a, float):
            return Const(a, torch.float32)
        self.fail(f"argument {a!r} of type {type(a).__name__}")

    def run(self) -> Mod:
        result = None
        inputs = iter(self.names)
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                name = next(inputs)
                self.env[node] = Input(name, torch.float32 if name == "score" else torch.int32)
            elif node.op == "get_attr":
                self.env[node] = ("tensor", getattr(self.gm, node.target))
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                out = node.args[0]
                result = out[0] if isinstance(out, (tuple, list)) else out
        root = self.arg(result)
        if self.kind == "mask" and root.dtype != torch.bool:
            root = Op("ne", (root, Const(0, torch.int64)), torch.bool)
        if self.kind == "score" and root.dtype != torch.float32:
            root = Op("cast", (root,), torch.float32)
        return Mod(self.kind, root, tuple(self.slots))

    def call(self, node):
        target, args, kwargs = node.target, node.args, node.kwargs
        val = node.meta.get("val")
        if target in _IDENTITY:
            return self.env[args[0]]
        if target is aten.lift_fresh_copy.default:
            # torch.tensor(...) written inside the mod: a constant of the function
            t = self.env[args[0]][1]
            if t.numel() != 1:
                self.fail(f"tensor constant of shape {tuple(t.shape)}")
            return Const(t.item(), t.dtype)
        if target is aten.scalar_tensor.default:
            dtype = kwargs.get("dtype") or torch.float32
            return Const(args[0], dtype)
        if target is aten.index.Tensor:
            return self.index(args)
        if target is aten._to_copy.default:
            src = self.arg(args[0])
            dtype = kwargs.get("dtype", src.dtype)
            return src if dtype == src.dtype else Op("cast", (src,), dtype)
        ins = [None if a is None else self.arg(a) for a in args]
        dtype = self.result_dtype(target, args, kwargs, val)
        if target in _BINARY:
            name = _BINARY[target]
            alpha = kwargs.get("alpha")
            if alpha is not None and alpha != 1:
                ins[1] = Op("mul", (ins[1], self.arg(alpha)), dtype)
            return self.op(name, ins, dtype)
        if target in (aten.rsub.Scalar, aten.rsub.Tensor):
            return self.op("sub", [ins[1], ins[0]], dtype)
        if target in _UNARY:
            return self.op(_UNARY[target], ins, dtype)
        if target in (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther,
                      aten.where.Scalar):
            return Op("where", tuple(ins), dtype)
        if target in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
            x = ins[0]
            lo = args[1] if len(args) > 1 else kwargs.get("min")
            hi = args[2] if len(args) > 2 else kwargs.get("max")
            if target is aten.clamp_max.default:
                lo, hi = None, lo
            if lo is not None:
                x = Op("maximum", (x, self.arg(lo)), dtype)
            if hi is not None:
                x = Op("minimum", (x, self.arg(hi)), dtype)
            return x
        if target is aten.div.Tensor_mode:
            mode = kwargs.get("rounding_mode")
            if mode == "floor":
                return Op("floordiv", tuple(ins), dtype)
            self.fail(f"division with rounding_mode={mode!r} (use floor division)")
        self.fail(f"op {getattr(target, '__name__', target)}")

    def op(self, name, ins, dtype):
        if name in _BOOLEAN_ONLY and any(i.dtype != torch.bool for i in ins):
            self.fail(f"bitwise op {name!r} on non-boolean values")
        return Op(name, tuple(ins), dtype)

    def result_dtype(self, target, args, kwargs, val):
        if isinstance(val, torch.Tensor):
            return val.dtype
        # make_fx (real mode) does not always record values: run the op on examples
        example = [self.example(a) for a in args]
        try:
            return target(*example, **kwargs).dtype
        except Exception:  # noqa: BLE001 - the op itself is refused next with its name
            return torch.float32

    def example(self, a):
        if isinstance(a, torch.fx.Node):
            v = self.env[a]
            if isinstance(v, tuple):
                return v[1]
            return torch.zeros(1, dtype=v.dtype, device=self.device)
        return a

    def index(self, args):
        base = self.env[args[0]]
        if not isinstance(base, tuple):
            self.fail("indexing a computed value (only captured tensors can be indexed)")
        t = base[1]
        idx = args[1]
        if any(i is None for i in idx) or len(idx) != t.dim():
            self.fail(f"captured tensor of shape {tuple(t.shape)} indexed with {len(idx)} "
                      "index(es): index every dimension with an integer expression")
        ins = tuple(self.arg(i) for i in idx)
        if any(i.dtype.is_floating_point or i.dtype == torch.bool for i in ins):
            self.fail("captured tensor indexed with a non-integer value")
        return Load(self.slot(t), ins, t.dtype)


# ---------------------------------------------------------------- cache

_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 256


_SCALARS = (bool, int, float, complex, str, type(None))


def _closure_values(fn) -> list:
    """The values a function can see besides its arguments: closure cells, defaults,
    referenced globals, and those of a functools.partial or a callable object's attributes
    (nested functions in its closure included). Tensors among them are captured by
    identity, Python scalars become constants of the trace: both go into the cache key, so
    rebinding one re-traces."""
    found = []
    if isinstance(fn, functools.partial):
        found += [*fn.args, *fn.keywords.values()]
        fn = fn.func
    if not inspect.isfunction(fn) and not inspect.ismethod(fn):
        if hasattr(fn, "__dict__"):
            found += list(vars(fn).values())
        fn = type(fn).__call__  # a callable object: its method's closure and globals
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if inspect.isfunction(value) and value is not fn:
            found += _closure_values(value)
        else:
            found.append(value)
    found += list(getattr(fn, "__defaults__", None) or ())
    if code is not None:
        globs = getattr(fn, "__globals__", {})
        found += [globs[name] for name in code.co_names if name in globs]
    return [v for v in found if isinstance(v, (torch.Tensor, *_SCALARS))]


def _key(fn, kind, device):
    values = _closure_values(fn)
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    scalars = tuple((type(v), v) for v in values if not isinstance(v, torch.Tensor))
    return (kind, fn, str(device), scalars,
            tuple((id(t), t.dtype, tuple(t.shape), t.device) for t in tensors)), tensors


def traced(fn, kind: str, device="cpu") -> Mod:
    """trace(fn, kind, device), cached per function, device and captured-tensor signature.
    A tensor the function visibly captures on another device is refused before tracing."""
    try:
        key, tensors = _key(fn, kind, device)
        hash(key)
    except TypeError:  # an unhashable callable: trace every call
        return trace(fn, kind, device)
    for t in tensors:
        if t.device != torch.device(device):
            what = "score_mod" if kind == "score" else "mask_mod"
            raise ValueError(f"asymflash: {what} {_name(fn)} captures a tensor of shape "
                             f"{tuple(t.shape)} on {t.device}, the inputs are on {device}: "
                             "move it to one device")
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit[0]
    mod = trace(fn, kind, device)
    # keep the closure tensors alive with the entry: their ids are in the key
    _CACHE[key] = (mod, tensors)
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return mod


def clear_cache():
    _CACHE.clear()


__all__ = ["trace", "traced", "clear_cache", "ModTraceError"]
