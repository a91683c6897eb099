"""The direct launcher (backends/launch.py) keys compiled binaries exactly as Triton
specialises them: checked against Triton's own `native_specialize_impl`, on the CPU."""

import itertools

import pytest
import torch

from asymflash.runtime import launch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402


def triton_spec(a):
    return native_specialize_impl(CUDABackend, a, False, True, True)


def assert_same_partition(values):
    """Two arguments share a key exactly when Triton specialises them the same way."""
    for a, b in itertools.combinations(values, 2):
        ours = launch.specialization_key([a]) == launch.specialization_key([b])
        theirs = triton_spec(a) == triton_spec(b)
        assert ours == theirs, (a, b, triton_spec(a), triton_spec(b))


def test_int_classes_match_triton():
    values = [0, 1, 2, 3, 15, 16, 17, 32, 113, 203, 4096, -1, -16, -17, 2**31 - 16, 2**31 - 1,
              2**31, 2**31 + 16, 2**31 + 17, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63,
              2**63 + 16, 2**64 - 16]
    assert_same_partition(values)


def test_tensor_classes_match_triton():
    buf = torch.randn(4096, dtype=torch.float32)
    views = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        base = buf.view(dtype)
        views += [base[i:] for i in (0, 1, 2, 3, 4, 8, 16, 17)]
    assert_same_partition(views)


def test_scalars_match_triton():
    assert_same_partition([1.5, -0.0, 1e30, float("inf"), True, False, None])


def test_descriptor_classes_match_triton():
    fwd = pytest.importorskip("asymflash.backends.sm90.fwd.host")
    if fwd.GLUON_ERROR is not None:
        pytest.skip(fwd.GLUON_ERROR)
    t = torch.randn(64, 4, 128).to(torch.bfloat16)
    h = torch.randn(64, 4, 128).to(torch.float16)
    descs = [fwd.tma_rows(t, (64, 128)), fwd.tma_rows(t[1:], (64, 128)),
             fwd.tma_rows(t, (128, 128)), fwd.tma_rows(h, (64, 128)),
             fwd.tma_heads(t, 64, 128), fwd.tma_heads(t, 128, 128), fwd.tma_heads(h, 64, 128)]
    assert_same_partition(descs)
    # asymflash's own descriptors carry a token; one built without keys the same way
    bare = fwd.tma_rows(t, (64, 128))
    del bare.asym_token
    assert launch.specialization_key([bare]) == launch.specialization_key([descs[0]])


class FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, leave, *args):
        self.log.append(("direct", (g0, g1, g2), args))


class FakeJit:
    """Stands in for a JITFunction: records each launch through Triton's path."""

    arg_names = ["x", "n", "scale", "BLOCK", "FLAG"]
    device_caches: dict = {}  # what marks a compiling (not interpreted) kernel

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, dict(kwargs)))
            return FakeCompiled(self.log)
        return run


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 7, raising=False)
    launch.reset_mode()
    yield
    launch.reset_mode()


def fake_kernel(monkeypatch):
    """A DirectLaunch over FakeJit whose binder always reports one specialisation."""
    monkeypatch.setattr(launch.DirectLaunch, "_binder",
                        lambda self, d: lambda *a, **k: (None, "spec", None))
    jit = FakeJit()
    return jit, launch.DirectLaunch(jit), torch.randn(64)


def test_direct_launch_compiles_once_per_class(fake_cuda, monkeypatch):
    jit, kernel, x = fake_kernel(monkeypatch)
    kernel[(3, 2)](x, 32, 0.5, BLOCK=64, FLAG=True, num_warps=4)
    kernel[(5, )](x, 48, 0.25, BLOCK=64, FLAG=True, num_warps=4)   # same class: direct
    kernel[(5, )](x, 17, 0.25, BLOCK=64, FLAG=True, num_warps=4)   # 17 % 16 != 0: compile
    kernel[(5, )](x, 32, 0.25, BLOCK=128, FLAG=True, num_warps=4)  # new constexpr: compile
    kernel[(5, )](x[1:], 32, 0.25, BLOCK=128, FLAG=True, num_warps=4)  # misaligned: compile
    kinds = [entry[0] for entry in jit.log]
    assert kinds == ["jit", "direct", "jit", "jit", "jit"]
    # the direct launch passes runtime args then the constexprs in signature order
    assert jit.log[1] == ("direct", (5, 1, 1), (x, 48, 0.25, 64, True))


