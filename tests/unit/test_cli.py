"""The README's commands: `python -m asymflash demo` checks itself; the CLI's help and errors."""

from __future__ import annotations

import re

import pytest
import torch

import asymflash
from asymflash.__main__ import main


def test_demo_runs_and_passes(capsys):
    assert main(["demo", "--seqlen", "48", "--causal"]) == 0
    text = capsys.readouterr().out
    pairs = re.findall(r"max error (\S+) \(bound (\S+)\) ok", text)
    assert len(pairs) == 4  # out, dq, dk, dv
    assert all(float(err) <= float(bound) for err, bound in pairs)
    assert "PASS" in text


def test_demo_fails_with_exit_1_on_a_wrong_result(capsys, monkeypatch):
    real = asymflash.flash_attn_func

    def off_by_a_little(*args, **kwargs):
        return real(*args, **kwargs) * 1.05
    monkeypatch.setattr(asymflash, "flash_attn_func", off_by_a_little)
    assert main(["demo", "--seqlen", "33"]) == 1
    assert "FAIL (out, dq, dk, dv)" in capsys.readouterr().out


def test_help_lists_the_commands_and_exits_0(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("demo", "bench", "env"))


def test_unknown_or_missing_command_is_refused(capsys):
    assert main(["nonsense"]) == 2
    assert "usage" in capsys.readouterr().err
    assert main([]) == 2


@pytest.mark.parametrize("argv,message", [
    (["demo", "--seqlen", "0"], "at least 1"),
    (["demo", "--device", "tpu"], "runs on cuda"),
])
def test_bad_demo_arguments_exit_2_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_demo_on_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["demo", "--device", "cuda"])
    assert stop.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_env_lists_backends_and_switches(capsys):
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert "cpu (CPU): backends ['cpu'" in text and "ASYMFLASH_CALL_PLANS" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_warm_without_a_gpu_refuses_and_says_why(capsys):
    # a CPU-side compile would land under other cache keys than a GPU process's launches
    assert main(["warm", "--heads", "8", "--head-dim", "64", "--seqlen", "128"]) == 2
    text = capsys.readouterr().out
    assert "needs the GPU" in text and "warm nothing" in text


@pytest.mark.parametrize("argv,message", [
    (["warm", "--heads", "6", "--kv-heads", "4", "--head-dim", "64", "--seqlen", "9"],
     "not a multiple"),
    (["warm", "--heads", "8", "--head-dim", "64", "--seqlen", "0"], "at least 1"),
    (["warm", "--heads", "8", "--seqlen", "64"], "--head-dim"),
])
def test_bad_warm_arguments_exit_2_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_warm(capsys):
    assert main(["--help"]) == 0
    assert "warm" in capsys.readouterr().out
