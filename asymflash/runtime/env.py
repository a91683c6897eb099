"""The environment switches asymflash reads, all of them, in one registry.

None is needed for correct or fast results: the defaults are what the measurements chose
(docs/tuning.md). They exist for bug reports and A/B timing.

Two kinds:
* read once, at the first use (an environment lookup costs ~2 us, and these guard the host
  fast paths themselves): ASYMFLASH_CALL_PLANS, ASYMFLASH_DIRECT_LAUNCH,
  ASYMFLASH_SM90_ANY_TRITON;
* read on every call (a process may flip them between calls: the benchmark's variants and the
  tests do): the sm90 forward's FA4 tricks. Call plans cache what a call's signature decided,
  so these values are part of every plan's key (`per_call_values`).
"""

from __future__ import annotations

import os

SWITCHES = {
    "ASYMFLASH_CALL_PLANS":
        "1 (default): a repeated call signature reuses its checks and dispatch (runtime/"
        "plans.py); 0: every call takes the full path",
    "ASYMFLASH_DIRECT_LAUNCH":
        "1 (default): kernels launch through bound launchers (runtime/launch.py); 0: through "
        "Triton's own launch path; check: both, compared",
    "ASYMFLASH_SM90_ANY_TRITON":
        "1: the sm90 Gluon kernels run on any Triton with Gluon, also one they were not "
        "verified on a GPU with (to verify a release: docs/triton-versions.md); unset: only "
        "on the verified ones (runtime/dispatch.py: SM90_TESTED_TRITON)",
    "ASYMFLASH_SM90_EXP2_EMU":
        "k in 0, 2, 4, 8: one exponential in k of the sm90 forward on the FMA pipe (FA4's "
        "polynomial exp2, core/exp2.py); unset: the config's choice",
    "ASYMFLASH_SM90_RESCALE":
        "t >= 0: the sm90 forward rescales O only when a row's max grew by more than t "
        "(log2 units; 0: always); unset: the config's choice",
}

# Read on every call, hence part of every call plan's key.
PER_CALL = ("ASYMFLASH_SM90_EXP2_EMU", "ASYMFLASH_SM90_RESCALE")

# CPython's dict behind os.environ: reading it directly costs ~0.1 us against ~2 us for
# os.environ.get, and per-call switches are read on every planned call.
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_KEYS = {name: os.fsencode(name) for name in PER_CALL} if _ENV_DATA is not None else {}
_PER_CALL_KEYS = tuple(_KEYS.values())


def get(name: str) -> str | None:
    """The value of a registered switch, as os.environ.get returns it."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not an asymflash switch; known: {sorted(SWITCHES)}")
    key = _KEYS.get(name)
    if key is None:
        return os.environ.get(name)
    value = _ENV_DATA.get(key)
    return None if value is None else os.fsdecode(value)


def per_call_values() -> tuple:
    """The current values of the per-call switches (raw, for plan keys)."""
    if _ENV_DATA is None:
        return tuple(os.environ.get(n) for n in PER_CALL)
    return tuple(_ENV_DATA.get(k) for k in _PER_CALL_KEYS)


def describe() -> str:
    """One line per switch: its name, current value and meaning (the CLI's `env` command)."""
    return "\n".join(f"{name}={os.environ.get(name, '')}\n    {what}"
                     for name, what in SWITCHES.items())
