"""Where the CPU kernels' build lives: one build per set of sources, flags and checkout."""

from __future__ import annotations

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
