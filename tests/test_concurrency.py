"""Concurrency (docs/design.md, safety invariant 8): one executor at a time, and what another process does meanwhile.

* two ``prune`` at once: the second exits 11 (``--lock-timeout`` short) or waits and then runs;
* ``prune`` while the daemon runs: whichever comes second skips or waits; the node converges;
* ``pin`` from another process while a prune is copying: the pinned checkpoints that the plan
  expires or reaps survive (the executor re-checks pins right before it deletes), and ``ls`` /
  ``status`` answer meanwhile.

Copies are slowed down through a test seam (a sleep at every copy chunk) so the races are real
and wide; the seam also drops a file when the first copy starts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from faultnode import GOLDEN, FaultNode, Template, kill

SLOW_COPIES = """
import os, sys, time
import ckptkeeper.executor as _ex
_hit = _ex._CrashPoints.hit
def hit(self, where):
    if where == "copy-progress":
        if not os.path.exists(os.environ["COPYING_FLAG"]):
            open(os.environ["COPYING_FLAG"], "w").close()
        time.sleep(float(os.environ.get("COPY_DELAY", "0.25")))
    _hit(self, where)
_ex._CrashPoints.hit = hit
from ckptkeeper.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return Template.build(tmp_path_factory.mktemp("small"), multipart=False)


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def slow_prune(node: FaultNode, *args: str, log: str = "slow") -> Any:
    flag = node.tmp / f"{log}.copying"
    proc = node.popen("prune", *args, env={"COPYING_FLAG": str(flag)}, wrapper=SLOW_COPIES, log=log)
    assert wait_for(flag.exists, 60), node.log(log)[-3000:]
    return proc


