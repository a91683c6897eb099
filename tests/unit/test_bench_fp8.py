"""The benchmark's fp8 mode at smoke size on the CPU: inputs, reference check, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from asymflash.bench import cli as bench
from asymflash.bench.core import OK, WRONG, Case, Provider, cpu_timer
from asymflash.bench.fp8 import Fp8Runner, fp8_providers, make_fp8_inputs
from asymflash.core.fp8 import dequantize
from asymflash.reference import attention_ref

CASE = Case(batch=2, seqlen_q=17, seqlen_k=33, nheads=4, nheads_kv=2, hdim=32, hdim_v=32,
            causal=True, dtype="fp8")


def test_inputs_are_e4m3_with_per_head_descales():
    inputs = make_fp8_inputs(CASE, "cpu", seed=1)
    assert {t.dtype for t in (inputs.q8, inputs.k8, inputs.v8)} == {torch.float8_e4m3fn}
    assert all(d.shape == (2, 2) and d.dtype == torch.float32 for d in inputs.descales)
    for deq, t8, d in zip((inputs.q, inputs.k, inputs.v), (inputs.q8, inputs.k8, inputs.v8),
                          inputs.descales):
        assert torch.equal(deq, dequantize(t8, d))
    # Each (batch, KV head)'s largest magnitude maps to e4m3's largest value.
    amax = inputs.k8.float().abs().amax(dim=(1, 3))
    assert torch.equal(amax, torch.full_like(amax, 448.0))


def _run(providers):
    runner = Fp8Runner(providers, ("fwd",), cpu_timer(reps=1, warmup=0), "cpu", attention_ref)
    return {r.provider: r for r in runner.run_case(CASE)}


def test_fp8_cells_are_checked_against_the_dequantised_reference():
    results = _run(fp8_providers())
    for name in ("asymflash-fp8", "asymflash-bf16"):
        r = results[name]
        assert r.status == OK, r.reason
        err, bound = r.errors["out"]
        assert 0 < err <= bound
    assert results["cuDNN-fp8"].reason  # n/a on the CPU, with the reason
    print(f"\nfp8 vs bf16 on the same dequantised values: fp8 max err "
          f"{results['asymflash-fp8'].errors['out'][0]:.3g}, bf16 "
          f"{results['asymflash-bf16'].errors['out'][0]:.3g}")


def test_a_provider_that_drops_v_descale_is_wrong():
    from asymflash import flash_attn_func

    def no_v_descale(inputs, causal):
        qd, kd, _ = inputs.descales
        return lambda: flash_attn_func(inputs.q8, inputs.k8, inputs.v8, causal=causal,
                                       q_descale=qd, k_descale=kd)

    r = _run([Provider("broken", no_v_descale, modes=("fwd",))])["broken"]
    assert r.status == WRONG


def test_cli_fp8_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU smoke size
    code = bench.main(["--dtype", "fp8", "--hdim", "32", "--seqlen", "64", "--causal", "1",
                       "--batch", "1", "--nheads", "2", "--out", str(tmp_path), "--no-plots"])
    assert code == 0
    record = json.loads((tmp_path / "results.json").read_text())
    by_name = {r["provider"]: r for r in record["results"]}
    assert by_name["asymflash-fp8"]["status"] == OK and by_name["asymflash-fp8"]["errors"]
    assert by_name["cuDNN-fp8"]["status"] == "n/a" and by_name["cuDNN-fp8"]["reason"]


@pytest.mark.parametrize("argv", [["--mode", "bwd"], ["--suite", "models"]])
def test_cli_fp8_refuses_backward_and_models(argv, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dtype", "fp8", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2


def test_exp2_emulation_columns_set_the_switch_and_are_checked():
    """The fp8 exp2-emulation columns are asked for by name, run with the forward's switch
    set (and unset after), and are checked like the rest."""
    import os

    from asymflash.backends.sm90.fwd.host import EXP2_EMU_SWITCH

    named = {p.name: p for p in fp8_providers()}
    emu = [named[f"asymflash-fp8-exp2emu{k}"] for k in (2, 4, 8)]
    assert all(p.opt_in for p in emu)
    with emu[2].context():
        assert os.environ[EXP2_EMU_SWITCH] == "8"
    assert EXP2_EMU_SWITCH not in os.environ
    r = _run([emu[2]])["asymflash-fp8-exp2emu8"]
    assert r.status == OK, r.reason


def test_the_grid_quantises_per_tensor_for_cudnn():
    """The fp8 grid's inputs carry one scale per tensor (in FA3's (batch, kv head) form), its
    amax at e4m3's largest value; per-head inputs are refused by the cuDNN column, by name,
    before it needs cuDNN."""
    from asymflash.bench.fp8 import _cudnn_fp8

    inputs = make_fp8_inputs(CASE, "cpu", seed=3, per_tensor=True)
    for deq, t8, d in zip((inputs.q, inputs.k, inputs.v), (inputs.q8, inputs.k8, inputs.v8),
                          inputs.descales):
        assert d.shape == (2, 2) and torch.unique(d).numel() == 1
        assert t8.float().abs().max().item() == 448.0
        assert torch.equal(deq, dequantize(t8, d))
    with pytest.raises(NotImplementedError, match="one descale per tensor"):
        _cudnn_fp8(make_fp8_inputs(CASE, "cpu", seed=3), causal=False)
