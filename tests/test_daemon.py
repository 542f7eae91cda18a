"""``ckptkeeper daemon`` as a real subprocess: sd_notify, watching, jobs, metrics, signals, lock.

Each test binds its own ``AF_UNIX`` datagram socket as ``$NOTIFY_SOCKET`` (a path, or an abstract
``@name``) and reads what the daemon tells "systemd". Every process started here is killed in a
``finally``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config, write_text_config
from layout_fixtures import make_hf  # tests/ is on sys.path (pytest prepend mode), as in test_layouts

from ckptkeeper.index import Index

REPO = Path(__file__).resolve().parent.parent
SETTLE = 1.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Notifications:
    """The systemd side of sd_notify: a bound datagram socket, read continuously, and what arrived.

    Read by a thread from the start, as systemd reads its notify socket: Linux queues only
    ``net.unix.max_dgram_qlen`` (10) unread datagrams, and a receiver that read only inside
    :meth:`wait_for` let a daemon's status lines fill the queue while a test polled something else
    (a settle loop); the daemon's next send then waited for room, and at SIGTERM the test waited
    for the daemon to exit before reading again: neither moved (test_daemon_e2e under load).
    """

    def __init__(self, *, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"ckptkeeper-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
            self._dir: str | None = None
        else:
            # AF_UNIX paths are limited to ~108 bytes: pytest's tmp_path can be longer.
            self._dir = tempfile.mkdtemp(prefix="ckn-", dir="/tmp")
            self.address = os.path.join(self._dir, "notify")
            self.sock.bind(self.address)
        self.messages: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        """Held across each read and its append: arrival order is kept, and :meth:`drain` can wait
        out a datagram the reader has taken off the socket but not recorded yet."""
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="test-notify-reader", daemon=True)
        self._reader.start()

    def close(self) -> None:
        self._closing.set()
        self._reader.join()
        self.sock.close()
        if self._dir is not None:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)

    def _read_loop(self) -> None:
        while not self._closing.is_set():
            self._pump(0.05)

    def _pump(self, wait: float) -> None:
        """Record every datagram queued, after waiting up to ``wait`` for the first."""
        readable, _, _ = select.select([self.sock], [], [], wait)
        with self._lock:
            while readable:
                try:
                    data = self.sock.recv(65536, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return
                self.messages.append((time.monotonic(), data.decode()))

    def drain(self, timeout: float = 0.0) -> None:
        """Everything sent before this call is in :attr:`messages` when it returns."""
        self._pump(timeout)

    def lines(self) -> list[str]:
        with self._lock:
            return [line for _t, m in self.messages for line in m.splitlines()]

    def wait_for(self, line: str, timeout: float, *, after: int = 0) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if any(ln == line for ln in self.lines()[after:]):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.drain(min(0.1, remaining))


class Node:
    """A hot and a warm tier, a 0600 config, and daemon processes started against them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.hot = tmp_path / "hot"
        self.warm = tmp_path / "warm"
        self.hot.mkdir()
        self.warm.mkdir()
        self.index_path = tmp_path / "state" / "index.db"
        self.config = tmp_path / "config.toml"
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.write_config()

    def write_config(
        self,
        *,
        daemon: Mapping[str, Any] | None = None,
        hot: Mapping[str, Any] | None = None,
        warm: Mapping[str, Any] | None = None,
        reaper: Mapping[str, Any] | None = None,
        warm_replicate: bool = False,
        raw: str | None = None,
    ) -> None:
        """hot (last 5) and warm; ``daemon``/``hot``/``warm`` add or override keys; ``raw``: this text."""
        if raw is not None:
            write_text_config(self.config, raw)
            return
        write_config(
            self.config,
            index=self.index_path,
            daemon={
                "settle_seconds": f"{SETTLE}s",
                "trust_mtimes": True,
                "metrics_addr": f"127.0.0.1:{self.port}",
                **(daemon or {}),
            },
            tiers=[
                local_tier("hot", self.hot, **{"keep_last": 5, **(hot or {})}),
                local_tier("warm", self.warm, **{"replicate": warm_replicate, **(warm or {})}),
            ],
            reaper=reaper,
        )

    def cli(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            **kwargs,
        )

    def start(
        self, notify: Notifications | None, *, watchdog_usec: int | None = None, name: str = "daemon"
    ) -> Any:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "CKPTKEEPER_"))
        }
        if notify is not None:
            env["NOTIFY_SOCKET"] = notify.address
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        log = (self.tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), "daemon"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        log.close()
        proc.log_path = self.tmp / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def log_text(self, proc: Any) -> str:
        return Path(proc.log_path).read_text(errors="replace")

    def log_events(self, proc: Any) -> list[dict[str, Any]]:
        out = []
        for line in self.log_text(proc).splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)

    def state(self, run: str, name: str) -> tuple[str | None, frozenset[str]]:
        if not self.index_path.exists():
            return None, frozenset()
        ix = Index(self.index_path, readonly=True)
        try:
            row = ix.checkpoint(run, name)
        finally:
            ix.close()
        return (None, frozenset()) if row is None else (row.state.value, row.verified_tiers)

    def ls(self) -> dict[tuple[str, int], dict[str, Any]]:
        res = self.cli("ls", "--json")
        assert res.returncode == 0, res.stderr
        doc = json.loads(res.stdout)
        return {(r["name"], c["step"]): c for r in doc["runs"] for c in r["checkpoints"]}


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def settled(path: Path) -> Path:
    """Backdate a checkpoint as if written an hour ago (while the daemon was down)."""
    past = time.time() - 3600
    for p in [path, *path.rglob("*")]:
        os.utime(p, (past, past), follow_symlinks=False)
    return path


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.kill_all()


