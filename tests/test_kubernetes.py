"""The daemon as the Kubernetes chart runs it, and the chart's manifests as the daemon needs them.

The chart configures the daemon by environment alone (a ConfigMap of ``CKPTKEEPER_*`` variables,
``CKPTKEEPER_NODE`` from the downward API, S3 credentials from a Secret), probes ``/healthz`` and
``/readyz``, reads JSON log lines from stdout and stops the pod with SIGTERM. The main test starts
the real daemon that way as a subprocess, with the ConfigMap's variables taken from the committed
plain manifests; the S3 tier sits behind a gate that holds its first listing, so the daemon is seen
not ready before its first catalog sync and ready after it, without any timing.

Helm itself is exercised by ``.ci/kubernetes.sh`` (lint, render, API schemas); these tests need
only Python.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from layout_fixtures import make_hf

from ckptkeeper.config import DEFAULT_CONFIG_PATH, settings_from_mapping
from ckptkeeper.daemon.metrics import Metrics

REPO = Path(__file__).resolve().parent.parent
KUBE = REPO / "deploy" / "kubernetes"
MANIFESTS = KUBE / "manifests" / "ckptkeeper.yaml"


def manifest_objects() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFESTS.read_text()) if isinstance(doc, dict)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    """Status and body of a GET; a 503 is an answer, not an error."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def answers(url: str) -> bool:
    try:
        get(url)
    except OSError:
        return False
    return True


