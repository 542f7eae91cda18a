"""What ``ckptkeeper prune`` flushes to disk, and in which order, seen from outside the process
(``strace`` of the real CLI; skipped where strace is not installed, ``.ci/syncs.sh`` installs it).

* A move flushes the copy (every file, its directories, the manifest, the rename into place) and a
  journal entry for the delete before the first change to the source.
* A pass with nothing to do flushes only what SQLite itself flushes (a new log, the close): the
  catalog's commits are re-derived from the tiers by the next pass and are not flushed one by one.

And the delete of a checkpoint's large files, unlinked beside each other, frees what it reports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import local_tier, write_config

from ckptkeeper.core.model import TierPolicy, TierSpec
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage import LocalTierStorage, TierStorage
from ckptkeeper.storage.localfs import PARALLEL_UNLINK_MIN

ROOT = Path(__file__).resolve().parent.parent
RUN = "run-a"
OLD = "checkpoint-100"
NEW = "checkpoint-200"
STRACE = shutil.which("strace")
needs_strace = pytest.mark.skipif(STRACE is None, reason="strace is not installed (.ci/syncs.sh)")
CLOCK_PROBE = f"/{STAGING_MARK}clock-"
"""The name the pass's reading of a local tier's clock gives its probe (storage/fs_clock.py)."""

_CALL = re.compile(r"^\d+\s+(?P<call>\w+)\((?P<args>.*)\)\s+=\s+(?P<ret>-?\d+)")
_UNFINISHED = re.compile(r"^(?P<tid>\d+)\s+(?P<call>\w+)\((?P<args>.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^(?P<tid>\d+)\s+<\.\.\. \w+ resumed>.*\)\s+=\s+(?P<ret>-?\d+)")


@pytest.fixture
def shm() -> Iterator[Path]:
    base = Path("/dev/shm")
    if not base.is_dir():
        pytest.skip("no /dev/shm (tmpfs) for the hot tier")
    path = base / f"ckptkeeper-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _checkpoint(run_dir: Path, name: str, when: float) -> None:
    """A Hugging Face Trainer checkpoint (what the catalog recognises), settled at ``when``."""
    ckpt = run_dir / name
    ckpt.mkdir(parents=True)
    n = 256 << 10
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + os.urandom(n))
    (ckpt / "optimizer.pt").write_bytes(os.urandom(128 << 10))
    step = int(name.split("-")[1])
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


def _node(shm: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(config, hot, warm) with an index already made; hot on tmpfs, warm on the test's disk."""
    hot, warm = shm / "hot", tmp_path / "warm"
    hot.mkdir()
    warm.mkdir()
    config = write_config(
        tmp_path / "ckptkeeper.toml",
        index=tmp_path / "state" / "index.db",
        tiers=[local_tier("hot", hot, keep_last=1), local_tier("warm", warm, keep_last=10)],
        daemon={"metrics_addr": "", "trust_mtimes": True},  # back-dated checkpoints: settled
    )
    assert _prune(config).returncode == 0
    now = time.time()
    _checkpoint(hot / RUN, OLD, now - 1200)  # moved to warm
    _checkpoint(hot / RUN, NEW, now - 600)  # the newest: kept in hot
    return config, hot, warm