@pytest.fixture
def notify_socket() -> Iterator[Notifications]:
    n = Notifications()
    try:
        yield n
    finally:
        n.close()


def stop_cleanly(node: Node, proc: Any, notify: Notifications) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, node.log_text(proc)
    notify.drain(0.2)
    assert "STOPPING=1" in notify.lines()


# -- the main scenario ------------------------------------------------------------------------------


def test_daemon_catalogs_notifies_serves_metrics_and_stops(node: Node, notify_socket: Notifications) -> None:
    import ckptkeeper

    settled(make_hf(node.hot / "before", 100, eval_loss=1.5))  # written while the daemon was down
    proc = node.start(notify_socket, watchdog_usec=200_000)
    try:
        assert notify_socket.wait_for("READY=1", 30), node.log_text(proc)
        assert any(line.startswith("STATUS=watching ") for line in notify_socket.lines())

        # Found by the startup reconcile.
        assert node.state("before", "checkpoint-100")[0] == "complete"

        # Written after start: marker present, so complete once quiet for settle_seconds.
        make_hf(node.hot / "after", 200)
        assert wait_for(lambda: node.state("after", "checkpoint-200")[0] == "complete", SETTLE + 5)

        # A partial checkpoint (no trainer_state.json) is never cataloged complete.
        make_hf(node.hot / "after", 300, complete=False)
        assert wait_for(lambda: node.state("after", "checkpoint-300")[0] == "writing", 5)

        # A hook commit is indexed within 1 s.
        with ckptkeeper.track_run(node.hot / "hooked", heartbeat_interval=0.1) as run:
            path = make_hf(node.hot / "hooked", 50, complete=False)
            assert wait_for(lambda: node.state("hooked", "checkpoint-50")[0] == "writing", 5)
            t0 = time.monotonic()
            run.commit(path, step=50, metrics={"eval_loss": 0.5})
            assert wait_for(lambda: node.state("hooked", "checkpoint-50")[0] == "complete", 1.0, 0.005)
            latency = time.monotonic() - t0

        listing = node.ls()
        assert listing[("before", 100)]["state"] == "complete"
        assert listing[("after", 200)]["state"] == "complete"
        assert listing[("after", 300)]["state"] == "writing"
        assert listing[("hooked", 50)]["state"] == "complete"
        assert listing[("hooked", 50)]["metrics"]["eval_loss"] == 0.5
        assert "hot" in listing[("after", 200)]["tiers"]

        # Watchdog pings every WATCHDOG_USEC / 2 while observer and scheduler are alive.
        n_before = notify_socket.lines().count("WATCHDOG=1")
        time.sleep(0.6)
        notify_socket.drain(0.1)
        assert notify_socket.lines().count("WATCHDOG=1") - n_before >= 3

        # /metrics serves the documented names (no step or path labels).
        with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        for name in (
            "ckptkeeper_checkpoints{",
            "ckptkeeper_bytes{",
            "ckptkeeper_reclaimed_bytes_total",
            "ckptkeeper_actions_total{",
            "ckptkeeper_errors_total{",
            "ckptkeeper_newest_checkpoint_age_seconds{",
            "ckptkeeper_tier_up{",
            "ckptkeeper_build_info{",
        ):
            assert name in body, name
        assert 'ckptkeeper_checkpoints{tier="hot"} 3.0' in body
        assert 'ckptkeeper_tier_up{tier="hot"} 1.0' in body
        assert "step=" not in body and "path=" not in body

        stop_cleanly(node, proc, notify_socket)
        lines = notify_socket.lines()
        assert lines.index("STOPPING=1") > lines.index("READY=1")
        print(f"hook commit -> indexed (seen by a polling reader): {latency * 1000:.1f} ms")
    finally:
        node.kill_all()


