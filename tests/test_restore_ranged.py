"""Restores from S3 through parallel ranged GETs (ckptkeeper/storage/s3_fetch.py), end to end.

A checkpoint is pruned from hot to an S3 tier with the real CLI, then restored with
``ckptkeeper restore``: byte-identical on moto and SeaweedFS, for one object of many ranges and
for many small objects; a changed byte in the store, or a ranged GET that keeps breaking, fails the
restore (exit 1) and leaves nothing that looks like a restored checkpoint; a GET broken once is
resumed and the restore succeeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from builders import local_tier, s3_tier, write_config
from click.testing import CliRunner
from faultproxy import FaultProxy, Request
from hypothesis import given
from hypothesis import strategies as st

from ckptkeeper.cli import main
from ckptkeeper.storage import s3_fetch, s3_get

RUN = "run-a"
STEP = 100
CKPT = f"checkpoint-{STEP}"
RANGE = 64 * 1024
"""A small range size for the tests, so a few MiB already span more ranges than the window."""
CHUNK = 16 * 1024
"""A small buffer, so each range streams through several and a few MiB fill the room ahead."""


@pytest.fixture(autouse=True)
def _small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_fetch, "RANGE_SIZE", RANGE)
    monkeypatch.setattr(s3_get, "RANGE_SIZE", RANGE)
    monkeypatch.setattr(s3_get, "CHUNK", CHUNK)


def _client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class Node:
    """A hot tier keeping nothing and an S3 tier keeping everything, driven through the CLI."""

    def __init__(self, tmp: Path, bucket: str, endpoint: str, files: dict[str, int]) -> None:
        self.tmp = tmp
        self.bucket = bucket
        self.hot = tmp / "hot"
        ckpt = self.hot / RUN / CKPT
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": STEP, "log_history": []}))
        for rel, size in files.items():
            (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
            (ckpt / rel).write_bytes(os.urandom(size))
        when = time.time() - 3600
        for p in [*ckpt.rglob("*"), ckpt]:
            os.utime(p, (when, when))
        self.original = _tree(ckpt)
        self.config = write_config(
            tmp / "config.toml",
            index=tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[local_tier("hot", self.hot, keep_last=0), s3_tier("cold", bucket, endpoint)],
        )
        code, out = self.cli("prune")
        assert code == 0, out
        assert not ckpt.exists(), "the prune moved the checkpoint to the S3 tier"

    def cli(self, *args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--config", str(self.config), *args], catch_exceptions=False)
        return result.exit_code, result.output

    def restore(self, to: Path) -> tuple[int, str]:
        return self.cli("restore", RUN, "--step", str(STEP), "--to", str(to))

    def key(self, rel: str) -> str:
        return f"ckpt/{RUN}/{CKPT}/{rel}"

    def with_endpoint(self, endpoint: str, **top: Any) -> None:
        """Point the S3 tier at another endpoint (a fault proxy in front of the same store)."""
        write_config(
            self.config,
            index=self.tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True},
            tiers=[local_tier("hot", self.hot, keep_last=0), s3_tier("cold", self.bucket, endpoint)],
            **top,
        )


def _nothing_restored(dest: Path) -> None:
    """No checkpoint (nor a staging directory that could pass for one) was left in ``dest``."""
    assert not dest.exists() or os.listdir(dest) == []


def test_a_large_object_restores_byte_identical_over_many_ranges(
    tmp_path: Path, store: tuple[str, dict[str, Any]]
) -> None:
    bucket, options = store
    # 4 MiB + 123 bytes: 65 ranges, many more than the window ahead of the hash frontier
    node = Node(tmp_path, bucket, options["endpoint_url"], {"model.bin": 4 * 2**20 + 123, "empty.bin": 0})
    code, out = node.restore(tmp_path / "restored")
    assert code == 0, out
    restored = tmp_path / "restored" / CKPT
    assert Path(out.strip().splitlines()[-1]) == restored
    assert _tree(restored) == node.original


def test_many_small_files_restore_byte_identical(tmp_path: Path, store: tuple[str, dict[str, Any]]) -> None:
    bucket, options = store
    files = {f"shard-{i % 8}/part-{i:03d}.bin": 1 + (i * 997) % 20_000 for i in range(200)}
    node = Node(tmp_path, bucket, options["endpoint_url"], files)
    code, out = node.restore(tmp_path / "restored")
    assert code == 0, out
    assert _tree(tmp_path / "restored" / CKPT) == node.original


def test_large_and_many_small_objects_restore_byte_identical_and_a_bad_one_leaves_nothing(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    """The ranged GETs of the large objects and the whole GETs of the small ones (more of them in
    flight, smallest first) run at once: all land byte-identical, and a changed small object
    stops the large ones too, leaving nothing."""
    files = {f"small/part-{i:03d}.bin": 1 + (i * 7919) % 60_000 for i in range(120)}
    files |= {"model.bin": 3 * 2**20 + 17, "optimizer.bin": 2 * 2**20 + 5}
    node = Node(tmp_path, s3_bucket, s3_reset, files)
    code, out = node.restore(tmp_path / "restored")
    assert code == 0, out
    assert _tree(tmp_path / "restored" / CKPT) == node.original
    s3 = _client(s3_reset)
    key = node.key("small/part-003.bin")
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[-1] ^= 0x01
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    dest = tmp_path / "again"
    code, out = node.restore(dest)
    assert code == 1, out
    assert "small/part-003.bin: hash" in out and "changed since cataloged" in out
    _nothing_restored(dest)


def test_many_small_objects_are_fetched_more_at_once_than_large_ranges(
    tmp_path: Path, s3_reset: str, s3_bucket: str, proxies: list[FaultProxy]
) -> None:
    """Small objects hide each request's round of lookups behind more connections: GETs of small
    objects are held by the proxy until 12 are in flight at once (more than the 8 ranged GETs of
    large objects); the first that waits in vain lets every one go, and the restore still lands."""
    files = {f"small/part-{i:03d}.bin": 100 + i for i in range(60)}
    node = Node(tmp_path, s3_bucket, s3_reset, files)
    lock, enough = threading.Lock(), threading.Event()
    held, most = [0], [0]

    def hold(data: bytes) -> bytes:
        with lock:
            held[0] += 1
            most[0] = max(most[0], held[0])
            if held[0] >= 12:
                enough.set()
        enough.wait(30)
        enough.set()
        with lock:
            held[0] -= 1
        return data

    def rule(req: Request) -> Any:
        return hold if req.method == "GET" and "/small/" in req.path else None

    proxy = FaultProxy(s3_reset, rate=0.0, rules=[rule])
    proxies.append(proxy)
    node.with_endpoint(proxy.start())
    code, out = node.restore(tmp_path / "restored")
    assert code == 0, out
    assert _tree(tmp_path / "restored" / CKPT) == node.original
    assert most[0] >= 12


def test_a_changed_byte_in_the_store_fails_the_restore_and_leaves_nothing(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    node = Node(tmp_path, s3_bucket, s3_reset, {"model.bin": 1 * 2**20 + 7})
    s3 = _client(s3_reset)
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=node.key("model.bin"))["Body"].read())
    body[len(body) // 2] ^= 0xFF  # same size: only the hash can tell
    s3.put_object(Bucket=s3_bucket, Key=node.key("model.bin"), Body=bytes(body))
    dest = tmp_path / "restored"
    code, out = node.restore(dest)
    assert code == 1, out
    assert "model.bin: hash" in out and "changed since cataloged" in out
    _nothing_restored(dest)


@pytest.fixture
def proxies(s3_reset: str) -> Iterator[list[FaultProxy]]:
    started: list[FaultProxy] = []
    yield started
    for proxy in started:
        proxy.stop()


def _ranged_gets_of(key: str, times: int | None) -> Any:
    """A rule cutting short (half the body, then a reset) the first ``times`` ranged GETs of
    ``key`` past its first range (None: every one of them)."""
    seen = [0]

    def rule(req: Request) -> str | None:
        ranged = any(k.lower() == "range" and not v.startswith("bytes=0-") for k, v in req.headers)
        if req.method != "GET" or not req.path.endswith(key) or not ranged:
            return None
        seen[0] += 1
        return "truncate" if times is None or seen[0] <= times else None

    return rule


def test_a_ranged_get_broken_once_is_resumed(
    tmp_path: Path, s3_reset: str, s3_bucket: str, proxies: list[FaultProxy]
) -> None:
    node = Node(tmp_path, s3_bucket, s3_reset, {"model.bin": 2 * 2**20 + 5})
    proxy = FaultProxy(s3_reset, rate=0.0, rules=[_ranged_gets_of(node.key("model.bin"), 1)])
    proxies.append(proxy)
    node.with_endpoint(proxy.start())
    code, out = node.restore(tmp_path / "restored")
    assert code == 0, out
    assert [f.kind for f in proxy.faults] == ["truncate"]
    assert _tree(tmp_path / "restored" / CKPT) == node.original


def test_a_ranged_get_that_keeps_breaking_fails_cleanly(
    tmp_path: Path, s3_reset: str, s3_bucket: str, proxies: list[FaultProxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_fetch, "RETRIES", 2)
    monkeypatch.setattr(s3_get, "RETRIES", 2)
    node = Node(tmp_path, s3_bucket, s3_reset, {"model.bin": 1 * 2**20 + 5, "small.bin": 100})
    proxy = FaultProxy(s3_reset, rate=0.0, rules=[_ranged_gets_of(node.key("model.bin"), None)])
    proxies.append(proxy)
    node.with_endpoint(proxy.start())
    dest = tmp_path / "restored"
    code, out = node.restore(dest)
    assert code == 1, out
    assert "model.bin: read broke at byte" in out
    assert proxy.faults, "the ranged GETs were cut short"
    _nothing_restored(dest)


def test_a_changed_object_among_200_fails_the_restore_naming_it_and_leaves_nothing(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    files = {f"shard-{i % 8}/part-{i:03d}.bin": 1 + (i * 997) % 20_000 for i in range(200)}
    node = Node(tmp_path, s3_bucket, s3_reset, files)
    s3 = _client(s3_reset)
    key = node.key("shard-5/part-117.bin")
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[0] ^= 0x01  # same size: only the hash can tell
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    dest = tmp_path / "restored"
    code, out = node.restore(dest)
    assert code == 1, out
    assert "shard-5/part-117.bin: hash" in out and "changed since cataloged" in out
    _nothing_restored(dest)


def test_an_object_replaced_during_the_restore_is_never_stitched_together(
    tmp_path: Path, s3_reset: str, s3_bucket: str, proxies: list[FaultProxy]
) -> None:
    """The object is rewritten (same size) while its ranges are being fetched: the ranges that
    arrive from the new object carry another ETag, or their If-Match fails, or the whole file no
    longer hashes to the manifest; whichever comes first, the restore fails and leaves nothing."""
    size = 2 * 2**20 + 5
    node = Node(tmp_path, s3_bucket, s3_reset, {"model.bin": size})
    s3 = _client(s3_reset)
    replaced: list[int] = []

    def replace_once(req: Request) -> str | None:
        ranged = any(k.lower() == "range" and not v.startswith("bytes=0-") for k, v in req.headers)
        if req.method == "GET" and req.path.endswith(node.key("model.bin")) and ranged and not replaced:
            replaced.append(1)
            s3.put_object(Bucket=s3_bucket, Key=node.key("model.bin"), Body=os.urandom(size))
        return None

    proxy = FaultProxy(s3_reset, rate=0.0, rules=[replace_once])
    proxies.append(proxy)
    node.with_endpoint(proxy.start())
    dest = tmp_path / "restored"
    code, out = node.restore(dest)
    assert replaced, "the object was replaced during the restore"
    assert code == 1, out
    assert "model.bin: " in out and ("changed during the restore" in out or "changed since cataloged" in out)
    _nothing_restored(dest)


def test_with_a_proxy_configured_the_restore_goes_through_the_s3_client(
    tmp_path: Path, store: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain GETs would bypass a proxy only the S3 client knows how to use: with one set, the
    restore takes the client's own path (here the store is exempt through NO_PROXY), same result."""
    bucket, options = store
    files = {"model.bin": 1 * 2**20 + 3, **{f"small/part-{i}.bin": 100 + i for i in range(20)}}
    node = Node(tmp_path, bucket, options["endpoint_url"], files)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    called: list[str] = []
    monkeypatch.setattr(s3_get, "fetch_direct", lambda *a, **k: called.append("direct"))
    code, out = node.restore(tmp_path / "restored")
    assert code == 0, out
    assert called == []
    assert _tree(tmp_path / "restored" / CKPT) == node.original


