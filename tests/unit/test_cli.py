"""The README's commands: `python -m asymflash demo` runs and reports small errors."""

from __future__ import annotations

import re

from asymflash.__main__ import main


def test_demo_runs_and_matches_the_reference(capsys):
    assert main(["demo", "--seqlen", "48", "--causal"]) == 0
    text = capsys.readouterr().out
    errors = [float(x) for x in re.findall(r"(\d\.\d+e[-+]\d+)", text)]
    assert len(errors) == 4  # out, dq, dk, dv
    assert max(errors) < 5e-2


def test_unknown_command_is_refused(capsys):
    assert main(["nonsense"]) == 2
    assert "usage" in capsys.readouterr().out