def test_second_daemon_refuses_to_start(node: Node, notify_socket: Notifications) -> None:
    first = node.start(notify_socket)
    try:
        assert notify_socket.wait_for("READY=1", 30), node.log_text(first)
        second = node.start(None, name="second")
        assert second.wait(timeout=30) == 1
        text = node.log_text(second)
        assert "another ckptkeeper daemon holds" in text
        assert f"index.db.daemon.lock (pid {first.pid})" in text
        assert first.poll() is None
        stop_cleanly(node, first, notify_socket)
    finally:
        node.kill_all()


def test_sighup_keeps_running_on_a_bad_config_and_applies_a_good_one(
    node: Node, notify_socket: Notifications
) -> None:
    proc = node.start(notify_socket)
    try:
        assert notify_socket.wait_for("READY=1", 30), node.log_text(proc)

        node.write_config(raw='index = "x"\n[[tiers]]\nname = "hot"\nurl = "/tmp"\nkeep_lsat = 3\n')
        proc.send_signal(signal.SIGHUP)
        assert wait_for(
            lambda: any(e.get("event", "").startswith("config reload failed") for e in node.log_events(proc)),
            10,
        )
        failed = next(
            e for e in node.log_events(proc) if e.get("event", "").startswith("config reload failed")
        )
        assert any("keep_lsat" in p for p in failed["problems"])
        assert proc.poll() is None

        mark = len(notify_socket.lines())
        node.write_config(daemon={"retention_interval": "7m"})
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: any(e.get("event") == "config reloaded" for e in node.log_events(proc)), 10)
        applied = next(e for e in node.log_events(proc) if e.get("event") == "config reloaded")
        assert applied["changed"] == ["daemon.retention_interval"]
        assert any(
            e.get("event") == "job rescheduled" and e.get("job") == "retention" for e in node.log_events(proc)
        )
        assert notify_socket.wait_for("READY=1", 5, after=mark)  # RELOADING=1 ... READY=1
        assert "RELOADING=1" in notify_socket.lines()[mark:]

        # Still watching after both reloads.
        make_hf(node.hot / "run", 10)
        assert wait_for(lambda: node.state("run", "checkpoint-10")[0] == "complete", SETTLE + 5)
        stop_cleanly(node, proc, notify_socket)
    finally:
        node.kill_all()


def test_abstract_notify_socket_and_prompt_replication(node: Node) -> None:
    """`@name` NOTIFY_SOCKET; a new checkpoint with `replicate` on warm gets copied long before
    the (1 h) retention interval: the watcher triggers a prompt retention pass."""
    notify = Notifications(abstract=True)
    node.write_config(daemon={"retention_interval": "1h", "reap_interval": "1h"}, warm_replicate=True)
    proc = node.start(notify)
    try:
        assert notify.wait_for("READY=1", 30), node.log_text(proc)
        make_hf(node.hot / "run", 1000)
        assert wait_for(
            lambda: node.state("run", "checkpoint-1000") == ("complete", frozenset({"hot", "warm"})), 20
        ), (
            node.state("run", "checkpoint-1000"),
            node.log_text(proc),
        )
        assert (node.warm / "run" / "checkpoint-1000" / "trainer_state.json").exists()
        assert wait_for(
            lambda: any(
                e.get("event") == "job finished" and e.get("job") == "retention" and e.get("ok")
                for e in node.log_events(proc)
            ),
            10,
        )
        events = node.log_events(proc)
        assert any(e.get("event") == "new checkpoint: prompt retention pass scheduled" for e in events)
        status = json.loads(node.cli("status", "--json").stdout)
        assert status["jobs"]["retention"]["last_success"] is not None
        stop_cleanly(node, proc, notify)
    finally:
        node.kill_all()
        notify.close()


