"""The version gate of the sm90 Gluon kernels: which Triton versions run them, and what a
user on any other version is told (once)."""

from __future__ import annotations

import warnings

import pytest
import triton

from asymflash.runtime import dispatch


@pytest.mark.parametrize("version,ok", [("3.6.0", True), ("3.6.1", True), ("3.7.1", False),
                                        ("3.8.0", False), ("3.9.0", False), ("3.60.0", False)])
def test_gate_admits_the_verified_versions_only(version, ok):
    assert dispatch.sm90_triton_verified(version) is ok


def test_fallback_warning_names_the_version_and_what_falls_back(monkeypatch):
    monkeypatch.setattr(dispatch, "_ANY_TRITON", [False])
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    monkeypatch.setattr(dispatch, "_warned", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert dispatch._sm90_allowed() is False
        assert dispatch._sm90_allowed() is False  # said once per process
    assert len(seen) == 1, [str(w.message) for w in seen]
    text = str(seen[0].message)
    assert "triton 3.8.0" in text and "3.6.x" in text
    assert "forward and backward" in text and "portable Triton kernels" in text


def test_verified_version_runs_without_a_warning(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(dispatch, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch._sm90_allowed() is True


def test_switch_lets_an_unverified_version_run_and_says_so(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "_ANY_TRITON", [])
    monkeypatch.setenv("ASYMFLASH_SM90_ANY_TRITON", "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert dispatch._sm90_allowed() is True
    assert len(seen) == 1 and "not verified" in str(seen[0].message)
    assert "3.8.0" in str(seen[0].message)
    monkeypatch.setattr(dispatch, "_ANY_TRITON", [])
    monkeypatch.setenv("ASYMFLASH_SM90_ANY_TRITON", "0")
    assert dispatch.sm90_triton_allowed("3.8.0") is False
    assert dispatch.sm90_triton_allowed("3.6.0") is True
