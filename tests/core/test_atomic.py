"""Directories published whole: staging names, the swap into place, leftovers, removal."""

from __future__ import annotations

from pathlib import Path

import pytest

from pl_pipedream.core import atomic
from pl_pipedream.core.atomic import (
    fsync_dir,
    leftovers,
    publish,
    remove,
    retired_dir,
    staging_dir,
    write_file,
)


def make(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    write_file(path / "data", content.encode())
    fsync_dir(path)
    return path


def test_staging_names_hide_the_target_name_and_differ_by_token(tmp_path: Path) -> None:
    """``ModelCheckpoint`` finds ``ckpt_path="last"`` by the word "last" and ``.ckpt``."""
    first, second = (
        staging_dir(tmp_path / "last.ckpt", "a"),
        staging_dir(tmp_path / "last.ckpt", "b"),
    )
    assert first.parent == tmp_path and first != second
    for name in (first.name, second.name, retired_dir(tmp_path / "last.ckpt", "a").name):
        assert name.startswith(".pipedream-") and "last" not in name and "ckpt" not in name
    assert staging_dir(tmp_path / "other.ckpt", "a") != first


def test_publish_onto_nothing_renames_the_staged_directory(tmp_path: Path) -> None:
    staged = make(staging_dir(tmp_path / "run.ckpt", "t"), "new")
    publish(staged, tmp_path / "run.ckpt", "t")
    assert (tmp_path / "run.ckpt" / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "two renames"])
def test_publish_replaces_the_previous_and_deletes_leftovers(
    tmp_path: Path, swap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not swap:  # a system without renameat2: the previous one is renamed aside first
        monkeypatch.setattr(atomic, "_exchange", lambda first, second: False)
    path = make(tmp_path / "last.ckpt", "old")
    crashed = make(staging_dir(path, "crashed"), "half")  # an earlier save that died
    other = make(staging_dir(tmp_path / "other.ckpt", "x"), "other")  # another target's save
    staged = make(staging_dir(path, "t"), "new")
    assert (path / "data").read_text() == "old"  # staging leaves the previous one alone
    assert leftovers(path) == sorted([crashed, staged])
    publish(staged, path, "t")
    assert (path / "data").read_text() == "new"
    assert leftovers(path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", other.name])


def test_remove_takes_a_directory_a_symlink_or_a_file(tmp_path: Path) -> None:
    target = make(tmp_path / "epoch=1.ckpt", "x")
    (tmp_path / "last.ckpt").symlink_to(target.name)  # ModelCheckpoint(save_last="link")
    remove(tmp_path / "last.ckpt")
    assert target.is_dir() and not (tmp_path / "last.ckpt").exists()
    remove(target)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "plain.ckpt").write_bytes(b"x")
    remove(tmp_path / "plain.ckpt")
    remove(tmp_path / "missing.ckpt")  # nothing to do
    assert list(tmp_path.iterdir()) == []


def test_publish_over_a_symlink_replaces_the_link_and_keeps_its_target(tmp_path: Path) -> None:
    """``last.ckpt`` left as a link by ``ModelCheckpoint(save_last="link")``, then saved."""
    target = make(tmp_path / "epoch=1.ckpt", "linked")
    (tmp_path / "last.ckpt").symlink_to(target.name)
    staged = make(staging_dir(tmp_path / "last.ckpt", "t"), "new")
    publish(staged, tmp_path / "last.ckpt", "t")
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert (tmp_path / "last.ckpt" / "data").read_text() == "new"
    assert (target / "data").read_text() == "linked"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1.ckpt", "last.ckpt"]
