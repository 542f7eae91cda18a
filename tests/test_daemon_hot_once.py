"""The daemon reads each hot byte once per move, as ``prune`` does (test_hot_once.py): a checkpoint
its watcher sees settle and that the policy moves is hashed while the move copies it, not hashed by
the watcher and read again by the move.

A real daemon process (real inotify, real files): hot on tmpfs (``/dev/shm``), warm on disk, so
the move is a copy. What it read is ``rchar`` from ``/proc/<daemon pid>/io``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_daemon import REPO, Node, Notifications, stop_cleanly, wait_for
from test_hot_once import _hf, _tree

from ckptkeeper.core.model import Manifest
from ckptkeeper.util.hashing import hash_file

RUN = "run-a"
OLD = "checkpoint-100"
NEW = "checkpoint-200"
DAEMON = {
    "settle_seconds": "1s",
    "trust_mtimes": True,
    "retention_interval": "1s",
    "reap_interval": "1s",
    "rescan_interval": "1h",
    "metrics_addr": "",
}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """Node's tiers with the hot one on tmpfs: hot keeps the newest checkpoint, warm ten."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm (tmpfs) for the hot tier")
    shm = Path("/dev/shm") / f"ckptkeeper-test-{uuid.uuid4().hex[:8]}"
    n = Node(tmp_path)
    n.hot = shm / "hot"
    n.hot.mkdir(parents=True)
    if os.stat(n.hot).st_dev == os.stat(n.warm).st_dev:
        shutil.rmtree(shm, ignore_errors=True)
        pytest.skip("/dev/shm and the test's tmp dir are one filesystem")
    n.write_config(daemon=DAEMON, hot={"keep_last": 1}, warm={"keep_last": 10})
    try:
        yield n
    finally:
        n.kill_all()
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def notify() -> Iterator[Notifications]:
    n = Notifications()
    try:
        yield n
    finally:
        n.close()


def rchar(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line.split()[1] for line in f if line.startswith("rchar:")))


def moved(node: Node, replicated: bool = False) -> bool:
    """OLD is recorded complete (hashed) in warm only, NEW in hot only; both in both when warm
    replicates."""
    old_tiers = frozenset({"hot", "warm"} if replicated else {"warm"})
    new_tiers = frozenset({"hot", "warm"} if replicated else {"hot"})
    return (
        node.state(RUN, OLD) == ("complete", old_tiers)
        and node.state(RUN, NEW) == ("complete", new_tiers)
        and (node.hot / RUN / OLD).exists() == ("hot" in old_tiers)
    )


def write_newest_first(node: Node, payload: int) -> dict[str, str]:
    """NEW, then an older OLD that arrives after it (copied in late): once OLD settles, hot's
    ``keep_last = 1`` moves it at once. Written while the daemon watches: each settles on its own."""
    _hf(node.hot / RUN, NEW, 4096, time.time())
    return _hf(node.hot / RUN, OLD, payload, time.time())


def assert_exact_in_warm(node: Node, digests: dict[str, str]) -> None:
    """OLD in warm byte for byte; its manifest carries the real hashes; ``verify`` agrees."""
    assert _tree(node.warm / RUN / OLD) == digests
    manifest = Manifest.from_json((node.warm / RUN / f"{OLD}.ckptkeeper-manifest.json").read_text())
    assert {e.path for e in manifest.files} == set(digests)
    for entry in manifest.files:
        assert hash_file(node.warm / RUN / OLD / entry.path) == (entry.size, entry.hash)
    verify = node.cli("verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("policy", ["replicated", "demoted"])
def test_the_daemon_moves_a_settled_checkpoint_reading_each_hot_byte_once(
    node: Node, notify: Notifications, policy: str
) -> None:
    """``replicated``: warm copies every checkpoint once it is complete (``replicate``), hot keeps
    it. ``demoted``: hot keeps the newest only, and OLD is not the newest when it settles."""
    if policy == "replicated":
        node.write_config(daemon=DAEMON, hot={"keep_last": 5}, warm={"keep_last": 10}, warm_replicate=True)
    proc = node.start(notify)
    assert notify.wait_for("READY=1", 60), node.log_text(proc)
    before = rchar(proc.pid)
    # Big enough that what the passes read of their own (~30 KB/s: the index) stays small beside it.
    digests = write_newest_first(node, 48 << 20)
    replicated = policy == "replicated"
    size = sum(
        p.stat().st_size
        for name in ([OLD, NEW] if replicated else [OLD])
        for p in (node.hot / RUN / name).iterdir()
    )

    assert wait_for(lambda: moved(node, replicated), 90, interval=0.2), (
        node.ls(),
        node.log_text(proc)[-4000:],
    )

    read = rchar(proc.pid) - before
    # Before: the watcher hashed each byte when the checkpoint settled, the move read it again.
    print(f"daemon rchar {read} for {size} bytes moved ({read / size:.3f} per byte)")
    assert read <= 1.1 * size, (read, size, node.log_text(proc)[-6000:])
    assert_exact_in_warm(node, digests)
    assert "held for its move" in node.log_text(proc)
    stop_cleanly(node, proc, notify)


# The daemon with a rewrite injected at a crash point of its copy (in process: no timing), after
# the watcher saw the checkpoint settle; then it stops itself (SIGTERM), as systemd would.
REWRITE_WRAPPER = """
import os, signal, sys
import ckptkeeper.executor as ex
target = os.environ["REWRITE_FILE"]
hit = ex._CrashPoints.hit
def rewrite(self, where):
    if where == "copy-journaled" and os.path.exists(target) and not os.environ.get("REWRITTEN"):
        os.environ["REWRITTEN"] = "1"
        with open(target, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            f.write(b"XXXXX")
        os.kill(os.getpid(), signal.SIGTERM)
    hit(self, where)
ex._CrashPoints.hit = rewrite
from ckptkeeper.cli import main
sys.argv = ["ckptkeeper", *sys.argv[1:]]
main()
"""


def _start_rewriting(node: Node, notify: Notifications, target: Path) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "CKPTKEEPER_"))}
    env.update(NOTIFY_SOCKET=notify.address, PYTHONPATH=str(REPO), REWRITE_FILE=str(target))
    log_path = node.tmp / "rewriting.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", REWRITE_WRAPPER, "--config", str(node.config), "daemon"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    node.procs.append(proc)
    return proc


