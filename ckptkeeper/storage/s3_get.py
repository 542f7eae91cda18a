"""Restoring from S3 with plain HTTP GETs on worker threads, each byte copied once by the kernel
into a reused buffer, hashed there and written at its offset (``os.pwrite``).

Why not the S3 client's event loop (:mod:`.s3_fetch`, still used behind a proxy): every byte
that passes through aiohttp is copied three times in Python (socket read, stream buffer, the
``read()`` that joins it) on one thread that also parses and signs each request; a restore spent
about twice the CPU per byte of s5cmd that way (bench/restore_s3.py). Here each request is signed
by :mod:`.s3_sign` (SigV4, ~15 µs; where the bucket lives and with which credentials as the tier's
S3 client would resolve them, :mod:`.s3_urls`) and ``http.client`` fetches it with ``readinto``
straight into the worker's buffer, every socket read, hash and write made with the GIL released.
The S3 client (s3fs, aiohttp) is never imported for a restore.

Large objects are fetched as ranges (sized per checkpoint, :func:`range_size`) by :data:`WORKERS`
threads; small objects (one range of at most :data:`SMALL_OBJECT` bytes) whole by up to
:data:`SMALL_WORKERS` more, smallest first, so a checkpoint of many small files keeps many requests
in flight (each costs the store a round of lookups, whatever its size). Every response streams through buffers of
:data:`CHUNK` bytes: what a restore holds does not grow with the range size, so ranges can be large
(fewer requests: each costs the store and the client a round trip and its parsing) while memory
stays bounded.

Safety is the same as :mod:`.s3_fetch`: each file is hashed in file order (a chunk that arrives
before its turn waits, in its buffer, for the earlier ones; how many may wait is bounded), checked
against its manifest entry (size, then hash) before it is finished; all ranges of one object carry
the same ETag (``If-Match`` on every range after the first answer); a broken stream resumes from
its last byte a bounded number of times; the first failure stops every worker (their connections
are shut down, so none waits out a stalled read) before the caller's abort removes the staging
directory.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ckptkeeper.core.model import FileEntry, Manifest
from ckptkeeper.storage import deadline, s3_urls
from ckptkeeper.storage.base import Progress, StorageError, TierUnavailable, VerificationError
from ckptkeeper.storage.s3_urls import S3TierStorage, error_code, region_hint
from ckptkeeper.util import hashing

if TYPE_CHECKING:
    from ckptkeeper.storage.localfs import _LocalFileWriter, _LocalSink
    from ckptkeeper.storage.s3_sign import GetSigner

__all__ = ["S3TierStorage", "fetch_direct", "keep_buffers", "kept_buffer_bytes", "release_idle_buffers"]

RANGE_SIZE = 8 * 2**20
"""The fewest bytes per ranged GET of a large object (:func:`range_size` picks the size)."""
LARGEST_RANGE = 64 * 2**20
"""The most bytes per ranged GET."""
CHUNK = 2 * 2**20
"""Bytes per buffer: each is received, written and hashed whole (then reused)."""
WORKERS = 8
"""GETs of large objects' ranges in flight at once (threads, each with its own connection)."""
SMALL_OBJECT = 2 * 2**20
"""Objects of at most this many bytes may also go to the small-object workers."""
SMALL_WORKERS = 24
"""More GETs in flight, each of one whole small object (taken smallest first): a small object's
request costs the store a round of lookups that more connections hide."""
AHEAD = 40
"""Chunks received before their turn to be hashed that may wait, at most (a worker whose next
chunk would be one more waits for its turn first). With one buffer per worker this bounds what a
restore holds: ``(WORKERS + SMALL_WORKERS + AHEAD) x CHUNK`` at worst."""
RETRIES = 5
"""Resumptions of one range whose stream broke or whose request failed transiently."""