class Gate:
    """A TCP relay to the S3 server that holds every connection until :meth:`open` (a node whose
    object store answers slowly at start-up). Every thread it starts is joined by :meth:`close`."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.connected = threading.Event()
        self._open = threading.Event()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name="test-gate-accept")
        self._acceptor.start()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closing.set()
        self._acceptor.join()
        self._listener.close()
        for thread in self._threads:
            thread.join()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _addr = self._listener.accept()
            except TimeoutError:
                continue
            self.connected.set()
            thread = threading.Thread(target=self._relay, args=(conn,), name="test-gate-relay")
            self._threads.append(thread)
            thread.start()

    def _relay(self, conn: socket.socket) -> None:
        with conn:
            while not self._open.wait(0.05):
                if self._closing.is_set():
                    return
            with socket.create_connection(self._upstream, timeout=30) as upstream:
                peers = {conn: upstream, upstream: conn}
                while not self._closing.is_set():
                    readable, _, _ = select.select(list(peers), [], [], 0.05)
                    for sock in readable:
                        data = sock.recv(65536)
                        if not data:
                            return
                        peers[sock].sendall(data)


@pytest.fixture
def gate(s3_reset: str) -> Iterator[Gate]:
    g = Gate(s3_reset)
    try:
        yield g
    finally:
        g.open()
        g.close()


def chart_environment(tmp_path: Path, tiers: list[dict[str, Any]], port: int) -> dict[str, str]:
    """The container's environment: the manifests' ConfigMap (paths and port moved into the test's
    directory), the downward API's node name (twice), the Secret's AWS variables; nothing else."""
    objects = manifest_objects()
    data = dict(objects["ConfigMap"]["data"])
    daemon = json.loads(data["CKPTKEEPER_DAEMON"])
    assert daemon["log_stream"] == "stdout"
    assert daemon["metrics_addr"] == "0.0.0.0:9464"
    daemon.update(metrics_addr=f"127.0.0.1:{port}", settle_seconds="1s", trust_mtimes=True)
    hot = json.loads(data["CKPTKEEPER_TIERS"])[0]
    data.update(
        CKPTKEEPER_DAEMON=json.dumps(daemon),
        CKPTKEEPER_TIERS=json.dumps([{**hot, **tiers[0]}, *tiers[1:]]),
        CKPTKEEPER_INDEX=str(tmp_path / "state" / "index.db"),
    )
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "PYTHONPATH") or k.startswith("AWS_")}
    node = {"CKPTKEEPER_NODE": "gpu-node-7", "CKPTKEEPER_HOST": "gpu-node-7"}  # spec.nodeName
    return {**env, **data, **node, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}


def test_daemon_runs_as_the_chart_runs_it(tmp_path: Path, gate: Gate, s3_bucket: str) -> None:
    assert not DEFAULT_CONFIG_PATH.exists(), f"{DEFAULT_CONFIG_PATH} exists here: the pod has none"
    hot, warm = tmp_path / "nvme", tmp_path / "warm"
    hot.mkdir()
    warm.mkdir()
    past = time.time() - 3600
    ckpt = make_hf(hot / "run-a", 100, eval_loss=1.5)
    for p in [ckpt, *ckpt.rglob("*")]:
        os.utime(p, (past, past))
    port = free_port()
    tiers: list[dict[str, Any]] = [
        {"name": "hot", "url": str(hot)},
        {"name": "warm", "url": str(warm)},
        {
            "name": "cold",
            "url": f"s3://{s3_bucket}/cluster",
            "shared": True,
            "storage_options": {"endpoint_url": gate.url},
        },
    ]
    env = chart_environment(tmp_path, tiers, port)
    grace = manifest_objects()["DaemonSet"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    base = f"http://127.0.0.1:{port}"
    with (tmp_path / "stdout").open("wb") as out, (tmp_path / "stderr").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptkeeper.cli", "daemon"], stdout=out, stderr=err, env=env, cwd=tmp_path
        )
    try:
        assert wait_for(lambda: answers(f"{base}/healthz") or proc.poll() is not None, 60)
        assert proc.poll() is None, (tmp_path / "stderr").read_text()
        # Alive, not ready: the first sync is stuck on the object store's first listing.
        assert gate.connected.wait(60), "the first sync never reached the S3 tier"
        assert get(f"{base}/healthz") == (200, "ok\n")
        status, body = get(f"{base}/readyz")
        assert status == 503
        assert body == f"initial scan of {hot} in progress\n"
        gate.open()
        assert wait_for(lambda: get(f"{base}/readyz")[0] == 200, 60)
        assert get(f"{base}/readyz") == (200, "ok\n")

        status, metrics = get(f"{base}/metrics")
        assert status == 200
        assert 'ckptkeeper_checkpoints{tier="hot"} 1.0' in metrics
        assert 'ckptkeeper_tier_up{tier="cold"} 1.0' in metrics

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=grace) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    stdout = (tmp_path / "stdout").read_text()
    assert (tmp_path / "stderr").read_text() == ""
    events = [json.loads(line) for line in stdout.splitlines()]  # every line is one JSON object
    assert all({"event", "level", "timestamp"} <= set(e) for e in events)
    names = [e["event"] for e in events]
    assert names.index("ready") < names.index("stopping") < names.index("stopped")
    assert names[-1] == "stopped"
    assert env["AWS_SECRET_ACCESS_KEY"] not in stdout


def test_plain_manifests_fit_the_daemon() -> None:
    """The committed manifests (a rendering of the chart's defaults, kept equal by CI) load as a
    ckptkeeper config from the environment, probe the daemon's endpoints on its port, name the node
    by the downward API and mount the index and every local tier."""
    result = subprocess.run(
        [sys.executable, str(KUBE / "check_manifests.py"), str(MANIFESTS)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == f"{MANIFESTS}: ok\n"


def test_cross_check_refuses_a_manifest_the_daemon_would_not_run(tmp_path: Path) -> None:
    text = MANIFESTS.read_text()
    broken = text.replace("path: /readyz", "path: /ready").replace('\\"keep_last\\":3', '\\"keep_lsat\\":3')
    assert broken.count("keep_lsat") == 1
    (tmp_path / "broken.yaml").write_text(broken)
    result = subprocess.run(
        [sys.executable, str(KUBE / "check_manifests.py"), str(tmp_path / "broken.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 1
    assert "readinessProbe is not GET /readyz" in result.stdout
    assert "tiers[0].keep_lsat: unknown key" in result.stdout


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in {**os.environ, **env}.items() if not k.startswith("CKPTKEEPER_") or k in env},
        cwd=cwd,
    )


def test_environment_alone_is_a_config_and_log_stream_is_the_daemons_only(tmp_path: Path) -> None:
    assert not DEFAULT_CONFIG_PATH.exists()
    (tmp_path / "hot").mkdir()
    env = {
        "CKPTKEEPER_TIERS": json.dumps([{"name": "hot", "url": str(tmp_path / "hot")}]),
        "CKPTKEEPER_INDEX": str(tmp_path / "index.db"),
        "CKPTKEEPER_DAEMON__LOG_STREAM": "stdout",
        "CKPTKEEPER_LOG_LEVEL": "debug",
    }
    listed = run_cli(["ls", "--json"], env, tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == {"runs": [], "quarantined": []}  # no log line on stdout

    # A file named but missing is still an error, whatever the environment holds.
    named = run_cli(["--config", str(tmp_path / "nope.toml"), "ls"], env, tmp_path)
    assert named.returncode == 2
    assert "config file not found" in named.stderr
    # No file and no tiers in the environment: not a config.
    bare = run_cli(["ls"], {"CKPTKEEPER_INDEX": str(tmp_path / "index.db")}, tmp_path)
    assert bare.returncode == 2
    assert "config file not found" in bare.stderr


def test_probes_answer_503_with_the_reason(tmp_path: Path) -> None:
    settings = settings_from_mapping(
        {"index": str(tmp_path / "index.db"), "tiers": [{"name": "hot", "url": str(tmp_path)}]}
    )

    def broken() -> str | None:
        raise RuntimeError("index gone")

    problem: list[str | None] = ["the job scheduler is not running"]
    metrics = Metrics(settings, probes={"/healthz": lambda: problem[0], "/readyz": broken})
    server = metrics.serve("127.0.0.1:0")
    assert server is not None
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert get(f"{base}/healthz") == (503, "the job scheduler is not running\n")
        problem[0] = None
        assert get(f"{base}/healthz") == (200, "ok\n")
        assert get(f"{base}/readyz") == (503, "RuntimeError: index gone\n")
        status, body = get(f"{base}/metrics")
        assert status == 200 and "ckptkeeper_build_info" in body
    finally:
        server.stop()


def test_a_restarted_pod_is_the_same_keeper_on_a_shared_tier(tmp_path: Path) -> None:
    """A pod's hostname is new at every restart; the chart names the machine by its node
    (``CKPTKEEPER_HOST`` from ``spec.nodeName``), so the keeper a restarted pod finds in a shared
    tier's heartbeat is itself, while another machine using the same node name is still refused."""
    shared = tmp_path / "lustre"
    shared.mkdir()
    env = {
        "CKPTKEEPER_TIERS": json.dumps([{"name": "hot", "url": str(shared), "shared": True}]),
        "CKPTKEEPER_INDEX": str(tmp_path / "state" / "index.db"),
        "CKPTKEEPER_NODE": "gpu-node-7",
        "CKPTKEEPER_HOST": "gpu-node-7",
    }
    first = run_cli(["prune"], env, tmp_path)  # writes the node's heartbeat in the shared tier
    assert first.returncode == 0, first.stderr
    restarted = run_cli(["prune"], env, tmp_path)
    assert restarted.returncode == 0, restarted.stderr
    other = run_cli(["prune"], {**env, "CKPTKEEPER_HOST": "gpu-node-8"}, tmp_path)
    assert other.returncode == 2, other.stdout + other.stderr
    assert "node name 'gpu-node-7' is also used by another keeper on shared tier 'hot'" in other.stderr
