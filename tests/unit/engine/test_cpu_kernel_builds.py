"""Where the CPU kernels' build lives: one build per set of sources, flags and checkout;
builds left unused are cleaned up."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from workers.engine import cpu_kernels


def test_each_checkout_of_the_kernels_gets_its_own_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same sources in another checkout build apart: torch's build file names the
    sources by path, so a shared build would be rebuilt by each checkout in turn."""
    here = cpu_kernels.build_dir()
    assert cpu_kernels.build_dir() == here  # stable for one checkout
    assert here.parent == cpu_kernels.DEFAULT_BUILD_ROOT
    monkeypatch.setattr(cpu_kernels, "KERNELS", tmp_path / "other-checkout" / "kernels")
    elsewhere = cpu_kernels.build_dir()
    assert elsewhere != here and elsewhere.parent == here.parent
    assert elsewhere.name.rsplit("-", 1)[0] == here.name.rsplit("-", 1)[0]  # torch, machine


def test_builds_unused_for_two_weeks_go_when_another_loads(tmp_path: Path) -> None:
    """Loading a build marks it used; its siblings unused past the limit are removed,
    recent ones (another checkout in use) stay, and so does a stale build just loaded."""
    now = time.time()
    builds = {name: tmp_path / name for name in ("loaded", "recent", "stale", "ancient")}
    for name, path in builds.items():
        path.mkdir()
        (path / "batchinfer_cpu_kernels.so").write_bytes(b"\0" * 16)
        age_days = {"loaded": 30, "recent": 3, "stale": 15, "ancient": 400}[name]
        os.utime(path, (now - age_days * 86400, now - age_days * 86400))
    (tmp_path / "not-a-build.txt").write_text("left alone")

    removed = cpu_kernels.prune_stale_builds(builds["loaded"])
    assert sorted(p.name for p in removed) == ["ancient", "stale"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loaded", "not-a-build.txt", "recent"]
    assert now - builds["loaded"].stat().st_mtime < 60
    assert cpu_kernels.prune_stale_builds(builds["recent"]) == []


def test_a_lock_left_by_a_killed_build_is_cleared_under_the_build_turn(tmp_path: Path) -> None:
    """torch's builder waits forever on its `lock` file; one left by a dead builder goes."""
    from workers.engine.cpu_kernels import _build_turn

    (tmp_path / "lock").write_text("")
    with _build_turn(tmp_path):
        assert not (tmp_path / "lock").exists()
