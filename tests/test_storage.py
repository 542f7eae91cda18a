"""Storage contract: one test-suite, run against every backend (as fsspec's/s3fs's shared tests).

``TestTierContract`` runs once against a local directory tier and once against S3 (a moto server
reached over HTTP by s3fs). Each backend provides the same small ``Raw`` helper to arrange and
inspect state *behind* the storage layer's back (corrupt a byte, plant garbage, list keys).
Backend-specific safety properties (symlinks, same-filesystem rename, orphan manifests) follow.
"""

from __future__ import annotations

import io
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import pytest
from builders import manifest_of
from builders import tier as spec  # `tier` names TierStorage objects here

from ckptkeeper import storage
from ckptkeeper.core.model import MANIFEST_SUFFIX, FileEntry, Manifest
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage import (
    LocalTierStorage,
    StorageError,
    TierStorage,
    TierUnavailable,
    VerificationError,
    localfs,
    s3_transfer,
    s3_upload,
)
from ckptkeeper.storage.base import PIN_SUFFIX
from ckptkeeper.util import hashing

MiB = 2**20

# --------------------------------------------------------------------------------------------
# the hot tier: a run with a directory checkpoint and a single-file checkpoint


CATALOGED = {
    "layout": "test",
    "metrics": {"eval_loss": 1.25},
    "created_at": 1_700_000_000.0,
    "node": "test-node",
}
"""The fields a catalog run on ``test-node`` would record besides the files."""


def cataloged(root: Path, run: str, name: str, step: int) -> Manifest:
    """What the catalog would record for ``root/run/name`` (hashing.hash_file, no symlinks)."""
    return manifest_of(root, run, step, name=name, **CATALOGED)


@dataclass
class Hot:
    root: Path
    tier: TierStorage
    ckpt_dir: Manifest
    ckpt_file: Manifest

    def path(self, m: Manifest) -> Path:
        return self.root / m.run / m.name


@pytest.fixture
def hot(tmp_path: Path) -> Hot:
    root = tmp_path / "hot"
    d = root / "run1" / "checkpoint-100"
    (d / "sub" / "optim").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(300 * 1024))  # crosses a 256 KiB chunk
    (d / "trainer_state.json").write_text('{"global_step": 100}')
    (d / "empty.bin").write_bytes(b"")
    (d / "sub" / "optim" / "shard-0.pt").write_bytes(os.urandom(4096))
    f = root / "run1" / "checkpoints" / "epoch=1-step=20.ckpt"
    f.parent.mkdir(parents=True)
    f.write_bytes(os.urandom(70 * 1024))
    return Hot(
        root=root,
        tier=TierStorage(spec("hot", str(root)), hot=True),
        ckpt_dir=cataloged(root, "run1", "checkpoint-100", 100),
        ckpt_file=cataloged(root, "run1", "checkpoints/epoch=1-step=20.ckpt", 20),
    )


def tree_bytes(path: Path) -> dict[str, bytes]:
    """Relative path → content of every regular file (or {"": content} for a file)."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# backends: a tier plus raw access behind its back


class Raw(Protocol):
    def put(self, rel: str, data: bytes) -> None: ...
    def get(self, rel: str) -> bytes: ...
    def remove(self, rel: str) -> None: ...
    def keys(self) -> list[str]: ...


class LocalRaw:
    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, rel: str, data: bytes) -> None:
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.root / rel).write_bytes(data)

    def get(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def remove(self, rel: str) -> None:
        (self.root / rel).unlink()

    def keys(self) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if not p.is_dir())


class S3Raw:
    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix

    def put(self, rel: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + rel, Body=data)

    def get(self, rel: str) -> bytes:
        body: bytes = self.client.get_object(Bucket=self.bucket, Key=self.prefix + rel)["Body"].read()
        return body

    def remove(self, rel: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + rel)

    def keys(self) -> list[str]:
        resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix)
        return sorted(o["Key"][len(self.prefix) :] for o in resp.get("Contents", []))


@dataclass
class Backend:
    kind: str
    tier: TierStorage
    raw: Raw


def make_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path, name: str) -> Backend:
    if kind == "local":
        root = tmp_path / name
        root.mkdir()
        return Backend(kind, TierStorage(spec(name, str(root))), LocalRaw(root))
    bucket = request.getfixturevalue("s3_bucket")
    options = request.getfixturevalue("s3_storage_options")
    tier = TierStorage(spec(name, f"s3://{bucket}/{name}/ckpt", storage_options=options))
    return Backend(kind, tier, S3Raw(request.getfixturevalue("s3_client"), bucket, f"{name}/ckpt/"))


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return make_backend(request.param, request, tmp_path, "warm" if request.param == "local" else "cold")


@pytest.fixture
def other(backend: Backend, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A tier of the other kind, for tier → tier copies (local → s3 and s3 → local)."""
    kind = "s3" if backend.kind == "local" else "local"
    return make_backend(kind, request, tmp_path, "other")