def test_checkpoint_written_while_running_is_tiered_without_walking_the_hot_tier(node: Node) -> None:
    """Between full reconciles (startup, rescan job, SIGHUP) the passes trust the watcher: a new
    checkpoint is cataloged and replicated, and neither the pre-pass sync nor the post-pass
    re-check walks the whole hot tier (a walk stamps the hot tier's status); SIGHUP still does."""
    for step in (100, 200):
        settled(make_hf(node.hot / "old", step))
    node.write_config(daemon={"retention_interval": "1h", "reap_interval": "1h"}, warm_replicate=True)
    notify = Notifications()
    proc = node.start(notify)
    try:
        assert notify.wait_for("READY=1", 30), node.log_text(proc)
        walked_at = hot_checked_at(node)
        make_hf(node.hot / "run", 1000)
        assert wait_for(
            lambda: node.state("run", "checkpoint-1000") == ("complete", frozenset({"hot", "warm"})), 20
        ), (node.state("run", "checkpoint-1000"), node.log_text(proc))
        # The prompt pass replicated what was there before the start as well.
        assert node.state("old", "checkpoint-200") == ("complete", frozenset({"hot", "warm"}))
        time.sleep(1.0)  # the post-pass re-check of "run" has run by now
        events = node.log_events(proc)
        passes = [e for e in events if e.get("event") == "prune done"]
        assert passes and all(e["hot_reconcile"] == "runs" for e in passes), passes
        walks = [e for e in events if e.get("event") == "reconciled" and e.get("run") == "*"]
        assert walks == [], walks
        assert hot_checked_at(node) == walked_at  # nor did run_prune walk it after copying

        proc.send_signal(signal.SIGHUP)
        assert wait_for(
            lambda: any(
                e.get("event") == "reconciled" and e.get("run") == "*" for e in node.log_events(proc)
            ),
            10,
        ), node.log_text(proc)
        assert hot_checked_at(node) > walked_at
        stop_cleanly(node, proc, notify)
    finally:
        node.kill_all()
        notify.close()


def hot_checked_at(node: Node) -> float:
    ix = Index(node.index_path, readonly=True)
    try:
        return ix.tier_statuses()["hot"].checked_at
    finally:
        ix.close()


def test_bad_metrics_addr_is_a_config_error(node: Node) -> None:
    node.write_config()
    text = node.config.read_text().replace(f'"127.0.0.1:{node.port}"', '"localhost"')
    node.write_config(raw=text)
    proc = node.start(None)
    try:
        assert proc.wait(timeout=30) == 2
        assert "daemon.metrics_addr" in node.log_text(proc)
    finally:
        node.kill_all()


# -- the small parts, in-process ----------------------------------------------------------------------


def test_lock_second_holder_waits_then_fails_naming_the_pid(tmp_path: Path) -> None:
    from ckptkeeper.util.lock import DaemonLock, ExecutorLock, LockHeld

    index = tmp_path / "state" / "index.db"
    first = ExecutorLock(index)
    first.acquire()
    try:
        t0 = time.monotonic()
        with pytest.raises(LockHeld) as err:
            ExecutorLock(index).acquire(timeout=0.3)
        assert time.monotonic() - t0 >= 0.25
        assert err.value.pid == os.getpid()
        assert (
            str(err.value) == f"another ckptkeeper executor holds {index}.executor.lock (pid {os.getpid()})"
        )
        with DaemonLock(index):  # a different lock file: the daemon lock is independent
            pass
    finally:
        first.release()
    with ExecutorLock(index) as again:  # released: free again, also for a new holder
        assert again.held
    assert first.holder_pid() is None


def test_sd_notify_is_a_no_op_without_a_socket_and_speaks_abstract_sockets() -> None:
    from ckptkeeper.daemon.sdnotify import notify, watchdog_interval

    assert notify("READY=1", env={}) is False
    assert notify("READY=1", env={"NOTIFY_SOCKET": "/nonexistent/sock"}) is False
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "200000"}) == pytest.approx(0.1)
    assert watchdog_interval({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}) is None
    n = Notifications(abstract=True)
    try:
        assert notify("STATUS=hello", env={"NOTIFY_SOCKET": n.address}) is True
        assert n.wait_for("STATUS=hello", 2)
    finally:
        n.close()