def test_ctrl_c_during_a_stalled_get_stops_every_worker_and_leaves_nothing(
    tmp_path: Path, s3_reset: str, s3_bucket: str, proxies: list[FaultProxy]
) -> None:
    """A GET the store never answers (request_timeout: a day) and Ctrl-C: the restore does not wait
    for it, it ends (the stalled connection is shut down), and no staging directory stays."""
    files = {"model.bin": 1 * 2**20 + 5, **{f"small/part-{i}.bin": 1000 + i for i in range(30)}}
    node = Node(tmp_path, s3_bucket, s3_reset, files)
    held = threading.Event()

    def hold_model(req: Request) -> str | None:
        if req.method == "GET" and req.path.endswith(node.key("model.bin")):
            held.set()
            return "hold"
        return None

    proxy = FaultProxy(s3_reset, rate=0.0, rules=[hold_model])
    proxies.append(proxy)
    node.with_endpoint(proxy.start(), request_timeout="1d")
    dest = tmp_path / "restored"
    argv = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "restore", RUN]
    argv += ["--step", str(STEP), "--to", str(dest)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        assert held.wait(120), "the restore asked for model.bin"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)  # a guard against hanging the suite, not a timing
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out
    _nothing_restored(dest)


def test_prefetch_takes_the_same_direct_path(
    tmp_path: Path, s3_reset: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ckptkeeper prefetch`` (which ``job start`` runs for the scheduler's pre-stage) brings the
    checkpoint back into the hot tier through the worker threads' GETs, not the S3 client's loop."""
    files = {"model.bin": 1 * 2**20 + 9, **{f"shard-{i % 4}/part-{i:03d}.bin": 500 + i for i in range(60)}}
    node = Node(tmp_path, s3_bucket, s3_reset, files)

    def no_loop(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the S3 client's event loop fetched bytes")

    monkeypatch.setattr(s3_fetch, "_fetch_all", no_loop)
    code, out = node.cli("prefetch", RUN, "--json")
    assert code == 0, out
    doc = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert doc["from_tier"] == "cold" and doc["step"] == STEP
    assert _tree(node.hot / RUN / CKPT) == node.original


def test_a_checkpoint_of_more_files_than_open_descriptors_allowed_restores(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    """Each file is opened when its first bytes are fetched and closed once written (synced at the
    commit, a bounded number kept open): 400 files restore under a limit of 160 descriptors."""
    files = {f"shard-{i % 4}/part-{i:04d}.bin": 10 + i for i in range(400)}
    node = Node(tmp_path, s3_bucket, s3_reset, files)
    dest = tmp_path / "restored"
    argv = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(node.config), "restore", RUN]
    argv += ["--step", str(STEP), "--to", str(dest)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (160, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=300, check=False, preexec_fn=few_descriptors
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _tree(dest / CKPT) == node.original


def test_a_refused_get_fails_the_restore_naming_the_object_and_leaves_nothing(
    tmp_path: Path, s3_reset: str, s3_bucket: str, proxies: list[FaultProxy]
) -> None:
    files = {f"part-{i:02d}.bin": 100 + i for i in range(20)}
    node = Node(tmp_path, s3_bucket, s3_reset, files)

    def deny(req: Request) -> str | None:
        return "denied" if req.method == "GET" and req.path.endswith(node.key("part-07.bin")) else None

    proxy = FaultProxy(s3_reset, rate=0.0, rules=[deny])
    proxies.append(proxy)
    node.with_endpoint(proxy.start())
    dest = tmp_path / "restored"
    code, out = node.restore(dest)
    assert code == 1, out
    assert "part-07.bin" in out and "AccessDenied" in out
    _nothing_restored(dest)


def test_a_process_keeping_buffers_restores_one_checkpoint_after_another_byte_identical(
    tmp_path: Path, store: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon keeps its range buffers between restores (``keep_buffers``): a second restore,
    of other bytes, into buffers that still hold the first's, is byte-identical, and a range the
    store changed still fails it with nothing left. Idle, the buffers are given back."""
    monkeypatch.setattr(s3_get, "_BUFFERS", s3_get._Buffers())
    monkeypatch.setattr(s3_get, "_buffer", s3_get._BUFFERS.take)
    monkeypatch.setattr(s3_get, "_give_back", s3_get._BUFFERS.give_back)
    s3_get.keep_buffers()
    bucket, options = store
    first = Node(tmp_path / "a", bucket, options["endpoint_url"], {"model.bin": 2 * 2**20 + 7})
    code, out = first.restore(tmp_path / "restored-a")
    assert code == 0, out
    assert _tree(tmp_path / "restored-a" / CKPT) == first.original
    kept = s3_get.kept_buffer_bytes()
    assert kept >= CHUNK  # what the restore used is kept for the next one
    files = {"model.bin": 2 * 2**20 + 3, **{f"shard/part-{i}.bin": 1 + i * 4099 for i in range(40)}}
    other, other_bucket = tmp_path / "b", f"{bucket}-b"
    s3 = _client(options["endpoint_url"])
    s3.create_bucket(Bucket=other_bucket)
    node = Node(other, other_bucket, options["endpoint_url"], files)
    code, out = node.restore(other / "restored")
    assert code == 0, out
    assert _tree(other / "restored" / CKPT) == node.original
    assert s3_get.kept_buffer_bytes() <= (s3_get.WORKERS + s3_get.SMALL_WORKERS + s3_get.AHEAD) * CHUNK
    key = node.key("model.bin")
    body = bytearray(s3.get_object(Bucket=other_bucket, Key=key)["Body"].read())
    body[RANGE * 3 + 5] ^= 0xFF  # a range in the middle: the buffer it lands in held good bytes before
    s3.put_object(Bucket=other_bucket, Key=key, Body=bytes(body))
    code, out = node.restore(other / "again")
    assert code != 0, out
    _nothing_restored(other / "again")
    assert s3_get.release_idle_buffers(3600.0) == 0  # used just now: kept
    assert s3_get.release_idle_buffers(0.0) > 0
    assert s3_get.kept_buffer_bytes() == 0


@given(st.lists(st.integers(min_value=0, max_value=2**36), max_size=300))
def test_ranges_are_as_large_as_lets_every_worker_stream(sizes: list[int]) -> None:
    """The range size of a restore: between the bounds, whole chunks, and, unless at the least
    size, the ranges running ahead of their files' frontiers fit the room ahead (no worker waits)."""
    size = s3_get.range_size(sizes)
    assert s3_get.RANGE_SIZE <= size <= max(s3_get.RANGE_SIZE, s3_get.LARGEST_RANGE)
    assert size % s3_get.CHUNK == 0
    in_flight = min(s3_get.WORKERS, sum(1 for n in sizes if n > s3_get.RANGE_SIZE))
    if size > s3_get.RANGE_SIZE:
        assert (s3_get.WORKERS - in_flight) * size <= s3_get.AHEAD * s3_get.CHUNK
    if in_flight == s3_get.WORKERS:
        assert size == s3_get.LARGEST_RANGE  # every worker at a frontier: nothing is held


@pytest.mark.parametrize("room", [1, 3])
def test_with_little_room_ahead_workers_wait_their_turn_and_the_restore_is_byte_identical(
    tmp_path: Path, store: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """With room for only ``room`` chunks received ahead of their files' frontiers, workers whose
    next chunk is not yet hashable wait (the one at each frontier never does): the restore of
    uneven large objects still completes byte-identical, and a byte changed in a chunk that waited
    still fails it, leaving nothing."""
    monkeypatch.setattr(s3_get, "CHUNK", 4096)
    monkeypatch.setattr(s3_get, "AHEAD", room)
    waited: list[int] = []
    reserve = s3_get._Plan.reserve

    def watched(plan: s3_get._Plan, f: Any, pos: int) -> bool:
        if pos != f.hashed and plan.ahead >= s3_get.AHEAD:
            waited.append(pos)
        return reserve(plan, f, pos)

    monkeypatch.setattr(s3_get._Plan, "reserve", watched)
    bucket, options = store
    files = {"model.bin": 2 * 2**20 + 11, "optimizer.bin": 1 * 2**20 + 4097, "extra.bin": 300_001}
    node = Node(tmp_path, bucket, options["endpoint_url"], files)
    code, out = node.restore(tmp_path / "restored")
    assert code == 0, out
    assert _tree(tmp_path / "restored" / CKPT) == node.original
    assert waited, "no worker ever had to wait for room: the test did not exercise the bound"
    s3 = _client(options["endpoint_url"])
    key = node.key("model.bin")
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[2 * 2**20 - 3] ^= 0x10  # near the end: received far ahead of the frontier
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    code, out = node.restore(tmp_path / "again")
    assert code == 1, out
    assert "model.bin: hash" in out
    _nothing_restored(tmp_path / "again")