class FailingReader:
    """A source stream that breaks after ``limit`` bytes (a dying disk or connection)."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner, self.limit, self.done = inner, limit, 0

    def read(self, n: int) -> bytes:
        if self.done >= self.limit:
            raise OSError(5, "Input/output error (injected)")
        data: bytes = self.inner.read(min(n, self.limit - self.done))
        self.done += len(data)
        return data

    def close(self) -> None:
        self.inner.close()


# --------------------------------------------------------------------------------------------
# the contract


class TestTierContract:
    def test_copy_from_hot_is_byte_identical_with_manifest_beside(
        self, backend: Backend, hot: Hot, tmp_path: Path
    ) -> None:
        seen: list[int] = []
        for m in (hot.ckpt_dir, hot.ckpt_file):
            backend.tier.copy_from(hot.tier, m, progress=seen.append)
        assert sum(seen) == hot.ckpt_dir.total_bytes + hot.ckpt_file.total_bytes

        keys = backend.raw.keys()
        assert "run1/checkpoint-100" + MANIFEST_SUFFIX in keys
        assert "run1/checkpoints/epoch=1-step=20.ckpt" + MANIFEST_SUFFIX in keys
        assert "run1/checkpoints/epoch=1-step=20.ckpt" in keys
        assert "run1/checkpoint-100/sub/optim/shard-0.pt" in keys
        assert not [k for k in keys if STAGING_MARK in k]

        assert backend.tier.list_manifests() == [
            ("run1/checkpoint-100", hot.ckpt_dir, None),
            ("run1/checkpoints/epoch=1-step=20.ckpt", hot.ckpt_file, None),
        ]
        assert backend.tier.read_manifest("run1/checkpoint-100") == hot.ckpt_dir
        for m in (hot.ckpt_dir, hot.ckpt_file):
            assert backend.tier.verify(m) == []
            restored = backend.tier.fetch(m, tmp_path / "restore")
            assert restored == tmp_path / "restore" / m.name
            assert tree_bytes(restored) == tree_bytes(hot.path(m))
        assert hot.tier.verify(hot.ckpt_dir) == []  # source untouched

    def test_copy_between_tiers(self, backend: Backend, other: Backend, hot: Hot, tmp_path: Path) -> None:
        for m in (hot.ckpt_dir, hot.ckpt_file):
            backend.tier.copy_from(hot.tier, m)
            other.tier.copy_from(backend.tier, m)  # local → s3, or s3 → local
            assert other.tier.read_manifest(f"{m.run}/{m.name}") == m
            restored = other.tier.fetch(m, tmp_path / f"restore-{m.step}")
            assert tree_bytes(restored) == tree_bytes(hot.path(m))
        assert [r for r, _, _ in other.tier.list_manifests()] == [
            "run1/checkpoint-100",
            "run1/checkpoints/epoch=1-step=20.ckpt",
        ]

    def test_copy_is_idempotent_and_refuses_another_version(self, backend: Backend, hot: Hot) -> None:
        backend.tier.copy_from(hot.tier, hot.ckpt_dir)
        backend.tier.copy_from(hot.tier, hot.ckpt_dir)  # same version: a no-op
        (hot.path(hot.ckpt_dir) / "trainer_state.json").write_text('{"global_step": 101}')
        rewritten = cataloged(hot.root, "run1", "checkpoint-100", 100)
        with pytest.raises(StorageError, match="another version"):
            backend.tier.copy_from(hot.tier, rewritten)
        assert backend.tier.read_manifest("run1/checkpoint-100") == hot.ckpt_dir

    def test_fetch_refuses_to_overwrite(self, backend: Backend, hot: Hot, tmp_path: Path) -> None:
        backend.tier.copy_from(hot.tier, hot.ckpt_file)
        dest = tmp_path / "restore"
        first = backend.tier.fetch(hot.ckpt_file, dest)
        with pytest.raises(StorageError, match="exists"):
            backend.tier.fetch(hot.ckpt_file, dest)
        assert first.read_bytes() == hot.path(hot.ckpt_file).read_bytes()
        assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging left

    def many_files(self, hot: Hot) -> Manifest:
        """A checkpoint of 40 files (nested, some empty, one over a chunk) beside ``hot``'s: an S3
        restore fetches several of them at once (``fetch_workers``)."""
        d = hot.root / "run1" / "checkpoint-200"
        for i in range(40):
            f = d / f"shard-{i % 4}" / ("empty" if i % 13 == 0 else f"part-{i:02d}.bin")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(os.urandom(0 if i % 13 == 0 else 1 + 997 * i + (300 * 1024 if i == 7 else 0)))
        return cataloged(hot.root, "run1", "checkpoint-200", 200)

    def test_fetch_of_many_files_is_byte_identical(self, backend: Backend, hot: Hot, tmp_path: Path) -> None:
        m = self.many_files(hot)
        backend.tier.copy_from(hot.tier, m)
        seen: list[int] = []
        restored = backend.tier.fetch(m, tmp_path / "restore", progress=seen.append)
        assert tree_bytes(restored) == tree_bytes(hot.path(m))
        assert sum(seen) == m.total_bytes
        assert [p.name for p in (tmp_path / "restore").iterdir()] == ["checkpoint-200"]  # no staging left

    @pytest.mark.parametrize("damage", ["flipped byte", "missing object"])
    def test_fetch_with_one_bad_file_among_many_leaves_nothing(
        self, backend: Backend, hot: Hot, tmp_path: Path, damage: str
    ) -> None:
        m = self.many_files(hot)
        backend.tier.copy_from(hot.tier, m)
        bad = "run1/checkpoint-200/shard-1/part-21.bin"
        if damage == "missing object":
            backend.raw.remove(bad)
        else:
            good = backend.raw.get(bad)
            backend.raw.put(bad, good[:100] + bytes([good[100] ^ 0x01]) + good[101:])
        dest = tmp_path / "restore"
        with pytest.raises(StorageError, match=r"part-21\.bin") as err:
            backend.tier.fetch(m, dest)
        if damage == "flipped byte":
            assert isinstance(err.value, VerificationError) and "hash" in str(err.value)
        assert list(dest.iterdir()) == []  # no checkpoint, no staging directory, no stray file
        # the copy itself is untouched: once repaired, the same fetch succeeds byte for byte
        backend.raw.put(bad, (hot.path(m) / "shard-1" / "part-21.bin").read_bytes())
        assert tree_bytes(backend.tier.fetch(m, dest)) == tree_bytes(hot.path(m))

    def test_manifest_paths_cannot_escape(self, backend: Backend, hot: Hot, tmp_path: Path) -> None:
        backend.tier.copy_from(hot.tier, hot.ckpt_dir)
        evil = replace(hot.ckpt_dir, files=(FileEntry("../../escaped", 1, "00"),))
        dest = tmp_path / "restore" / "deeper"
        with pytest.raises(StorageError):
            backend.tier.fetch(evil, dest)
        with pytest.raises(StorageError):
            backend.tier.copy_from(hot.tier, replace(evil, run="../run1"))
        assert not list(tmp_path.rglob("escaped"))

    def test_verify_detects_corruption_missing_and_size(self, backend: Backend, hot: Hot) -> None:
        tier, raw, m = backend.tier, backend.raw, hot.ckpt_dir
        tier.copy_from(hot.tier, m)
        model = "run1/checkpoint-100/model.safetensors"
        good = raw.get(model)

        raw.put(model, good[:1000] + bytes([good[1000] ^ 0x01]) + good[1001:])  # one flipped bit
        problems = tier.verify(m)
        assert len(problems) == 1 and "model.safetensors" in problems[0] and "hash" in problems[0]
        assert tier.verify(m, deep=False) == []  # sizes alone cannot see it

        raw.put(model, good + b"x")
        assert any("model.safetensors: size" in p for p in tier.verify(m, deep=False))

        raw.put(model, good)
        raw.remove("run1/checkpoint-100/trainer_state.json")
        raw.put("run1/checkpoint-100/stray.txt", b"?")
        problems = tier.verify(m)
        assert any("trainer_state.json: missing" in p for p in problems)
        assert any("stray.txt: not in manifest" in p for p in problems)

        tier.copy_from(hot.tier, hot.ckpt_file)
        raw.remove("run1/checkpoints/epoch=1-step=20.ckpt")
        assert tier.verify(hot.ckpt_file) == ["run1/checkpoints/epoch=1-step=20.ckpt: missing"]

    def assert_nothing_committed(self, backend: Backend) -> None:
        assert backend.tier.list_manifests() == []
        assert backend.tier.read_manifest("run1/checkpoint-100") is None
        assert backend.tier.list_staging() == []
        assert backend.tier.list_multipart_uploads() == []
        assert backend.raw.keys() == []

    def test_source_changed_since_cataloged_fails_and_leaves_nothing(
        self, backend: Backend, hot: Hot
    ) -> None:
        model = hot.path(hot.ckpt_dir) / "model.safetensors"
        data = bytearray(model.read_bytes())
        data[-1] ^= 0xFF  # same size, other content: only the hash can tell
        model.write_bytes(data)
        with pytest.raises(VerificationError, match=r"model\.safetensors"):
            backend.tier.copy_from(hot.tier, hot.ckpt_dir)
        self.assert_nothing_committed(backend)
        assert model.read_bytes() == data  # source untouched

        (hot.path(hot.ckpt_file)).write_bytes(os.urandom(71 * 1024))  # grew
        with pytest.raises(VerificationError, match="more than"):
            backend.tier.copy_from(hot.tier, hot.ckpt_file)
        self.assert_nothing_committed(backend)

    def test_failing_source_stream_midway_aborts_cleanly(
        self, backend: Backend, hot: Hot, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        big = hot.root / "run1" / "big.pt"
        big.write_bytes(os.urandom(12 * MiB))
        m = cataloged(hot.root, "run1", "big.pt", 300)
        if isinstance(backend.tier, storage.S3TierStorage):
            backend.tier.part_size = 5 * MiB  # the failure hits a multipart upload in flight
            backend.tier.max_inflight = 2
        original = hot.tier._open_read
        monkeypatch.setattr(hot.tier, "_open_read", lambda rel, p: FailingReader(original(rel, p), 11 * MiB))
        with pytest.raises(StorageError, match="injected"):
            backend.tier.copy_from(hot.tier, m)
        self.assert_nothing_committed(backend)
        assert hashing.hash_file(big) == (m.files[0].size, m.files[0].hash)

    def test_interrupted_copy_is_staging_not_a_copy(
        self, backend: Backend, hot: Hot, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # kill -9 mid-copy: no cleanup runs
        monkeypatch.setattr(localfs._LocalSink, "abort", lambda self: None)
        monkeypatch.setattr(s3_transfer._S3Sink, "abort", lambda self: None)
        original = hot.tier._open_read
        monkeypatch.setattr(
            hot.tier, "_open_read", lambda rel, p: FailingReader(original(rel, p), 200 * 1024)
        )
        with pytest.raises(StorageError):
            backend.tier.copy_from(hot.tier, hot.ckpt_dir)
        monkeypatch.undo()

        assert backend.raw.keys() != []
        assert backend.tier.list_manifests() == []
        assert backend.tier.read_manifest("run1/checkpoint-100") is None
        staging = backend.tier.list_staging()
        assert len(staging) == 1
        art = staging[0]
        assert art.kind == storage.STAGING_KIND and art.run == "run1"
        assert art.path.startswith("run1/checkpoint-100" + STAGING_MARK)
        assert abs(art.last_write - time.time()) < 60
        if backend.kind == "local":
            assert art.bytes >= 200 * 1024  # streamed to disk up to the failure
        # (S3 buffers a file below part_size in memory: only the files before it were uploaded)

        assert backend.tier.discard_staging(art) == art.bytes
        assert backend.tier.list_staging() == [] and backend.raw.keys() == []
        backend.tier.copy_from(hot.tier, hot.ckpt_dir)
        assert backend.tier.verify(hot.ckpt_dir) == []

    def test_malformed_manifest_is_reported_not_fatal(self, backend: Backend, hot: Hot) -> None:
        backend.tier.copy_from(hot.tier, hot.ckpt_dir)
        backend.tier.copy_from(hot.tier, hot.ckpt_file)
        backend.raw.put("run1/checkpoint-100" + MANIFEST_SUFFIX, b"{not json")
        backend.raw.put("run2/stolen", b"x")
        backend.raw.put(
            "run2/stolen" + MANIFEST_SUFFIX, hot.ckpt_file.to_json().encode()
        )  # describes another path
        listing = {rel: (m, err) for rel, m, err in backend.tier.list_manifests()}
        assert listing["run1/checkpoints/epoch=1-step=20.ckpt"] == (hot.ckpt_file, None)
        m, err = listing["run1/checkpoint-100"]
        assert m is None and err and "malformed" in err
        m, err = listing["run2/stolen"]
        assert m is None and err and "describes run1/checkpoints/epoch=1-step=20.ckpt" in err
        with pytest.raises(StorageError):
            backend.tier.read_manifest("run1/checkpoint-100")

    def test_delete_removes_copy_and_manifest(self, backend: Backend, hot: Hot) -> None:
        backend.tier.copy_from(hot.tier, hot.ckpt_dir)
        backend.tier.copy_from(hot.tier, hot.ckpt_file)
        assert backend.tier.delete("run1/checkpoint-100") == hot.ckpt_dir.total_bytes
        assert backend.tier.read_manifest("run1/checkpoint-100") is None
        assert [r for r, _, _ in backend.tier.list_manifests()] == ["run1/checkpoints/epoch=1-step=20.ckpt"]
        assert backend.tier.delete("run1/checkpoint-100") == 0  # idempotent (journal replay)
        assert backend.tier.delete("run1/checkpoints/epoch=1-step=20.ckpt") == hot.ckpt_file.total_bytes
        assert backend.tier.list_manifests() == [] and backend.tier.list_staging() == []
        assert backend.raw.keys() == []

    def test_delete_refuses_paths_outside_the_root(self, backend: Backend, hot: Hot, tmp_path: Path) -> None:
        backend.tier.copy_from(hot.tier, hot.ckpt_file)
        outside = tmp_path / "x"
        outside.write_text("precious")
        for bad in (
            "",
            "..",
            "../x",
            "run1/../../etc",
            "/etc/passwd",
            "run1//checkpoints",
            "./run1",
            "run1/.",
        ):
            with pytest.raises(StorageError):
                backend.tier.delete(bad)
        assert outside.read_text() == "precious"
        assert len(backend.tier.list_manifests()) == 1
        assert backend.tier.verify(hot.ckpt_file) == []

    def test_multipart_uploads_listed_and_aborted(
        self, backend: Backend, request: pytest.FixtureRequest
    ) -> None:
        if backend.kind == "local":
            assert backend.tier.list_multipart_uploads() == []
            return
        assert isinstance(backend.tier, storage.S3TierStorage)
        client, bucket = request.getfixturevalue("s3_client"), backend.tier.bucket
        ours = client.create_multipart_upload(Bucket=bucket, Key="cold/ckpt/run1/big.pt")["UploadId"]
        client.upload_part(
            Bucket=bucket, Key="cold/ckpt/run1/big.pt", UploadId=ours, PartNumber=1, Body=b"x" * 1024
        )
        client.create_multipart_upload(Bucket=bucket, Key="elsewhere/big.pt")  # outside the tier prefix

        (art,) = backend.tier.list_multipart_uploads()
        assert (art.kind, art.path, art.upload_id, art.bytes, art.run) == (
            "multipart-upload",
            "run1/big.pt",
            ours,
            1024,
            "run1",
        )
        assert art.last_write > 0  # moto reports a fixed Initiated (2010-11-10), AWS the real one
        backend.tier.abort_multipart(art)
        backend.tier.abort_multipart(art)  # already gone: fine
        assert backend.tier.list_multipart_uploads() == []
        assert [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket)["Uploads"]] == [
            "elsewhere/big.pt"
        ]

    def test_manifests_and_pins_come_from_one_listing(
        self, backend: Backend, hot: Hot, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A reconcile needs both: one walk of a local tier (one LIST of the prefix in S3) finds
        the same copies and pins as the two separate listings do."""
        backend.tier.copy_from(hot.tier, hot.ckpt_dir)
        backend.tier.copy_from(hot.tier, hot.ckpt_file)
        backend.tier.write_pin("run1", "checkpoint-100", 100, "test-node")
        backend.tier.write_pin("run9", "checkpoint-1", 1, "test-node")  # pinned, no copy here
        backend.raw.put("run1/checkpoint-7" + PIN_SUFFIX, b"[1, 2]")  # hostile: ignored
        backend.raw.put("run2/x" + MANIFEST_SUFFIX, b"{not json")
        backend.raw.put("run2/x", b"x")
        separate = (backend.tier.list_manifests(), backend.tier.list_pins())

        listings: list[str] = []
        if backend.kind == "local":
            real_fwalk = os.fwalk

            def fwalk(top: Any = ".", *args: Any, **kwargs: Any) -> Any:
                listings.append(str(top))
                return real_fwalk(top, *args, **kwargs)

            monkeypatch.setattr(os, "fwalk", fwalk)
        else:
            assert isinstance(backend.tier, storage.S3TierStorage)
            real_list = backend.tier._list_objects

            def list_objects(prefix: str) -> list[dict[str, Any]]:
                listings.append(prefix)
                return real_list(prefix)

            monkeypatch.setattr(backend.tier, "_list_objects", list_objects)
        listing, pins = backend.tier.list_manifests_and_pins()
        assert len(listings) == 1
        assert (listing, pins) == separate
        assert pins == {("run1", "checkpoint-100"), ("run9", "checkpoint-1")}
        by_rel = {rel: (m, err) for rel, m, err in listing}
        assert by_rel["run1/checkpoint-100"] == (hot.ckpt_dir, None)
        assert by_rel["run1/checkpoints/epoch=1-step=20.ckpt"] == (hot.ckpt_file, None)
        assert by_rel["run2/x"][0] is None

    def test_usage(self, backend: Backend) -> None:
        usage = backend.tier.usage()
        if backend.kind == "s3":
            assert usage is None
            return
        assert usage is not None
        assert usage.total_bytes > 0 and 0 < usage.used_bytes <= usage.total_bytes
        assert 0.0 < usage.fraction <= 1.0


