"""The server's malloc setting for a flat heap (glibc on Linux)."""

from __future__ import annotations

import platform
import sys

import pytest

from rawserve.ops.memory import fix_mmap_threshold


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)
def test_the_mmap_threshold_is_fixed_on_glibc():
    assert fix_mmap_threshold() is True


def test_elsewhere_it_is_a_no_op(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert fix_mmap_threshold() is False
