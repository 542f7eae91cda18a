"""Uploads to S3: one object per file, a single PUT or a multipart upload, each body carrying
the CRC32 of the bytes that were hashed, sent from the very buffers the copy read and hashed
(each byte read once: docs/uploads.md).

Also the :class:`_S3Tier` surface through which this module and :mod:`.s3_transfer` drive the
backend, so that neither imports it (``s3.py`` builds on both).
"""

from __future__ import annotations

import contextlib
import io
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ckptkeeper.core.model import FileEntry
from ckptkeeper.storage.base import (
    StorageError,
    VerificationError,
    _describe,
    log,
)
from ckptkeeper.storage.s3_bodies import _crc32_b64, _PartPool, _PartStream
from ckptkeeper.util import hashing

if TYPE_CHECKING:
    from concurrent.futures import Future

    from s3fs import S3FileSystem

# asyncio, concurrent.futures and s3fs are imported where used: the CLI imports this package and
# local tiers need none of them.


class _S3Tier(Protocol):
    """What the reader, writers and sink use of the S3 backend (:class:`~ckptkeeper.storage.s3.S3TierStorage`)."""

    name: str
    node: str
    bucket: str
    max_inflight: int
    put_concurrency: int
    marker_beat: float

    @property
    def fs(self) -> S3FileSystem: ...
    def _call(self, method: str, **kwargs: Any) -> Any: ...
    def _errors(
        self, what: str, exc_type: type[StorageError] = StorageError
    ) -> contextlib.AbstractContextManager[None]: ...
    def _redact(self, text: str) -> str: ...
    def _key(self, rel: str) -> str: ...
    def _part_size_for(self, size: int) -> int: ...
    def _head(self, key: str, *, checksum: bool = False) -> dict[str, Any] | None: ...
    def _put_json(self, key: str, doc: Mapping[str, Any]) -> None: ...
    def _target_objects(self, key: str) -> list[tuple[str, int, float]]: ...
    def _list_objects(self, prefix: str) -> list[dict[str, Any]]: ...
    def _delete_keys(self, keys: list[str]) -> None: ...
    def _abort_uploads_under(self, key: str, keep: Collection[str] = ()) -> set[str]: ...
    def _resumable_uploads(self, key: str) -> tuple[dict[str, dict[str, Any]], list[str]]: ...
    def _interrupted_copies(
        self, key: str
    ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[str]]: ...
    def _still_finished(self, records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]: ...
    def _commit_manifest(self, key: str, body: bytes) -> None: ...
    def _other_writers(self, key: str) -> list[str]: ...


