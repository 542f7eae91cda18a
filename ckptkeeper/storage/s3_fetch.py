"""Restoring from S3 at the speed of the network: every object of a checkpoint fetched on the
client's event loop, large ones as parallel ranged GETs, each byte written once at its offset in
the destination file (``os.pwrite``) and hashed as it arrives.

The manifest's hash (xxh3-128) cannot be combined from pieces, so it is computed in file order: the
range at the *hash frontier* of a file is hashed straight from the network; a later range that
arrives first keeps its bytes (the ones already written to the file) until the frontier reaches
it. A file never has more than :data:`WINDOW` ranges fetched ahead of its frontier, so what is held
is bounded (``WINDOW x RANGE_SIZE`` per file being fetched). Nothing is read back from disk.

Each file is checked against its manifest entry (size, then hash) before it is finished; ranges of
one object must all carry the same ETag (an object replaced mid-restore is never stitched
together). A range whose stream breaks is resumed from its last byte (``Range`` + ``If-Match``), a
bounded number of times. The first failure stops every other transfer before the caller's abort
removes the staging directory, so no half-restored checkpoint is ever renamed into place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ckptkeeper.core.model import FileEntry, Manifest
from ckptkeeper.storage import deadline, s3_urls
from ckptkeeper.storage.base import (
    Progress,
    StorageError,
    TierUnavailable,
    VerificationError,
    _describe,
)
from ckptkeeper.util import hashing

if TYPE_CHECKING:
    import asyncio  # imported where used: a restore by plain GETs (s3_get) runs no event loop

    from s3fs import S3FileSystem

    from ckptkeeper.core.model import TierSpec
    from ckptkeeper.storage.localfs import _LocalFileWriter, _LocalSink


class S3TierStorage(Protocol):
    """What a ranged restore uses of the S3 backend (:class:`~ckptkeeper.storage.s3.S3TierStorage`)."""

    name: str
    bucket: str
    spec: TierSpec

    @property
    def fs(self) -> S3FileSystem: ...
    def _redact(self, text: str) -> str: ...
    def _key(self, rel: str) -> str: ...


RANGE_SIZE = 8 * 2**20
"""Bytes per ranged GET of a large object (boto3's default chunk as well): large enough that a
request's fixed cost (~1 ms of botocore) is small per byte, small enough that a 32 MiB object is
already fetched over four connections."""
WINDOW = 4
"""Ranges of one file fetched ahead of its hash frontier at most (bounds the bytes held)."""
CONCURRENCY = 10
"""GETs in flight at once for one restore: aiobotocore's connection pool (10) kept busy."""
READ_SIZE = 1 * 2**20
"""Most bytes taken from a response body at a time."""
RETRIES = 5
"""Resumptions of one range whose stream broke (the request itself is retried by s3fs)."""


@dataclass(eq=False)
class _Range:
    start: int
    end: int  # exclusive
    held: list[bytes] = field(default_factory=list)
    """Bytes received while this range was ahead of the frontier, in order (already written)."""
    done: bool = False


def _event() -> asyncio.Event:
    import asyncio

    return asyncio.Event()


@dataclass(eq=False)
class _File:
    entry: FileEntry
    key: str
    where: str
    writer: _LocalFileWriter
    ranges: list[_Range]
    hasher: hashing.Hasher = field(default_factory=hashing.new_hasher)
    frontier: int = 0
    etag: str | None = None
    moved: asyncio.Event = field(default_factory=_event)
    """Set whenever the frontier advances (a range waiting for the window looks again)."""
    left: int = 0
    """Ranges not yet done."""

    def take(self, r: int, data: bytes) -> None:
        """Bytes of range ``r`` arrived (and are written): hash them now or hold them."""
        if r == self.frontier:
            self.hasher.update(data)
        else:
            self.ranges[r].held.append(data)

    def finished(self, r: int) -> None:
        self.ranges[r].done = True
        self.left -= 1
        while self.frontier < len(self.ranges) and self.ranges[self.frontier].done:
            self.frontier += 1
            if self.frontier < len(self.ranges):
                nxt = self.ranges[self.frontier]
                for chunk in nxt.held:
                    self.hasher.update(chunk)
                nxt.held.clear()
        self.moved.set()
        self.moved = _event()


def fetch_ranged(
    tier: S3TierStorage,
    rel: str,
    manifest: Manifest,
    sink: _LocalSink,
    progress: Progress | None,
) -> None:
    """Write and verify every file of ``manifest`` from ``tier`` into ``sink`` (not committed).

    Returns when all files are written, each checked against the manifest; raises the first
    failure once every transfer has stopped (the caller's abort never races a write).

    Plain GETs on worker threads (:mod:`.s3_get`: about half the CPU per byte) unless a proxy
    stands between this host and the store, which only the S3 client's own HTTP stack speaks to."""
    from ckptkeeper.storage import s3_get

    if s3_urls.usable(tier):
        s3_get.fetch_direct(tier, rel, manifest, sink, progress)
        return
    import asyncio

    loop = tier.fs.loop  # the s3fs client's event loop, run by fsspec's IO thread
    failed: list[BaseException] = []
    future: concurrent.futures.Future[None] = asyncio.run_coroutine_threadsafe(
        _fetch_all(tier, rel, manifest, sink, progress, failed), loop
    )
    try:
        future.result()
    except BaseException as exc:
        if not future.done():  # Ctrl-C while waiting: every transfer stops at its next chunk
            failed.append(exc)
            with contextlib.suppress(BaseException):
                future.result()  # nothing may still write when the caller removes the staging
        raise


async def _fetch_all(
    tier: S3TierStorage,
    rel: str,
    manifest: Manifest,
    sink: _LocalSink,
    progress: Progress | None,
    failed: list[BaseException],
) -> None:
    import asyncio

    files: list[_File] = []
    try:
        for entry in sorted(manifest.files, key=lambda e: (-e.size, e.path)):
            key = tier._key(f"{rel}/{entry.path}" if entry.path else rel)
            where = f"{tier.name}:{rel}/{entry.path}" if entry.path else f"{tier.name}:{rel}"
            writer: Any = sink.open_file(entry)
            spans = [(s, min(s + RANGE_SIZE, entry.size)) for s in range(0, entry.size, RANGE_SIZE)]
            ranges = [_Range(s, e) for s, e in spans] or [_Range(0, 0)]
            files.append(_File(entry, key, where, writer, ranges, left=len(ranges)))
        work = [(f, r) for f in files for r in range(len(f.ranges))]
        queue = iter(work)

        async def worker() -> None:
            for f, r in queue:
                if failed:
                    return
                try:
                    while r >= f.frontier + WINDOW and not failed:
                        await f.moved.wait()
                    await _get_range(tier, f, r, progress, failed)
                    f.finished(r)
                    if not f.left:  # off the loop: finishing may fsync older files
                        await asyncio.to_thread(_check, f)
                except BaseException as exc:  # the first one is raised below
                    failed.append(exc)
                    for g in files:  # wake every waiter so it sees the failure
                        g.moved.set()
                    return

        await asyncio.gather(*(worker() for _ in range(min(CONCURRENCY, len(work)))))
        if failed:
            raise failed[0]
    finally:
        for f in files:
            if f.writer.fd is not None:
                f.writer.close()


def _check(f: _File) -> None:
    """The whole file is written: size and hash against the manifest, then finished (size again)."""
    digest = f.hasher.hexdigest()
    if digest != f.entry.hash:
        raise VerificationError(
            f"{f.where}: hash {digest} != {f.entry.hash} in manifest (changed since cataloged)"
        )
    f.writer.written = f.entry.size
    f.writer.finish()


async def _get_range(
    tier: S3TierStorage, f: _File, r: int, progress: Progress | None, failed: list[BaseException]
) -> None:
    """GET range ``r`` of ``f`` into the file at its offset, resuming a broken stream."""
    import asyncio

    rng = f.ranges[r]
    pos = rng.start
    attempt = 0
    whole = len(f.ranges) == 1
    fd = f.writer.fd
    assert fd is not None
    while True:
        kw: dict[str, Any] = {}
        if not whole or pos:
            kw["Range"] = f"bytes={pos}-{rng.end - 1}"
        if f.etag:
            kw["IfMatch"] = f.etag  # every range, and a resumed one, of the same object
        resp = await _call(tier, "get_object", Bucket=tier.bucket, Key=f.key, **kw)
        etag = resp.get("ETag")
        if f.etag is None:
            f.etag = etag
        elif etag and etag != f.etag:
            raise VerificationError(f"{f.where}: the object changed during the restore (ETag)")
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        if not whole and total != str(f.entry.size):
            raise VerificationError(
                f"{f.where}: object holds {total or '?'} bytes, manifest says {f.entry.size} "
                "(changed since cataloged)"
            )
        body = resp["Body"]
        try:
            while pos < rng.end or whole:
                if failed:
                    raise StorageError(f"{f.where}: stopped, another file of the checkpoint failed")
                data = await body.read(READ_SIZE)
                if not data:
                    break
                n = len(data)
                if pos + n > (rng.end if not whole else f.entry.size):
                    raise VerificationError(
                        f"{f.where}: more than the {f.entry.size} bytes of its manifest "
                        "(changed since cataloged)"
                    )
                _pwrite_all(fd, data, pos)
                pos += n
                f.take(r, data)
                if progress is not None:
                    progress(n)
        except (StorageError, asyncio.CancelledError):
            raise
        except Exception as exc:
            attempt += 1
            s3_urls.resume_or_fail(tier, f.where, f.key, pos, exc, attempt, RETRIES)
            await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
            continue
        finally:
            body.close()
        end = f.entry.size if whole else rng.end
        if pos != end:
            raise VerificationError(
                f"{f.where}: {pos} bytes, manifest says {f.entry.size} (changed since cataloged)"
            )
        return


async def _call(tier: S3TierStorage, method: str, **kwargs: Any) -> Any:
    """One request through the s3fs client (its retries for transient errors) within the request
    deadline (:mod:`ckptkeeper.storage.deadline`), errors named."""
    import asyncio

    call: Callable[..., Awaitable[Any]] = tier.fs._call_s3
    what = f"{method} {kwargs.get('Key', '')}"
    try:
        timeout = deadline.remaining(what, tier.name)
    except TimeoutError as exc:
        raise TierUnavailable(tier._redact(str(exc))) from None
    try:
        return await asyncio.wait_for(call(method, **kwargs), timeout)
    except TimeoutError:
        raise TierUnavailable(tier._redact(deadline.hung(tier.name, what, timeout))) from None
    except Exception as exc:
        raise StorageError(
            tier._redact(f"tier {tier.name!r}: {method} {kwargs.get('Key', '')}: {_describe(exc)}")
        ) from exc


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