def test_a_checkpoint_rewritten_after_it_settled_fails_its_copy_and_stays_in_hot(
    node: Node, notify: Notifications
) -> None:
    target = node.hot / RUN / OLD / "model.safetensors"
    proc = _start_rewriting(node, notify, target)
    assert notify.wait_for("READY=1", 60), node.log_text(proc)
    write_newest_first(node, 2 << 20)

    assert proc.wait(timeout=120) == 0, node.log_text(proc)  # stopped itself after the rewrite

    text = node.log_text(proc)
    assert "copying a new checkpoint while hashing it" in text, text[-4000:]
    assert "changed since cataloged" in text, text[-4000:]
    assert target.read_bytes().endswith(b"XXXXX")  # the hot copy, rewritten, is still there
    assert not (node.warm / RUN / OLD).exists()
    assert not (node.warm / RUN / f"{OLD}.ckptkeeper-manifest.json").exists()
    assert not [p for p in node.warm.rglob("*") if "staging" in p.name]
    assert "warm" not in node.state(RUN, OLD)[1]

    # Started again: the rewritten checkpoint settles and moves with the hashes of its new bytes.
    rewritten = _tree(node.hot / RUN / OLD)
    again = node.start(notify, name="again")
    assert wait_for(lambda: moved(node), 90, interval=0.2), (node.ls(), node.log_text(again)[-4000:])
    assert_exact_in_warm(node, rewritten)
    assert rewritten["model.safetensors"] != hashlib.sha256(b"").hexdigest()
    again.send_signal(signal.SIGTERM)
    assert again.wait(timeout=30) == 0, node.log_text(again)


def test_a_held_checkpoint_is_hashed_in_place_while_no_pass_can_move_it(
    node: Node, notify: Notifications
) -> None:
    """Another process holds the executor lock (a manual ``prune``): every pass is skipped, and
    the checkpoints the watcher held for their move are hashed in place and shown by ``ls`` rather
    than wait; once the lock is free a pass moves them (reading them again)."""
    from ckptkeeper.actions.index import executor_lock
    from ckptkeeper.config import load_settings

    node.write_config(daemon=DAEMON, hot={"keep_last": 5}, warm={"keep_last": 10}, warm_replicate=True)
    proc = node.start(notify)
    assert notify.wait_for("READY=1", 60), node.log_text(proc)
    hot_only = ("complete", frozenset({"hot"}))
    with executor_lock(load_settings(str(node.config)), timeout=10):
        digests = write_newest_first(node, 1 << 20)
        assert wait_for(lambda: node.state(RUN, OLD) == hot_only == node.state(RUN, NEW), 60, interval=0.2), (
            node.log_text(proc)[-4000:]
        )
        text = node.log_text(proc)
        assert "held for its move" in text and "no pass can move them now" in text, text[-4000:]
        assert not (node.warm / RUN).exists()
        assert {c["name"] for c in node.ls().values()} == {OLD, NEW}

    assert wait_for(lambda: moved(node, replicated=True), 60, interval=0.2), node.log_text(proc)[-4000:]
    assert_exact_in_warm(node, digests)
    stop_cleanly(node, proc, notify)


