"""Moving bytes to and from S3: the resumable reader, and the sink whose manifest PUT commits a
copy (its files are uploaded by :mod:`.s3_upload`).

Drives the tier through the :class:`~.s3_upload._S3Tier` surface, so that it does not import the
backend (``s3.py`` builds on this module).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import deque
from typing import Any

from ckptkeeper.core.model import (
    MANIFEST_SUFFIX,
    FileEntry,
    Manifest,
)
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import (
    StorageError,
    VerificationError,
    _describe,
    _FileWriter,
    _Reader,
    _token,
    log,
)
from ckptkeeper.storage.s3_bodies import _PartPool
from ckptkeeper.storage.s3_upload import _S3FileWriter, _S3Tier
from ckptkeeper.util import hashing

# fsspec is imported where used: the CLI imports this package and local tiers need none of it.


async def _read_upto(body: Any, n: int) -> bytes:
    """Read ``n`` bytes (fewer only at EOF) from an aiobotocore streaming body."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = await body.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _S3Reader:
    """Sequential reader over one GET, resumed with ``Range`` + ``If-Match`` after a dropped stream.

    One request per object (not one per block, as fsspec's buffered file does) and a bounded buffer:
    aiohttp stops reading from the socket while we are not consuming.
    """

    retries = 5

    def __init__(self, tier: _S3Tier, key: str) -> None:
        self.tier = tier
        self.key = key
        self.pos = 0
        self.body: Any = None
        self.etag: str | None = None
        self.eof = False

    def _open(self) -> None:
        kw: dict[str, Any] = {}
        if self.pos:
            kw["Range"] = f"bytes={self.pos}-"
        if self.etag:
            kw["IfMatch"] = self.etag  # a resumed read must continue the same object
        resp = self.tier._call("get_object", Bucket=self.tier.bucket, Key=self.key, **kw)
        self.etag = self.etag or resp.get("ETag")
        self.body = resp["Body"]

    def read(self, n: int, /) -> bytes:
        from fsspec.asyn import sync

        if self.eof:
            return b""
        attempt = 0
        while True:
            if self.body is None:
                self._open()  # s3fs already retried this request
            try:
                data: bytes = sync(self.tier.fs.loop, _read_upto, self.body, n)
            except Exception as exc:
                self._close_body()
                attempt += 1
                if attempt > self.retries:
                    raise
                log.warning(
                    "%s: read of s3://%s/%s broke at byte %d (%s); resuming, attempt %d of %d",
                    self.tier.name,
                    self.tier.bucket,
                    self.key,
                    self.pos,
                    self.tier._redact(_describe(exc)),
                    attempt,
                    self.retries,
                )
                time.sleep(min(0.2 * 2**attempt, 5.0))
                continue
            if not data:
                self.eof = True
                self._close_body()
            self.pos += len(data)
            return data

    def _close_body(self) -> None:
        if self.body is not None:
            with contextlib.suppress(Exception):
                self.body.close()
            self.body = None

    def close(self) -> None:
        self._close_body()


