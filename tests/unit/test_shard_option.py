"""conftest's --shard I/N (scripts/gpu-check.sh splits its slowest GPU file with it): the N
slices are disjoint, contiguous and cover every collected test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _collect(*args):
    res = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                          "tests/unit/test_sm90_host_transforms.py", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return [line for line in res.stdout.splitlines() if "::" in line]


def test_shards_partition_the_collection_in_order():
    everything = _collect()
    assert len(everything) >= 4
    slices = [_collect("--shard", f"{i}/3") for i in range(3)]
    assert sum(slices, []) == everything
    assert all(slices)


def test_shard_out_of_range_is_a_usage_error():
    res = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                          "tests/unit/test_sm90_host_transforms.py", "--shard", "3/3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode != 0 and "--shard 3/3" in res.stdout + res.stderr
