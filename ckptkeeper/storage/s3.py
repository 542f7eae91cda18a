"""The S3 backend: a tier in S3-compatible object storage, through s3fs/aiobotocore (see the
package docstring for its commit protocol and verification).

Built from :mod:`.s3_client` (requests, errors, secrets), :mod:`.s3_staging` (markers and
multipart uploads for the reaper), :mod:`.s3_fleet` (a shared bucket's lease, heartbeats and
views) and :mod:`.s3_transfer` / :mod:`.s3_upload` (moving the bytes).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from ckptkeeper.core.model import (
    MANIFEST_SUFFIX,
    Manifest,
    TierSpec,
    TierUsage,
)
from ckptkeeper.hook.protocol import STAGING_MARK, TRASH_DIR
from ckptkeeper.storage import content
from ckptkeeper.storage.base import (
    _MAX_PIN_BYTES,
    DAMAGED_COPY,
    PIN_SUFFIX,
    Progress,
    StorageError,
    TierUnavailable,
    _check_manifest,
    _describe,
    _parse_manifest,
    _parse_pin,
    _pin_doc,
    _Reader,
    _rel_of,
    _Sink,
    _split_rel,
    _token,
)
from ckptkeeper.storage.s3_client import _CREDENTIAL_ENV, _collect_secrets
from ckptkeeper.storage.s3_fleet import FleetObjects
from ckptkeeper.storage.s3_staging import StagingObjects
from ckptkeeper.storage.s3_transfer import _marker_doc, _S3Reader, _S3Sink
from ckptkeeper.storage.s3_trash import TrashObjects
from ckptkeeper.storage.tier import TierStorage, _compare_sizes

if TYPE_CHECKING:
    from s3fs import S3FileSystem

    from ckptkeeper.storage.localfs import _LocalSink

# fsspec and s3fs are imported where used: the CLI imports this package and local tiers need neither.

_NO_CONDITIONAL_WRITE = (
    "manifests are committed with a read-then-write (two nodes committing the same path at the same "
    "instant are not detected); copies go on"
)


class S3TierStorage(StagingObjects, FleetObjects, TrashObjects, TierStorage):
    """A tier in S3-compatible object storage, through s3fs/aiobotocore."""

    is_local = False
    schemes = ("s3", "s3a")
    part_size: int = 16 * 2**20
    """Multipart part size (grown for objects that would need more than ~9000 parts); objects up
    to it are one PUT.

    Fewer requests cost less client CPU (each is ~ms of botocore) and, read from the file while
    sent, a part costs no memory: bench/s3_transfer.py, 4 x 256 MiB, medians of 5 alternating
    runs: 16 MiB parts 1.75 client CPU-s/GiB and 9.6 s, 8 MiB parts 2.09 CPU-s/GiB and 10.2 s,
    both 65.6 MiB peak RSS (boto3: 2.83 CPU-s/GiB, 10.8 s, 82.0 MiB)."""
    fetch_workers = 4
    """Objects a restore (:meth:`fetch`) downloads at once, each one GET streamed, hashed and
    written by its own thread: one object after another left the link idle for a round trip per
    object (a TCP connect too, with moto). Below aiobotocore's pool of 10 connections. Measured
    (`ckptkeeper restore` of the quick bench's 40-file checkpoint, moto): 4 fetches the files as
    fast as 8 (in-process fetch 0.25 s → 0.18 s) at +3 MiB peak RSS instead of +8 MiB (each
    thread's malloc arena and buffers)."""
    recheck_concurrency: int = 16
    """HEADs in flight at once when a re-check before a delete (:meth:`recheck`) asks about
    objects its listing did not show as expected."""
    put_concurrency: int = 4
    """One-PUT objects of a checkpoint (files up to :attr:`part_size`) in flight at once while the
    copy reads and hashes the next file (:meth:`~.s3_transfer._S3Sink.settle`); each is sent from
    a buffer of its own (at most :attr:`part_size`). Measured in bench/prune_e2e.py (below)."""
    max_inflight: int = 3
    """Parts uploaded concurrently per file.

    Parts are sent from the buffers the copy read and hashed them into (each byte read once,
    docs/uploads.md): part buffers take ≈ (max_inflight + 1) * part_size. (Parts read from the
    file again while sent held no buffer, but read and hashed every byte twice.)

    Measured against a local moto server, 4 x 256 MiB, with buffered parts: 16 MiB x 4 took 1.39
    client CPU-s/GiB, 8 MiB x 3 1.57 CPU-s/GiB, 5 MiB x 4 1.71 CPU-s/GiB; all at or above boto3's
    wall speed."""

    def __init__(self, spec: TierSpec, *, hot: bool = False) -> None:
        super().__init__(spec, hot=hot)
        if hot:
            raise StorageError(f"tier {spec.name!r}: the hot tier must be a local path")
        rest = spec.url.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StorageError(f"tier {spec.name!r}: no bucket in URL {spec.url!r}")
        self.bucket = bucket
        self.marker_beat = spec.marker_beat
        prefix = prefix.strip("/")
        self.root_prefix = f"{prefix}/" if prefix else ""
        """The tier URL's prefix: the bucket-wide root every node of a shared tier shares."""
        self.prefix = self.root_prefix
        """Where this tier object reads and writes copies: the root, or ``<root><node>/`` in a
        shared tier (docs/design.md, "Many nodes": one node's keys can never be another's)."""
        self.read_only = False
        if spec.shared:
            if not spec.node:
                raise StorageError(
                    f"tier {spec.name!r}: a shared tier needs this node's name (config `node`)"
                )
            _split_rel(spec.node, "node name")
            self.prefix = f"{self.root_prefix}{spec.node}/"
        self._secrets = _collect_secrets(spec.storage_options)
        # credentials botocore would find on its own are just as secret as configured ones
        self._add_secrets(os.environ.get(name, "") for name in _CREDENTIAL_ENV)
        self._fs: S3FileSystem | None = None

    def _commit_manifest(self, key: str, body: bytes) -> None:
        """PUT the manifest once (``If-None-Match: *``); an ambiguous failure is resolved by reading it."""
        try:
            self._call(
                "put_object",
                Bucket=self.bucket,
                Key=key,
                Body=body,
                IfNoneMatch="*",
                ContentType="application/json",
            )
        except Exception as exc:
            if self._degraded("conditional writes (If-None-Match)", exc, _NO_CONDITIONAL_WRITE):
                self._commit_manifest_unconditionally(key, body)
                return
            try:
                if self._get(key) == body:
                    return  # the first attempt landed; a retry then met If-None-Match
            except Exception:
                pass
            raise

    def _commit_manifest_unconditionally(self, key: str, body: bytes) -> None:
        """The commit on a store without conditional writes: look, then PUT. Another writer of
        the same path between the two is not detected (the staging marker makes that rare)."""
        existing = self._get(key)
        if existing == body:
            return
        if existing is not None:
            raise StorageError(self._redact(f"tier {self.name!r}: {key} was committed by someone else"))
        self._call("put_object", Bucket=self.bucket, Key=key, Body=body, ContentType="application/json")

    # -- primitives -------------------------------------------------------------------------

    def _fetch_files(self, rel: str, manifest: Manifest, sink: _LocalSink, progress: Progress | None) -> None:
        """Parallel ranged GETs written in place and hashed as they arrive (:mod:`.s3_fetch`)."""
        from ckptkeeper.storage.s3_fetch import fetch_ranged

        fetch_ranged(self, rel, manifest, sink, progress)

    def _open_read(self, rel: str, file_path: str) -> _Reader:
        if file_path:
            _split_rel(file_path, "file path in manifest")
        key = self._key(rel) + (f"/{file_path}" if file_path else "")
        return _GuardedReader(self, _S3Reader(self, key))

    def _begin_write(self, rel: str, manifest: Manifest) -> _Sink:
        self._check_writable(f"copy to {rel}")
        return _S3Sink(self, rel, manifest, with_manifest=True)

    def _list_files(self, rel: str, is_dir: bool) -> dict[str, int | None] | None:
        key = self._key(rel)
        with self._errors(f"listing {rel}"):
            if is_dir:  # an empty "directory" and a missing one look alike in S3
                found: dict[str, int | None] = {
                    o["Key"][len(key) + 1 :]: int(o["Size"]) for o in self._list_objects(key + "/")
                }
                return found or None
            head = self._head(key)
            return None if head is None else {"": int(head["ContentLength"])}

    # -- public API -------------------------------------------------------------------------

    def usage(self) -> TierUsage | None:
        return None  # object stores have no capacity; watermarks do not apply

    def read_manifest(self, rel_path: str) -> Manifest | None:
        key = self._key(rel_path) + MANIFEST_SUFFIX
        with self._errors(f"reading manifest of {rel_path}"):
            text = self._get(key, plain=True)
        return None if text is None else _parse_manifest(rel_path, text)

    def list_manifests(self) -> list[tuple[str, Manifest | None, str | None]]:
        with self._errors(f"listing {self.url}", TierUnavailable):
            objs = self._list_objects(self.prefix)
        return self._manifests_in(objs)

    def list_manifests_and_pins(
        self,
    ) -> tuple[list[tuple[str, Manifest | None, str | None]], set[tuple[str, str]]]:
        """Both from one listing of the prefix (a reconcile needs both)."""
        with self._errors(f"listing {self.url}", TierUnavailable):
            objs = self._list_objects(self.prefix)
        return self._manifests_in(objs), self._pins_in(objs)

    def _manifests_in(self, objs: list[dict[str, Any]]) -> list[tuple[str, Manifest | None, str | None]]:
        """:meth:`list_manifests` from a listing of the prefix: every manifest read, all at once."""
        import asyncio

        from fsspec.asyn import sync

        with self._errors(f"listing {self.url}", TierUnavailable):
            sizes = {o["Key"]: int(o["Size"]) for o in objs}
            trash = f"{self.prefix}{TRASH_DIR}/"  # listed by list_trash, never as copies
            keys = [
                o["Key"]
                for o in objs
                if o["Key"].endswith(MANIFEST_SUFFIX)
                and STAGING_MARK not in o["Key"].rsplit("/", 1)[-1]
                and not o["Key"].startswith(trash)
            ]

            async def fetch_all() -> list[bytes | BaseException]:
                sem = asyncio.Semaphore(16)

                async def one(key: str) -> bytes | BaseException:
                    async with sem:
                        try:
                            data: bytes = await self.fs._cat_file(f"{self.bucket}/{key}")
                            return data
                        except Exception as exc:
                            return exc

                return await asyncio.gather(*(one(k) for k in keys))

            results = sync(self.fs.loop, fetch_all)
        out: list[tuple[str, Manifest | None, str | None]] = []
        for key, result in zip(keys, results, strict=True):
            rel = key[len(self.prefix) : -len(MANIFEST_SUFFIX)]
            if isinstance(result, FileNotFoundError):
                continue  # deleted since the listing
            if isinstance(result, BaseException):
                raise TierUnavailable(
                    self._redact(f"tier {self.name!r}: reading {key}: {_describe(result)}")
                ) from result
            try:
                manifest = _parse_manifest(rel, result)
            except StorageError as exc:
                out.append((rel, None, str(exc)))
                continue
            # The listing already holds every object's size: a manifest over missing data costs
            # no request to catch, and must not be reported as a copy.
            base = key[: -len(MANIFEST_SUFFIX)]
            present: dict[str, int | None] = {
                e.path: sizes.get(f"{base}/{e.path}" if e.path else base) for e in manifest.files
            }
            damage = _compare_sizes(rel, manifest, {k: v for k, v in present.items() if v is not None})
            out.append((rel, manifest, DAMAGED_COPY + "; ".join(damage) if damage else None))
        return sorted(out, key=lambda t: t[0])

    def recheck(self, manifest: Manifest) -> list[str]:
        """:meth:`TierStorage.recheck`: the manifest and one listing, in flight together.

        A GET of the manifest (it must still be committed, with this version) beside one listing
        of the checkpoint's prefix, which shows every data object's presence and size (a HEAD per
        object cost a checkpoint of 200 small files 200 requests before each delete:
        bench/prune_e2e.py). An object the listing does not show at the manifest's size is asked
        about with its own HEAD before it counts as missing or short, so a store whose listing
        lags its writes costs requests, never a false verdict. A single-file checkpoint is one
        HEAD. The manifest's content hash is not something S3 can echo (it stores a CRC32), so
        content is :meth:`verify`'s job, as for local tiers.
        """
        import asyncio

        from fsspec.asyn import sync

        _check_manifest(manifest)
        rel = _rel_of(manifest)
        key = self._key(rel)
        targets = [(e.path, f"{key}/{e.path}" if e.path else key) for e in manifest.files]
        expected = {k: e.size for (_, k), e in zip(targets, manifest.files, strict=True)}

        async def head(k: str) -> int | None:
            try:
                resp = await self.fs._call_s3("head_object", Bucket=self.bucket, Key=k)
            except FileNotFoundError:
                return None
            return int(resp["ContentLength"])

        async def committed() -> bytes | None:
            try:  # one GET (s3fs's _cat_file would HEAD first)
                resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=f"{key}{MANIFEST_SUFFIX}")
            except FileNotFoundError:
                return None
            body = resp["Body"]
            try:
                data: bytes = await body.read()
            finally:
                body.close()
            return data

        async def listed() -> dict[str, int]:
            sizes: dict[str, int] = {}
            if not any(path for path, _ in targets):
                return sizes
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key + "/"}
            while True:
                resp = await self.fs._call_s3("list_objects_v2", **kw)
                sizes.update((str(o["Key"]), int(o["Size"])) for o in resp.get("Contents", []))
                if not resp.get("IsTruncated"):
                    return sizes
                kw["ContinuationToken"] = resp["NextContinuationToken"]

        async def check_all() -> tuple[bytes | None, dict[str, int | None]]:
            text, sizes = await asyncio.gather(committed(), listed())
            expected.update(_stored_sizes(rel, text, manifest, targets))  # a compressed copy's sizes
            present: dict[str, int | None] = {k: sizes.get(k) for k in expected}
            unseen = [k for k, size in present.items() if size != expected[k]]
            sem = asyncio.Semaphore(self.recheck_concurrency)

            async def ask(k: str) -> None:
                async with sem:
                    present[k] = await head(k)

            await asyncio.gather(*(ask(k) for k in unseen))
            return text, present

        with self._errors(f"re-checking {rel}"):
            text, present = sync(self.fs.loop, check_all)
        if text is None:
            return [f"{rel}: no committed copy (manifest missing)"]
        committed_manifest = _parse_manifest(rel, text)
        if committed_manifest.digest != manifest.digest:
            return [f"{rel}: holds version {committed_manifest.digest}, not {manifest.digest}"]
        if content.has_content(committed_manifest):
            return content.recheck(self, committed_manifest)
        sizes_by_path = {path: present[k] for path, k in targets}
        return _compare_sizes(
            rel, committed_manifest, {p: s for p, s in sizes_by_path.items() if s is not None}
        )

    def delete(self, rel_path: str, *, adopt: bool = False) -> int:
        """Marker, then manifest (de-commit), then data; the marker goes last.

        A copy whose manifest names another node is refused (docs/design.md, "Many nodes": another node's copies
        are read-only here) unless ``adopt`` (the fleet lease holder cleaning an orphan).

        The data deleted is what the listing shows *and* every file the manifest names: a listing
        that lags (omits a key) leaves nothing behind. Then the copy's prefix is listed again, up
        to :data:`_DELETE_RELISTS` times, and whatever appears is deleted too; an object still
        there after that keeps the delete's staging marker (the reaper's to finish) and fails the
        delete, naming it: nothing leaks silently.
        """
        self._check_writable(f"delete of {rel_path}")
        key = self._key(rel_path)
        with self._errors(f"delete {rel_path}"):
            manifest_key = key + MANIFEST_SUFFIX
            body = self._get(manifest_key)
            has_manifest = body is not None
            owner = _owner_of(body) if body is not None else ""
            if owner and self.node and owner != self.node and not adopt:
                raise StorageError(
                    f"tier {self.name!r}: {rel_path} is owned by node {owner}, not {self.node}: "
                    "refusing to delete another node's copy"
                )
            objs = self._target_objects(key)
            named = _named_keys(key, rel_path, body)
            if not objs and not has_manifest:
                return 0
            marker = f"{key}{STAGING_MARK}{_token()}"
            self._put_json(marker, _marker_doc("delete", rel_path, None, self.node))
            if has_manifest:
                self._delete_keys([manifest_key])
            self._delete_keys(sorted({k for k, _, _ in objs} | named))
            for _ in range(_DELETE_RELISTS):
                left = self._target_objects(key)
                if not left:
                    break
                self._delete_keys([k for k, _, _ in left])
            else:
                left = self._target_objects(key)
                if left:
                    raise StorageError(
                        f"tier {self.name!r}: delete of {rel_path}: {len(left)} objects still listed after "
                        f"{_DELETE_RELISTS} re-listings (e.g. {left[0][0]}); its delete marker stays for the reaper"
                    )
            self._delete_keys([marker])
        return sum(size for _, size, _ in objs)

    # -- pins ------------------------------------------------------------------------------

    def write_pin(self, run: str, name: str, step: int, node: str) -> None:
        rel = f"{run}/{name}"
        self._check_writable(f"pin of {rel}")
        with self._errors(f"writing the pin of {rel}"):
            self._call(
                "put_object",
                Bucket=self.bucket,
                Key=self._key(rel) + PIN_SUFFIX,
                Body=_pin_doc(run, name, step, node),
                ContentType="application/json",
            )

    def remove_pin(self, run: str, name: str) -> None:
        rel = f"{run}/{name}"
        self._check_writable(f"unpin of {rel}")
        with self._errors(f"removing the pin of {rel}"):
            self._delete_keys([self._key(rel) + PIN_SUFFIX])

    def list_pins(self) -> set[tuple[str, str]]:
        with self._errors(f"listing pins in {self.url}", TierUnavailable):
            objs = self._list_objects(self.prefix)
        return self._pins_in(objs)

    def _pins_in(self, objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
        """:meth:`list_pins` from a listing of the prefix. A pin written since that listing is read
        at the next one (pins are only ever added from a listing, so a late one costs nothing but a
        pass)."""
        out: set[tuple[str, str]] = set()
        trash = f"{self.prefix}{TRASH_DIR}/"
        with self._errors(f"listing pins in {self.url}", TierUnavailable):
            for obj in objs:
                key = obj["Key"]
                if (
                    not key.endswith(PIN_SUFFIX)
                    or STAGING_MARK in key.rsplit("/", 1)[-1]
                    or key.startswith(trash)
                ):
                    continue
                if int(obj.get("Size", 0)) > _MAX_PIN_BYTES:
                    continue  # no pin of ours is that big: never downloaded
                data = self._get(key)
                if data is None:
                    continue  # unpinned since the listing
                pin = _parse_pin(key[len(self.prefix) : -len(PIN_SUFFIX)], data)
                if pin is not None:
                    out.add(pin)
        return out


_DELETE_RELISTS = 3
"""Listings of a deleted copy's prefix, at most, until it is seen empty."""


def _named_keys(key: str, rel_path: str, body: bytes | None) -> set[str]:
    """The data keys a copy's manifest names (none when it has no readable manifest)."""
    if body is None:
        return set()
    try:
        manifest = _parse_manifest(rel_path, body)
    except (StorageError, ValueError):
        return set()
    if not manifest.is_dir:
        return {key}
    named = {f"{key}/{f.path}" for f in manifest.files}
    return {
        k for k in named if "/../" not in k[len(key) :] and not k.endswith("/..")
    }  # never outside the copy


def _owner_of(body: bytes) -> str:
    """The ``node`` a manifest names ('' when it names none or is not JSON: owner unknown)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    node = doc.get("node") if isinstance(doc, dict) else None
    return node if isinstance(node, str) else ""


class _GuardedReader:
    def __init__(self, tier: S3TierStorage, reader: _S3Reader) -> None:
        self.tier = tier
        self.reader = reader

    def read(self, n: int, /) -> bytes:
        with self.tier._errors(f"reading {self.reader.key}"):
            return self.reader.read(n)

    def close(self) -> None:
        self.reader.close()


def _stored_sizes(
    rel: str, text: bytes | None, manifest: Manifest, targets: list[tuple[str, str]]
) -> dict[str, int]:
    """Key → stored size of the files the committed manifest ``text`` says are compressed (none
    when it is not this version's: the caller reports that)."""
    try:
        committed = _parse_manifest(rel, text) if text is not None else None
    except StorageError:
        return {}
    if committed is None or committed.digest != manifest.digest:
        return {}
    by_path = {e.path: e for e in committed.files}
    return {k: by_path[p].stored_size for p, k in targets if p in by_path and by_path[p].encoding}
