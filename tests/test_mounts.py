"""Mount points under a tier root are never crossed, bind mounts included (docs/design.md, safety invariant 4; issue #13
item 6).

``mount --bind outside/data hot/r/checkpoint-1/nested`` shares ``st_dev`` with the hot tier, so the
``st_dev`` checks let the delete of an expired checkpoint-1 walk into it and delete
``outside/data/optimizer.pt`` (then fail with EBUSY on the mount point). Mount points are now
read from ``/proc/self/mountinfo``: never walked, copied or deleted into, and a checkpoint that
contains one is not deleted (the action fails, naming the mount point).

The real bind mount runs the CLI inside a private mount namespace (``unshare -m``), so a failed
test leaves no mount behind; it is skipped only where mounting is not permitted. The same rules
are also checked in-process against a fake mount table.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import local_tier, manifest_of, tier, write_config
from layout_fixtures import make_hf

from ckptkeeper.ingest.layouts import scan_run
from ckptkeeper.storage import StorageError, TierStorage
from ckptkeeper.util import mounts


def settled(path: Path, age: float = 3600) -> Path:
    when = time.time() - age
    for p in [*path.rglob("*"), path]:
        os.utime(p, (when, when), follow_symlinks=False)
    return path


def _can_bind_mount(tmp: Path) -> str | None:
    """None if ``unshare -m`` + ``mount --bind`` work here, else why not."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "unshare/mount not installed"
    (tmp / "probe-a").mkdir()
    (tmp / "probe-b").mkdir()
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "mount",
            "--bind",
            str(tmp / "probe-a"),
            str(tmp / "probe-b"),
        ],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"mount not permitted: {probe.stderr.strip()}"


def test_bind_mount_inside_an_expiring_checkpoint_is_never_deleted_into(tmp_path: Path) -> None:
    why = _can_bind_mount(tmp_path)
    if why is not None:
        pytest.skip(why)
    hot = tmp_path / "hot"
    outside = tmp_path / "outside" / "data"
    outside.mkdir(parents=True)
    (outside / "optimizer.pt").write_bytes(b"not a checkpoint's: never delete" * 100)
    for step in (1, 2):
        make_hf(hot / "r", step)
    (hot / "r" / "checkpoint-1" / "nested").mkdir()
    for step in (1, 2):
        settled(hot / "r" / f"checkpoint-{step}", 3600 - step)
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1s", "trust_mtimes": True},
        tiers=[local_tier("hot", hot, keep_last=1)],
    )
    cli = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config)]
    mount = (
        f"mount --bind {shlex.quote(str(outside))} {shlex.quote(str(hot / 'r' / 'checkpoint-1' / 'nested'))}"
    )
    script = f"{mount} && {shlex.join([*cli, 'prune'])}; echo EXIT=$?; {shlex.join([*cli, 'ls', '--json'])}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = result.stdout + result.stderr
    assert (outside / "optimizer.pt").is_file(), out  # the bind-mounted data is untouched
    assert (hot / "r" / "checkpoint-1").is_dir(), out  # a checkpoint holding a mount point stays
    assert "EXIT=1" in result.stdout, out  # the expiry failed, and says so
    assert "mount point r/checkpoint-1/nested" in out, out
    listing = json.loads(result.stdout.split("EXIT=1", 1)[1])
    steps = {c["step"] for r in listing["runs"] for c in r["checkpoints"]}
    assert steps == {1, 2}
    # Outside the namespace nothing is mounted: the expiry now goes through.
    again = subprocess.run([*cli, "prune"], capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not (hot / "r" / "checkpoint-1").exists()
    assert (outside / "optimizer.pt").is_file()


@pytest.fixture
def fake_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    table = tmp_path / "mountinfo"
    monkeypatch.setattr(mounts, "MOUNTINFO", str(table))
    return table


def _mounted(table: Path, *points: Path) -> None:
    lines = [
        f"{20 + i} 1 254:0 /outside {str(os.path.realpath(p)).replace(' ', chr(92) + '040')} rw - ext4 /dev/vda rw"
        for i, p in enumerate(points)
    ]
    table.write_text("".join(line + "\n" for line in lines))


def test_fake_mount_table_walks_skip_and_deletes_refuse(tmp_path: Path, fake_table: Path) -> None:
    hot = tmp_path / "hot"
    ckpt = make_hf(hot / "r", 1)
    storage = TierStorage(tier("hot", str(hot)), hot=True)
    warm = tmp_path / "warm"
    warm.mkdir()
    warm_tier = TierStorage(tier("warm", str(warm)))
    warm_tier.copy_from(storage, manifest_of(hot, "r", 1))
    nested = ckpt / "nested dir"
    nested.mkdir()
    (nested / "optimizer.pt").write_bytes(b"x" * 100)
    _mounted(fake_table, nested)
    assert mounts.mounts_under(hot) == {"r/checkpoint-1/nested dir"}

    (cand,) = scan_run(hot / "r", "r").candidates
    assert cand.files and not any(f.startswith("nested dir/") for f in cand.files)  # not walked

    with pytest.raises(StorageError, match="mount point r/checkpoint-1/nested dir"):
        storage.delete("r/checkpoint-1")
    assert (nested / "optimizer.pt").is_file() and ckpt.is_dir()

    # a slower tier: its listings neither enter a mount point nor see what is inside it
    (warm / "mnt" / "x").mkdir(parents=True)
    shutil.copytree(warm / "r" / "checkpoint-1", warm / "mnt" / "x" / "c")
    doc = json.loads((warm / "r" / "checkpoint-1.ckptkeeper-manifest.json").read_text())
    (warm / "mnt" / "x" / "c.ckptkeeper-manifest.json").write_text(
        json.dumps({**doc, "run": "mnt", "name": "x/c"})
    )
    _mounted(fake_table, nested, warm / "mnt")
    assert [rel for rel, _, _ in warm_tier.list_manifests()] == ["r/checkpoint-1"]
    with pytest.raises(StorageError, match="mount point mnt"):
        warm_tier.delete("mnt/x/c")
    assert (warm / "mnt" / "x" / "c").is_dir()
    _mounted(fake_table)
    assert [rel for rel, _, _ in warm_tier.list_manifests()] == ["mnt/x/c", "r/checkpoint-1"]
    assert storage.delete("r/checkpoint-1") > 0  # no mount point any more: deleted


def test_mountinfo_escapes_and_the_real_table_is_cached_until_it_changes() -> None:
    table = mounts._parse(b"36 35 98:0 /mnt1 /mnt/with\\040space rw - ext3 /dev/root rw\n")
    assert table == {"/mnt/with space"}
    first = mounts.mount_points()
    assert "/" in first or not os.path.exists("/proc/self/mountinfo")
    assert mounts.mount_points() is first  # nothing mounted since: the cached table, not a re-read
