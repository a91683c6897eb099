"""Launch a Triton/Gluon kernel's compiled binary directly once it has been compiled.

`kernel[grid](*args, **constexprs)` costs 25-90 us of host time per call on the H200
machine (docs/tuning.md, host path): binding the arguments, specialising each
one, building a cache key, then the launcher. At 512-row shapes our calls are host-bound,
so that time is kernel time lost. `DirectLaunch` keeps the binary Triton compiled for each
distinct call signature and launches it through its launcher (15-28 us measured).

The signature has to be exactly what Triton specialises on, or a binary compiled under one
assumption would run under another. Triton 3.6 (the version the sm90 backend is pinned to,
`dispatch.SM90_TESTED_TRITON`) specialises: an int on == 1, on divisibility by 16 and on
its width (i32 / i64); a tensor on its dtype and on a 16-byte aligned data pointer; a
tensor descriptor on its dtype, box and shared layout; floats and bools only on their type.
`specialization_key` encodes the same classes (tests/test_direct_launch.py checks it
against Triton's own `native_specialize_impl`); for parameters a kernel marks
`do_not_specialize` it is finer than Triton's, which only costs an extra cache entry.
Any other kind of argument, a launch hook (profilers), a call leaving a defaulted parameter
out or ASYMFLASH_DIRECT_LAUNCH=0 takes Triton's normal path;
ASYMFLASH_DIRECT_LAUNCH=check also runs Triton's binder on every direct launch and fails
if its specialisation differs from the one the binary was compiled for (GPU tests). The
variable is read once, at the first launch.
"""

from __future__ import annotations

import functools

import torch

from . import env

_Tensor = torch.Tensor
_TOKENS: dict = {}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of `device` (cached per device): what persistent grids and split heuristics size
    themselves by. On the CPU (the interpreter) an H200's 132, so those heuristics run there
    as on the GPU."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def descriptor_token(dtype, block: tuple, layout) -> int:
    """A small int naming a descriptor class (dtype, box, shared layout): descriptors built
    by asymflash carry one as `.asym_token`, so keying them costs no layout hashing."""
    return _TOKENS.setdefault((dtype, tuple(block), layout), len(_TOKENS))


class _Unkeyable(Exception):
    pass


def _other_class(a):
    token = getattr(a, "asym_token", None)
    if token is not None:
        return token
    if type(a).__name__ == "TensorDescriptor":  # built elsewhere: key it in full
        return descriptor_token(a.base.dtype, tuple(a.block_shape), a.layout)
    if isinstance(a, bool):
        return "u1"
    raise _Unkeyable(type(a).__name__)


def specialization_key(args) -> tuple:
    """What Triton's compiled binary depends on among `args` (see the module docstring);
    raises _Unkeyable for an argument whose specialisation is not modelled here."""
    key = []
    add = key.append
    for a in args:
        ty = type(a)
        if ty is int:
            # strings, not bools: True == 1 would merge the classes "== 1" and "% 16 == 0"
            if a == 1:
                add("one")
            elif -(2**31) <= a < 2**31:
                add("D" if a % 16 == 0 else "i32")
            elif -(2**63) <= a < 2**64:
                add(("i64" if a < 2**63 else "u64", a % 16 == 0))
            else:
                raise _Unkeyable(repr(a))
        elif ty is _Tensor:
            add(a.dtype)
            add(a.data_ptr() % 16 == 0)
        elif ty is float:
            add("fp32")
        elif a is None:
            add(None)
        else:
            add(_other_class(a))
    return tuple(key)


_mode: list = []


def mode() -> str:
    """'on' (default), 'off' (ASYMFLASH_DIRECT_LAUNCH=0) or 'check'; read from the
    environment at the first launch (an environment lookup costs ~2 us per call)."""
    if not _mode:
        value = env.get("ASYMFLASH_DIRECT_LAUNCH") or "1"
        _mode.append({"0": "off", "check": "check"}.get(value, "on"))
    return _mode[0]


def reset_mode() -> None:
    """Read ASYMFLASH_DIRECT_LAUNCH again at the next launch (tests that change it)."""
    _mode.clear()


def _hooked(hook) -> bool:
    """Whether a launch hook (a profiler's) is installed: triton 3.6 keeps an empty
    HookChain there when none is."""
    return hook is not None and getattr(hook, "calls", True) != []


def launch_hooked() -> bool:
    """Whether a profiler's launch hook is installed (launches must then take Triton's path,
    which calls it)."""
    from triton import knobs

    runtime = knobs.runtime
    return _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


_MISSING = object()


