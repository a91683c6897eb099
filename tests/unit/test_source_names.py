"""Every name a source file reads is defined. The GPU test files and scripts run only on a
GPU machine, where a leftover name from a refactor costs a whole device run (a helper that
stopped returning a value left every case of a GPU file failing on a NameError); pyflakes
finds such names here, on the CPU, without running anything."""
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages, reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("asymflash", "tests", "scripts", "benchmarks")
                 for p in (ROOT / d).rglob("*.py"))
# Names read but never bound, and locals bound but never read (a value a refactor forgot).
FAULTS = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport,
          messages.UnusedVariable)


class _Collect(reporter.Reporter):
    def __init__(self):
        self.found = []

    def flake(self, message):
        if isinstance(message, FAULTS):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


def test_sources_found():
    assert len(SOURCES) > 100, SOURCES


def test_every_name_read_is_defined():
    collect = _Collect()
    for path in SOURCES:
        pyflakes_api.check(path.read_text(), str(path.relative_to(ROOT)), collect)
    assert not collect.found, "\n".join(collect.found)