class _S3Sink:
    """Data at final keys, marker first, manifest last (the commit point).

    The marker is a heartbeat (docs/design.md, "Many nodes"): it is rewritten at least every :attr:`beat_every`
    seconds while the copy runs and whenever a multipart upload starts, recording the node and
    the ids of its uploads; its ``LastModified`` (the store's clock) is how old the copy looks to a
    reaper, and the ids tie each upload to it (a store's upload start time proves nothing: moto
    reports a fixed one).
    """

    beat_every: float = 60.0
    """The tier's ``marker_beat`` (:attr:`ckptkeeper.core.model.TierSpec.marker_beat`)."""

    def __init__(self, tier: _S3Tier, rel: str, manifest: Manifest, *, with_manifest: bool) -> None:
        self.tier = tier
        self.rel = rel
        self.key = tier._key(rel)
        self.marker = f"{self.key}{STAGING_MARK}{_token()}"
        self.with_manifest = with_manifest
        self.landed: dict[str, str] = {}
        """key -> ETag of every object this copy stored: all that an abort deletes."""
        self.writer: _S3FileWriter | None = None
        self.in_flight: deque[_GuardedWriter] = deque()
        """Files whose one PUT is still in flight (oldest first), at most :attr:`put_concurrency`."""
        self.put_concurrency = max(1, tier.put_concurrency)
        self.uncertain: list[str] = []
        """Keys whose PUT failed or was cut short without an answer: stored or not, nobody knows."""
        self.pool = _PartPool()
        self.untrusted: list[tuple[str, int, str]] = []
        """(key, size, content hash of the bytes sent) of objects the store echoed no checksum of."""
        self.unchecked: list[tuple[str, FileEntry]] = []
        """One-PUT objects whose presence and size :meth:`commit` checks (one listing for all)."""
        self.commit_attempted = False
        self.committed = False
        self.is_dir = manifest.is_dir
        self.uploads: list[str] = []
        self.resumable: dict[str, dict[str, Any]] = {}
        """Object key -> resume record of an upload of an interrupted copy, until a writer takes it."""
        self.resume: dict[str, dict[str, Any]] = {}
        """Upload id -> its resume record, for each upload of this copy that has one."""
        self.finished: dict[str, dict[str, Any]] = {}
        """Object key -> record of each object this copy holds finished (:meth:`_S3FileWriter.done_record`):
        the marker names them, so that a copy after a kill keeps them instead of sending them again."""
        self.reusable: dict[str, dict[str, Any]] = {}
        """Object key -> record of an object an interrupted copy finished, of a file of this copy,
        still in the store as recorded, until a writer takes it."""
        self.beat_every = tier.marker_beat
        self.started = time.time()
        self.last_beat = self.started
        with tier._errors(f"start copy of {rel}"):
            others = tier._other_writers(self.key)
            if others:
                raise StorageError(
                    f"tier {tier.name!r}: node {', '.join(others)} is copying to {rel} too (two nodes share "
                    "the single-node layout: set shared = true on the tier); nothing was written"
                )
            # An earlier copy of this node killed mid-upload left uploads it can resume: the new
            # marker names them before anything else happens, so no reaper takes them for abandoned.
            self.resumable, done, superseded = tier._interrupted_copies(self.key)
            self.resume = {r["upload"]: r for r in self.resumable.values()}
            self.uploads = sorted(self.resume)
            self.reusable = tier._still_finished(_of_files(done, self.key, manifest))
            self.finished = dict(self.reusable)
            self.landed = {k: r["etag"] for k, r in self.reusable.items()}
            self.beat()
            # leftovers of an earlier interrupted copy: uncommitted (no manifest), so ours to drop
            tier._delete_keys([k for k, _, _ in tier._target_objects(self.key) if k not in self.reusable])
            tier._abort_uploads_under(self.key, keep=self.resume)
            tier._delete_keys([m for m in superseded if m != self.marker])

    def open_file(self, entry: FileEntry, source: _Reader | None = None) -> _FileWriter:
        """A writer of ``entry``'s object. ``source`` is not read: what is stored is exactly the
        bytes written (read and hashed once by the copy, checked against the manifest before the
        writer finishes), never the file read again."""
        key = f"{self.key}/{entry.path}" if entry.path else self.key
        self._note_landed()
        self.writer = _S3FileWriter(
            self.tier, key, entry, f"{self.tier.name}:{self.rel}/{entry.path}", self.pool
        )
        self.writer.on_upload = self._upload_started
        self.writer.resume = self.resumable.pop(key, None)
        done = self.reusable.pop(key, None)
        self.writer.done = done if done is not None and done["part_size"] == self.writer.part_size else None
        if self.writer.done is not None and self.writer.resume is not None:
            upload, self.writer.resume = self.writer.resume["upload"], None  # the object is whole
            with contextlib.suppress(Exception):  # else the reaper aborts it
                self.tier._call("abort_multipart_upload", Bucket=self.tier.bucket, Key=key, UploadId=upload)
        self.writer.defer_check = bool(entry.path)  # objects under ``key/``: one listing finds them
        self.writer.in_background = self.put_concurrency > 1
        return _GuardedWriter(self, self.writer)

    def settle(self, keep: int = 0) -> None:
        """Wait for the oldest PUTs in flight until at most ``keep`` remain; raise the first failure.

        A checkpoint of many small files sent them one PUT after another, a round trip each
        (bench/prune_e2e.py: 200 files of 64 KiB-4 MiB per checkpoint); now up to
        :attr:`put_concurrency` of them are in flight while the next file is read and hashed. A
        failed PUT's key is :attr:`uncertain` (an answer may have been lost after it landed), and
        :meth:`abort` settles the rest before it cleans up."""
        while len(self.in_flight) > keep:
            guarded = self.in_flight.popleft()
            try:
                with self.tier._errors(f"upload of {guarded.writer.key}"):
                    guarded.writer.settle()
            except BaseException:
                self.uncertain.append(guarded.writer.key)
                raise
            guarded.stored()

    def _upload_started(self, upload_id: str) -> None:
        self.uploads.append(upload_id)
        record = self.writer.resume_record() if self.writer is not None else None
        if record is not None:
            self.resume[upload_id] = record
        self.beat()

    def beat(self) -> None:
        """Rewrite the marker: a fresh heartbeat, this copy's uploads so far, and for each upload
        from a local file the record a copy needs to resume it after a kill (docs/uploads.md)."""
        self.last_beat = time.time()
        doc = _marker_doc("copy", self.rel, self.is_dir, self.tier.node)
        doc.update(
            started=self.started,
            uploads=list(self.uploads),
            resume=[self.resume[u] for u in self.uploads if u in self.resume],
            done=list(self.finished.values()),
        )
        self.tier._put_json(self.marker, doc)

    def maybe_beat(self) -> None:
        if time.time() - self.last_beat >= self.beat_every:
            self.beat()

    def _check_landed(self) -> None:
        """Every one-PUT object is there at its manifest size, before the manifest commits it.

        One listing of the checkpoint's prefix answers for all of them (a checkpoint of 200
        small files paid 200 sequential HEADs before: bench/prune_e2e.py); an object the listing
        does not show as expected is asked about with its own HEAD before it counts as missing,
        so a store whose listing lags its writes only costs a request, never a false failure."""
        if not self.unchecked:
            return
        tier = self.tier
        with tier._errors(f"check of {self.rel}"):
            listed = {str(o["Key"]): int(o["Size"]) for o in tier._list_objects(self.key + "/")}
            for key, entry in self.unchecked:
                size = listed.get(key)
                if size != entry.size:
                    head = tier._head(key)
                    size = None if head is None else int(head["ContentLength"])
                if size is None:
                    raise VerificationError(f"{tier.name}:{key}: object missing right after upload")
                if size != entry.size:
                    raise VerificationError(
                        f"{tier.name}:{key}: store holds {size} bytes, expected {entry.size}"
                    )
        self.unchecked = []

    def commit(self, manifest: Manifest) -> None:
        tier = self.tier
        self.settle()
        self._check_landed()
        for key, want_size, want_digest in self.untrusted:
            with tier._errors(f"read-back of {key}"):
                reader = _S3Reader(tier, key)
                try:
                    size, digest = hashing.hash_stream(reader)  # type: ignore[arg-type]
                finally:
                    reader.close()
            if (size, digest) != (want_size, want_digest):
                raise VerificationError(f"{tier.name}:{key}: read-back does not match the manifest")
        if self.with_manifest:
            self.commit_attempted = True
            with tier._errors(f"commit of {self.rel}"):
                tier._commit_manifest(self.key + MANIFEST_SUFFIX, manifest.to_json().encode())
        self.committed = True
        try:
            # A retried CreateMultipartUpload whose first reply was lost left an upload nobody
            # completes; the marker goes only once they are gone (list_staging finds them via it).
            tier._abort_uploads_under(self.key)
            tier._delete_keys([self.marker])
        except Exception as exc:  # a stale marker beside a manifest is harmless
            log.warning("%s: stale staging marker left: %s", tier.name, tier._redact(_describe(exc)))

    def _note_landed(self) -> None:
        if self.writer is not None and self.writer.etag is not None:
            self.landed[self.writer.key] = self.writer.etag

    def _still_ours(self) -> list[str]:
        """Keys of objects this copy stored that still hold what it stored."""
        mine = []
        for key, etag in self.landed.items():
            head = self.tier._head(key)
            if head is not None and str(head.get("ETag") or "") == etag:
                mine.append(key)
        return mine

    def abort(self) -> None:
        if self.committed:
            return
        while self.in_flight:  # cancelled, or waited for: each one's outcome is known or uncertain
            w = self.in_flight.popleft().writer
            w.abort()
            if w.etag is not None:
                self.landed[w.key] = w.etag
            else:
                self.uncertain.append(w.key)
        if self.writer is not None:
            self.writer.abort()
        for record in self.resumable.values():  # taken over from an interrupted copy, never resumed
            with contextlib.suppress(Exception):
                self.tier._call(
                    "abort_multipart_upload",
                    Bucket=self.tier.bucket,
                    Key=record["key"],
                    UploadId=record["upload"],
                )
        self.resumable = {}
        if self.commit_attempted:
            # The manifest PUT failed without a clear answer. All data is uploaded and verified, so
            # the copy is either committed (valid) or staging; deleting data could orphan a manifest.
            log.warning("%s: commit of %s uncertain; leaving it for list_staging", self.tier.name, self.rel)
            return
        self._note_landed()
        try:
            # Only objects this copy stored and nobody replaced since (same ETag), and only its
            # own upload (the writer aborted it): a concurrent writer of the same key keeps its
            # data and its uploads (docs/design.md, "Many nodes": a losing writer deletes only its own keys).
            self.tier._delete_keys(self._still_ours())
            current = self.writer
            unknown = [k for k in self.uncertain if k not in self.landed]
            if current is not None and current.etag is None and current.key not in unknown:
                unknown.append(current.key)
            for key in unknown:
                if self.tier._head(key) is not None:
                    # The failed file may have landed (a reply lost) or be someone else's: the marker
                    # stays, so the reaper settles it once the copy is stale (list_staging).
                    log.warning(
                        "%s: %s may hold an object of this copy; left for the reaper", self.tier.name, key
                    )
                    return
            self.tier._delete_keys([self.marker])
        except Exception as exc:
            log.warning(
                "%s: could not clean staging of %s (list_staging reports it): %s",
                self.tier.name,
                self.rel,
                self.tier._redact(_describe(exc)),
            )