class DirectLaunch:
    """`DirectLaunch(jit)[grid](*args, **kwargs)` behaves as `jit[grid](*args, **kwargs)`:
    runtime arguments positional, constexprs and launch options (num_warps, ...) by keyword,
    always the same keywords in the same order at one call site."""

    def __init__(self, jit):
        self.jit = jit
        self.name = getattr(getattr(jit, "fn", jit), "__name__", "kernel")
        # Under TRITON_INTERPRET=1 kernels are interpreted functions: nothing to launch.
        self.compiles = hasattr(jit, "device_caches")
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        how = mode()
        if how == "off" or launch_hooked() or not self.compiles:
            self.jit[grid](*args, **kwargs)
            return
        device = torch.cuda.current_device()
        try:
            key = (device, tuple(kwargs.items()), specialization_key(args))
        except _Unkeyable:
            self.jit[grid](*args, **kwargs)
            return
        entry = self._compiled.get(key, _MISSING)
        if entry is _MISSING:
            self._compiled[key] = self._compile_and_launch(device, grid, args, kwargs)
            return
        if entry is None:  # a call shape the launcher's argument list cannot be rebuilt for
            self.jit[grid](*args, **kwargs)
            return
        kernel, tail, spec, fast = entry
        if how == "check":
            self._check(device, args, kwargs, spec)
        g = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch._C._cuda_getCurrentRawStream(device)
        fast(g[0], g[1], g[2], stream, args + tail)

    def bind(self, args, kwargs):
        """A launcher for calls whose specialisation equals that of (args, kwargs), or None.

        For call plans (`interface`'s cache per call signature): the caller guarantees that
        every later call's runtime arguments fall in the same specialisation classes (same
        dtypes, ints in the same == 1 / % 16 / width classes, aligned tensors, descriptors of
        one class), so the key need not be rebuilt per call. Needs a launch with these
        arguments first (the binary must exist); None off the plain path (direct launch off
        or in check mode, a launch hook, a call shape Triton's own path must launch)."""
        if mode() != "on" or not self.compiles or launch_hooked():
            return None
        device = torch.cuda.current_device()
        try:
            key = (device, tuple(kwargs.items()), specialization_key(args))
        except _Unkeyable:
            return None
        entry = self._compiled.get(key)
        if entry is None:
            return None
        return BoundLaunch(device, entry[3], entry[1])

    def _binder(self, device):
        return self.jit.device_caches[device][4]

    def _compile_and_launch(self, device, grid, args, kwargs):
        """Triton's normal path (compiles on a miss, launches); keeps the binary, the
        launcher's trailing arguments (the constexprs, in signature order) and Triton's
        specialisation (for check mode)."""
        kernel = self.jit[grid](*args, **kwargs)
        if hasattr(kernel, "result"):  # an asynchronous compile
            kernel = kernel.result()
        _, spec, _ = self._binder(device)(*args, **kwargs)
        names = self.jit.arg_names[len(args):]
        if any(n not in kwargs for n in names):  # a defaulted parameter left out
            return None
        fast = _CachedMapLaunch.build(kernel) or _plain_launch(kernel)
        return kernel, tuple(kwargs[n] for n in names), spec, fast

    def _check(self, device, args, kwargs, spec):
        _, now, _ = self._binder(device)(*args, **kwargs)
        if now != spec:
            raise AssertionError(f"asymflash direct launch of {self.name}: Triton "
                                 f"specialises {now}, the cached binary was built for {spec}")


def _plain_launch(kernel):
    """Triton's C launcher of a compiled kernel without descriptor arguments, called directly
    (`fast(gx, gy, gz, stream, args)`, as `_CachedMapLaunch`)."""
    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata

    def fast(gx, gy, gz, stream, args):
        run(gx, gy, gz, stream, function, metadata, None, None, None, *args)
    return fast