def test_tiny_bench_measures_what_the_daemon_reads_per_byte_moved(tmp_path: Path) -> None:
    """bench/daemon_move.py: a real daemon replicating new checkpoints tmpfs → disk, the bytes it
    reads (rchar) per byte moved, and how long after its last write each is in the index."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "bench", "--tiny", "--only", "daemon_move", "--json", str(out)]
    proc = subprocess.run(
        [*argv, "--disk-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert not doc["errors"], doc["errors"]
    reads, waits = doc["rows"]
    assert "bytes read from hot per byte moved" in reads["metric"] and reads["baseline_label"] == "cp -r"
    assert reads["ok"], reads  # rchar, not a time: 2.0x before
    assert "in the index" in waits["metric"] and waits["ours"] > 0


def test_a_held_checkpoint_is_checked_again_before_its_pass_copies_it(node: Node) -> None:
    """What the daemon's two halves do, in process: the watcher's triage hashes what stays in hot
    and holds what a pass moves; the pass copies a held checkpoint only if it is still unrecorded
    and its files still show the fingerprints the watcher took (else its run is cataloged afresh)."""
    from ckptkeeper.actions.index import open_index
    from ckptkeeper.actions.pruning import watched
    from ckptkeeper.actions.pruning.state import PassState
    from ckptkeeper.config import load_settings
    from ckptkeeper.ingest.catalog import Catalog
    from ckptkeeper.ingest.report import ReconcileReport
    from ckptkeeper.util import fingerprint

    settings = load_settings(str(node.config))
    index = open_index(settings, rebuild=True)
    requested: list[str] = []
    write_newest_first(node, 1 << 20)
    target = node.hot / RUN / OLD / "model.safetensors"
    files = [p for name in (OLD, NEW) for p in (node.hot / RUN / name, *(node.hot / RUN / name).iterdir())]
    assert wait_for(lambda: all(fingerprint.settled(fingerprint.take(p)) for p in files), 10)
    for p in files:  # back-dated: settled for the catalog (trust_mtimes), as after settle_seconds
        os.utime(p, (time.time() - 600, time.time() - 600))
    assert wait_for(lambda: all(fingerprint.settled(fingerprint.take(p)) for p in files), 10)

    def watcher_sees_it() -> Catalog:
        catalog = Catalog(settings, index, defer_new=watched.defers(settings, index))
        report = catalog.reconcile_run(RUN)
        assert watched.triage(settings, catalog, report) == 1
        assert [d.path for d in catalog.deferred] == [f"{RUN}/{OLD}"]
        return catalog

    def the_pass(catalog: Catalog) -> None:
        state = PassState(settings, index, kinds=("retention",))
        state.observed = time.time()
        watched.resolve_held(state, watched.take_held(catalog), ReconcileReport(), requested.append)

    try:
        assert watched.defers(settings, index)
        # Rewritten after the watcher saw it: not copied, not recorded; its run is looked at again.
        catalog = watcher_sees_it()
        assert node.state(RUN, NEW) == ("complete", frozenset({"hot"}))  # stays in hot: hashed now
        assert node.state(RUN, OLD) == (None, frozenset())  # held: not in the index yet
        with open(target, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            f.write(b"XXXXX")
        the_pass(catalog)
        assert requested == [RUN]
        assert node.state(RUN, OLD) == (None, frozenset()) and not (node.warm / RUN).exists()

        # Recorded meanwhile by another process (a manual prune): left alone.
        for p in (target, target.parent):
            os.utime(p, (time.time() - 600, time.time() - 600))
        assert wait_for(lambda: fingerprint.settled(fingerprint.take(target)), 10)
        catalog = watcher_sees_it()
        Catalog(settings, index).reconcile_run(RUN)
        assert node.state(RUN, OLD) == ("complete", frozenset({"hot"}))
        the_pass(catalog)
        assert requested == [RUN] and not (node.warm / RUN).exists()
    finally:
        index.close()


def test_checkpoints_found_at_start_up_are_moved_reading_them_once(node: Node, notify: Notifications) -> None:
    """Written while the daemon was down: its first reconcile hashes NEW (it stays in hot) and
    holds OLD, and the first retention pass, started right after ``READY``, copies OLD hashing it."""
    node.write_config(
        daemon={**DAEMON, "retention_interval": "1h", "reap_interval": "1h"}, hot={"keep_last": 1}
    )
    assert node.cli("scan").returncode == 0  # the index exists (a first start builds it hashing all)
    past = time.time() - 600
    _hf(node.hot / RUN, NEW, 4096, past)
    digests = _hf(node.hot / RUN, OLD, 2 << 20, past - 60)
    proc = node.start(notify)
    assert notify.wait_for("READY=1", 60), node.log_text(proc)

    assert wait_for(lambda: moved(node), 90, interval=0.2), (node.ls(), node.log_text(proc)[-4000:])
    text = node.log_text(proc)
    assert "held for its move" in text and "copying a new checkpoint while hashing it" in text, text[-4000:]
    assert_exact_in_warm(node, digests)
    stop_cleanly(node, proc, notify)
