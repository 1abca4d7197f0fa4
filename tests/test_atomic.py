"""graphcap.atomic.write_atomic: the target holds the old bytes or the new ones, never a part, and no temp file stays."""
from __future__ import annotations

import os
import stat

import pytest

from graphcap import atomic


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_writes_the_bytes_with_the_mode(tmp_path, mode):
    p = tmp_path / "f.bin"
    data = os.urandom(4096)
    assert atomic.write_atomic(p, data, mode) == p
    assert p.read_bytes() == data and stat.S_IMODE(p.stat().st_mode) == mode
    assert [x.name for x in tmp_path.iterdir()] == ["f.bin"]


@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch, fail_at):
    p = tmp_path / "f.bin"
    p.write_bytes(b"old")

    def boom(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, fail_at, boom)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_atomic(p, os.urandom(64), 0o600)
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.bin"]
