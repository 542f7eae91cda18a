"""What a standalone ``ckptkeeper restore`` process loads before and around its real work.

A restore from an S3 tier that plain GETs can reach (:mod:`ckptkeeper.storage.s3_get`) reads the
checkpoint's committed manifest with one plain signed GET too (:mod:`ckptkeeper.storage.s3_plain`):
the S3 client stack (s3fs, aiobotocore, aiohttp, botocore) is never imported, which was ~0.4 CPU-s
of a ~1 CPU-s restore (bench/restore_s3.py). Checked on the real command, run as a user runs it
(``-X importtime`` lists every module the process imported). The manifest's GET answers what the
S3 client's did: a missing manifest falls back to the index's, a transient failure is retried, a
refused one fails the restore naming the object and leaves nothing behind. A restore that logs
nothing never imports structlog either (ckptkeeper.util.logs applies its configuration at the
first line logged).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from builders import local_tier, s3_tier, write_config
from faultproxy import FaultProxy, Request

RUN = "run-a"
STEP = 100
CKPT = f"checkpoint-{STEP}"
MANIFEST_KEY = f"ckpt/{RUN}/{CKPT}.ckptkeeper-manifest.json"
CLIENT_STACK = ("s3fs", "aiobotocore", "aiohttp", "botocore", "fsspec")


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTKEEPER_", "AWS_"))}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class Node:
    """A hot tier keeping nothing, an S3 tier keeping everything: one checkpoint pruned to S3."""

    def __init__(self, tmp: Path, bucket: str, endpoint: str) -> None:
        self.tmp = tmp
        self.bucket = bucket
        self.hot = tmp / "hot"
        ckpt = self.hot / RUN / CKPT
        (ckpt / "shard").mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": STEP, "log_history": []}))
        (ckpt / "model.bin").write_bytes(os.urandom(300_000))
        for i in range(5):
            (ckpt / "shard" / f"part-{i}.bin").write_bytes(os.urandom(1000 + i))
        when = time.time() - 3600
        for p in [*ckpt.rglob("*"), ckpt]:
            os.utime(p, (when, when))
        self.original = _tree(ckpt)
        self.config = tmp / "config.toml"
        self.point_at(endpoint)
        code, out, err = self.cli("prune")
        assert code == 0, out + err
        assert not ckpt.exists(), "the prune moved the checkpoint to the S3 tier"

    def point_at(self, endpoint: str) -> None:
        write_config(
            self.config,
            index=self.tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},
            tiers=[local_tier("hot", self.hot, keep_last=0), s3_tier("cold", self.bucket, endpoint)],
        )

    def cli(
        self, *args: str, importtime: bool = False, env: dict[str, str] | None = None
    ) -> tuple[int, str, str]:
        flags = ["-X", "importtime"] if importtime else []
        argv = [sys.executable, *flags, "-m", "ckptkeeper.cli", "--config", str(self.config), *args]
        environ = {**_env(), **(env or {})}
        proc = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=300, check=False)
        return proc.returncode, proc.stdout, proc.stderr

    def restore(
        self, to: Path, *, importtime: bool = False, env: dict[str, str] | None = None
    ) -> tuple[int, str, str]:
        args = ("restore", RUN, "--step", str(STEP), "--to", str(to), "--no-daemon")
        return self.cli(*args, importtime=importtime, env=env)


def _imported(importtime_err: str) -> set[str]:
    """Every module named by ``-X importtime`` lines of a process's stderr."""
    return {
        line.rpartition("|")[2].strip()
        for line in importtime_err.splitlines()
        if line.startswith("import time:") and "|" in line
    }


@pytest.fixture
def proxies() -> Iterator[list[FaultProxy]]:
    started: list[FaultProxy] = []
    yield started
    for proxy in started:
        proxy.stop()


@pytest.mark.parametrize("region", [None, "us-east-1"])
def test_a_standalone_restore_never_imports_the_s3_client(
    tmp_path: Path, s3_reset: str, s3_bucket: str, region: str | None
) -> None:
    """Without a region the requests are signed by botocore alone (it resolves the region as the
    S3 client would); with one given (here ``AWS_DEFAULT_REGION``) not even botocore is loaded."""
    node = Node(tmp_path, s3_bucket, s3_reset)
    dest = tmp_path / "restored"
    code, out, err = node.restore(dest, importtime=True, env={"AWS_DEFAULT_REGION": region} if region else {})
    assert code == 0, out + err
    assert Path(out.strip()) == dest / CKPT
    assert _tree(dest / CKPT) == node.original
    imported = _imported(err)
    assert "ckptkeeper.storage.s3_get" in imported  # the -X importtime listing is there at all
    stack = CLIENT_STACK if region else tuple(m for m in CLIENT_STACK if m != "botocore")
    loaded = sorted({m.split(".")[0] for m in imported} & set(stack))
    assert loaded == [], f"a standalone restore imported the S3 client stack: {loaded}"
    assert "structlog" not in imported  # nothing was logged: the logging library was never loaded


