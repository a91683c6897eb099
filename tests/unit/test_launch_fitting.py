"""runtime.launch.launch_fitting: a launch the GPU's shared memory refuses is repeated with
fewer pipeline stages (same tiles and grid), the count that fits remembered; every other
failure propagates. Checked with a stand-in launcher that refuses, as Triton does at the
binary's load, any stage count above what its pretend GPU holds."""

from __future__ import annotations

import pytest

from asymflash.runtime import launch

triton = pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402

BYTES_PER_STAGE = 46_000


class SmallGPU:
    """A launcher whose kernel needs BYTES_PER_STAGE per stage, on a GPU with `limit` bytes."""

    def __init__(self, limit=101_376, error=None):
        self.limit, self.error, self.launched, self.tries = limit, error, [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.tries.append(kwargs["num_stages"])
            if self.error is not None:
                raise self.error
            need = BYTES_PER_STAGE * kwargs["num_stages"]
            if need > self.limit:
                raise OutOfResources(need, self.limit, "shared memory")
            self.launched.append((grid, args, kwargs))
        return run


@pytest.fixture(autouse=True)
def fresh_memo(monkeypatch):
    monkeypatch.setattr(launch, "_STAGES_THAT_FIT", {})


def test_a_refused_launch_runs_with_the_stages_that_fit_and_remembers_them():
    gpu = SmallGPU()  # 99 KB: 2 stages of 46 KB fit, 3 do not
    kw = dict(BLOCK_N=128, num_warps=4, num_stages=3)
    used = launch.launch_fitting(gpu, (7, 3), (11, "x"), kw)
    assert used == dict(BLOCK_N=128, num_warps=4, num_stages=2)
    assert list(used) == list(kw)  # the keyword order a direct launcher keys on
    assert gpu.tries == [3, 2] and gpu.launched == [((7, 3), (11, "x"), used)]
    assert kw["num_stages"] == 3  # the caller's keywords are not modified
    again = launch.launch_fitting(gpu, (1, 1), (5,), kw)
    assert again["num_stages"] == 2 and gpu.tries == [3, 2, 2]  # no second refusal


def test_stages_go_down_to_one_and_then_the_error_stands():
    gpu = SmallGPU(limit=60_000)  # one stage fits
    assert launch.launch_fitting(gpu, (1,), (), dict(num_stages=4))["num_stages"] == 1
    assert gpu.tries == [4, 3, 2, 1]
    tiny = SmallGPU(limit=10_000)  # nothing fits: the refusal of one stage is raised
    with pytest.raises(OutOfResources, match="shared memory"):
        launch.launch_fitting(tiny, (1,), (), dict(num_stages=2, BLOCK_M=64))
    assert tiny.tries == [2, 1]


def test_a_launch_that_fits_is_tried_once():
    gpu = SmallGPU(limit=232_448)
    assert launch.launch_fitting(gpu, (2,), (), dict(num_stages=3))["num_stages"] == 3
    assert gpu.tries == [3] and launch._STAGES_THAT_FIT == {}


@pytest.mark.parametrize("error", [OutOfResources(300, 255, "registers"),
                                   RuntimeError("an illegal memory access"),
                                   ValueError("a bad argument")],
                         ids=["registers", "runtime", "value"])
def test_other_failures_propagate_untried(error):
    gpu = SmallGPU(error=error)
    with pytest.raises(type(error)):
        launch.launch_fitting(gpu, (1,), (), dict(num_stages=3))
    assert gpu.tries == [3] and launch._STAGES_THAT_FIT == {}


def test_memo_is_per_launcher_and_per_keywords():
    small, other = SmallGPU(), SmallGPU()
    launch.launch_fitting(small, (1,), (), dict(num_stages=3, BLOCK_N=128))
    launch.launch_fitting(other, (1,), (), dict(num_stages=3, BLOCK_N=128))
    launch.launch_fitting(small, (1,), (), dict(num_stages=3, BLOCK_N=64))
    assert other.tries == [3, 2] and small.tries == [3, 2, 3, 2]