class _GuardedWriter:
    """Translates backend exceptions of one file into StorageError and records untrusted uploads."""

    def __init__(self, sink: _S3Sink, writer: _S3FileWriter) -> None:
        self.sink = sink
        self.writer = writer

    def write(self, data: bytes | memoryview, /) -> None:
        with self.sink.tier._errors(f"upload of {self.writer.key}"):
            self.writer.write(data)
            self.sink.maybe_beat()

    def finish(self) -> None:
        sink = self.sink
        with sink.tier._errors(f"upload of {self.writer.key}"):
            self.writer.finish()
            record = None if self.writer.kept else self.writer.done_record()
            if record is not None:  # a large object: recorded at once, a kill then loses none of it
                sink.finished[self.writer.key] = record
                sink.beat()
        if self.writer.put is not None:
            sink.writer = None  # the sink's in-flight queue owns it now
            sink.in_flight.append(self)
            sink.settle(keep=sink.put_concurrency)
            return
        self.stored()

    def stored(self) -> None:
        """The object is stored: what the commit must still check, and what an abort may delete."""
        if self.writer.etag is not None:
            self.sink.landed[self.writer.key] = self.writer.etag
        if self.writer.unchecked:
            self.sink.unchecked.append((self.writer.key, self.writer.entry))
        if not self.writer.trusted:
            self.sink.untrusted.append(
                (self.writer.key, self.writer.entry.size, self.writer.content.hexdigest())
            )


def _of_files(done: dict[str, dict[str, Any]], key: str, manifest: Manifest) -> list[dict[str, Any]]:
    """The finished-object records of ``done`` that are of a file of ``manifest`` as this copy is
    given it (object key, size and hash; a file hashed on the way: the same fingerprint)."""
    files = {(f"{key}/{e.path}" if e.path else key): e for e in manifest.files}
    out = []
    for object_key, record in done.items():
        entry = files.get(object_key)
        if entry is not None and (entry.size, entry.hash) == (record["size"], record["hash"]):
            out.append(record)
    return out


def _marker_doc(op: str, rel: str, is_dir: bool | None, node: str) -> dict[str, Any]:
    """A staging marker's body: who is copying what (``node``: docs/design.md, "Many nodes", so another node's
    reaper can tell whose marker it is)."""
    now = time.time()
    return {
        "op": op,
        "target": rel,
        "is_dir": is_dir,
        "started": now,
        "heartbeat": now,
        "node": node,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