@dataclass(eq=False)
class _File:
    entry: FileEntry
    key: str
    where: str
    range_size: int
    ranges: int
    url: str = ""
    writer: _LocalFileWriter | None = None
    """Opened when its first range is handed out (a checkpoint of thousands of files never holds
    a descriptor for each at once)."""
    hasher: hashing.Hasher = field(default_factory=hashing.new_hasher)
    handed: int = 0
    """Ranges given to a worker so far (they are handed out in order)."""
    hashed: int = 0
    """Bytes hashed so far: the frontier, always the start of a chunk not yet received."""
    held: dict[int, tuple[bytearray, int]] = field(default_factory=dict)
    """Chunks received before their turn, by offset: their buffer and length (written already)."""
    etag: str | None = None
    hashing: bool = False
    """A worker is hashing this file's frontier (received chunks that follow are held)."""

    def span(self, r: int) -> tuple[int, int]:
        start = r * self.range_size
        return start, min(start + self.range_size, self.entry.size)

    def ahead_of_frontier(self) -> int:
        """How far the next range to hand out starts past the frontier (0: nothing in flight)."""
        return self.handed * self.range_size - self.hashed


def range_size(sizes: list[int]) -> int:
    """Bytes per ranged GET for a checkpoint of files of ``sizes``: as large as lets every worker
    stream without waiting for room ahead. Each file in flight has one range at its frontier, which
    holds nothing; the other workers' ranges run ahead of their files' frontiers, and together they
    should fit the :data:`AHEAD` chunks. Larger ranges mean fewer requests (a served restore of
    4 x 128 MiB: ~10 % less wall and CPU at 64 MiB than at 8 MiB, bench/restore_s3.py); but a store
    that serves each connection at a bounded rate (S3: about 100 MB/s) is only fast with every
    connection streaming, which ranges too large for the room ahead would stop."""
    in_flight = min(WORKERS, sum(1 for size in sizes if size > RANGE_SIZE))
    ahead = WORKERS - in_flight
    if ahead == 0:
        return max(RANGE_SIZE, LARGEST_RANGE)
    fits = AHEAD * CHUNK // ahead // CHUNK * CHUNK
    return max(RANGE_SIZE, min(LARGEST_RANGE, fits))


