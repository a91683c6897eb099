"""Warpgroup arrives without a warpgroup barrier: a PTX pass for the Gluon kernels.

Why. Triton 3.6 lowers `mbarrier.arrive` in a 4-warp partition to `bar.sync id, 128` (the
warpgroup waits for its slowest warp) and one thread's arrive. Our consumer warpgroups
release a K/V ring slot that way twice per key block (forward) and three times per step
(backward). Nsight Compute beside FA4, same shapes (H200 2026-11-30, 16k rows,
`scripts/ncu-compare.sh`, STALLS=1): stall cycles per issued instruction waiting at a
barrier, ours / FA4's, forward d=64 2.37 / 0.31 and backward d=128 5.34 / 1.59, which is
about the whole difference in cycles per instruction (8.36 / 6.15 and 13.1 / 10.6); both
forwards issue the same 1.81 G instructions. FA4's pipelines (CUTLASS) arrive from every
thread. Gluon 3.6 has no such arrive.

How. A kernel asks for it by arriving with count 128 (its ARRIVE constexpr: a warpgroup's
threads) on a barrier initialised for 128 arrivals per warpgroup. As compiled, that is
thread 0 arriving for its warpgroup after the warpgroup barrier: correct without this pass.
The pass, run on the PTX of our kernels (`install`: triton's add_stages_inspection_hook):
1. turns each such arrive into an arrive of count 1 by every thread and deletes the
   `bar.sync` just before it where that barrier orders nothing else: on every path back to
   the previous barrier (labels followed to the jumps that reach them) no generic
   shared-memory access, no proxy fence, no wait for a bulk copy to have read shared memory.
   Each thread's arrive releases its own reads (CUTLASS's consumer_release); the waiter
   sees all 128 before the phase completes;
2. then drops, in the partitions where step 1 rewrote an arrive, every other warpgroup
   barrier that orders nothing by the same test, except one right before a thread-0 arrive.
   Triton's barrier pass counts an arrive as reading and writing all of shared memory (a
   thread-0 arrive publishes the other threads' accesses), so it also puts a barrier before
   the next shared-memory instruction after each arrive, an mbarrier wait or a wgmma
   included: the barrier at the top of every key loop. Asynchronous wgmma reads need none:
   a warpgroup's MMA has read its operands once any of its warps has waited for it (CUTLASS
   releases a stage from one thread per warpgroup on the same ground).
Arrives and barriers the pass leaves alone stay as compiled.

Binaries with and without the pass compute the same thing, so Triton's cache (whose key
does not see the hook) cannot hand out a wrong one; VERSION keeps passes apart there. Off
by default (FwdConfig.arrive_all, BwdConfig.arrive_all): correct on the H200 (2026-11-30,
the GPU tests with bitwise repeats) but no faster; their comments have the numbers.
"""

from __future__ import annotations

import re

# Threads of a warpgroup: an arrive of this count on a warpgroup's behalf is the pass's mark.
WARPGROUP = 128
# Bump when rewrite_ptx changes. Kernels built with the pass take it as a constexpr
# (ARRIVE_PASS), so Triton's cache, whose key does not see this pass, keeps the binaries of
# different versions apart.
VERSION = 6

_ARRIVE = re.compile(r"^(\s*)@%p\d+ mbarrier\.arrive\.shared::cta\.b64 _, \[(%r\d+)\], "
                     rf"{WARPGROUP};\s*$")
