"""Compression around a backend's writers and readers (docs/compression.md).

:class:`EncodingSink` wraps the sink of a copy into a tier whose ``compression`` is on: the copy
loop still hashes and hands it raw bytes; each file is cut into frames (:mod:`.codec`), compressed
on a few threads (zstd and ZipNN release the GIL) into an unlinked spool file, then streamed into
the backend's own writer as a file of its stored size; with ``store_behind``, on a thread of its
own while the copy reads and compresses the next file (the link is not idle while a file is
compressed). The commit records, per file, how it is
stored; the version digest stays the raw content's. Reading goes the other way
(:func:`open_entry`): a :class:`~.codec.DecodingReader` over the backend's reader.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import stat
import struct
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptkeeper.core.model import FileEntry, Manifest
from ckptkeeper.storage import codec
from ckptkeeper.storage.base import StorageError, VerificationError, _FileWriter, _Reader, _Sink, log
from ckptkeeper.util import hashing


def compress_threads() -> int:
    """Frames compressed at once per copy: the cores, at most 4 (CPU on training nodes is not free)."""
    env = os.environ.get("CKPTKEEPER_COMPRESS_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(4, os.cpu_count() or 1))


def raw_form(manifest: Manifest) -> Manifest:
    """``manifest`` with every file marked raw (what a copy starts from: how another tier stores a
    file says nothing about how this one does)."""
    if not any(e.encoding for e in manifest.files):
        return manifest
    files = tuple(dataclasses.replace(e, encoding="", stored=None) for e in manifest.files)
    return dataclasses.replace(manifest, files=files)


def with_stored_form(manifest: Manifest, committed: Manifest | None) -> Manifest:
    """``manifest`` with how this tier stores each file, from the tier's ``committed`` manifest of the
    same version (raw if there is none: the copy's absence is the caller's finding)."""
    if committed is None or committed.digest != manifest.digest:
        return raw_form(manifest)
    if not any(e.encoding for e in committed.files):
        return raw_form(manifest)
    by_path = {e.path: e for e in committed.files}
    files = tuple(
        dataclasses.replace(e, encoding=by_path[e.path].encoding, stored=by_path[e.path].stored)
        for e in manifest.files
    )
    return dataclasses.replace(manifest, files=files)


def open_entry(reader: _Reader, entry: FileEntry, where: str) -> _Reader:
    """The raw bytes of ``entry`` from ``reader`` (its stored bytes)."""
    if not entry.encoding:
        return reader
    return codec.DecodingReader(reader, entry.stored_size, where)


@dataclasses.dataclass
class CopyStats:
    """What a compressed copy stored: shown by ``prune`` (progress, log, ``--json``)."""

    raw_bytes: int = 0
    stored_bytes: int = 0
    cpu_seconds: float = 0.0
    files_compressed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "compress_cpu_seconds": round(self.cpu_seconds, 3),
            "files_compressed": self.files_compressed,
        }


class EncodingSink:
    """A :class:`~.base._Sink` that compresses each file into ``inner`` (the backend's sink)."""

    def __init__(
        self, inner: _Sink, mode: str, where: str, spool_dir: str | None = None, *, store_behind: int = 0
    ) -> None:
        self.inner = inner
        self.mode = mode
        self.where = where
        self.spool_dir = os.environ.get("CKPTKEEPER_SPOOL_DIR") or spool_dir
        """Where a file's frames wait until it is compressed whole (an unlinked file): the tier's
        own filesystem for a local tier, else ``$TMPDIR``; ``CKPTKEEPER_SPOOL_DIR`` overrides."""
        self.lock = threading.Lock()
        self.stored: dict[str, tuple[str, int]] = {}
        """path → (encoding, stored size) of every file written."""
        self.stats = CopyStats()
        self.threads = compress_threads()
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckptkeeper-compress")
        self.writers: set[_EncodingWriter] = set()
        self.store_behind = store_behind
        """Files whose spool may wait or be stored while the next file is compressed (0: each
        file is stored by its own :meth:`_EncodingWriter.finish`). One thread stores them, in
        order: ``inner`` sees one file after another, as from the copy loop itself."""
        self.storer = (
            ThreadPoolExecutor(1, thread_name_prefix="ckptkeeper-store") if store_behind > 0 else None
        )
        self.stores: collections.deque[Future[None]] = collections.deque()
        self.stopping = threading.Event()

    def open_file(self, entry: FileEntry, source: _Reader | None = None) -> _FileWriter:
        writer = _EncodingWriter(self, entry, source)
        with self.lock:
            self.writers.add(writer)
        return writer

    def _store(self, store: collections.abc.Callable[[], None]) -> None:
        """Run ``store`` (one file's), behind the copy if :attr:`store_behind`; a failure of an
        earlier file's is raised here, so the copy stops at the next file."""
        if self.storer is None:
            store()
            return
        while self.stores and (len(self.stores) >= self.store_behind or self.stores[0].done()):
            self.stores.popleft().result()
        self.stores.append(self.storer.submit(store))

    def _stored_all(self) -> None:
        """Wait for every file stored behind the copy; raise the first failure."""
        while self.stores:
            self.stores.popleft().result()

    def commit(self, manifest: Manifest) -> None:
        self._stored_all()  # nothing commits before every file is stored and checked
        if self.storer is not None:
            self.storer.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        files = []
        for e in manifest.files:
            encoding, stored = self.stored.get(e.path, ("", e.size))
            files.append(dataclasses.replace(e, encoding=encoding, stored=stored if encoding else None))
        self.inner.commit(dataclasses.replace(manifest, files=tuple(files)))
        if self.stats.files_compressed:
            log.info(
                "%s: stored %d raw bytes as %d (%.1f %%), %.2f CPU-s compressing",
                self.where,
                self.stats.raw_bytes,
                self.stats.stored_bytes,
                100.0 * self.stats.stored_bytes / max(1, self.stats.raw_bytes),
                self.stats.cpu_seconds,
            )

    def abort(self) -> None:
        self.stopping.set()  # a file being stored stops at its next chunk
        for fut in self.stores:
            fut.cancel()
        if self.storer is not None:
            self.storer.shutdown(wait=True, cancel_futures=True)  # nothing touches inner after this
        self.stores.clear()
        with self.lock:
            writers = list(self.writers)
        for w in writers:
            w.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.inner.abort()


class _EncodingWriter:
    """Frames one file's raw bytes as they come, compressing them on the sink's threads into a
    spool file; :meth:`finish` stores the spool (or the raw file, when compressing saves too
    little and the source can be read again) through the backend's writer."""

    def __init__(self, sink: EncodingSink, entry: FileEntry, source: _Reader | None) -> None:
        self.sink = sink
        self.entry = entry
        self.source = source
        self.where = f"{sink.where}/{entry.path}" if entry.path else sink.where
        # An unlinked file: whatever happens to this process, it leaves nothing behind.
        self.spool: Any = tempfile.TemporaryFile(prefix="ckptkeeper-spool-", dir=sink.spool_dir)  # noqa: SIM115 - closed by close()
        self.spool.write(codec.MAGIC)
        self.stored_size = len(codec.MAGIC)
        self.hasher = hashing.new_hasher()
        self.hasher.update(codec.MAGIC)
        self.pending = bytearray()
        self.offset = 0
        """File offset of ``pending[0]``."""
        self.frames: collections.abc.Iterator[tuple[int, int, str | None]] | None = None
        self.frame: tuple[int, int, str | None] | None = None
        self.inflight: collections.deque[Future[tuple[bytes, float]]] = collections.deque()
        self.limit = 2 * sink.threads
        self.reread: io.FileIO | None = None

    # -- framing ------------------------------------------------------------------------------

    def _plan_now(self, final: bool) -> None:
        need = 9  # a safetensors header's length and its first byte: then the whole header
        if len(self.pending) >= 9 and self.pending[8:9] == b"{":
            (n,) = struct.unpack("<Q", self.pending[:8])
            need = 8 + n if n <= codec._MAX_SAFETENSORS_HEADER else 9
        if not final and len(self.pending) < min(need, self.entry.size):
            return
        head = bytes(self.pending[:need])
        regions = self._zip_plan(head) or codec.plan(self.sink.mode, self.entry.size, head)
        self.frames = codec.frames_of(regions)
        self.frame = next(self.frames, None)

    def _zip_plan(self, head: bytes) -> list[codec.Region] | None:
        """A ``torch.save`` archive's members as regions (:func:`codec.zip_regions`), read from the
        source file's central directory; None unless ``auto`` and the source is a local zip."""
        if (
            self.sink.mode != "auto"
            or not head.startswith(b"PK\x03\x04")
            or self.entry.size < codec._SAMPLE_FROM
        ):
            return None
        fileno = getattr(self.source, "fileno", None)
        if fileno is None:
            return None
        try:  # pread only: the source's own offset (shared by a dup) must not move
            fd = fileno()
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.entry.size:
                return None
            return codec.zip_regions(self.entry.size, lambda offset, n: os.pread(fd, n, offset))
        except (OSError, ValueError):
            return None

    def write(self, data: bytes | memoryview, /) -> None:
        self.pending += data
        if self.frames is None:
            self._plan_now(final=False)
        self._cut()

    def _cut(self) -> None:
        while self.frame is not None and self.offset + len(self.pending) >= self.frame[1]:
            start, end, dtype = self.frame
            n = end - start
            chunk = bytes(self.pending[:n])
            del self.pending[:n]
            self.offset += n
            self._submit(chunk, dtype)
            assert self.frames is not None
            self.frame = next(self.frames, None)

    def _submit(self, chunk: bytes, dtype: str | None) -> None:
        while len(self.inflight) >= self.limit:
            self._drain_one()
        self.inflight.append(self.sink.pool.submit(_encode, chunk, dtype))

    def _drain_one(self) -> None:
        frame, cpu = self.inflight.popleft().result()
        self.spool.write(frame)
        self.hasher.update(frame)
        self.stored_size += len(frame)
        with self.sink.lock:
            self.sink.stats.cpu_seconds += cpu

    # -- storing ------------------------------------------------------------------------------

    def finish(self) -> None:
        if self.frames is None:
            self._plan_now(final=True)
        self._cut()
        if self.pending or self.frame is not None:
            raise VerificationError(f"{self.where}: the bytes do not end where its plan does")
        while self.inflight:
            self._drain_one()
        # Our own handle now: the copy loop closes its source once this returns.
        self.reread = _reopen(self.source)
        self.sink._store(self._store)

    def _store(self) -> None:
        raw = self.entry.size
        encoding = codec.ENCODING_OF_MODE[self.sink.mode]
        try:
            if self.stored_size > codec.WORTH * raw and self.reread is not None:
                self._store_raw(self.reread)
                encoding, stored = "", raw
            else:
                self._store_spool()
                stored = self.stored_size
        finally:
            self.close()
        with self.sink.lock:
            self.sink.stored[self.entry.path] = (encoding, stored)
            self.sink.stats.raw_bytes += raw
            self.sink.stats.stored_bytes += stored
            self.sink.stats.files_compressed += bool(encoding)

    def _store_spool(self) -> None:
        self.spool.flush()
        self.spool.seek(0)
        stored = FileEntry(self.entry.path, self.stored_size, self.hasher.hexdigest())
        source = io.FileIO(os.dup(self.spool.fileno()), "rb", closefd=True)
        try:
            writer = self.sink.inner.open_file(stored, source)
            while chunk := source.read(hashing.CHUNK_SIZE):
                self._check_stopping()
                writer.write(chunk)
            writer.finish()
        finally:
            source.close()

    def _store_raw(self, source: io.FileIO) -> None:
        """Compressing saved too little: the raw bytes, read again from the source file and checked
        against the hash they had when they were first read (the file may have changed since)."""
        writer = self.sink.inner.open_file(self.entry, source)
        hasher = hashing.new_hasher()
        size = 0
        while chunk := source.read(hashing.CHUNK_SIZE):
            self._check_stopping()
            hasher.update(chunk)
            size += len(chunk)
            writer.write(chunk)
        if (size, hasher.hexdigest()) != (self.entry.size, self.entry.hash):
            raise VerificationError(f"{self.where}: changed while it was copied")
        writer.finish()

    def _check_stopping(self) -> None:
        if self.sink.stopping.is_set():
            raise StorageError(f"{self.where}: stopped, the copy failed")

    def close(self) -> None:
        if self.reread is not None:
            self.reread.close()
            self.reread = None
        for fut in self.inflight:
            fut.cancel()
        self.inflight.clear()
        if self.spool is not None:
            self.spool.close()
            self.spool = None
        with self.sink.lock:
            self.sink.writers.discard(self)


def _encode(chunk: bytes, dtype: str | None) -> tuple[bytes, float]:
    t0 = time.thread_time()
    frame = codec.encode_frame(chunk, dtype)
    return frame, time.thread_time() - t0


def _reopen(source: _Reader | None) -> io.FileIO | None:
    """Our own handle on ``source`` from its start, if it is a regular local file; else None."""
    fileno = getattr(source, "fileno", None)
    if fileno is None:
        return None
    try:
        fd = os.dup(fileno())
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        return None
    return io.FileIO(fd, "rb", closefd=True)
