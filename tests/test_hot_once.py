"""A prune to warm reads each hot byte once: a checkpoint that ``prune`` sees for the first time and
moves is hashed while it is copied (the catalog's fingerprints vouch for it), not hashed by the
catalog and read again by the copy.

Hot is on tmpfs (``/dev/shm``) and warm on disk, as on a node (NVMe → disk): two filesystems, so
the move is a copy (on one filesystem it is a rename and reads nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import local_tier, write_config

from ckptkeeper.core.model import FileEntry, Manifest, TierPolicy, TierSpec
from ckptkeeper.storage import LocalTierStorage, VerificationError
from ckptkeeper.util import fingerprint
from ckptkeeper.util.hashing import hash_file

ROOT = Path(__file__).resolve().parent.parent
RUN = "run-a"
OLD = "checkpoint-100"
NEW = "checkpoint-200"


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


def _cli(config: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _cli_rchar(config: Path, *args: str) -> tuple[int, int, str]:
    """(exit code, rchar of the whole process: every byte it read, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # a zombie still has its counters
    with open(f"/proc/{proc.pid}/io") as f:
        rchar = int(next(line.split()[1] for line in f if line.startswith("rchar:")))
    _, err = proc.communicate(timeout=60)
    return proc.returncode, rchar, err


def _hf(run_dir: Path, name: str, payload: int, when: float) -> dict[str, str]:
    """An HF checkpoint; returns file -> sha256."""
    ckpt = run_dir / name
    ckpt.mkdir(parents=True)
    body = os.urandom(payload)
    header = json.dumps({"w": {"dtype": "U8", "shape": [payload], "data_offsets": [0, payload]}}).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + body)
    (ckpt / "optimizer.pt").write_bytes(os.urandom(payload // 3))
    step = int(name.split("-")[1])
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.iterdir()}


def _node(shm: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(config, hot, warm): an index that exists already (``scan`` of an empty hot tier)."""
    hot, warm = shm / "hot", tmp_path / "warm"
    hot.mkdir()
    warm.mkdir()
    if os.stat(hot).st_dev == os.stat(warm).st_dev:
        pytest.skip("/dev/shm and the test's tmp dir are one filesystem")
    config = write_config(
        tmp_path / "ckptkeeper.toml",
        index=tmp_path / "index.db",
        tiers=[local_tier("hot", hot, keep_last=1), local_tier("warm", warm, keep_last=10)],
        daemon={"metrics_addr": "", "trust_mtimes": True},  # back-dated checkpoints: settled
    )
    assert _cli(config, "scan").returncode == 0
    return config, hot, warm


def _new_checkpoints(hot: Path, old_payload: int) -> dict[str, str]:
    """Two new checkpoints: the older one (moved to warm) and a small newest one (kept in hot)."""
    now = time.time()
    digests = _hf(hot / RUN, OLD, old_payload, now - 1200)
    _hf(hot / RUN, NEW, 4096, now - 600)
    return digests


def _tree(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.iterdir() if p.is_file()}


def _index_versions(tmp_path: Path) -> dict[str, tuple[str, dict[str, str]]]:
    con = sqlite3.connect(tmp_path / "index.db")
    try:
        rows = con.execute("SELECT id, name, version FROM checkpoints").fetchall()
        locs = con.execute("SELECT checkpoint_id, tier, version FROM locations").fetchall()
    finally:
        con.close()
    return {name: (version, {t: v for c, t, v in locs if c == cid}) for cid, name, version in rows}


def _assert_moved_exactly(tmp_path: Path, hot: Path, warm: Path, digests: dict[str, str]) -> None:
    """The old checkpoint is in warm only, byte for byte; its manifest's hashes are the real ones,
    and its version is what the index records for the warm copy."""
    assert not (hot / RUN / OLD).exists()
    assert _tree(warm / RUN / OLD) == digests
    manifest = Manifest.from_json((warm / RUN / f"{OLD}.ckptkeeper-manifest.json").read_text())
    for entry in manifest.files:
        assert hash_file(warm / RUN / OLD / entry.path) == (entry.size, entry.hash)
    version, locations = _index_versions(tmp_path)[OLD]
    assert version == manifest.digest and locations == {"warm": manifest.digest}


def test_prune_reads_each_hot_byte_once_and_records_exact_hashes(shm: Path, tmp_path: Path) -> None:
    config, hot, warm = _node(shm, tmp_path)
    rc, idle, err = _cli_rchar(config, "prune", "--json")  # what a pass reads besides checkpoints
    assert rc == 0, err
    digests = _new_checkpoints(hot, 24 << 20)
    moved = sum(p.stat().st_size for p in (hot / RUN / OLD).iterdir())

    rc, rchar, err = _cli_rchar(config, "prune", "--json")

    assert rc == 0, err
    _assert_moved_exactly(tmp_path, hot, warm, digests)
    # Before: the catalog hashed every byte, then the copy read it again (2x).
    assert rchar - idle <= 1.1 * moved, (rchar, idle, moved)
    verify = _cli(config, "verify")  # re-hashes every copy against its manifest
    assert verify.returncode == 0, verify.stdout + verify.stderr
    restored = tmp_path / "restored"
    got = _cli(config, "restore", RUN, "--step", "100", "--to", str(restored))
    assert got.returncode == 0, got.stderr
    assert _tree(restored / OLD) == digests
    history = _cli(config, "history", "--json")
    assert '"copy"' in history.stdout and '"delete"' in history.stdout


# A rewrite injected at a crash point of the hashing copy (in process: no timing involved).
REWRITE_WRAPPER = """
import os, sys
import ckptkeeper.executor as ex
target, mode, at = os.environ["REWRITE_FILE"], os.environ["REWRITE_MODE"], os.environ["REWRITE_AT"]
hit = ex._CrashPoints.hit
def rewrite(self, where):
    if where == at and os.path.exists(target) and not os.environ.get("REWRITTEN"):
        os.environ["REWRITTEN"] = "1"
        with open(target, "r+b") as f:
            if mode == "same-size":
                f.seek(-5, os.SEEK_END)
                f.write(b"XXXXX")
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"more")
    hit(self, where)
ex._CrashPoints.hit = rewrite
from ckptkeeper.cli import main
sys.argv = ["ckptkeeper", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("mode", ["same-size", "other-size"])
@pytest.mark.parametrize("at", ["copy-journaled", "copy-progress"])
def test_a_file_rewritten_after_the_catalog_saw_it_fails_the_copy(
    shm: Path, tmp_path: Path, mode: str, at: str
) -> None:
    """Rewritten before the copy read it (``copy-journaled``) or while it copies (after its first
    chunk): no copy is committed in warm, the checkpoint stays in hot with its new bytes."""
    config, hot, warm = _node(shm, tmp_path)
    _new_checkpoints(hot, 2 << 20)
    target = hot / RUN / OLD / "model.safetensors"
    env = {**_env(), "REWRITE_FILE": str(target), "REWRITE_MODE": mode, "REWRITE_AT": at}
    proc = subprocess.run(
        [sys.executable, "-c", REWRITE_WRAPPER, "--config", str(config), "prune", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert "changed since cataloged" in proc.stderr
    assert (hot / RUN / OLD / "model.safetensors").exists()
    assert not (warm / RUN / OLD).exists() and not (warm / RUN / f"{OLD}.ckptkeeper-manifest.json").exists()
    assert not [p for p in warm.rglob("*") if "ckptkeeper-staging" in p.name or "staging" in p.name]
    # Cataloged again: just written to, so settling in hot (hashed once settled), never in warm.
    assert _cli(config, "scan").returncode == 0
    _, locations = _index_versions(tmp_path)[OLD]
    assert "warm" not in locations


def test_kill_9_at_every_crash_point_of_a_hashing_move_loses_nothing(shm: Path, tmp_path: Path) -> None:
    """``prune`` killed at the K-th crash point (journal, every chunk, commit, record, delete),
    for every K until one run passes them all; after each kill the checkpoint is whole in hot or
    committed whole in warm, and the next prune finishes the move with exact hashes."""
    config, hot, warm = _node(shm, tmp_path)
    template = tmp_path / "template"
    digests = _hf(template, OLD, 600 << 10, time.time() - 1200)
    newest = _hf(template, NEW, 4096, time.time() - 600)
    assert newest
    crashes = 0
    for k in range(1, 40):
        for root in (hot / RUN, warm / RUN):
            shutil.rmtree(root, ignore_errors=True)
        for suffix in ("index.db", "index.db-wal", "index.db-shm"):
            (tmp_path / suffix).unlink(missing_ok=True)
        assert _cli(config, "scan").returncode == 0
        (hot / RUN).mkdir()
        for name in (OLD, NEW):
            subprocess.run(["cp", "-a", str(template / name), str(hot / RUN / name)], check=True)
        proc = _cli(config, "prune", "--json", env={**_env(), "CKPTKEEPER_TEST_CRASH_AFTER": str(k)})
        if proc.returncode != -signal.SIGKILL:
            assert proc.returncode == 0, proc.stderr
            break
        crashes += 1
        whole_in_hot = (hot / RUN / OLD).is_dir() and _tree(hot / RUN / OLD) == digests
        committed = warm / RUN / f"{OLD}.ckptkeeper-manifest.json"
        whole_in_warm = committed.exists() and _tree(warm / RUN / OLD) == digests
        assert whole_in_hot or whole_in_warm, f"crash point {k}: no whole copy left"
        again = _cli(config, "prune", "--json")
        assert again.returncode == 0, again.stderr
        _assert_moved_exactly(tmp_path, hot, warm, digests)
        assert not [p.name for p in warm.rglob("*") if "staging" in p.name]
    assert crashes >= 5  # journaled, chunks, committed, recorded, the delete's points


def test_copy_from_with_fingerprints_hashes_while_copying(tmp_path: Path) -> None:
    """The storage primitive: the manifest committed carries the hashes of the bytes copied; a
    source whose fingerprint moved (rewritten in the middle of the copy) commits nothing."""
    hot_root, warm_root = tmp_path / "hot", tmp_path / "warm"
    (hot_root / RUN / OLD).mkdir(parents=True)
    warm_root.mkdir()
    data = os.urandom(3 << 20)
    (hot_root / RUN / OLD / "w.bin").write_bytes(data)
    hot = LocalTierStorage(TierSpec("hot", str(hot_root), TierPolicy()), hot=True)
    warm = LocalTierStorage(TierSpec("warm", str(warm_root), TierPolicy()))
    src = hot_root / RUN / OLD / "w.bin"
    prints = {"w.bin": fingerprint.take(src)}
    unhashed = Manifest(
        run=RUN,
        step=100,
        name=OLD,
        layout="hf",
        is_dir=True,
        files=(FileEntry("w.bin", len(data), "unhashed"),),
    )

    def rewrite(_: int) -> None:
        with open(src, "r+b") as f:
            f.write(b"Z")

    with pytest.raises(VerificationError, match="changed since cataloged"):
        warm.copy_from(hot, unhashed, fingerprints=prints, progress=rewrite)
    assert warm.read_manifest(f"{RUN}/{OLD}") is None and not list(warm_root.rglob("w.bin"))

    prints = {"w.bin": fingerprint.take(src)}
    committed = warm.copy_from(hot, unhashed, fingerprints=prints).manifest
    assert committed.files[0].hash == hash_file(src)[1]
    assert warm.read_manifest(f"{RUN}/{OLD}") == committed
    assert (warm_root / RUN / OLD / "w.bin").read_bytes() == src.read_bytes()


def test_a_checkpoint_first_seen_while_written_is_also_read_once(shm: Path, tmp_path: Path) -> None:
    """A prune (cron) that met the checkpoint mid-write recorded it unhashed; the next one, once
    it has settled, moves it reading it once."""
    config, hot, warm = _node(shm, tmp_path)
    rc, idle, err = _cli_rchar(config, "prune", "--json")
    assert rc == 0, err
    digests = _hf(hot / RUN, OLD, 16 << 20, time.time())  # just written: settling
    assert _cli(config, "prune", "--json").returncode == 0
    assert _index_versions(tmp_path)[OLD][0] is None and (hot / RUN / OLD).is_dir()
    _hf(hot / RUN, NEW, 4096, time.time() - 600)
    for p in [*(hot / RUN / OLD).rglob("*"), hot / RUN / OLD]:
        os.utime(p, (time.time() - 1200, time.time() - 1200))  # now settled
    moved = sum(p.stat().st_size for p in (hot / RUN / OLD).iterdir())

    rc, rchar, err = _cli_rchar(config, "prune", "--json")

    assert rc == 0, err
    _assert_moved_exactly(tmp_path, hot, warm, digests)
    assert rchar - idle <= 1.1 * moved, (rchar, idle, moved)


def test_tiny_bench_measures_the_whole_prune_and_its_reads(tmp_path: Path) -> None:
    """bench/tier_move.py: `ckptkeeper prune` moving a new checkpoint tmpfs → disk, timed whole
    against `cp -r` + `sync`, and the bytes it read (rchar) per byte moved."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "bench", "--tiny", "--only", "tier_move", "--json", str(out)]
    proc = subprocess.run(
        [*argv, "--disk-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a target missed, still a table
    doc = json.loads(out.read_text())
    assert not doc["errors"], doc["errors"]
    rows = {row["metric"]: row for row in doc["rows"]}
    whole = rows["ckptkeeper prune to warm, 8 MiB (tmpfs→disk), whole process"]
    reads = rows["  same: bytes read from hot per byte moved (rchar of the process)"]
    assert whole["ours"] > 0 and whole["baseline"] > 0
    assert reads["baseline"] >= 1.0 and "net of the" in reads["note"]


@pytest.mark.parametrize("warm_options", [{"dedup": True}, {"compression": "zstd"}])
def test_a_move_into_a_dedup_or_compressing_tier_keeps_exact_hashes(
    shm: Path, tmp_path: Path, warm_options: dict[str, object]
) -> None:
    """A dedup tier's content store is keyed by hash, so its copies are hashed first (not on the
    way); a compressing tier hashes the raw bytes on the way. Either way the copy restores byte
    for byte and verifies."""
    hot, warm = shm / "hot", tmp_path / "warm"
    hot.mkdir()
    warm.mkdir()
    config = write_config(
        tmp_path / "ckptkeeper.toml",
        index=tmp_path / "index.db",
        tiers=[local_tier("hot", hot, keep_last=1), local_tier("warm", warm, keep_last=10, **warm_options)],
        daemon={"metrics_addr": "", "trust_mtimes": True},
    )
    assert _cli(config, "scan").returncode == 0
    digests = _new_checkpoints(hot, 2 << 20)

    got = _cli(config, "prune", "--json")

    assert got.returncode == 0, got.stderr
    assert not (hot / RUN / OLD).exists()
    assert _cli(config, "verify").returncode == 0
    restored = tmp_path / "restored"
    back = _cli(config, "restore", RUN, "--step", "100", "--to", str(restored), "--no-daemon")
    assert back.returncode == 0, back.stderr
    assert _tree(restored / OLD) == digests