_WARPGROUP_BAR = re.compile(rf"^\s*(bar|barrier)\.sync\s+(\d+),\s*{WARPGROUP};\s*$")
_THREAD0_ARRIVE = re.compile(r"^\s*@%p\d+ mbarrier\.arrive\b")
_ANY_BAR = re.compile(r"^\s*(@!?%p\d+\s+)?(bar|barrier)(\.cta)?\.(sync|arrive|red)\b")
# The barriers that order memory for every thread that reaches them (a bar.arrive does not
# make its thread wait): only those end a region walked back from a barrier.
_SYNC_BAR = re.compile(r"^\s*(bar|barrier)(\.cta)?\.(sync|red)\b")
_NEUTRAL = re.compile(r"^\s*($|//|\.loc\b)")
# What a deleted barrier might have been ordering: any load, store or atomic (shared or
# global: a barrier orders both; kernel-parameter loads aside), proxy fences (a thread's
# stores made visible to TMA/wgmma), non-bulk async copies, and the wait for a bulk copy to
# have read shared memory (other threads may overwrite it after the barrier). Issuing a
# bulk copy (TMA) needs no barrier after it; mbarrier waits and arrives are
# synchronisation, not data.
_MBARRIER = re.compile(r"^\s*(@!?%p\d+\s+)?mbarrier\.(try_wait|test_wait|arrive)\b")
_BULK_ISSUE = re.compile(r"^\s*(@!?%p\d+\s+)?(cp\.async\.bulk\.(tensor|commit_group)|"
                         r"cp\.reduce\.async\.bulk)")
_DATA = re.compile(r"\.shared\b|\.shared::|matrix|fence\.proxy|cp\.async|cp\.reduce|"
                   r"\bst\.async|\b(ld|st|atom|red)\.(?!param\b)")
# Block labels (the $L__tmp labels PTX carries are line-info markers, not targets) and jumps.
_LABEL = re.compile(r"^\s*(\$L__BB\w*|[A-Za-z_]\w*):")
_JUMP = re.compile(r"^\s*(@!?%p\d+\s+)?(bra|brx)(\.uni)?\s+(\$?\w+)\s*;")
_END = re.compile(r"^\s*(@!?%p\d+\s+)?(ret|exit|trap)\b")


def _previous(lines: list[str], i: int) -> int:
    """Index of the last line before i that is not blank, a comment or a .loc (-1 if none)."""
    i -= 1
    while i >= 0 and _NEUTRAL.match(lines[i]):
        i -= 1
    return i


def _jumps(lines: list[str]) -> dict[str, list[int]]:
    """Label -> the lines that jump to it (outside inline-asm scopes)."""
    out: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        m = _JUMP.match(line)
        if m:
            out.setdefault(m.group(4), []).append(i)
    return out


def _orders_nothing(lines: list[str], bar: int, jumps: dict, gone: set) -> bool:
    """Whether the barrier at `bar` only synchronises execution: on every path back to a
    previous barrier (one not in `gone`, the barriers already dropped) there is no data
    access it could order. Labels are followed to the jumps that reach them; labels and
    jumps inside an inline-asm `{ }` scope (the mbarrier wait loop's) stay local; a path
    that reaches the function's start fails."""
    seen: set[int] = set()

    def clean_before(start: int) -> bool:
        depth = 0  # inline-asm scopes we are inside, walking backwards
        i = start - 1
        while i >= 0:
            if depth == 0 and i in seen:
                return True  # this path was checked already (or is being checked: a loop)
            seen.add(i)
            line = lines[i].strip()
            if line == "}":
                depth += 1
            elif line == "{":
                depth -= 1
            elif depth > 0:
                if _DATA.search(line) and not _MBARRIER.match(line):
                    return False
            elif _SYNC_BAR.match(line) and i not in gone:
                return True
            elif (m := _LABEL.match(line)) is not None:
                if not all(clean_before(j) for j in jumps.get(m.group(1), ())):
                    return False
                prev = _previous(lines, i)
                if prev >= 0 and (_END.match(lines[prev]) or (
                        _JUMP.match(lines[prev]) and not lines[prev].lstrip().startswith("@"))):
                    return True  # no fall-through into the label: its jumps were the only ways
            elif _DATA.search(line) and not _MBARRIER.match(line) and \
                    not _BULK_ISSUE.match(line):
                return False
            i -= 1
        return False  # the function's start: leave it

    return clean_before(bar)