def test_watchdog_pinger_pings_only_while_healthy() -> None:
    from ckptkeeper.daemon.sdnotify import WatchdogPinger

    n = Notifications()
    healthy = True
    pinger = WatchdogPinger(0.02, lambda: healthy, env={"NOTIFY_SOCKET": n.address})
    try:
        pinger.start()
        assert n.wait_for("WATCHDOG=1", 2)
        healthy = False
        time.sleep(0.1)
        n.drain(0.05)
        count = n.lines().count("WATCHDOG=1")
        time.sleep(0.2)
        n.drain(0.05)
        assert n.lines().count("WATCHDOG=1") == count
        assert pinger.skipped >= 5
    finally:
        pinger.stop()
        n.close()


def test_parse_metrics_addr() -> None:
    from ckptkeeper.config import parse_addr

    assert parse_addr("") is None
    assert parse_addr("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_addr("[::1]:9464") == ("::1", 9464)
    for bad in ("localhost", ":9464", "host:http", "host:70000"):
        with pytest.raises(ValueError, match=r"daemon\.metrics_addr"):
            parse_addr(bad)


def test_prune_textfile_is_written_atomically_with_index_metrics(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from ckptkeeper.config import settings_from_mapping
    from ckptkeeper.core.model import Action, ActionKind
    from ckptkeeper.daemon.metrics import write_prune_textfile
    from ckptkeeper.ingest.catalog import Catalog

    hot = tmp_path / "hot"
    settled(make_hf(hot / "run", 100))
    prom = tmp_path / "textfile" / "ckptkeeper.prom"
    settings = settings_from_mapping(
        {
            "index": str(tmp_path / "index.db"),
            "daemon": {"textfile": str(prom), "trust_mtimes": True},  # `settled` back-dates
            "tiers": [{"name": "hot", "url": str(hot)}, {"name": "cold", "url": "s3://bucket/x"}],
        }
    )
    with Index(settings.index) as ix:
        Catalog(settings, ix).reconcile_hot()
        ix.add_reclaimed("partial", 1000)
        ix.add_reclaimed("something-new", 5)
        ix.job_finished("prune")
        done = [Action(ActionKind.REAP, "partial", run="run", step=1, tier="hot", path="run/x", bytes=1000)]
        outcome = SimpleNamespace(
            plan=None,
            result=SimpleNamespace(done=done),
            exit_code=0,
            failed=[],
            reclaimed_bytes=1000,
            dry_run=False,
        )
        assert write_prune_textfile(settings, ix, outcome) == prom
    body = prom.read_text()
    assert 'ckptkeeper_checkpoints{tier="hot"} 1.0' in body
    assert 'ckptkeeper_checkpoints{tier="cold"} 0.0' in body
    assert 'ckptkeeper_reclaimed_bytes_total{reason="partial"} 1000.0' in body
    assert 'ckptkeeper_reclaimed_bytes_total{reason="other"} 5.0' in body  # closed label set
    assert 'ckptkeeper_prune_last_actions{kind="reap"} 1.0' in body
    assert "ckptkeeper_prune_last_reclaimed_bytes 1000.0" in body
    assert 'ckptkeeper_job_last_success_timestamp_seconds{job="prune"}' in body
    assert 'ckptkeeper_newest_checkpoint_age_seconds{tier="hot"}' in body
    assert sorted(p.name for p in prom.parent.iterdir()) == ["ckptkeeper.prom"]  # no temp file left


def test_sd_notify_never_blocks_on_a_manager_that_stopped_reading() -> None:
    """Regression: a full notify queue (Linux: 10 unread datagrams) blocked ``notify`` for good,
    from the job thread after each pass and from the main thread at SIGTERM: the daemon stopped
    running passes and never exited."""
    from ckptkeeper.daemon import sdnotify

    name = f"ckptkeeper-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # bound, never read
    sock.bind("\0" + name)
    env = {"NOTIFY_SOCKET": "@" + name}
    results: list[bool] = []

    def send_until_dropped() -> None:
        for i in range(1000):
            results.append(sdnotify.notify(f"STATUS={i}", env=env))
            if not results[-1]:
                return

    sender = threading.Thread(target=send_until_dropped, name="test-notify-sender", daemon=True)
    try:
        sender.start()
        sender.join(60)  # a hang is what this tests; the one dropped send takes SEND_TIMEOUT
        assert not sender.is_alive(), "notify blocked on a full socket queue"
        assert results[0] is True and results[-1] is False, results
        sock.recv(65536)
        assert sdnotify.notify("STOPPING=1", env=env) is True  # room again: delivered
    finally:
        sock.close()
