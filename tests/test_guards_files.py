"""Guards of the mapped model files that no other test could see fail (issue 37): a file that grew or shrank
after its header was read is refused when mapped and named by ``changed_files`` (what the sender reports when
a send from the mapping fails), whichever way its length changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tensorxfer.files import FileFormatError, plan_load
from tensorxfer.files.mapped import changed_files, map_sources, mirror

from .conftest import resource_fds
from .test_cli import model_dir


def _mirrored(tmp_path: Path):
    src = model_dir(tmp_path / "src", shards=3, rows=100)
    mirrored = mirror(plan_load([src]))
    assert mirrored is not None
    plan, bases = mirrored
    victim = Path(plan.jobs[1][0])
    assert changed_files(plan) == []
    return plan, bases, victim


def _resize(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "grew":
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)           # a writer appending, or a new file written over it in place
    else:
        os.truncate(path, size // 2)        # cut short (a copy still being written, a truncating rewrite)


@pytest.mark.parametrize("how", ["grew", "shrank"])
def test_a_file_whose_length_changed_before_it_is_mapped_is_refused_and_named(tmp_path: Path, how: str) -> None:
    plan, bases, victim = _mirrored(tmp_path)
    _resize(victim, how)
    assert changed_files(plan) == [str(victim)]
    fds = resource_fds()
    with pytest.raises(FileFormatError, match=f"{victim.name}: {how} while being read"):
        map_sources(plan, bases)
    assert resource_fds() == fds, "the refused mapping left something open"


@pytest.mark.parametrize("how", ["grew", "shrank"])
def test_a_file_whose_length_changed_after_it_was_mapped_is_named_by_changed_files(tmp_path: Path,
                                                                                   how: str) -> None:
    """What the sender names when a send from the mapping fails (a shrunk file fails the kernel's copy from
    the mapping; the CLI's test in test_overlap.py sends one): only the file that changed."""
    plan, bases, victim = _mirrored(tmp_path)
    with map_sources(plan, bases):
        assert changed_files(plan) == []
        _resize(victim, how)
        assert changed_files(plan) == [str(victim)]
    victim.unlink()
    assert changed_files(plan) == [str(victim)], "a file gone is changed too"