def test_two_prunes_at_once_the_second_exits_11_or_waits(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    node = FaultNode(tmp_path, small, endpoint=s3_client.meta.endpoint_url, bucket=s3_bucket)
    first = slow_prune(node)
    try:
        refused = node.cli("prune", "--lock-timeout", "0.3")
        assert refused.returncode == 11, refused.stdout + refused.stderr
        assert "holds" in refused.stderr and "try again later" in refused.stderr
        waited = node.cli("prune", "--lock-timeout", "120")  # waits for the first, then runs
        assert waited.returncode == 0, waited.stdout + waited.stderr
        assert first.poll() is not None  # it could only run after the first one finished
    finally:
        assert kill(first, signal.SIGTERM) == 0, node.log("slow")[-3000:]
    assert node.lost(s3_client) == []
    assert node.misplaced(s3_client) == []
    assert node.litter(s3_client) == []


def test_prune_while_the_daemon_runs_skips_or_waits_and_the_node_converges(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    node = FaultNode(tmp_path, small, endpoint=s3_client.meta.endpoint_url, bucket=s3_bucket)
    daemon = node.popen("daemon", log="daemon")
    codes = []
    try:
        for _ in range(4):
            result = node.cli("prune", "--lock-timeout", "0.2")
            codes.append(result.returncode)
            assert result.returncode in (0, 11), result.stdout + result.stderr
            assert node.lost(s3_client) == []
        assert wait_for(lambda: node.misplaced(s3_client) == [] and node.litter(s3_client) == [], 60, 0.5)
    finally:
        assert kill(daemon, signal.SIGTERM) == 0, node.log("daemon")[-3000:]
    log = node.log("daemon")
    assert "Traceback" not in log
    # both sides really ran: the CLI did work or was refused, the daemon pruned or skipped
    assert '"prune done"' in log or "prune skipped: another process holds the executor lock" in log
    assert node.cli("prune").returncode == 0
    assert node.misplaced(s3_client) == []


def test_pin_from_another_process_during_a_slow_prune_saves_the_checkpoint(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    """The plan expires train@400 and reaps failed@100; both get pinned while the prune is still
    copying. The executor re-reads the index before each delete and skips them."""
    node = FaultNode(tmp_path, small, endpoint=s3_client.meta.endpoint_url, bucket=s3_bucket)
    dry = json.loads(node.cli("prune", "--dry-run", "--json").stdout)
    doomed = {(a["run"], a["step"]) for a in dry["actions"] if a["action"] in ("delete", "reap")}
    assert {("train", 400), ("failed", 100)} <= doomed
    assert node.cli("scan").returncode == 0  # so the rows exist for `pin` while the prune runs
    proc = slow_prune(node)
    try:
        # Both at once, as two operators would: a pin also writes its pin object to every slower
        # tier (S3 included), so one after the other could outlast the copies.
        with ThreadPoolExecutor(2) as pool:
            pins = list(pool.map(lambda key: node.cli("pin", *key), (("train", "400"), ("failed", "100"))))
        for pinned in pins:
            assert pinned.returncode == 0, pinned.stderr
        assert proc.poll() is None, "the race was lost: the prune finished before the pins"
        for args in (("ls", "--json"), ("status", "--json")):
            meanwhile = node.cli(*args)
            assert meanwhile.returncode == 0, meanwhile.stderr  # readers never wait on the executor
        assert proc.wait(timeout=120) == 0, node.log("slow")[-3000:]
    finally:
        kill(proc)
    out = node.log("slow")
    assert "pinned since the plan was made" in out, out[-3000:]
    for key in (("train", 400), ("failed", 100)):
        assert node.intact_in(key, "hot", s3_client), key
    placement = node.placement()
    assert placement[("train", 400)] == ("hot",) and placement[("failed", 100)] == ("hot",)
    assert node.lost(s3_client, GOLDEN) == []
    # and the pins hold on later passes too
    assert node.cli("prune").returncode == 0
    assert node.intact_in(("train", 400), "hot", s3_client) and node.intact_in(
        ("failed", 100), "hot", s3_client
    )


def test_index_threads_never_leave_a_write_uncommitted(tmp_path: Path) -> None:
    """Found by the crash stress (a daemon trial left an S3 staging marker): the daemon's watcher
    and executor threads share one SQLite connection. ``journal_begin`` ran ``INSERT … RETURNING``
    under the lock but read the returned row after releasing it; a watcher COMMIT landing in between
    failed ("SQL statements in progress") and left its transaction open, so every later write of
    the daemon — journal entries included — joined it and was never committed: a kill -9 lost the
    journal, and other processes waited on the write lock ("database is locked")."""
    import sqlite3
    import threading

    from ckptkeeper.core.model import RunState
    from ckptkeeper.index import Index

    path = tmp_path / "index.db"
    ix = Index(path)
    errors: list[BaseException] = []
    stop = threading.Event()

    def journal() -> None:
        try:
            while not stop.is_set():
                ix.journal_done(ix.journal_begin({"action": "copy", "path": "r/c"}, "copying"))
        except BaseException as exc:
            errors.append(exc)

    def reconcile() -> None:
        try:
            while not stop.is_set():
                with ix.transaction():
                    ix.set_tier_status("hot", True)
                    ix.upsert_run("r", state=RunState.ACTIVE)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=journal), threading.Thread(target=reconcile)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between any two bytecodes: the race in a second
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(10)
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert not ix._db.in_transaction
    written = ix._exec("SELECT COUNT(*) FROM journal").fetchone()[0]
    other = sqlite3.connect(path)  # another process's view: only what was committed
    try:
        assert other.execute("SELECT COUNT(*) FROM journal").fetchone()[0] == written > 0
    finally:
        other.close()

    # and a COMMIT that does fail rolls back instead of leaving the transaction open
    pending = ix._db.execute(
        "INSERT INTO journal (action, phase, detail, started_at, updated_at) VALUES ('{}', 'x', '{}', 0, 0) RETURNING id"
    )
    with pytest.raises(sqlite3.OperationalError, match="statements in progress"), ix.transaction():
        ix.set_tier_status("warm", True)
    assert not ix._db.in_transaction
    pending.fetchall()
    ix.close()


def test_another_process_can_write_the_index_while_the_catalog_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the fault suite: the catalog hashed new checkpoints inside its write transaction,
    so a `pin` or `prune` from another process waited for the whole read of a big checkpoint and
    hit the 10 s busy timeout. Hashing now happens before the transaction: every write another
    connection attempts while a file is hashed gets the lock at once (timeout 0)."""
    import sqlite3

    from layout_fixtures import make_hf

    import ckptkeeper.ingest.catalog as catalog_module
    from ckptkeeper.config import settings_from_mapping
    from ckptkeeper.index import Index
    from ckptkeeper.ingest.catalog import Catalog

    hot = tmp_path / "hot"
    for step in (100, 200, 300):
        make_hf(hot / "run", step)
    old = time.time() - 3600
    for p in hot.rglob("*"):
        os.utime(p, (old, old))
    settings = settings_from_mapping(
        {
            "index": str(tmp_path / "index.db"),
            "daemon": {"trust_mtimes": True},  # back-dated above to mean "settled"
            "tiers": [{"name": "hot", "url": str(hot)}],
        }
    )
    real_hash = catalog_module.hash_file
    attempts: list[str] = []

    def hash_file_while_another_process_writes(path: Any) -> tuple[int, str]:
        other = sqlite3.connect(settings.index, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("UPDATE checkpoints SET pinned = pinned")
            other.execute("COMMIT")
            attempts.append("ok")
        except sqlite3.OperationalError as exc:
            attempts.append(str(exc))
        finally:
            other.close()
        return real_hash(path)

    monkeypatch.setattr(catalog_module, "hash_file", hash_file_while_another_process_writes)
    with Index(settings.index) as ix:
        report = Catalog(settings, ix).reconcile_hot()
        assert report.new == 3
        assert attempts and set(attempts) == {"ok"}, attempts
        assert [c.state.value for c in ix.snapshot(["hot"]).checkpoints] == ["complete"] * 3