class _Plan:
    """Which range a worker fetches next, which chunks wait to be hashed, and the first failure.

    Progress is guaranteed: the chunk at a file's frontier is always the next one its range's
    worker receives (a chunk is hashed at once, or held, the moment it arrives), and that worker
    never waits for room (:meth:`reserve`); hashing it frees the held chunks that follow."""

    def __init__(self, files: list[_File], sink: _LocalSink, signer: GetSigner | None) -> None:
        self.files = files
        self.sink = sink
        self.first = 0
        """Files before this one have every range handed out."""
        self.last = len(files)
        """Files from this one on have every range handed out (taken by the small-object workers)."""
        self.signer = signer
        """Signs each request (None: every URL is presigned)."""
        self.cond = threading.Condition()
        self.ahead = 0
        """Chunks received (or being received) before their turn: held, or reserved."""
        self.failed: list[BaseException] = []
        self.spare: list[bytearray] = []
        self.conns: set[http.client.HTTPConnection] = set()
        self.gate = threading.Event()
        """Set once every worker is started (or none more can be): workers begin then."""

    def take(self) -> tuple[_File, int] | None:
        """The next range to fetch, None when none is left. A range that starts at its file's
        frontier first (it streams straight through, holding nothing), else, while there is
        room ahead, the range nearest its file's frontier."""
        with self.cond:
            while not self.failed:
                files = self.files
                while self.first < len(files) and files[self.first].handed >= files[self.first].ranges:
                    self.first += 1
                if self.first == len(files):
                    return None
                nearest: _File | None = None
                for i in range(self.first, self.last):
                    f = files[i]
                    if f.handed >= f.ranges:
                        continue
                    if f.ahead_of_frontier() == 0:
                        nearest = f
                        break
                    if self.ahead < AHEAD and (
                        nearest is None or f.ahead_of_frontier() < nearest.ahead_of_frontier()
                    ):
                        nearest = f
                if nearest is not None:
                    return self._hand(nearest)
                self.cond.wait()
            return None

    def _hand(self, f: _File) -> tuple[_File, int]:
        if f.writer is None:
            f.writer = self.sink.open_file(f.entry)  # type: ignore[assignment]
        f.handed += 1
        return f, f.handed - 1

    def take_small(self) -> _File | None:
        """The smallest object not handed out yet, if it is a small one (whole: one range)."""
        with self.cond:
            files = self.files
            while self.last > self.first and files[self.last - 1].handed >= files[self.last - 1].ranges:
                self.last -= 1
            if self.failed or self.last <= self.first:
                return None
            f = files[self.last - 1]
            if not _small(f):
                return None
            return self._hand(f)[0]

    def reserve(self, f: _File, pos: int) -> bool:
        """Before receiving the chunk at ``pos``: whether it takes a place ahead (True), waiting
        for one if none is free. The chunk at the frontier never waits and takes none."""
        with self.cond:
            while True:
                if self.failed:
                    raise StorageError(f"{f.where}: stopped, another file of the checkpoint failed")
                if pos == f.hashed:
                    return False
                if self.ahead < AHEAD:
                    self.ahead += 1
                    return True
                self.cond.wait()

    def received(self, f: _File, pos: int, n: int, buf: bytearray, reserved: bool) -> tuple[bytearray, bool]:
        """The chunk ``[pos, pos + n)`` of ``f`` is in ``buf`` (and written): hash it now, or hold
        it until its turn. Returns the buffer the worker goes on with and whether the whole file is
        hashed (for exactly one caller per file).

        Hashing (the GIL released) happens outside the lock, by one worker at a time per file: the
        one whose chunk is at the frontier, which then hashes the held chunks that follow it."""
        with self.cond:
            if pos != f.hashed or f.hashing:
                f.held[pos] = (buf, n)
                if not reserved:
                    self.ahead += 1
                return (self.spare.pop() if self.spare else _buffer()), False
            f.hashing = True
            if reserved:
                self.ahead -= 1
        mine, chunk, size = buf, buf, n
        while True:
            f.hasher.update(memoryview(chunk)[:size])
            with self.cond:
                if chunk is not mine:
                    self.spare.append(chunk)
                    self.ahead -= 1
                pos = f.hashed = pos + size
                following = f.held.pop(pos, None)
                if following is None:
                    f.hashing = False
                    self.cond.notify_all()
                    return mine, f.hashed >= f.entry.size
                chunk, size = following

    def fail(self, exc: BaseException) -> None:
        """Stop every worker: no new range is given, and reads in progress end now."""
        with self.cond:
            self.failed.append(exc)
            conns = list(self.conns)
            self.cond.notify_all()
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def fetch_direct(
    tier: S3TierStorage, rel: str, manifest: Manifest, sink: _LocalSink, progress: Progress | None
) -> None:
    """Write and verify every file of ``manifest`` from ``tier`` into ``sink`` (not committed).

    Returns when all files are written, each checked against the manifest; raises the first
    failure once every worker has stopped (the caller's abort never races a write)."""
    files: list[_File] = []
    per_range = range_size([e.size for e in manifest.files])
    try:
        for entry in sorted(manifest.files, key=lambda e: (-e.size, e.path)):
            key = tier._key(f"{rel}/{entry.path}" if entry.path else rel)
            where = f"{tier.name}:{rel}/{entry.path}" if entry.path else f"{tier.name}:{rel}"
            files.append(_File(entry, key, where, per_range, max(1, -(-entry.size // per_range))))
        signer, urls = s3_urls.urls(tier, [f.key for f in files])
        for f, url in zip(files, urls, strict=True):
            f.url = url
        plan = _Plan(files, sink, signer)
        report = _locked(progress, plan.cond) if progress is not None else None
        context = s3_urls.tls_context(tier) if files and files[0].url.startswith("https:") else None
        small = sum(1 for f in files if _small(f))
        workers = [
            _Worker(tier, plan, report, context, small=False)
            for _ in range(min(WORKERS, sum(f.ranges for f in files)))
        ] + [
            _Worker(tier, plan, report, context, small=True)
            for _ in range(min(SMALL_WORKERS, max(0, small - WORKERS)))
        ]
        threads = [
            threading.Thread(
                target=w.run, name=f"ckptkeeper-get-{'small-' if w.small else ''}{i}", daemon=True
            )
            for i, w in enumerate(workers)
        ]
        started: list[threading.Thread] = []
        try:
            # Every worker waits at the gate until all are started: a thread's start() waits for
            # it to take the GIL once, and workers already fetching would make each of them wait
            # for its turn (about 5 ms each, 150+ ms for the 32 threads of many small files).
            try:
                for t in threads:
                    t.start()
                    started.append(t)
            finally:
                plan.gate.set()
            for t in started:
                t.join()
        except BaseException as exc:  # Ctrl-C, or no more threads: stop the workers, then the staging goes
            plan.fail(exc)
            for t in started:
                t.join()
            raise
        if plan.failed:
            raise plan.failed[0]
        for spare in plan.spare:
            _give_back(spare)
    finally:
        for f in files:
            if f.writer is not None and f.writer.fd is not None:
                f.writer.close()


def _locked(progress: Progress, lock: threading.Condition) -> Progress:
    def report(n: int) -> None:
        with lock:
            progress(n)

    return report


class _Worker:
    """One thread's fetching: its connection, and the buffer it receives into (held chunks are
    the plan's until hashed; a buffer is given back once, by whoever holds it last)."""

    def __init__(
        self,
        tier: S3TierStorage,
        plan: _Plan,
        progress: Progress | None,
        context: ssl.SSLContext | None,
        *,
        small: bool,
    ) -> None:
        self.tier = tier
        self.plan = plan
        self.progress = progress
        self.context = context
        self.small = small
        """Takes whole small objects, smallest first (else large objects' ranges)."""
        self.buf: bytearray | None = None
        self.conn: http.client.HTTPConnection | None = None

    def run(self) -> None:
        """Fetch ranges until none is left."""
        plan = self.plan
        plan.gate.wait()
        try:
            self.buf = _buffer()
            while (job := _next(plan, self.small)) is not None:
                self._fetch(*job)
        except BaseException as exc:  # the first one is raised by the caller
            plan.fail(exc)
        finally:
            self.drop()
            if self.buf is not None:
                _give_back(self.buf)

    def _fetch(self, f: _File, r: int) -> None:
        """Range ``r`` of ``f``, chunk by chunk: received, written at its offset, then hashed or
        held (:meth:`_Plan.received`)."""
        plan = self.plan
        start, end = f.span(r)
        assert f.writer is not None and f.writer.fd is not None
        fd = f.writer.fd
        stream = _Stream(self, f, start, end)
        pos = start
        while True:
            n = min(CHUNK, end - pos)
            reserved = plan.reserve(f, pos)
            assert self.buf is not None
            view = memoryview(self.buf)[:n]
            stream.fill(view)
            _pwrite_all(fd, view, pos)
            if self.progress is not None and n:
                self.progress(n)
            buf, self.buf = self.buf, None  # the plan's now, until it says which one is ours
            self.buf, whole = plan.received(f, pos, n, buf, reserved)
            if whole:
                _check(f)
            pos += n
            if pos >= end:
                stream.finish()
                return

    def connection(self, url: str, timeout: float) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = s3_urls.connect(url, timeout, self.context)
            with self.plan.cond:
                self.plan.conns.add(self.conn)
        self.conn.timeout = timeout
        if self.conn.sock is not None:
            self.conn.sock.settimeout(timeout)
        return self.conn

    def drop(self) -> None:
        """Close the connection (a broken request's, or at the end): the next request opens one."""
        if self.conn is not None:
            with self.plan.cond:
                self.plan.conns.discard(self.conn)
            self.conn.close()
            self.conn = None


class _Stream:
    """The bytes ``[start, end)`` of one object as they arrive on one GET, resumed from the next
    byte not received when the stream breaks (a bounded number of times per range)."""

    def __init__(self, worker: _Worker, f: _File, start: int, end: int) -> None:
        self.worker = worker
        self.f = f
        self.at = start
        """The next byte to receive."""
        self.end = end
        self.resp: http.client.HTTPResponse | None = None
        self.timeout = 0.0
        """Of the request in flight: its socket's timeout, what a hung one is reported with."""
        self.attempt = 0

    def fill(self, view: memoryview) -> None:
        """Receive the next ``len(view)`` bytes into ``view`` (the request is sent on the first
        call, also for an empty object: its answer is checked all the same)."""
        base = self.at
        target = base + len(view)
        tier, plan, f = self.worker.tier, self.worker.plan, self.f
        what = f"GET {f.key}"
        while True:
            if plan.failed:
                raise StorageError(f"{f.where}: stopped, another file of the checkpoint failed")
            try:
                if self.resp is None:
                    try:
                        self.timeout = deadline.remaining(what, tier.name)
                    except TimeoutError as exc:
                        raise TierUnavailable(tier._redact(str(exc))) from None
                    conn = self.worker.connection(f.url, self.timeout)
                    self.resp = _request(tier, conn, plan.signer, f, self.at, self.end)
                if self.at >= target:
                    return
                n = self.resp.readinto(view[self.at - base :])
                if not n:
                    raise _Broken(f"connection closed at byte {self.at} of {self.end}")
                self.at += n
            except (StorageError, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._broken(exc)

    def finish(self) -> None:
        """Every byte is received: the answer is read to its end, so its connection can carry the
        next request (an empty object's answer has no body to read otherwise)."""
        if self.resp is not None and not self.resp.isclosed():
            self.resp.read()
        self.resp = None

    def _broken(self, exc: BaseException) -> None:
        """A request failed or its stream broke: retried after a pause (a failure elsewhere or
        Ctrl-C ends it at once), or the restore fails naming the object and the byte."""
        tier, plan, f = self.worker.tier, self.worker.plan, self.f
        self.resp = None
        self.worker.drop()
        if plan.failed:
            raise StorageError(f"{f.where}: stopped, another file of the checkpoint failed") from None
        if isinstance(exc, TimeoutError | socket.timeout):
            raise TierUnavailable(
                tier._redact(deadline.hung(tier.name, f"GET {f.key}", self.timeout))
            ) from None
        if not isinstance(exc, _Broken | OSError | http.client.HTTPException):
            raise exc
        self.attempt += 1
        s3_urls.resume_or_fail(tier, f.where, f.key, self.at, exc, self.attempt, RETRIES)
        with plan.cond:
            plan.cond.wait_for(lambda: bool(plan.failed), timeout=min(0.2 * 2**self.attempt, 5.0))
        if isinstance(exc, _Broken) and exc.args and exc.args[0] == "resign" and plan.signer is None:
            f.url = s3_urls.presign(tier, [f.key])[0]  # expired (a signer signs every request afresh)


class _Buffers:
    """Chunk buffers a long-lived process (the daemon, :func:`keep_buffers`) keeps between
    restores. A fresh buffer costs its pages' first touch (~20 ms of CPU per 64 MiB here), paid
    again by every restore; kept, the next restore writes into pages already mapped. What a
    buffer still holds of an earlier restore is never read: each chunk is received whole before it
    is written or hashed, and each file is checked against its manifest. Bounded by what one
    restore holds at most, and given back to the OS once idle (:func:`release_idle_buffers`)."""

    def __init__(self) -> None:
        self.keeping = False
        self.free: list[bytearray] = []
        self.last_used = 0.0
        self.lock = threading.Lock()

    def take(self) -> bytearray:
        with self.lock:
            if self.free:
                buf = self.free.pop()
                if len(buf) == CHUNK:
                    return buf
        return bytearray(CHUNK)

    def give_back(self, buf: bytearray) -> None:
        if not self.keeping:
            return
        with self.lock:
            if len(self.free) < WORKERS + SMALL_WORKERS + AHEAD:
                self.free.append(buf)
            self.last_used = time.monotonic()


_BUFFERS = _Buffers()
_buffer = _BUFFERS.take
_give_back = _BUFFERS.give_back


def keep_buffers() -> None:
    """This process serves restore after restore (the daemon): keep chunk buffers between them."""
    _BUFFERS.keeping = True


def release_idle_buffers(idle_seconds: float) -> int:
    """Give back the kept buffers when no restore used them for ``idle_seconds``; the bytes
    released (a daemon idles at its start-up size between restores)."""
    with _BUFFERS.lock:
        if time.monotonic() - _BUFFERS.last_used < idle_seconds:
            return 0
        released = sum(len(b) for b in _BUFFERS.free)
        _BUFFERS.free.clear()
    return released


def kept_buffer_bytes() -> int:
    """Bytes of chunk buffers kept for the next restore."""
    with _BUFFERS.lock:
        return sum(len(b) for b in _BUFFERS.free)


def _small(f: _File) -> bool:
    return f.ranges == 1 and f.entry.size <= SMALL_OBJECT


def _next(plan: _Plan, small: bool) -> tuple[_File, int] | None:
    if not small:
        return plan.take()
    f = plan.take_small()
    return None if f is None else (f, 0)


def _check(f: _File) -> None:
    """The whole file is written and hashed: the hash against the manifest, then finished (size)."""
    digest = f.hasher.hexdigest()
    if digest != f.entry.hash:
        raise VerificationError(
            f"{f.where}: hash {digest} != {f.entry.hash} in manifest (changed since cataloged)"
        )
    assert f.writer is not None
    f.writer.written = f.entry.size
    f.writer.finish()


class _Broken(Exception):
    """A transient failure of one request: the range is resumed from where it got to."""


def _request(
    tier: S3TierStorage,
    conn: http.client.HTTPConnection,
    signer: GetSigner | None,
    f: _File,
    pos: int,
    end: int,
) -> http.client.HTTPResponse:
    """Send one GET of ``[pos, end)`` of ``f``; its answer, checked (status, ETag, lengths), with
    the body still to be read."""
    whole = f.ranges == 1 and pos == 0
    parts = urlsplit(f.url)
    path = f"{parts.path}?{parts.query}" if parts.query else parts.path
    headers = signer.headers(path) if signer is not None else {}
    if not whole:
        headers["Range"] = f"bytes={pos}-{end - 1}"
    if f.etag:
        headers["If-Match"] = f.etag  # every range, and a resumed one, of the same object
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    if resp.status not in (200, 206):
        body = resp.read(4096)
        region = resp.getheader("x-amz-bucket-region")
        _fail_status(tier, f, resp.status, body, presigned=signer is None, region=region)
    etag = resp.getheader("ETag")
    if f.etag is None:
        f.etag = etag
    elif etag and etag != f.etag:
        raise VerificationError(f"{f.where}: the object changed during the restore (ETag)")
    if not whole:
        total = (resp.getheader("Content-Range") or "").rpartition("/")[2]
        if total != str(f.entry.size):
            raise VerificationError(
                f"{f.where}: object holds {total or '?'} bytes, manifest says {f.entry.size} "
                "(changed since cataloged)"
            )
    length = resp.getheader("Content-Length")
    if length is not None and int(length) != end - pos:
        raise VerificationError(
            f"{f.where}: object holds {length} bytes, manifest says {f.entry.size} (changed since cataloged)"
        )
    return resp


def _fail_status(
    tier: S3TierStorage, f: _File, status: int, body: bytes, *, presigned: bool, region: str | None
) -> None:
    """The error a store's answer means: transient ones (5xx, 429; a presigned URL refused, which
    may have expired) are retried, the others end the restore naming the object and the code."""
    code = error_code(body, status)
    if status == 412:
        raise VerificationError(f"{f.where}: the object changed during the restore (ETag)")
    if status in (301, 307) and region:
        raise StorageError(tier._redact(f"tier {tier.name!r}: GET {f.key}: {code}{region_hint(region)}"))
    if status in (404, 416):
        raise StorageError(tier._redact(f"tier {tier.name!r}: GET {f.key}: {code} (HTTP {status})"))
    if status >= 500 or status == 429:
        raise _Broken(f"{code} (HTTP {status})")
    if status == 403 and presigned:
        raise _Broken("resign")
    raise StorageError(tier._redact(f"tier {tier.name!r}: GET {f.key}: {code} (HTTP {status})"))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n