def test_a_missing_committed_manifest_falls_back_to_the_index(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    """The store answers 404 for the committed manifest: the index's manifest says how the files
    are stored (raw), as it did through the S3 client; the files are still checked against it."""
    node = Node(tmp_path, s3_bucket, s3_reset)
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_reset,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    s3.delete_object(Bucket=s3_bucket, Key=MANIFEST_KEY)
    dest = tmp_path / "restored"
    code, out, err = node.restore(dest)
    assert code == 0, out + err
    assert _tree(dest / CKPT) == node.original


def test_a_manifest_get_throttled_once_is_retried(
    tmp_path: Path, s3_reset: str, s3_bucket: str, proxies: list[FaultProxy]
) -> None:
    node = Node(tmp_path, s3_bucket, s3_reset)
    seen = [0]

    def slow_down_once(req: Request) -> str | None:
        if req.method == "GET" and req.path.endswith(MANIFEST_KEY):
            seen[0] += 1
            return "slowdown" if seen[0] == 1 else None
        return None

    proxy = FaultProxy(s3_reset, rate=0.0, rules=[slow_down_once])
    proxies.append(proxy)
    node.point_at(proxy.start())
    dest = tmp_path / "restored"
    code, out, err = node.restore(dest)
    assert code == 0, out + err
    assert [f.kind for f in proxy.faults] == ["slowdown"]
    assert "SlowDown" in err  # the retry is logged with its cause
    assert _tree(dest / CKPT) == node.original


def test_a_refused_manifest_get_fails_the_restore_naming_it(
    tmp_path: Path, s3_reset: str, s3_bucket: str, proxies: list[FaultProxy]
) -> None:
    node = Node(tmp_path, s3_bucket, s3_reset)

    def deny(req: Request) -> str | None:
        return "denied" if req.method == "GET" and req.path.endswith(MANIFEST_KEY) else None

    proxy = FaultProxy(s3_reset, rate=0.0, rules=[deny])
    proxies.append(proxy)
    node.point_at(proxy.start())
    dest = tmp_path / "restored"
    code, out, err = node.restore(dest)
    assert code == 1, out + err
    assert f"reading manifest of {RUN}/{CKPT}" in err and "AccessDenied" in err, err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    (warning,) = [d for d in lines if d.get("event") == "restore from tier failed, trying the next"]
    assert (warning["level"], warning["tier"]) == ("warning", "cold")  # logged as JSON lines, as configured
    assert "timestamp" in warning and "AccessDenied" in warning["error"]
    assert not dest.exists() or os.listdir(dest) == []


# -- a config validated before (ckptkeeper.config_cache) ------------------------------------


def _cached_config(node: Node) -> Path:
    from ckptkeeper.config_cache import cache_path

    path = cache_path(node.config)
    assert path is not None and path.is_file(), "the prune remembered the config it validated"
    return path


def test_a_standalone_restore_of_a_config_validated_before_loads_neither_pydantic_nor_click(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    """The prune validated this config: the restore reads the remembered values (no pydantic) and
    parses its plain command line itself (no click), and restores the same files."""
    node = Node(tmp_path, s3_bucket, s3_reset)
    _cached_config(node)
    dest = tmp_path / "restored"
    code, out, err = node.restore(dest, importtime=True, env={"AWS_DEFAULT_REGION": "us-east-1"})
    assert code == 0, out + err
    assert Path(out.strip()) == dest / CKPT
    assert _tree(dest / CKPT) == node.original
    imported = {m.split(".")[0] for m in _imported(err)}
    assert "ckptkeeper" in imported
    assert sorted(imported & {"pydantic", "pydantic_settings", "pydantic_core", "click"}) == []


def test_a_restore_no_daemon_answers_runs_here_without_click_or_pydantic(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    """The plain ``ckptkeeper restore`` a user types (no ``--no-daemon``) on a node whose daemon is
    not up: the thin client finds no daemon and the restore runs in this process, as cheaply as
    with ``--no-daemon``."""
    node = Node(tmp_path, s3_bucket, s3_reset)
    _cached_config(node)
    dest = tmp_path / "restored"
    code, out, err = node.cli(
        "restore",
        RUN,
        "--step",
        str(STEP),
        "--to",
        str(dest),
        importtime=True,
        env={"AWS_DEFAULT_REGION": "us-east-1"},
    )
    assert code == 0, out + err
    assert Path(out.strip()) == dest / CKPT
    assert _tree(dest / CKPT) == node.original
    imported = {m.split(".")[0] for m in _imported(err)}
    assert "ckptkeeper" in imported
    assert sorted(imported & {"pydantic", "pydantic_settings", "pydantic_core", "click"}) == []


def test_a_standalone_restore_prints_what_the_command_prints(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    """With the config remembered and without (no cache directory to read or write: click and
    pydantic do the work), the same JSON document, and the same error and exit code for a step
    that is nowhere."""
    node = Node(tmp_path, s3_bucket, s3_reset)
    _cached_config(node)
    no_cache = tmp_path / "not-a-directory"
    no_cache.write_text("")
    outcomes: list[tuple[dict[str, object], tuple[int, str, str]]] = []
    for cache in (None, str(no_cache)):
        env = {"XDG_CACHE_HOME": cache} if cache else {}
        dest = tmp_path / f"restored-{len(outcomes)}"
        code, out, err = node.cli(
            "restore", RUN, "--step", str(STEP), "--to", str(dest), "--json", "--no-daemon", env=env
        )
        assert code == 0, out + err
        doc = json.loads(out)
        assert doc["path"] == str(dest / CKPT) and _tree(dest / CKPT) == node.original
        missing = node.cli("restore", RUN, "--step", "7", "--to", str(dest), "--no-daemon", env=env)
        outcomes.append(({**doc, "path": None, "duration_s": None}, missing))
    (with_cache, missing_cached), (without, missing_full) = outcomes
    assert with_cache == without
    assert missing_cached == missing_full
    assert missing_cached[0] == 1 and missing_cached[2].startswith("ckptkeeper: "), missing_cached


def test_a_config_changed_since_is_validated_again(tmp_path: Path, s3_reset: str, s3_bucket: str) -> None:
    """A typo added to the file, or a bad value in the environment, after the config was
    remembered: the restore reports it as always (exit 2, naming the key) and does nothing."""
    node = Node(tmp_path, s3_bucket, s3_reset)
    _cached_config(node)
    dest = tmp_path / "restored"
    code, out, err = node.restore(dest, env={"CKPTKEEPER_MAX_DELETE": "-1"})
    assert code == 2, out + err
    assert "config error: max_delete:" in err and "CKPTKEEPER_MAX_DELETE" in err, err
    text = node.config.read_text().replace("keep_last = 0", "keep_lsat = 0", 1)
    assert text != node.config.read_text()
    node.config.write_text(text)
    code, out, err = node.restore(dest)
    assert code == 2, out + err
    assert "config error: tiers[0].keep_lsat: unknown key" in err, err
    assert not dest.exists()


def test_a_config_file_others_may_write_is_refused_though_remembered(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    node = Node(tmp_path, s3_bucket, s3_reset)
    _cached_config(node)
    node.config.chmod(0o620)
    code, out, err = node.restore(tmp_path / "restored")
    assert code == 2, out + err
    assert "refusing a config file writable by group or others" in err, err


def test_a_remembered_config_others_could_have_written_is_not_read(
    tmp_path: Path, s3_reset: str, s3_bucket: str
) -> None:
    """A cache file writable by group or others may say anything: the config is validated in
    full (pydantic loaded) and the restore goes where the config says."""
    node = Node(tmp_path, s3_bucket, s3_reset)
    cached = _cached_config(node)
    doc = json.loads(cached.read_text())
    doc["settings"]["index"] = str(tmp_path / "elsewhere.db")
    cached.write_text(json.dumps(doc))
    cached.chmod(0o622)
    dest = tmp_path / "restored"
    code, out, err = node.restore(dest, importtime=True)
    assert code == 0, out + err
    assert "pydantic" in {m.split(".")[0] for m in _imported(err)}
    assert _tree(dest / CKPT) == node.original
    assert not (tmp_path / "elsewhere.db").exists()