def _prune(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune", "--json"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _traced_prune(config: Path, out: Path) -> list[tuple[str, str]]:
    """``prune`` under strace: its (call, arguments) in order, descriptors shown as their paths."""
    assert STRACE is not None
    proc = subprocess.run(
        [
            STRACE,
            "-f",
            "-qq",
            "-y",
            "-o",
            str(out),
            "-e",
            "trace=fsync,fdatasync,sync_file_range,syncfs,sync,renameat,renameat2,rename,unlinkat,unlink",
            sys.executable,
            "-m",
            "ckptkeeper.cli",
            "--config",
            str(config),
            "prune",
            "--json",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    calls: list[tuple[str, str, str]] = []  # in the order they started: (call, arguments, result)
    started: dict[str, int] = {}  # thread id -> its call that another thread's line interrupted
    for line in out.read_text().splitlines():
        if m := _CALL.match(line):
            calls.append((m["call"], m["args"], m["ret"]))
        elif m := _UNFINISHED.match(line):
            started[m["tid"]] = len(calls)
            calls.append((m["call"], m["args"], ""))
        elif (m := _RESUMED.match(line)) and m["tid"] in started:
            i = started.pop(m["tid"])
            calls[i] = (*calls[i][:2], m["ret"])
    return [(call, args) for call, args, ret in calls if ret not in ("", "-1")]


def _changes_hot(call: str, args: str, hot: Path) -> bool:
    """A rename or unlink in the hot tier, other than of the probe the pass reads the
    filesystem's clock with (created and removed at once under the root)."""
    return call.startswith(("rename", "unlink")) and str(hot) in args and CLOCK_PROBE not in args


def _flushes(calls: list[tuple[str, str]]) -> list[str]:
    return [
        args for call, args in calls if call in ("fsync", "fdatasync", "sync_file_range", "syncfs", "sync")
    ]


@needs_strace
def test_a_move_flushes_the_copy_and_the_delete_s_journal_entry_before_touching_the_source(
    shm: Path, tmp_path: Path
) -> None:
    config, hot, warm = _node(shm, tmp_path)
    calls = _traced_prune(config, tmp_path / "move.strace")

    assert not (hot / RUN / OLD).exists() and (warm / RUN / OLD / "model.safetensors").is_file()
    # The first change to the source: the delete renames it aside (de-commit), then unlinks.
    first = next(i for i, (call, args) in enumerate(calls) if _changes_hot(call, args, hot))
    before = [args for call, args in calls[:first] if call in ("fsync", "fdatasync")]
    assert any("model.safetensors" in a and str(warm) in a for a in before), before
    assert any("optimizer.pt" in a and str(warm) in a for a in before), before
    assert any("ckptkeeper-manifest.json" in a and str(warm) in a for a in before), before
    # the copy renamed into place, then its directory flushed, then the journal's log
    commit = max(
        i
        for i, (call, args) in enumerate(calls[:first])
        if call.startswith("rename") and f'"{OLD}"' in args and str(warm) in args
    )
    after_commit = [args for call, args in calls[commit:first] if call in ("fsync", "fdatasync")]
    assert any(a.rstrip(">").endswith(f"{warm}/{RUN}") for a in after_commit), after_commit
    assert any("index.db-wal" in a for a in after_commit), after_commit


@needs_strace
def test_an_idle_pass_flushes_only_the_close_of_the_index(shm: Path, tmp_path: Path) -> None:
    config, hot, _warm = _node(shm, tmp_path)
    assert _prune(config).returncode == 0  # the move
    calls = _traced_prune(config, tmp_path / "idle.strace")

    flushes = _flushes(calls)
    # SQLite's own: a new log's header and its directory at the first commit, the log and the
    # database at the close. Before, every catalog commit flushed the log as well: 7 in all.
    assert len(flushes) <= 4, flushes
    assert all("index.db" in a or a.rstrip(">").endswith("/state") for a in flushes), flushes
    assert not [args for call, args in calls if _changes_hot(call, args, hot)]


def test_a_delete_frees_large_files_side_by_side_and_reports_what_it_freed(tmp_path: Path) -> None:
    """Files of at least PARALLEL_UNLINK_MIN bytes are unlinked on several threads: all of them go,
    a file with another hard link frees nothing, a symlink's target stays."""
    root = tmp_path / "warm"
    ckpt = root / RUN / OLD
    (ckpt / "sub").mkdir(parents=True)
    sizes = {
        "a.bin": PARALLEL_UNLINK_MIN,
        "b.bin": PARALLEL_UNLINK_MIN + 1,
        "sub/c.bin": 2 * PARALLEL_UNLINK_MIN,
    }
    for rel, size in sizes.items():
        with open(ckpt / rel, "wb") as f:
            f.truncate(size)  # sparse: the size is what counts
    (ckpt / "small.json").write_text("{}")
    with open(ckpt / "linked.bin", "wb") as f:
        f.truncate(PARALLEL_UNLINK_MIN)
    os.link(ckpt / "linked.bin", tmp_path / "other-link.bin")
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"keep me")
    (ckpt / "link").symlink_to(outside)
    tier = TierStorage(TierSpec(name="warm", url=str(root), policy=TierPolicy(keep_last=1)))
    assert isinstance(tier, LocalTierStorage)

    freed = tier.delete(f"{RUN}/{OLD}")

    assert freed == sum(sizes.values()) + 2
    assert not ckpt.exists() and sorted(os.listdir(root / RUN)) == []
    assert outside.read_bytes() == b"keep me"
    assert (tmp_path / "other-link.bin").stat().st_size == PARALLEL_UNLINK_MIN