# --------------------------------------------------------------------------------------------
# unavailable tiers: unknown, never empty


def test_local_tier_unavailable(tmp_path: Path) -> None:
    missing = TierStorage(spec("warm", str(tmp_path / "nope")))
    (tmp_path / "file").write_text("")
    not_a_dir = TierStorage(spec("warm", str(tmp_path / "file")))
    for tier in (missing, not_a_dir):
        with pytest.raises(TierUnavailable):
            tier.list_manifests()
        with pytest.raises(TierUnavailable):
            tier.list_staging()
    with pytest.raises(TierUnavailable):
        missing.usage()


def test_local_tier_with_unreadable_directory_is_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "warm"
    (root / "run1" / "locked").mkdir(parents=True)
    tier = TierStorage(spec("warm", str(root)))
    if os.geteuid() != 0:
        (root / "run1" / "locked").chmod(0)
        try:
            with pytest.raises(TierUnavailable, match="Permission"):
                tier.list_manifests()
        finally:
            (root / "run1" / "locked").chmod(0o755)
    # as root permissions cannot fail: make the walk itself report the error
    real_fwalk = os.fwalk

    def fwalk(*args: Any, **kwargs: Any) -> Iterator[Any]:
        yield from real_fwalk(*args, **kwargs)
        kwargs["onerror"](PermissionError(13, "Permission denied", "run1/locked"))

    monkeypatch.setattr(os, "fwalk", fwalk)
    with pytest.raises(TierUnavailable, match="Permission denied"):
        tier.list_manifests()