def _plain(line: str) -> bool:
    """A register-only instruction (or a neutral line): no memory, synchronisation, wgmma,
    label or branch."""
    return not (_ANY_BAR.match(line) or _LABEL.match(line) or _JUMP.match(line) or
                _DATA.search(line) or "mbarrier" in line or "wgmma" in line)


def _barrier_before(lines: list[str], a: int) -> int:
    """The warpgroup barrier just before the arrive at `a` (register arithmetic, such as
    the arrive's predicate, may sit between them), or -1."""
    i = a - 1
    while i >= 0 and not _SYNC_BAR.match(lines[i]):
        if not _plain(lines[i]):
            return -1
        i -= 1
    return i if i >= 0 and _WARPGROUP_BAR.match(lines[i]) else -1


def _guards_thread0_arrive(lines: list[str], bar: int) -> bool:
    """Whether a thread-0 arrive follows the barrier at `bar` before anything else that
    synchronises, touches memory or branches (register arithmetic may sit between them)."""
    for line in lines[bar + 1:]:
        if _THREAD0_ARRIVE.match(line):
            return True
        if not _plain(line):
            return False
    return False


def rewrite_ptx(ptx: str) -> tuple[str, int, int]:
    """(PTX with every marked arrive made per-thread where safe, how many were, how many
    warpgroup barriers were dropped).

    First each marked arrive with the barrier before it. Then, in the partitions that had
    one (their barrier ids), every other warpgroup barrier that orders nothing either: those
    are there because Triton's barrier pass counts an arrive as reading and writing all of
    shared memory (a thread-0 arrive publishes the others' accesses), so it also puts one
    before the next shared-memory instruction after the arrive, an mbarrier wait included:
    the loop-top barrier of our key loops. A barrier right before an arrive the pass did not
    make per-thread stays: that thread-0 arrive needs the warpgroup done."""
    lines = ptx.split("\n")
    jumps = _jumps(lines)
    gone: set[int] = set()
    ids: set[str] = set()
    arrives = 0
    for a, line in enumerate(lines):
        m = _ARRIVE.match(line)
        if m is None:
            continue
        bar = _barrier_before(lines, a)
        if bar < 0 or not _orders_nothing(lines, bar, jumps, gone):
            continue
        b = _WARPGROUP_BAR.match(lines[bar])
        gone.add(bar)
        ids.add(b.group(2))
        lines[a] = f"{m.group(1)}mbarrier.arrive.shared::cta.b64 _, [{m.group(2)}];"
        arrives += 1
    for i, line in enumerate(lines):
        b = _WARPGROUP_BAR.match(line)
        if b is None or i in gone or b.group(2) not in ids:
            continue
        if _guards_thread0_arrive(lines, i):
            continue
        if _orders_nothing(lines, i, jumps, gone):
            gone.add(i)
    return "\n".join(x for i, x in enumerate(lines) if i not in gone), arrives, len(gone)


# Kernels the pass may touch: ours, by the names Triton gives them.
KERNELS = frozenset({"_attn_fwd_kernel", "attn_bwd_ws_kernel"})
_installed: list = []


def install() -> None:
    """Run `rewrite_ptx` after the PTX stage of our kernels (idempotent; chains a hook
    someone else installed)."""
    if _installed:
        return
    from triton import knobs

    previous = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_ptx = stages.get("ptx")
        if make_ptx is None:
            return

        def ptx_stage(src, metadata):
            ptx = make_ptx(src, metadata)
            if metadata.get("name") in KERNELS:
                ptx, metadata["asym_arrives_per_thread"], metadata["asym_barriers_dropped"] = \
                    rewrite_ptx(ptx)
            return ptx
        stages["ptx"] = ptx_stage

    knobs.runtime.add_stages_inspection_hook = hook
    _installed.append(hook)
