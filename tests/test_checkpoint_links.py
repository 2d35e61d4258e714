"""A local checkpoint is what its directory holds: no symbolic link in it may lead out of it, and the reason a
load failed reaches ``/readyz`` (which anyone may read) without an absolute path."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from policy_operator.runtime.checkpoint.format import CheckpointError, check_links_stay_inside, verify_checkpoint
from policy_operator.runtime.worker import public_reason
from tests.support.servers import PolicyServerProcess, session_checkpoint
from tests.test_runtime_faults import FAST, load_error_in_readyz


def copy_of(checkpoint: Path, where: Path) -> Path:
    shutil.copytree(checkpoint, where)
    return where


@pytest.mark.parametrize("linked", ["model.safetensors", "config.json"])
def test_a_link_out_of_the_checkpoint_is_refused_naming_the_link(
    tmp_path: Path, tiny_checkpoint: Path, linked: str
) -> None:
    ckpt = copy_of(tiny_checkpoint, tmp_path / "ckpt")
    outside = copy_of(tiny_checkpoint, tmp_path / "elsewhere")
    (ckpt / linked).unlink()
    (ckpt / linked).symlink_to(outside / linked)  # the same bytes: only the link is wrong
    for check in (check_links_stay_inside, verify_checkpoint):
        with pytest.raises(CheckpointError, match=rf"^{linked} is a symbolic link out of the checkpoint") as info:
            check(ckpt)
        assert str(tmp_path) not in str(info.value)


def test_links_within_the_checkpoint_and_a_linked_root_are_fine(tmp_path: Path, tiny_checkpoint: Path) -> None:
    ckpt = copy_of(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "weights").symlink_to("../model.safetensors")
    (tmp_path / "current").symlink_to(ckpt)  # a cache's "current" link to its snapshot
    check_links_stay_inside(tmp_path / "current")
    (ckpt / "sub" / "escape").symlink_to("../../elsewhere")  # dangling and outside
    with pytest.raises(CheckpointError, match="^sub/escape is a symbolic link out"):
        check_links_stay_inside(tmp_path / "current")


def test_public_reason_keeps_no_absolute_path() -> None:
    opts = SimpleNamespace(checkpoint="/data/ckpt", cache_dir=".cache/checkpoints")  # what public_reason reads
    reason = public_reason(
        "/data/ckpt/config.json names pretrained_path '/home/robot/secret/model.bin', not found; see /readyz",
        opts,  # type: ignore[arg-type]
    )
    assert reason == "<checkpoint>/config.json names pretrained_path '<path>', not found; see /readyz"
    url = public_reason("fetch of https://host/org/repo/model.bin failed", opts)  # type: ignore[arg-type]
    assert url == "fetch of https://host/org/repo/model.bin failed"


@pytest.mark.slow  # a server of its own that fails to load
def test_serve_refuses_weights_linked_from_outside(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = copy_of(session_checkpoint(tmp_path_factory), tmp_path / "ckpt")
    other = session_checkpoint(tmp_path_factory, seed=1)  # another model's weights, outside the directory
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(other / "model.safetensors")
    server = PolicyServerProcess(ckpt, *FAST)
    error = load_error_in_readyz(server)
    assert "model.safetensors is a symbolic link out of the checkpoint directory" in error, error
    assert "/tmp" not in error and str(tmp_path) not in error, error