def test_s3_missing_bucket_is_unavailable(s3_storage_options: dict[str, Any]) -> None:
    tier = TierStorage(spec("cold", "s3://no-such-bucket-here/ckpt", storage_options=s3_storage_options))
    with pytest.raises(TierUnavailable):
        tier.list_manifests()
    with pytest.raises(TierUnavailable):
        tier.list_staging()
    with pytest.raises(TierUnavailable):
        tier.list_multipart_uploads()


def test_s3_unreachable_endpoint_is_unavailable_and_secrets_stay_out(s3_reset: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connection refused
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "AKIAEXAMPLEKEY0001",
        "secret": "hunter2-very-secret-value",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    tier = TierStorage(spec("cold", "s3://bucket/ckpt", storage_options=options))
    start = time.monotonic()
    with pytest.raises(TierUnavailable) as info:
        tier.list_manifests()
    assert time.monotonic() - start < 10
    for text in (str(info.value), repr(tier)):
        assert "hunter2" not in text and "AKIAEXAMPLEKEY0001" not in text


def test_s3_error_messages_redact_secrets(s3_storage_options: dict[str, Any]) -> None:
    tier = TierStorage(
        spec("cold", "s3://bucket/ckpt", storage_options={**s3_storage_options, "secret": "s3cr3t-value"})
    )
    assert isinstance(tier, storage.S3TierStorage)
    assert tier._redact("failed with s3cr3t-value inside") == "failed with *** inside"
    assert tier._redact("http://user:pw@host/x") == "http://***@host/x"


# --------------------------------------------------------------------------------------------
# local-only safety: symlinks, filesystems, same-filesystem rename, orphan manifests


@pytest.fixture
def warm(tmp_path: Path) -> LocalTierStorage:
    (tmp_path / "warm").mkdir()
    tier = TierStorage(spec("warm", str(tmp_path / "warm")))
    assert isinstance(tier, LocalTierStorage)
    return tier


def test_delete_unlinks_planted_symlinks_never_their_targets(
    warm: LocalTierStorage, hot: Hot, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "precious.bin").write_bytes(b"keep me")
    warm.copy_from(hot.tier, hot.ckpt_dir)
    doomed = warm.root / "run1" / "checkpoint-100"
    (doomed / "evil-dir").symlink_to(outside)
    (doomed / "sub" / "evil-file").symlink_to(outside / "deep" / "precious.bin")

    assert warm.delete("run1/checkpoint-100") == hot.ckpt_dir.total_bytes  # links free nothing
    assert not doomed.exists() and not doomed.is_symlink()
    assert (outside / "deep" / "precious.bin").read_bytes() == b"keep me"


def test_delete_refuses_to_walk_through_a_symlinked_parent(warm: LocalTierStorage, tmp_path: Path) -> None:
    outside = tmp_path / "outside-run"
    (outside / "ckpt").mkdir(parents=True)
    (outside / "ckpt" / "precious.bin").write_bytes(b"keep me")
    (warm.root / "run2").symlink_to(outside)
    with pytest.raises(StorageError):
        warm.delete("run2/ckpt")
    assert (outside / "ckpt" / "precious.bin").read_bytes() == b"keep me"
    # a checkpoint that is itself a symlink (Lightning's last.ckpt): only the link goes
    (warm.root / "run3").mkdir()
    (warm.root / "run3" / "last.ckpt").symlink_to(outside / "ckpt" / "precious.bin")
    assert warm.delete("run3/last.ckpt") == 0
    assert (outside / "ckpt" / "precious.bin").read_bytes() == b"keep me"


def test_delete_refuses_to_cross_filesystems(
    warm: LocalTierStorage, hot: Hot, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm.copy_from(hot.tier, hot.ckpt_dir)
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        st = real_stat(path, *args, **kwargs)
        if path == "sub":  # pretend run1/checkpoint-100/sub is a mount point
            values = list(st)
            values[2] = st.st_dev + 1  # st_dev
            return os.stat_result(values)
        return st

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(StorageError, match="another filesystem"):
        warm.delete("run1/checkpoint-100")
    monkeypatch.undo()
    assert warm.verify(hot.ckpt_dir) == []  # refused before anything was removed


def test_copy_refuses_symlinks_inside_the_source(warm: LocalTierStorage, hot: Hot, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 10)
    link = hot.path(hot.ckpt_dir) / "link.bin"
    link.symlink_to(secret)
    m = replace(
        hot.ckpt_dir, files=(*hot.ckpt_dir.files, FileEntry("link.bin", 10, hashing.hash_file(secret)[1]))
    )
    with pytest.raises(StorageError):
        warm.copy_from(hot.tier, m)
    assert warm.list_manifests() == [] and warm.list_staging() == []


def test_same_filesystem_rename(warm: LocalTierStorage, hot: Hot) -> None:
    assert warm.same_filesystem(hot.tier)
    before = tree_bytes(hot.path(hot.ckpt_dir))
    warm.rename_from(hot.tier, hot.ckpt_dir)  # type: ignore[arg-type]
    assert not hot.path(hot.ckpt_dir).exists()
    assert warm.list_manifests() == [("run1/checkpoint-100", hot.ckpt_dir, None)]
    assert tree_bytes(warm.root / "run1" / "checkpoint-100") == before
    assert warm.verify(hot.ckpt_dir) == []

    (hot.path(hot.ckpt_file)).write_bytes(b"changed")
    with pytest.raises(VerificationError):
        warm.rename_from(hot.tier, hot.ckpt_file)  # type: ignore[arg-type]
    assert hot.path(hot.ckpt_file).read_bytes() == b"changed"
    assert warm.read_manifest("run1/checkpoints/epoch=1-step=20.ckpt") is None
    assert warm.list_staging() == []


def test_rename_waits_for_the_callers_flush_and_leaves_nothing_when_it_fails(
    warm: LocalTierStorage, hot: Hot
) -> None:
    """The journal's flush runs beside the manifest's (issue 17): nothing is renamed before it has
    finished, and when it fails the move fails with the checkpoint where it was and no litter."""
    before = tree_bytes(hot.path(hot.ckpt_dir))
    seen: list[bool] = []

    def failing_flush() -> None:
        seen.append(hot.path(hot.ckpt_dir).is_dir())
        raise OSError(5, "Input/output error")

    with pytest.raises(StorageError, match="Input/output error"):
        warm.rename_from(hot.tier, hot.ckpt_dir, before_rename=failing_flush)  # type: ignore[arg-type]
    assert seen == [True]
    assert tree_bytes(hot.path(hot.ckpt_dir)) == before
    assert warm.list_staging() == [] and warm.list_manifests() == []

    steps: list[str] = []

    def flush() -> None:
        steps.append("flushed" if hot.path(hot.ckpt_dir).is_dir() else "renamed before the flush")

    warm.rename_from(hot.tier, hot.ckpt_dir, before_rename=flush, step=steps.append)  # type: ignore[arg-type]
    assert steps == ["flushed", "rename-staged", "rename-manifest", "rename-done"]
    assert tree_bytes(warm.root / "run1" / "checkpoint-100") == before
    assert warm.verify(hot.ckpt_dir) == []


def test_orphan_manifest_is_staging_not_a_copy(warm: LocalTierStorage, hot: Hot) -> None:
    # crash between writing the manifest and the commit rename
    (warm.root / "run1").mkdir()
    orphan = warm.root / "run1" / ("checkpoint-100" + MANIFEST_SUFFIX)
    orphan.write_text(hot.ckpt_dir.to_json())
    assert warm.list_manifests() == []
    assert warm.read_manifest("run1/checkpoint-100") is None
    (art,) = warm.list_staging()
    assert art.path == "run1/checkpoint-100" + MANIFEST_SUFFIX
    size = orphan.stat().st_size
    assert warm.discard_staging(art) == size
    assert not orphan.exists()
    warm.copy_from(hot.tier, hot.ckpt_dir)
    assert warm.list_manifests() == [("run1/checkpoint-100", hot.ckpt_dir, None)]


def test_local_copy_is_durable_and_leaves_no_staging(
    warm: LocalTierStorage, hot: Hot, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    warm.copy_from(hot.tier, hot.ckpt_dir)
    # 4 files + staging dir + 2 nested dirs + manifest + its directory (+ created parents)
    assert len(synced) >= 9
    names = sorted(p.name for p in (warm.root / "run1").iterdir())
    assert names == ["checkpoint-100", "checkpoint-100" + MANIFEST_SUFFIX]


# --------------------------------------------------------------------------------------------
# S3-only: verification without downloading, and the read-back fallback


@pytest.fixture
def cold(request: pytest.FixtureRequest, tmp_path: Path) -> storage.S3TierStorage:
    tier = make_backend("s3", request, tmp_path, "cold").tier
    assert isinstance(tier, storage.S3TierStorage)
    tier.part_size = 5 * MiB  # S3's minimum part size
    return tier


@pytest.fixture
def big(hot: Hot) -> Manifest:
    (hot.root / "run1" / "big.pt").write_bytes(os.urandom(11 * MiB))
    return cataloged(hot.root, "run1", "big.pt", 300)


def corrupt_parts_in_transit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flip a bit of every part after its CRC32 was computed (a bad NIC, proxy or store)."""
    original = s3_upload._S3FileWriter._upload_part

    async def upload_part(self: Any, upload_id: str, number: int, body: Any, crc: str) -> Any:
        data = bytearray(body.getvalue())
        data[7] ^= 0x01
        return await original(self, upload_id, number, io.BytesIO(bytes(data)), crc)

    monkeypatch.setattr(s3_upload._S3FileWriter, "_upload_part", upload_part)


def test_s3_corruption_in_transit_is_caught_by_the_stored_checksum(
    cold: storage.S3TierStorage, hot: Hot, big: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # AWS rejects such a part outright (BadDigest); moto stores it, but the COMPOSITE checksum it
    # derives from the stored parts no longer matches ours, so the HEAD check fails the copy.
    corrupt_parts_in_transit(monkeypatch)
    with pytest.raises(VerificationError, match="CRC32"):
        cold.copy_from(hot.tier, big)
    assert cold.list_manifests() == [] and cold.list_staging() == []


def test_s3_store_without_checksums_is_read_back(
    cold: storage.S3TierStorage, hot: Hot, big: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str]] = []
    real_call = cold._call

    def call_without_checksums(method: str, **kwargs: Any) -> Any:
        calls.append((method, kwargs.get("Key", "")))
        resp = real_call(method, **kwargs)
        if isinstance(resp, dict):  # an old S3 clone: ignores x-amz-checksum-*, echoes nothing
            resp = {k: v for k, v in resp.items() if not k.startswith("Checksum")}
        return resp

    monkeypatch.setattr(cold, "_call", call_without_checksums)
    cold.copy_from(hot.tier, big)
    assert ("get_object", "cold/ckpt/run1/big.pt") in calls  # verified by reading the object back
    assert cold.verify(big) == []

    cold.delete("run1/big.pt")
    corrupt_parts_in_transit(monkeypatch)  # and this store would not have rejected the parts
    with pytest.raises(VerificationError, match="read-back"):
        cold.copy_from(hot.tier, big)
    assert cold.list_manifests() == []


def test_s3_copy_is_verified_without_downloading(
    cold: storage.S3TierStorage, hot: Hot, big: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str]] = []
    real_call = cold._call

    def recording_call(method: str, **kwargs: Any) -> Any:
        calls.append((method, kwargs.get("Key", "")))
        return real_call(method, **kwargs)

    monkeypatch.setattr(cold, "_call", recording_call)
    cold.copy_from(hot.tier, big)
    data_key = "cold/ckpt/run1/big.pt"
    assert ("get_object", data_key) not in calls
    assert ("create_multipart_upload", data_key) in calls  # 11 MiB in 5 MiB parts
    assert ("head_object", data_key) in calls  # size + stored COMPOSITE CRC32


def flip_byte(path: Path, offset: int) -> None:
    """Change one byte in place (same size, same inode): a writer still busy with the file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0x01]))