class _S3FileWriter:
    """Streams one object: a single PUT if it fits in one part, else a multipart upload.

    At most ``max_inflight`` parts upload concurrently on fsspec's IO loop. The part being
    filled and the parts in flight are held in buffers of the copy's :class:`_PartPool`
    (``(max_inflight + 1) * part_size``), and a one-PUT object in a buffer of its own: what is
    sent is exactly the bytes the copy read and hashed, never the file read again (each byte is
    read once, and a file changed after it was read cannot slip other bytes under the CRC32 and
    hash of the ones read: docs/uploads.md). Every request carries the CRC32 of its body,
    computed here from the bytes that were hashed.
    """

    def __init__(
        self,
        tier: _S3Tier,
        key: str,
        entry: FileEntry,
        where: str,
        pool: _PartPool,
    ) -> None:
        self.tier = tier
        self.key = key
        self.entry = entry
        self.where = where
        self.pool = pool
        self.part_size = tier._part_size_for(entry.size)
        self.single = entry.size <= self.part_size
        """The whole object fits in one part: one PUT, no multipart upload."""
        self.capacity = max(1, min(self.part_size, entry.size))
        self.buf: bytearray | None = None
        self.filled = 0
        self.offset = 0
        """Where the part being filled starts in the file."""
        self.crc = 0
        self.upload_id: str | None = None
        self.next_part = 1
        self.parts: list[dict[str, Any]] = []
        self.part_crcs: dict[int, int] = {}
        self.resume: dict[str, Any] | None = None
        """Set by the sink: the record of an upload of this key that an interrupted copy of this
        node left (:func:`~.s3_staging._resume_records`), resumed if it fits this file."""
        self.stored_parts: dict[int, tuple[int, str, str]] = {}
        """Part number -> (size, ETag, CRC32 or "" if the store lists none) of the parts a resumed
        upload already holds."""
        self.part_md5: Any = None
        """MD5 of the part being filled, for a stored part listed without a CRC32."""
        self.reused = 0
        """Parts of a resumed upload not sent again: the store holds them, checked against the
        CRC32 of the bytes this copy hashed."""
        self.pending: deque[tuple[int, int, Future[Any], bytearray | None]] = deque()
        self.trusted = True
        """False when the store echoed no checksum: then the object is read back before commit."""
        self.on_upload: Callable[[str], None] | None = None
        """Told the id of the multipart upload this writer creates (the sink records it in its
        staging marker, so no reaper takes the upload for an abandoned one while the copy lives)."""
        self.etag: str | None = None
        """ETag of the object this writer stored (HEAD right after the upload): what an abort may
        delete — never an object someone else wrote at the same key since."""
        self.defer_check = False
        """Set by a sink that checks its one-PUT objects' presence and size itself, all at once
        before its commit (:meth:`_S3Sink.commit`): then a one-PUT object's ETag is the PUT's
        answer and its HEAD is left to that check."""
        self.unchecked = False
        """The object was stored with its presence and size not checked yet (``defer_check``)."""
        self.in_background = False
        """Set by a sink that lets a one-PUT object go on while the next file is read
        (:meth:`_S3Sink.open_file`): :meth:`finish` then only sends the PUT, and :meth:`settle`
        waits for its answer. Needs ``defer_check``; the body is held in its own buffer (at most
        the part size) while the request is in flight."""
        self.put: tuple[Future[Any], str] | None = None
        """The one-PUT request in flight and the CRC32 it carries, until :meth:`settle`."""
        self.content = hashing.new_hasher()
        """The content hash of every byte written (and so sent): what a finished object's record
        names (:meth:`done_record`), and what a read-back is checked against."""
        self.done: dict[str, Any] | None = None
        """Set by the sink: the record of this very object, finished by an interrupted copy of
        this node and found in the store as recorded (:func:`~.s3_staging._done_records`). The
        bytes are then read and hashed as always but not sent; :meth:`finish` keeps the object if
        they are the bytes it holds, else fails the copy."""
        self.kept = False
        """The object was not sent: the store held it (:attr:`done`), checked byte for byte."""

    def write(self, data: bytes | memoryview, /) -> None:
        view = memoryview(data)
        if self.resume is not None and not self.single:
            self._prepare_resume()  # before the first part's bytes: a part checked by MD5 needs them
        self.content.update(view)
        while view:
            n = min(len(view), self.capacity - self.filled)
            if n == 0:  # only a single-PUT object can fill its one part before finish()
                raise VerificationError(f"{self.where}: more than the {self.entry.size} bytes expected")
            take = view[:n]
            if self.done is not None:
                pass  # the store holds this object already: its bytes are only checked
            else:
                if self.buf is None:
                    # a one-PUT object's buffer is its own (sizes vary: a pool would keep them all)
                    self.buf = bytearray(self.capacity) if self.single else self.pool.get(self.capacity)
                self.buf[self.filled : self.filled + n] = take
            self.crc = hashing.crc32(take, self.crc)
            if self.stored_parts:
                self._md5_for_reuse(take)
            self.filled += n
            view = view[n:]
            if self.filled == self.capacity and not self.single:
                if self.done is not None:
                    self._check_part()
                else:
                    self._send_part()

    def _take_part(self) -> tuple[_PartStream, int, bytearray]:
        """The body of the part filled so far, its CRC32 and its buffer."""
        buf = self.buf if self.buf is not None else bytearray(0)
        taken = (_PartStream(buf, self.filled), self.crc, buf)
        self.offset += self.filled
        self.buf, self.filled, self.crc = None, 0, 0
        return taken

    def resume_record(self) -> dict[str, Any] | None:
        """What a later copy needs to resume this object's multipart upload after a kill: the
        upload, and the file it uploads (size, content hash, part size). None when nothing could be
        checked against it (no content hash) or there is no upload."""
        if self.upload_id is None or not self.entry.hash:
            return None
        return {
            "upload": self.upload_id,
            "key": self.key,
            "size": self.entry.size,
            "hash": self.entry.hash,
            "part_size": self.part_size,
        }

    def _prepare_resume(self) -> None:
        """Resume the interrupted upload the sink handed over if it is of this very file (its
        parts are then listed in :attr:`stored_parts`), else abort it."""
        tier = self.tier
        record, self.resume = self.resume, None
        if record is None:
            return
        fits = (record["key"], record["size"], record["hash"], record["part_size"]) == (
            self.key,
            self.entry.size,
            self.entry.hash,
            self.part_size,
        )
        if fits and self.entry.hash and self._list_stored_parts(record["upload"]):
            self.upload_id = record["upload"]
            log.info(
                "%s: resuming multipart upload %s: %d parts stored",
                self.where,
                record["upload"],
                len(self.stored_parts),
            )
            return
        log.info("%s: an interrupted upload is of other content or gone; starting again", self.where)
        with contextlib.suppress(Exception):  # the reaper aborts it if this fails
            tier._call("abort_multipart_upload", Bucket=tier.bucket, Key=self.key, UploadId=record["upload"])

    def _start_upload(self) -> None:
        """Create the multipart upload and tell the sink its id (a resumed one its marker names)."""
        tier = self.tier
        resp = tier._call(
            "create_multipart_upload", Bucket=tier.bucket, Key=self.key, ChecksumAlgorithm="CRC32"
        )
        upload_id = self.upload_id = str(resp["UploadId"])
        if self.on_upload is not None:
            self.on_upload(upload_id)

    def _md5_for_reuse(self, data: memoryview) -> None:
        """Hash the part being filled with MD5 when the store lists it without a CRC32: its ETag
        (the MD5 of the part, for uploads without SSE-KMS/SSE-C) is then what it is checked by."""
        stored = self.stored_parts.get(self.next_part)
        if stored is None or stored[2]:
            return
        if self.part_md5 is None:
            import hashlib

            self.part_md5 = hashlib.md5(usedforsecurity=False)
        self.part_md5.update(data)

    def _list_stored_parts(self, upload_id: str) -> bool:
        """ListParts (every page) of an upload to resume into :attr:`stored_parts`; False if it is
        gone (completed or aborted since) or cannot be listed: then it is not resumed."""
        tier = self.tier
        kw: dict[str, Any] = {"Bucket": tier.bucket, "Key": self.key, "UploadId": upload_id}
        stored: dict[int, tuple[int, str, str]] = {}
        try:
            while True:
                resp = tier._call("list_parts", **kw)
                for part in resp.get("Parts", []):
                    number, size, etag = part.get("PartNumber"), part.get("Size"), part.get("ETag")
                    crc = part.get("ChecksumCRC32")
                    if type(number) is int and type(size) is int and isinstance(etag, str):
                        stored[number] = (size, etag, crc if isinstance(crc, str) else "")
                if not resp.get("IsTruncated"):
                    break
                kw["PartNumberMarker"] = resp["NextPartNumberMarker"]
        except Exception as exc:
            log.info("%s: cannot list the parts of upload %s: %s", self.where, upload_id, _describe(exc))
            return False
        self.stored_parts = stored
        return True

    def _reuse_part(self) -> bool:
        """Take the part filled so far from a resumed upload if the store holds it: same size, and
        the store's CRC32 of what it received equals the CRC32 of the bytes this copy read and
        hashed (the upload's record already tied it to this file's size and content hash)."""
        number = self.next_part
        stored = self.stored_parts.get(number)
        crc = _crc32_b64(self.crc)
        md5, self.part_md5 = self.part_md5, None
        if stored is None or stored[0] != self.filled:
            return False
        if stored[2] != crc and (stored[2] or md5 is None or stored[1].strip('"') != md5.hexdigest()):
            return False
        if self.buf is not None:
            self.pool.put(self.buf)
        self.part_crcs[number] = self.crc
        self.parts.append({"PartNumber": number, "ETag": stored[1], "ChecksumCRC32": crc})
        self.offset += self.filled
        self.buf, self.filled, self.crc = None, 0, 0
        self.next_part += 1
        self.reused += 1
        return True

    def _send_part(self) -> None:
        import asyncio

        tier = self.tier
        if self.upload_id is None:
            self._start_upload()
        assert self.upload_id is not None
        if self.stored_parts and self._reuse_part():
            return
        self._drain(tier.max_inflight - 1)
        body, crc, buf = self._take_part()
        number = self.next_part
        self.next_part += 1
        coro = self._upload_part(self.upload_id, number, body, _crc32_b64(crc))
        self.pending.append((number, crc, asyncio.run_coroutine_threadsafe(coro, tier.fs.loop), buf))

    async def _upload_part(self, upload_id: str, number: int, body: io.BytesIO, crc: str) -> Any:
        return await self._send("upload_part", body, crc, UploadId=upload_id, PartNumber=number)

    async def _send(self, method: str, body: io.BytesIO, crc: str, **kwargs: Any) -> Any:
        """One body-carrying request (UploadPart, or the PutObject of a one-part object) with
        s3fs's retry policy, rewinding the stream before every attempt: s3fs's own retry loop
        would resend a half-consumed one (botocore's retries rewind it too). The request gets the same
        extra arguments s3fs adds to its own calls (``s3_additional_kwargs``, requester pays)."""
        import asyncio

        from s3fs.core import S3_RETRYABLE_ERRORS

        fs = self.tier.fs
        await fs.set_session()
        client = await fs.get_s3(self.tier.bucket)
        call = getattr(client, method)
        request = fs._get_s3_method_kwargs(
            call,
            Bucket=self.tier.bucket,
            Key=self.key,
            Body=body,
            ChecksumAlgorithm="CRC32",
            ChecksumCRC32=crc,
            **kwargs,
        )
        # A connection reset or refused on every botocore attempt surfaces as botocore's
        # ConnectionError (EndpointConnectionError), which s3fs does not count as retryable; for a
        # PUT of a whole object or part, resending it is as safe as after any other transient error.
        from botocore.exceptions import ConnectionError as BotocoreConnectionError

        retryable = (*S3_RETRYABLE_ERRORS, BotocoreConnectionError)
        attempt = 0
        while True:
            body.seek(0)
            try:
                return await call(**request)
            except Exception as exc:
                attempt += 1
                if not isinstance(exc, retryable) or attempt >= fs.retries:
                    raise
                log.warning(
                    "%s: %s failed after botocore's retries (%s); resending it whole, attempt %d of %d",
                    self.where,
                    method,
                    self.tier._redact(_describe(exc)),
                    attempt + 1,
                    fs.retries,
                )
                await asyncio.sleep(min(0.1 * 1.7**attempt, 15.0))

    def _drain(self, keep: int) -> None:
        while len(self.pending) > keep:
            number, crc, fut, buf = self.pending.popleft()
            resp = fut.result()
            if buf is not None:
                self.pool.put(buf)  # the request is over: nothing reads the buffer any more
            self._check_echo(resp, _crc32_b64(crc), f"part {number}")
            self.parts.append({"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32": _crc32_b64(crc)})
            self.part_crcs[number] = crc

    def _check_echo(self, resp: Mapping[str, Any], expected: str, what: str) -> None:
        echoed = resp.get("ChecksumCRC32")
        if echoed is None:
            self.trusted = False
        elif echoed != expected:
            raise VerificationError(f"{self.where}: {what}: store reports CRC32 {echoed}, sent {expected}")

    @property
    def backgrounded(self) -> bool:
        """This object's PUT is sent by :meth:`finish` and answered at :meth:`settle` (from a
        buffer of its own: at most ``put_concurrency`` one-PUT objects are held, none above the
        part size)."""
        return self.in_background and self.defer_check and self.single

    def finish(self) -> None:
        tier = self.tier
        if self.done is not None:
            self._keep_done()
            return
        if self.upload_id is None:
            import asyncio

            body, crc, _ = self._take_part()  # a one-PUT buffer is never pooled: it is dropped
            expected = _crc32_b64(crc)
            future = asyncio.run_coroutine_threadsafe(self._send("put_object", body, expected), tier.fs.loop)
            if self.backgrounded:
                self.put = (future, expected)
                return
            resp = future.result()
            if self._stored_unchecked(resp, expected):
                return
        else:
            if self.filled:
                self._send_part()
            self._drain(0)
            self.parts.sort(key=lambda p: int(p["PartNumber"]))  # resumed parts came in unsent
            expected = self._composite_crc()
            try:
                tier._call(
                    "complete_multipart_upload",
                    Bucket=tier.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": self.parts},
                )
            except Exception:
                # A retry after a lost response meets NoSuchUpload although the first call
                # landed: the object with our exact size and checksum settles the question.
                head = tier._head(self.key, checksum=True)
                if head is None or not _same_checksum(str(head.get("ChecksumCRC32")), expected):
                    raise
            self.upload_id = None
        self._check_stored(expected)

    def _composite_crc(self) -> str:
        """The multipart object's CRC32 as S3 reports it: the CRC32 of its parts' CRC32s, ``-N``."""
        combined = b"".join(self.part_crcs[n].to_bytes(4, "big") for n in sorted(self.part_crcs))
        return f"{_crc32_b64(hashing.crc32(combined))}-{len(self.part_crcs)}"

    def _check_part(self) -> None:
        """A part of an object the store holds already (:attr:`done`): its CRC32, not sent."""
        self.part_crcs[self.next_part] = self.crc
        self.next_part += 1
        self.offset += self.filled
        self.filled, self.crc = 0, 0

    def _keep_done(self) -> None:
        """Keep the object an interrupted copy finished, if the bytes just read are the ones it
        holds: the content hash and size its record names, the composite CRC32 of these bytes
        cut at its part size equal to the one it recorded and to the store's (HEAD), and still
        its ETag. Anything else fails the copy: the file is not what was uploaded."""
        record, self.done = self.done, None
        assert record is not None
        if self.filled:
            self._check_part()
        expected = self._composite_crc()
        if (self.content.hexdigest(), expected) != (record["digest"], record["crc"]):
            raise VerificationError(
                f"{self.where}: not the bytes an interrupted copy uploaded (changed since cataloged)"
            )
        self._check_stored(expected)
        if self.trusted is False or self.etag != record["etag"]:
            raise VerificationError(f"{self.where}: the object an interrupted copy uploaded was replaced")
        self.kept = True
        log.info("%s: kept the object an interrupted copy had uploaded (nothing sent)", self.where)

    def done_record(self) -> dict[str, Any] | None:
        """What a later copy needs to keep this finished object after a kill instead of sending
        it again (docs/uploads.md): the file it is of (key, size, the hash the copy was given),
        the hash, ETag and CRC32 of what the store holds, and the part size. Only a multipart
        object the store checked against the CRC32 of the bytes sent (``trusted``); None else."""
        if self.single or not self.trusted or not self.etag or not self.entry.hash or not self.part_crcs:
            return None
        return {
            "key": self.key,
            "size": self.entry.size,
            "hash": self.entry.hash,
            "digest": self.content.hexdigest(),
            "etag": self.etag,
            "crc": self._composite_crc(),
            "part_size": self.part_size,
        }

    def _check_stored(self, expected: str) -> None:
        """HEAD the stored object: there, at the entry's size, with the CRC32 of the bytes sent."""
        head = self.tier._head(self.key, checksum=True)
        if head is None:
            raise VerificationError(f"{self.where}: object missing right after upload")
        self.etag = str(head.get("ETag") or "") or None
        size = int(head["ContentLength"])
        if size != self.entry.size:
            raise VerificationError(f"{self.where}: store holds {size} bytes, expected {self.entry.size}")
        stored = head.get("ChecksumCRC32")
        if stored is None:
            self.trusted = False
        elif not _same_checksum(stored, expected):
            raise VerificationError(f"{self.where}: stored CRC32 {stored} != {expected} of the bytes sent")

    def _stored_unchecked(self, resp: Mapping[str, Any], expected: str) -> bool:
        """Check a one-PUT answer; True if the object counts as stored, its presence and size left
        to the sink's listing (``defer_check``)."""
        self._check_echo(resp, expected, "put")
        if self.defer_check and resp.get("ETag"):
            # The store checked the body against its CRC32 (and echoed it: _check_echo); that
            # it holds the object, at this size, is checked with its siblings' before commit.
            self.etag = str(resp["ETag"])
            self.unchecked = True
            return True
        return False

    def settle(self) -> None:
        """Wait for the answer to a PUT :meth:`finish` left in flight, and check it as finish would."""
        if self.put is None:
            return
        future, expected = self.put
        self.put = None
        if not self._stored_unchecked(future.result(), expected):
            self._check_stored(expected)  # an answer without an ETag: ask the store

    def abort(self) -> None:
        """Stop this object's requests. A PUT still in flight is let finish (one request, bounded
        by the client's timeouts; cancelled only after 60 s): with its answer, :attr:`etag` says
        what it stored, and the sink deletes it if still ours. Cancelled, or failed, whether it
        landed is unknown (``etag`` None) and the sink asks the store."""
        import concurrent.futures

        if self.put is not None:
            future, _ = self.put
            self.put = None
            if concurrent.futures.wait([future], timeout=60).not_done:
                future.cancel()
            if future.done() and not future.cancelled() and future.exception() is None:
                etag = future.result().get("ETag")
                self.etag = str(etag) if etag else None
        for _, _, fut, _ in self.pending:
            fut.cancel()
        concurrent.futures.wait([f for _, _, f, _ in self.pending], timeout=60)
        self.pending.clear()  # their buffers are dropped, not reused: a cancelled send may hold them
        self.buf, self.filled = None, 0
        if self.upload_id is not None:
            try:
                self.tier._call(
                    "abort_multipart_upload", Bucket=self.tier.bucket, Key=self.key, UploadId=self.upload_id
                )
            except Exception as exc:
                log.warning(
                    "%s: could not abort multipart upload (the reaper will): %s",
                    self.where,
                    self.tier._redact(_describe(exc)),
                )
            self.upload_id = None


def _same_checksum(stored: str, expected: str) -> bool:
    """Compare a HEAD checksum with ours; the ``-N`` part count suffix is optional (moto omits it)."""
    value, _, parts = stored.partition("-")
    want_value, _, want_parts = expected.partition("-")
    return value == want_value and (not parts or parts == want_parts)