def test_bound_launch_of_a_kernel_without_descriptors(fake_cuda, monkeypatch):
    # Call plans bind the binary after the first launch; a kernel without descriptor
    # arguments binds Triton's C launcher (kernel.run) with the constexpr tail appended.
    jit, kernel, x = fake_kernel(monkeypatch)
    kwargs = dict(BLOCK=64, FLAG=True, num_warps=4)
    assert kernel.bind((x, 32, 0.5), kwargs) is None  # nothing compiled yet
    kernel[(3, 2)](x, 32, 0.5, **kwargs)
    bound = kernel.bind((x, 32, 0.5), kwargs)
    y = torch.randn(64)
    assert bound((4, 1), (y, 48, 0.25)) is True
    assert jit.log[-1] == ("direct", (4, 1, 1), (y, 48, 0.25, 64, True))
    assert kernel.bind((x, 17, 0.5), kwargs) is None  # another class: not compiled


def test_launch_site_binds_after_its_first_launch(fake_cuda, monkeypatch):
    # A runner's LaunchSite: Triton's path once (compiling), the bound binary after; with a
    # profiler's hook installed since, the bound launch declines and Triton's path runs.
    from triton import knobs

    jit, kernel, x = fake_kernel(monkeypatch)
    site = launch.LaunchSite()
    kwargs = dict(BLOCK=64, FLAG=True, num_warps=4)
    site(kernel, (3, 2), (x, 32, 0.5), kwargs)
    assert site.bound is not None
    y = torch.randn(64)
    site(kernel, (4,), (y, 48, 0.25), kwargs)
    assert [entry[0] for entry in jit.log] == ["jit", "direct"]
    assert jit.log[-1] == ("direct", (4, 1, 1), (y, 48, 0.25, 64, True))
    hook = knobs.HookChain()
    hook.add(lambda metadata: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    site(kernel, (4,), (y, 48, 0.25), kwargs)
    assert jit.log[-1][0] == "jit" and jit.log[-1][1] == (4,)


def test_direct_launch_off_and_unkeyable(fake_cuda, monkeypatch):
    jit, kernel, x = fake_kernel(monkeypatch)
    monkeypatch.setenv("ASYMFLASH_DIRECT_LAUNCH", "0")
    launch.reset_mode()
    for _ in range(2):
        kernel[(1, )](x, 32, 0.5, BLOCK=64, FLAG=True)
    monkeypatch.setenv("ASYMFLASH_DIRECT_LAUNCH", "1")
    launch.reset_mode()
    for _ in range(2):  # an argument kind the key does not model: Triton's path every time
        kernel[(1, )](x, 32, object(), BLOCK=64, FLAG=True)
    assert [entry[0] for entry in jit.log] == ["jit"] * 4


def test_left_out_defaults_take_tritons_path(fake_cuda, monkeypatch):
    # A trailing parameter left to its default: the launcher's argument list cannot be
    # rebuilt from the call, so every call goes through Triton.
    jit, kernel, x = fake_kernel(monkeypatch)
    for _ in range(2):
        kernel[(1, )](x, 32, 0.5, BLOCK=64)
    assert [entry[0] for entry in jit.log] == ["jit", "jit"]


def test_check_mode_catches_a_wrong_key(fake_cuda, monkeypatch):
    specs = iter(["built", "different"])
    monkeypatch.setattr(launch.DirectLaunch, "_binder",
                        lambda self, d: lambda *a, **k: (None, next(specs), None))
    monkeypatch.setenv("ASYMFLASH_DIRECT_LAUNCH", "check")
    launch.reset_mode()
    kernel = launch.DirectLaunch(FakeJit())
    x = torch.randn(64)
    kernel[(1, )](x, 32, 0.5, BLOCK=64, FLAG=True)
    with pytest.raises(AssertionError, match="specialises"):
        kernel[(1, )](x, 32, 0.5, BLOCK=64, FLAG=True)


def test_profiler_hooks_take_tritons_path(fake_cuda, monkeypatch):
    from triton import knobs

    hook = knobs.HookChain()
    hook.add(lambda metadata: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    jit, kernel, x = fake_kernel(monkeypatch)
    for _ in range(2):
        kernel[(1, )](x, 32, 0.5, BLOCK=64, FLAG=True)
    assert [entry[0] for entry in jit.log] == ["jit", "jit"]


def test_cached_map_launch_passes_what_tritons_launcher_passes(monkeypatch):
    # Triton's own descriptor expansion (wrap_handle_tensordesc) and the cached one must hand
    # the C launch the same argument list; the encode runs once per buffer and shape.
    from types import SimpleNamespace

    from triton.backends.nvidia import driver as nv

    encodes = []

    def fake_encode(arg, meta):  # stands in for the CUDA tensor-map encode
        encodes.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), tuple(arg.shape), meta["swizzle"]), *arg.shape,
                *arg.strides]

    monkeypatch.setattr(nv, "make_tensordesc_arg", fake_encode)
    launched = []
    signature = {"a": "tensordesc<bf16[64, 32]>", "x": "*fp32", "b": "tensordesc<bf16[64, 32]>",
                 "n": "i32", "BLOCK": "constexpr"}
    run = SimpleNamespace(global_scratch_size=0, profile_scratch_size=0,
                          launch_cooperative_grid=False, launch_pdl=True,
                          launch=nv.wrap_handle_tensordesc(lambda *a: launched.append(a),
                                                           signature,
                                                           [{"swizzle": 128}, {"swizzle": 64}]))
    kernel = SimpleNamespace(function=11, packed_metadata=22, run=run)
    fast = launch._CachedMapLaunch.build(kernel)
    if fast is None and not triton.__version__.startswith("3.6."):
        # build() declined this launcher, so such kernels keep Triton's own: safe, slower.
        pytest.skip(f"the cached-map launcher follows triton 3.6's CUDA launcher; triton "
                    f"{triton.__version__}'s differs, and kernels keep Triton's own there")
    assert fast is not None

    def desc(t):
        return SimpleNamespace(base=t, shape=[t.shape[0], t.shape[1]], strides=[t.shape[1], 1],
                               padding="zero")

    x, ta, tb = torch.randn(8), torch.randn(128, 32), torch.randn(256, 32)
    args = (desc(ta), x, desc(tb), 5, 64)
    run.launch(3, 2, 1, 7, 11, False, True, None, None, 22, None, None, None, *args)
    fast(3, 2, 1, 7, args)
    assert launched[0] == launched[1]
    assert len(encodes) == 4  # two by Triton's path, two on the first cached launch
    fast(3, 2, 1, 7, (desc(ta), x, desc(tb), 9, 64))  # same buffers: no encode
    assert len(encodes) == 4 and launched[2][-2:] == (9, 64)
    tc = torch.randn(128, 32)
    fast(3, 2, 1, 7, (desc(tc), x, desc(tb), 9, 64))  # a new buffer: encoded once
    assert encodes[4:] == [tc.data_ptr()] and launched[3][13][1] == tc.data_ptr()
    # a launcher this was not written for (scratch memory): Triton's own
    run.global_scratch_size = 64
    assert launch._CachedMapLaunch.build(kernel) is None
    # no descriptor arguments (Triton's launch is the C function): nothing to cache
    run.global_scratch_size = 0
    run.launch = len  # a builtin, as the compiled launcher's C function
    assert launch._CachedMapLaunch.build(kernel) is None


@pytest.mark.parametrize("total_q,width,acc_rows", [(1, 64, 1), (113, 128, 113),
                                                   (203, 256, 203), (17, 128, 320),
                                                   (203, 64, 448)])
def test_preprocess_zeroes_the_dq_accumulator(total_q, width, acc_rows):
    """The backward preprocess writes delta = rowsum(dO * O) - dlse and, for the sm90
    backward, zeroes its fp32 dQ accumulator in the same launch: total_q rows, or more (the
    fragment-order buffer, sm90/dq_fragments.py)."""
    from asymflash.backends.portable import row_delta

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hq, dv = 3, 72
    out = torch.randn(total_q, hq, dv, device=device).to(torch.bfloat16)
    dout = torch.randn(total_q, hq, dv, device=device).to(torch.bfloat16)
    dlse = torch.randn(hq, total_q, device=device)
    acc = torch.full((acc_rows, hq, width), float("nan"), device=device)
    delta = row_delta(out, dout, dlse, zero=acc)
    want = (out.float() * dout.float()).sum(-1).transpose(0, 1) - dlse
    torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(acc, torch.zeros_like(acc))