def test_s3_part_changed_after_hashing_stores_the_bytes_hashed(
    cold: storage.S3TierStorage, hot: Hot, big: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parts are sent from the buffers the copy loop read and hashed them into, not read from the
    # file again: a file changed after part 1 was hashed cannot put other bytes under the CRC32
    # and hash of the ones read. What the store holds is the version of the manifest.
    path = hot.path(big)
    hashed = path.read_bytes()
    original = s3_upload._S3FileWriter._upload_part

    async def upload_part(self: Any, upload_id: str, number: int, body: Any, crc: str) -> Any:
        if number == 1:
            flip_byte(path, 5 * MiB - 1)  # the part's last byte, before the part is sent
        return await original(self, upload_id, number, body, crc)

    monkeypatch.setattr(s3_upload._S3FileWriter, "_upload_part", upload_part)
    cold.copy_from(hot.tier, big)
    assert path.read_bytes() != hashed
    assert cold.verify(big) == [] and cold.list_staging() == []
    assert cold.list_multipart_uploads() == []


def test_s3_single_put_changed_after_hashing_stores_the_bytes_hashed(
    cold: storage.S3TierStorage, hot: Hot, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = hot.path(hot.ckpt_file)
    hashed = path.read_bytes()
    original = s3_upload._S3FileWriter._send

    async def send(self: Any, method: str, body: Any, crc: str, **kwargs: Any) -> Any:
        if method == "put_object" and self.key.endswith(".ckpt"):
            flip_byte(path, 0)
        return await original(self, method, body, crc, **kwargs)

    monkeypatch.setattr(s3_upload._S3FileWriter, "_send", send)
    cold.copy_from(hot.tier, hot.ckpt_file)
    assert path.read_bytes() != hashed
    assert cold.verify(hot.ckpt_file) == [] and cold.list_staging() == []


_TRACED_UPLOAD = """
import json, sys, tracemalloc
from ckptkeeper.core.model import Manifest, TierPolicy, TierSpec
from ckptkeeper.storage import TierStorage
job = json.loads(sys.argv[1])
cold = TierStorage(TierSpec("cold", job["url"], TierPolicy(), storage_options=job["options"]))
cold.part_size, cold.max_inflight = job["part_size"], job["max_inflight"]
cold.list_manifests()  # client and first connection outside the trace
hot = TierStorage(TierSpec("hot", job["hot"], TierPolicy()), hot=True)
tracemalloc.start()
cold.copy_from(hot, Manifest.from_json(job["manifest"]))
print(tracemalloc.get_traced_memory()[1])
"""


def test_s3_upload_holds_at_most_its_part_buffers(cold: storage.S3TierStorage, hot: Hot) -> None:
    # A training node's memory is the scarce resource: parts are sent from the buffers the copy
    # read and hashed them into (each byte read once), reused: an upload holds at most
    # (max_inflight + 1) part buffers, never the whole file. Traced in a process of its own: the
    # moto server of the tests allocates in this one.
    import subprocess
    import sys

    path = hot.root / "run1" / "huge.pt"
    path.write_bytes(os.urandom(40 * MiB + 5))
    m = cataloged(hot.root, "run1", "huge.pt", 400)
    job = {
        "url": cold.spec.url,
        "options": dict(cold.spec.storage_options),
        "part_size": 8 * MiB,
        "max_inflight": 2,
        "hot": str(hot.root),
        "manifest": m.to_json(),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _TRACED_UPLOAD, json.dumps(job)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = int(proc.stdout.split()[-1])
    assert peak < (2 + 1) * 8 * MiB + 4 * MiB, f"{peak / MiB:.1f} MiB traced at peak"
    assert cold.verify(m) == []