class _CachedMapLaunch:
    """Triton 3.6's launcher minus its per-call Python, for one compiled kernel.

    Triton's CUDA launcher expands every tensor-descriptor argument on every launch into a
    freshly encoded CUtensorMap (`make_tensordesc_arg`: a Python function and a driver encode
    each) before its C `launch`. The map depends only on the tensor's address, shape and
    strides and on the kernel's descriptor metadata, so it is kept here per (argument,
    address, shape, strides) and reused: repeated calls on the same buffers (a training
    step's, a benchmark's, the caching allocator's recycled blocks) skip the encode. The C
    `launch` copies the map into the kernel's parameters, so reuse is safe.

    `build` returns None, and the caller calls Triton's launcher as it is (`_plain_launch`),
    for kernels without descriptor arguments and wherever this launcher's layout differs from
    the one this was written against (scratch buffers, another wrapper).
    """

    _LIMIT = 512  # cached maps per kernel; cleared when full

    def __init__(self, kernel, c_launch, slots, expand):
        run = kernel.run
        self.head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                     kernel.packed_metadata, None, None, None)
        self.c_launch = c_launch
        self.slots = slots  # (argument index, descriptor metadata), descending
        self.expand = expand  # triton's make_tensordesc_arg
        self.maps: dict = {}

    @classmethod
    def build(cls, kernel):
        try:
            from triton.backends.nvidia import driver as nv

            run = kernel.run
            if run.global_scratch_size or run.profile_scratch_size or \
                    nv._BASE_ARGS_FORMAT_LEN != 13:
                return None
            inner = run.launch
            # Without descriptor arguments Triton's launch is the C function itself (no
            # closure) and there is nothing to cache: its own launcher stays.
            if getattr(inner, "__closure__", None) is None:
                return None
            free = dict(zip(inner.__code__.co_freevars,
                            (c.cell_contents for c in inner.__closure__)))
            indices = sorted(free["tensordesc_indices"])
            metas = free["tensordesc_meta"]
            if not metas or len(metas) != len(indices) or None in metas:
                return None
            return cls(kernel, free["launcher"], tuple(reversed(list(zip(indices, metas)))),
                       nv.make_tensordesc_arg)
        except Exception:  # noqa: BLE001 - another triton: its own launcher, unchanged
            return None

    def __call__(self, gx, gy, gz, stream, args):
        args = list(args)
        maps = self.maps
        for i, meta in self.slots:
            d = args[i]
            key = (i, d.base.data_ptr(), *d.shape, *d.strides, d.padding)
            expanded = maps.get(key)
            if expanded is None:
                if len(maps) >= self._LIMIT:
                    maps.clear()
                expanded = maps[key] = self.expand(d, meta)
            args[i:i + 1] = expanded
        self.c_launch(gx, gy, gz, stream, *self.head, *args)


# (kernel, device, launch keywords) -> the pipeline stages that fit that GPU's shared memory
_STAGES_THAT_FIT: dict = {}


def launch_fitting(launcher, grid, args, kwargs: dict) -> dict:
    """`launcher[grid](*args, **kwargs)`, with fewer pipeline stages (`num_stages`) where the
    GPU's shared memory cannot hold the ones asked for; returns the keywords that launched
    (a caller binding the binary afterwards binds those).

    The portable kernels' tiles were chosen on Hopper's 227 KB per block; Ampere's 163 KB
    and Ada's or consumer Ampere's 99 KB refuse some (the contiguous decode at d=128 takes
    136 KB at its 3 stages on sm_86). Triton raises OutOfResources when it loads the binary,
    before the kernel runs, so the call is repeated with one stage fewer (same tiles, same
    grid: only the prefetch depth changes), down to one; the count that fits is remembered.
    """
    key = None
    if _STAGES_THAT_FIT:  # (empty on a GPU where everything fits: no key per call)
        key = _fitting_key(launcher, kwargs)
        fits = _STAGES_THAT_FIT.get(key)
        if fits is not None:
            kwargs = dict(kwargs, num_stages=fits)
    while True:
        try:
            launcher[grid](*args, **kwargs)
            return kwargs
        except Exception as e:
            from triton.runtime.errors import OutOfResources

            stages = kwargs.get("num_stages", 1)
            if not isinstance(e, OutOfResources) or "shared memory" not in str(e) or \
                    stages <= 1:
                raise
            key = key or _fitting_key(launcher, kwargs)
            kwargs = dict(kwargs, num_stages=stages - 1)
            _STAGES_THAT_FIT[key] = stages - 1


def _fitting_key(launcher, kwargs: dict) -> tuple:
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return (id(launcher), device, tuple(kwargs.items()))


class BoundLaunch:
    """One compiled binary's launcher with its constexpr tail fixed (`DirectLaunch.bind`):
    `bound(grid, args)` launches on the current stream of the device it was bound on. A
    launch hook installed since (a profiler started) or another current device makes it
    return False without launching: the caller then takes its normal path."""

    __slots__ = ("device", "fast", "tail")

    def __init__(self, device, fast, tail):
        self.device, self.fast, self.tail = device, fast, tail

    def __call__(self, grid, args) -> bool:
        device = torch.cuda.current_device()
        if device != self.device or launch_hooked():
            return False
        g = tuple(grid) + (1,) * (3 - len(grid))
        self.fast(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device),
                  args + self.tail)
        return True


class LaunchSite:
    """One launch of a runner that call plans keep (a signature's kernels and specialisation
    fixed): `site(launcher, grid, args, kwargs)` launches through `launcher` (a DirectLaunch)
    the first time, binds its binary (`DirectLaunch.bind`) and launches through the bound
    binary from then on, skipping the specialisation key. The caller guarantees what `bind`
    asks: every call at this site passes arguments of one specialisation class."""

    __slots__ = ("bound",)

    def __init__(self):
        self.bound = None

    def __call__(self, launcher: DirectLaunch, grid, args, kwargs) -> None:
        bound = self.bound
        if bound is not None and bound(grid, args):
            return
        launcher[grid](*args, **kwargs)
        if bound is None:  # None again where it cannot bind (a profiler's hook): retried
            self.bound = launcher.bind(args, kwargs)
