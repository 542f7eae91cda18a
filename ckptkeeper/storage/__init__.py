"""Tier access: streamed copy with hashing, verification, atomic commit, safe delete, usage.

One interface (:class:`TierStorage`) over two backends, picked from the tier URL:

* **local** paths (``/mnt/warm/ckpt`` or ``file:///…``) use plain ``os`` calls on directory file
  descriptors rather than fsspec's LocalFileSystem, because the safety invariants of DESIGN §8 need
  ``O_NOFOLLOW`` walks, ``fsync`` of files *and* directories, ``rename`` inside one directory and
  ``st_dev`` checks that fsspec does not expose;
* **S3** (``s3://bucket/prefix``) uses s3fs only for what it does well — a configured aiobotocore
  client on fsspec's IO loop with bounded retries — and drives multipart uploads itself, so that
  memory stays bounded and every part carries a checksum computed in the same pass as the content
  hash.

Layout of a slower tier (DESIGN §7): ``<root>/<run>/<name>`` (a directory or a single file; ``name``
may contain ``/``) plus ``<root>/<run>/<name>.ckptkeeper-manifest.json`` beside it. The hot tier
(``hot=True``) holds no manifests: the catalog hashes it itself.

Commit protocol
---------------
Every copy is *copy → verify → commit*; the source is never modified, and a failure leaves nothing
that a listing would report as a committed copy.

* **Local**: data is streamed into ``<run>/<name>.ckptkeeper-tmp-<token>`` (files ``fsync``-ed,
  then every created directory), the manifest is written atomically (temp + ``fsync`` + rename),
  and the commit point is the final ``rename`` of the staging name into place (then the parent
  directory is ``fsync``-ed). A manifest whose data is missing is an *orphan* (crash between the
  two renames, or an interrupted delete): :meth:`list_manifests` skips it and :meth:`list_staging`
  reports it.
* **S3** has no rename (a server-side copy of 20 GB would double the cost), so data objects are
  written at their final keys and the **manifest object, written last with** ``If-None-Match: *``,
  is the commit point. Before any data is written a small marker object
  ``<run>/<name>.ckptkeeper-tmp-<token>`` records the copy in progress; it is removed after the
  commit. A marker without a manifest is an interrupted copy (:meth:`list_staging`), a marker with
  one is just stale. Deletes use the same marker, then remove the manifest (de-commit), then data.

S3 verification
---------------
Each part (and each small single-request object) is sent with ``ChecksumCRC32`` computed locally
from the very bytes that were hashed for the manifest. AWS S3 (and MinIO, Ceph RGW, …) reject a body
that does not match it (``BadDigest``), and for multipart objects the server derives a COMPOSITE
checksum (CRC32 of the part CRC32s, ``…-N``) from what it stored. After the upload we ``HEAD`` the
object with ``ChecksumMode=ENABLED`` and require the size of the manifest and our own composite
checksum, so no data is downloaded again. CRC32 rather than CRC32C: botocore needs ``awscrt`` for
CRC32C and moto silently falls back to CRC32 without the ``crc32c`` package; zlib's CRC32 is in the
standard library and every S3 implementation that speaks flexible checksums supports it. ETag/MD5
was rejected: it is not an MD5 under SSE-KMS/SSE-C, multipart ETags differ between stores, and MD5
would cost a second, slower hash per byte. When a store echoes no checksum at all (an old S3
clone) the checksum cannot be trusted and the object is read back and re-hashed before commit.

Errors: every failure surfaces as :class:`StorageError` (listing failures as
:class:`TierUnavailable`, content mismatches as :class:`VerificationError`) with the cause chained;
messages never contain ``storage_options`` secrets.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import io
import json
import logging
import os
import re
import secrets
import socket
import stat
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ckptkeeper.core.model import (
    HASH_ALGORITHM,
    MANIFEST_SUFFIX,
    Artifact,
    FileEntry,
    Manifest,
    TierSpec,
    TierUsage,
)
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.util import hashing

if TYPE_CHECKING:
    from concurrent.futures import Future

    from s3fs import S3FileSystem

# asyncio, concurrent.futures, fsspec and s3fs are imported where used: the CLI imports this module
# and local tiers need none of them.

log = logging.getLogger(__name__)

"""Infix of every staging name we create (local staging dirs/files, S3 markers, manifest temps)."""
STAGING_KIND = "ckptkeeper-staging"
MULTIPART_KIND = "multipart-upload"

Progress = Callable[[int], None]
"""Called with the number of bytes just copied (an increment, not a total)."""

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
_MAX_MANIFEST_BYTES = 256 * 2**20


class StorageError(Exception):
    """A tier operation failed; nothing was committed by the failing call."""


class TierUnavailable(StorageError):
    """Listing or usage of a tier failed: callers must treat the tier as unknown, never as empty."""


class VerificationError(StorageError):
    """Content does not match its manifest (source changed, transfer or storage corruption)."""


# --------------------------------------------------------------------------------------------
# helpers


def _split_rel(rel: str, what: str = "path") -> tuple[str, ...]:
    """Validate a tier-relative path and split it; rejects anything that could leave the root."""
    if not isinstance(rel, str) or not rel:
        raise StorageError(f"empty {what}")
    if "\0" in rel:
        raise StorageError(f"{what} contains NUL: {rel!r}")
    if rel.startswith("/") or rel.startswith("\\"):
        raise StorageError(f"absolute {what} refused: {rel!r}")
    parts = tuple(rel.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"{what} must be a plain relative path without '.', '..' or '//': {rel!r}")
    return parts


def _rel_of(manifest: Manifest) -> str:
    return f"{manifest.run}/{manifest.name}"


def _check_manifest(manifest: Manifest) -> tuple[str, ...]:
    """Reject manifests we cannot honour safely (a shared cold tier is not trusted input)."""
    if manifest.algorithm != HASH_ALGORITHM:
        raise StorageError(f"unsupported hash algorithm {manifest.algorithm!r} (want {HASH_ALGORITHM})")
    parts = _split_rel(_rel_of(manifest), "checkpoint path")
    if manifest.is_dir:
        seen: set[str] = set()
        for entry in manifest.files:
            _split_rel(entry.path, "file path in manifest")
            if entry.path in seen:
                raise StorageError(f"duplicate file in manifest: {entry.path!r}")
            seen.add(entry.path)
    elif len(manifest.files) != 1 or manifest.files[0].path != "":
        raise StorageError("a single-file checkpoint must have exactly one file entry with path ''")
    for entry in manifest.files:
        if entry.size < 0:
            raise StorageError(f"negative size in manifest for {entry.path!r}")
    return parts


def _token() -> str:
    return secrets.token_hex(6)


def _crc32_b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Reader(Protocol):
    def read(self, n: int, /) -> bytes: ...
    def close(self) -> None: ...


class _FileWriter(Protocol):
    def write(self, data: bytes | memoryview, /) -> None:
        """``data`` is only valid during the call (a view of the copy loop's reused buffer)."""

    def finish(self) -> None:
        """Make the file durable and check what the destination holds (size, checksum)."""


class _Sink(Protocol):
    """One in-progress copy of a checkpoint into a tier."""

    def open_file(self, entry: FileEntry, source: _Reader | None = None) -> _FileWriter:
        """``source`` is the stream the file's bytes come from; a sink may read it again."""

    def commit(self, manifest: Manifest) -> None: ...
    def abort(self) -> None:
        """Best effort: remove everything written; leave only what list_staging reports."""


# --------------------------------------------------------------------------------------------
# the interface


class TierStorage:
    """Access to one tier. ``TierStorage(spec)`` returns the backend for the URL (as pathlib.Path does).

    ``hot=True`` marks the watched local root: no manifests are stored beside checkpoints there.
    """

    name: str
    url: str
    is_local: bool
    hot: bool

    def __new__(cls, spec: TierSpec, *, hot: bool = False) -> TierStorage:
        if cls is TierStorage:
            scheme = spec.url.split("://", 1)[0].lower() if "://" in spec.url else ""
            if scheme in ("", "file", "local"):
                return object.__new__(LocalTierStorage)
            if scheme in ("s3", "s3a"):
                return object.__new__(S3TierStorage)
            raise StorageError(f"tier {spec.name!r}: unsupported URL scheme {scheme!r} (local path or s3://)")
        return object.__new__(cls)

    def __init__(self, spec: TierSpec, *, hot: bool = False) -> None:
        self.spec = spec
        self.name = spec.name
        self.url = spec.url
        self.hot = hot

    def __repr__(self) -> str:  # never shows storage_options (secrets)
        return f"{type(self).__name__}(name={self.name!r}, url={self.url!r}, hot={self.hot})"

    # -- backend primitives -----------------------------------------------------------------

    def _open_read(self, rel: str, file_path: str) -> _Reader:
        raise NotImplementedError

    def _begin_write(self, rel: str, manifest: Manifest) -> _Sink:
        raise NotImplementedError

    def _list_files(self, rel: str, is_dir: bool) -> dict[str, int | None] | None:
        """Files present for a checkpoint: path → size (None: not a regular file); None if absent."""
        raise NotImplementedError

    # -- public API -------------------------------------------------------------------------

    def usage(self) -> TierUsage | None:
        raise NotImplementedError

    def list_manifests(self) -> list[tuple[str, Manifest | None, str | None]]:
        """``(rel_path, manifest, None)`` per committed copy, ``(rel_path, None, error)`` per bad one.

        Raises :class:`TierUnavailable` if the listing is incomplete for any reason.
        """
        raise NotImplementedError

    def read_manifest(self, rel_path: str) -> Manifest | None:
        """The committed manifest at ``rel_path``, None if there is no committed copy."""
        raise NotImplementedError

    def delete(self, rel_path: str) -> int:
        """Delete a checkpoint (directory or file) and its manifest; return bytes freed."""
        raise NotImplementedError

    def list_staging(self) -> list[Artifact]:
        """Our own interrupted copies/deletes (kind ``ckptkeeper-staging``), for the reaper."""
        raise NotImplementedError

    def discard_staging(self, artifact: Artifact) -> int:
        """Remove one artifact reported by :meth:`list_staging`; return bytes freed."""
        raise NotImplementedError

    def list_multipart_uploads(self) -> list[Artifact]:
        return []

    def abort_multipart(self, artifact: Artifact) -> None:
        raise StorageError(f"tier {self.name!r} has no multipart uploads")

    def same_filesystem(self, other: TierStorage) -> bool:
        return False

    def copy_from(self, src: TierStorage, manifest: Manifest, *, progress: Progress | None = None) -> None:
        """Copy checkpoint ``manifest`` from ``src`` into this tier, verified and committed.

        One pass over the source: each chunk is read once, hashed and written. The source's size
        and hash must equal the manifest (else :class:`VerificationError`: it changed since it
        was cataloged), the destination's size (and, for S3, checksum) is checked, then the copy
        is committed. If this tier already holds a committed copy of the same version the call is
        a no-op (idempotent for journal replay); a different version raises :class:`StorageError`.
        On failure nothing is committed, the source is untouched, and staging is removed or left
        where :meth:`list_staging` finds it.
        """
        _check_manifest(manifest)
        rel = _rel_of(manifest)
        if not self.hot:
            existing = self.read_manifest(rel)
            if existing is not None:
                if existing.digest == manifest.digest:
                    log.info("%s: %s already holds version %s", self.name, rel, manifest.digest)
                    return
                raise StorageError(
                    f"tier {self.name!r} already holds a different version of {rel} "
                    f"({existing.digest}, not {manifest.digest}); delete it first"
                )
        sink = self._begin_write(rel, manifest)
        try:
            _stream_checkpoint(src, rel, manifest, sink, progress)
            sink.commit(manifest)
        except BaseException as exc:
            sink.abort()
            if isinstance(exc, StorageError) or not isinstance(exc, Exception):
                raise
            raise StorageError(
                f"copy of {rel} from {src.name!r} to {self.name!r} failed: {_describe(exc)}"
            ) from exc

    def fetch(self, manifest: Manifest, to_dir: Path, *, progress: Progress | None = None) -> Path:
        """Restore: verified copy of the checkpoint into ``to_dir/<name>``; returns that path.

        Written under a staging name and renamed into place; refuses to overwrite.
        """
        _check_manifest(manifest)
        rel = _rel_of(manifest)
        to_dir = Path(to_dir)
        try:
            to_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create restore directory {to_dir}: {_describe(exc)}") from exc
        sink = _LocalSink(
            to_dir, _split_rel(manifest.name, "checkpoint name"), manifest.is_dir, with_manifest=False
        )
        try:
            _stream_checkpoint(self, rel, manifest, sink, progress)
            sink.commit(manifest)
        except BaseException as exc:
            sink.abort()
            if isinstance(exc, StorageError) or not isinstance(exc, Exception):
                raise
            raise StorageError(f"restore of {rel} from {self.name!r} failed: {_describe(exc)}") from exc
        return to_dir / manifest.name

    def verify(self, manifest: Manifest, *, deep: bool = True) -> list[str]:
        """Check this tier's copy against ``manifest``; return mismatch descriptions ([] = ok).

        ``deep`` re-hashes every byte (a download for S3); otherwise only presence and sizes.
        Files present but not in the manifest are reported too.
        """
        _check_manifest(manifest)
        rel = _rel_of(manifest)
        problems: list[str] = []
        present = self._list_files(rel, manifest.is_dir)
        if present is None:
            return [f"{rel}: missing"]
        for entry in manifest.files:
            where = f"{rel}/{entry.path}" if entry.path else rel
            if entry.path not in present:
                problems.append(f"{where}: missing")
                continue
            size = present[entry.path]
            if size is None:
                problems.append(f"{where}: not a regular file")
                continue
            if size != entry.size:
                problems.append(f"{where}: size {size} != {entry.size} in manifest")
                continue
            if deep:
                reader = self._open_read(rel, entry.path)
                try:
                    got_size, digest = hashing.hash_stream(reader)  # type: ignore[arg-type]
                finally:
                    reader.close()
                if got_size != entry.size:
                    problems.append(f"{where}: read {got_size} bytes, manifest says {entry.size}")
                elif digest != entry.hash:
                    problems.append(f"{where}: hash {digest} != {entry.hash} in manifest")
        expected = {e.path for e in manifest.files}
        for path in sorted(set(present) - expected):
            problems.append(f"{rel}/{path}: not in manifest")
        return problems


def _stream_checkpoint(
    src: TierStorage, rel: str, manifest: Manifest, sink: _Sink, progress: Progress | None
) -> None:
    """The single read → hash → write pass over every file of a checkpoint.

    A local source is read with ``readinto`` into one reused buffer (no allocation per chunk);
    writers get a view of it that is only valid during ``write`` and must copy what they keep.
    """
    buf = bytearray(hashing.CHUNK_SIZE)
    view = memoryview(buf)
    for entry in manifest.files:
        where = f"{src.name}:{rel}/{entry.path}" if entry.path else f"{src.name}:{rel}"
        reader = src._open_read(rel, entry.path)
        try:
            writer = sink.open_file(entry, reader)
            hasher = hashing.new_hasher()
            size = 0
            readinto = getattr(reader, "readinto", None)
            while True:
                chunk: bytes | memoryview
                if readinto is not None:
                    n = readinto(buf)
                    chunk = view[:n]
                else:
                    chunk = reader.read(hashing.CHUNK_SIZE)
                    n = len(chunk)
                if not n:
                    break
                size += n
                if size > entry.size:
                    raise VerificationError(
                        f"{where}: more than the {entry.size} bytes of its manifest (changed since cataloged)"
                    )
                hasher.update(chunk)
                writer.write(chunk)
                if progress is not None:
                    progress(n)
            if size != entry.size:
                raise VerificationError(
                    f"{where}: {size} bytes, manifest says {entry.size} (changed since cataloged)"
                )
            digest = hasher.hexdigest()
            if digest != entry.hash:
                raise VerificationError(
                    f"{where}: hash {digest} != {entry.hash} in manifest (changed since cataloged)"
                )
            writer.finish()
        finally:
            reader.close()


# --------------------------------------------------------------------------------------------
# local backend


def _open_dirs(root_fd: int, parts: tuple[str, ...], *, create: bool = False, dev: int | None = None) -> int:
    """Open ``root/parts…`` as a directory fd without following any symlink on the way.

    With ``create`` missing directories are made (and their parents fsync-ed). With ``dev`` every
    directory must be on that filesystem. The caller closes the returned fd.
    """
    fd = os.dup(root_fd)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                    os.fsync(fd)
                except FileExistsError:
                    pass
            nfd = os.open(part, _O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if dev is not None and os.fstat(fd).st_dev != dev:
                raise StorageError(f"refusing to cross into another filesystem at {'/'.join(parts)}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_file_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """temp + fsync + rename in ``dir_fd``; the caller fsyncs the directory."""
    tmp = f"{name}{STAGING_MARK}{_token()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC, 0o666, dir_fd=dir_fd)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _scan_tree(dir_fd: int, name: str, dev: int) -> tuple[int, float]:
    """(bytes, newest mtime) under ``name``; refuses trees that cross into another filesystem."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        return (st.st_size if stat.S_ISREG(st.st_mode) else 0), st.st_mtime
    if st.st_dev != dev:
        raise StorageError(f"refusing to cross into another filesystem at {name!r}")
    fd = os.open(name, _O_DIR, dir_fd=dir_fd)
    try:
        total, newest = 0, st.st_mtime
        with os.scandir(fd) as it:
            children = [e.name for e in it]
        for child in children:
            size, mtime = _scan_tree(fd, child, dev)
            total += size
            newest = max(newest, mtime)
        return total, newest
    finally:
        os.close(fd)


def _remove_tree(dir_fd: int, name: str, dev: int) -> int:
    """Remove ``name`` in ``dir_fd`` recursively through directory fds; return bytes freed.

    Symlinks are unlinked, never followed; directories on another filesystem are refused; only
    regular files with a single link count as freed.
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0
    fd = os.open(name, _O_DIR, dir_fd=dir_fd)  # ELOOP if swapped for a symlink meanwhile
    try:
        fst = os.fstat(fd)
        if fst.st_dev != dev or fst.st_ino != st.st_ino:
            raise StorageError(f"refusing to delete {name!r}: another filesystem, or it changed under us")
        with os.scandir(fd) as it:
            children = [e.name for e in it]
        freed = sum(_remove_tree(fd, child, dev) for child in children)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)
    return freed


WRITEBACK_WINDOW = 8 * 2**20
"""Start writeback of every this many bytes written (see :func:`_start_writeback`)."""
_MAX_UNSYNCED_FILES = 64
"""Written files whose fsync waits for the commit; beyond this the oldest is synced right away."""


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``[offset, offset+length)`` to disk now, without waiting.

    ``cp`` + ``sync`` first fills the page cache, then waits for the disk; starting writeback while
    we copy overlaps the two, so the final fsync only waits for the tail. On Linux
    ``POSIX_FADV_DONTNEED`` starts asynchronous writeback of dirty pages in the range (and drops
    pages that are already clean); elsewhere it is at worst a no-op hint.
    """
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class _LocalFileWriter:
    def __init__(self, fd: int, entry: FileEntry, where: str, sink: _LocalSink) -> None:
        self.fd: int | None = fd
        self.entry = entry
        self.where = where
        self.sink = sink
        self.written = 0
        self.kicked = 0

    def write(self, data: bytes | memoryview, /) -> None:
        assert self.fd is not None
        _write_all(self.fd, data)
        self.written += len(data)
        if self.written - self.kicked >= WRITEBACK_WINDOW:
            _start_writeback(self.fd, self.kicked, self.written - self.kicked)
            self.kicked = self.written

    def finish(self) -> None:
        """Check the size; the fsync happens at commit, once every file is written, so one journal
        commit covers many small files and the disk works while later files are copied."""
        assert self.fd is not None
        if self.written > self.kicked:
            _start_writeback(self.fd, self.kicked, self.written - self.kicked)
            self.kicked = self.written
        size = os.fstat(self.fd).st_size
        if size != self.entry.size:
            self.close()
            raise VerificationError(
                f"{self.where}: destination holds {size} bytes, expected {self.entry.size}"
            )
        self.sink._written(self.fd)
        self.fd = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _LocalSink:
    """Writes ``root/<parts>`` under a staging name; commit = manifest, then rename into place."""

    def __init__(self, root: Path, parts: tuple[str, ...], is_dir: bool, *, with_manifest: bool) -> None:
        self.root = root
        self.rel = "/".join(parts)
        self.name = parts[-1]
        self.is_dir = is_dir
        self.with_manifest = with_manifest
        self.staging = f"{self.name}{STAGING_MARK}{_token()}"
        self.manifest_name = self.name + MANIFEST_SUFFIX
        self.manifest_written = False
        self.committed = False
        self.writer: _LocalFileWriter | None = None
        self.dir_fds: dict[tuple[str, ...], int] = {}
        self.unsynced: deque[int] = deque()
        """Descriptors of finished files not yet fsync-ed (done at commit, oldest first)."""
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        except OSError as exc:
            raise StorageError(f"cannot open {root}: {_describe(exc)}") from exc
        try:
            self.parent_fd = _open_dirs(root_fd, parts[:-1], create=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create parent directories of {self.rel} under {root}: {_describe(exc)}"
            ) from exc
        finally:
            os.close(root_fd)
        try:
            if _exists_at(self.parent_fd, self.name):
                raise StorageError(f"{root}/{self.rel} already exists; refusing to overwrite")
            if is_dir:
                os.mkdir(self.staging, 0o777, dir_fd=self.parent_fd)
                self.dir_fds[()] = os.open(self.staging, _O_DIR, dir_fd=self.parent_fd)
        except OSError as exc:
            os.close(self.parent_fd)
            raise StorageError(
                f"cannot create staging for {self.rel} under {root}: {_describe(exc)}"
            ) from exc
        except BaseException:
            os.close(self.parent_fd)
            raise

    def _dir(self, parts: tuple[str, ...]) -> int:
        if parts not in self.dir_fds:
            parent = self._dir(parts[:-1])
            with contextlib.suppress(FileExistsError):
                os.mkdir(parts[-1], 0o777, dir_fd=parent)
            self.dir_fds[parts] = os.open(parts[-1], _O_DIR, dir_fd=parent)
        return self.dir_fds[parts]

    def open_file(self, entry: FileEntry, source: _Reader | None = None) -> _FileWriter:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
        where = f"{self.root}/{self.rel}" + (f"/{entry.path}" if entry.path else "")
        try:
            if self.is_dir:
                parts = _split_rel(entry.path, "file path in manifest")
                fd = os.open(parts[-1], flags, 0o666, dir_fd=self._dir(parts[:-1]))
            else:
                fd = os.open(self.staging, flags, 0o666, dir_fd=self.parent_fd)
        except OSError as exc:
            raise StorageError(f"cannot create {where}: {_describe(exc)}") from exc
        self.writer = _LocalFileWriter(fd, entry, where, self)
        return self.writer

    def _written(self, fd: int) -> None:
        self.unsynced.append(fd)
        while len(self.unsynced) > _MAX_UNSYNCED_FILES:
            self._sync_oldest()

    def _sync_oldest(self) -> None:
        fd = self.unsynced.popleft()
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _close_unsynced(self) -> None:
        while self.unsynced:
            with contextlib.suppress(OSError):
                os.close(self.unsynced.popleft())

    def _close_dirs(self) -> None:
        for fd in self.dir_fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.dir_fds.clear()

    def commit(self, manifest: Manifest) -> None:
        try:
            while self.unsynced:  # file data first, then the directory entries naming the files
                self._sync_oldest()
            # deepest first: a directory entry is durable once its parent directory is synced
            for parts in sorted(self.dir_fds, key=len, reverse=True):
                os.fsync(self.dir_fds[parts])
            self._close_dirs()
            if self.with_manifest:
                _write_file_atomic(self.parent_fd, self.manifest_name, manifest.to_json().encode())
                self.manifest_written = True
            if _exists_at(self.parent_fd, self.name):
                raise StorageError(f"{self.root}/{self.rel} appeared during the copy; not overwriting it")
            os.rename(self.staging, self.name, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
            self.committed = True  # from here on the copy exists: abort() must not undo it
            os.fsync(self.parent_fd)
        except OSError as exc:
            raise StorageError(f"commit of {self.root}/{self.rel} failed: {_describe(exc)}") from exc
        finally:
            if self.committed:
                os.close(self.parent_fd)

    def abort(self) -> None:
        if self.committed:
            return
        if self.writer is not None:
            self.writer.close()
        self._close_unsynced()
        self._close_dirs()
        try:
            dev = os.fstat(self.parent_fd).st_dev
            if _exists_at(self.parent_fd, self.staging):
                _remove_tree(self.parent_fd, self.staging, dev)
            if self.manifest_written:
                os.unlink(self.manifest_name, dir_fd=self.parent_fd)
            os.fsync(self.parent_fd)
        except (OSError, StorageError) as exc:
            log.warning(
                "could not clean staging %s/%s (list_staging reports it): %s", self.root, self.staging, exc
            )
        finally:
            os.close(self.parent_fd)


class LocalTierStorage(TierStorage):
    """A tier on a local (or NFS/Lustre-mounted) filesystem."""

    is_local = True

    def __init__(self, spec: TierSpec, *, hot: bool = False) -> None:
        super().__init__(spec, hot=hot)
        url = spec.url
        for prefix in ("file://", "local://"):
            if url.lower().startswith(prefix):
                url = url[len(prefix) :]
        self.root = Path(url)

    @contextlib.contextmanager
    def _root_fd(self, exc_type: type[StorageError] = StorageError) -> Iterator[int]:
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        except OSError as exc:
            raise exc_type(f"tier {self.name!r}: cannot open {self.root}: {_describe(exc)}") from exc
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _parent_fd(self, parts: tuple[str, ...], *, dev_check: bool = True) -> Iterator[int]:
        """Directory fd of the parent of ``parts`` (no symlinks, same filesystem as the root)."""
        with self._root_fd() as root_fd:
            dev = os.fstat(root_fd).st_dev if dev_check else None
            fd = _open_dirs(root_fd, parts[:-1], dev=dev)
        try:
            yield fd
        finally:
            os.close(fd)

    def usage(self) -> TierUsage | None:
        try:
            st = os.statvfs(self.root)
        except OSError as exc:
            raise TierUnavailable(f"tier {self.name!r}: statvfs {self.root}: {_describe(exc)}") from exc
        total = st.f_blocks * st.f_frsize
        return TierUsage(total_bytes=total, used_bytes=total - st.f_bfree * st.f_frsize)

    def same_filesystem(self, other: TierStorage) -> bool:
        if not isinstance(other, LocalTierStorage):
            return False
        try:
            return os.stat(self.root).st_dev == os.stat(other.root).st_dev
        except OSError:
            return False

    def _open_read(self, rel: str, file_path: str) -> _Reader:
        parts = _split_rel(rel) + (_split_rel(file_path, "file path in manifest") if file_path else ())
        try:
            with self._parent_fd(parts, dev_check=False) as dir_fd:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            raise StorageError(
                f"tier {self.name!r}: cannot open {'/'.join(parts)}: {_describe(exc)}"
            ) from exc
        with contextlib.suppress(OSError, AttributeError):  # a hint: larger readahead
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return os.fdopen(fd, "rb", buffering=0)

    def _begin_write(self, rel: str, manifest: Manifest) -> _Sink:
        with self._root_fd():
            pass  # a missing tier root is an error, not something to create silently
        return _LocalSink(self.root, _split_rel(rel), manifest.is_dir, with_manifest=not self.hot)

    def _list_files(self, rel: str, is_dir: bool) -> dict[str, int | None] | None:
        parts = _split_rel(rel)
        try:
            with self._parent_fd(parts, dev_check=False) as dir_fd:
                try:
                    st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    return None
                if not is_dir:
                    return {"": st.st_size if stat.S_ISREG(st.st_mode) else None}
                if not stat.S_ISDIR(st.st_mode):
                    return None
                out: dict[str, int | None] = {}

                def fail(exc: OSError) -> None:
                    raise exc

                for dirpath, dirnames, filenames, dfd in os.fwalk(
                    parts[-1], dir_fd=dir_fd, follow_symlinks=False, onerror=fail
                ):
                    base = dirpath[len(parts[-1]) + 1 :]
                    # fwalk lists a symlink to a directory among dirnames (without descending)
                    for fname in filenames + dirnames:
                        fst = os.stat(fname, dir_fd=dfd, follow_symlinks=False)
                        if not stat.S_ISDIR(fst.st_mode):
                            path = f"{base}/{fname}" if base else fname
                            out[path] = fst.st_size if stat.S_ISREG(fst.st_mode) else None
                return out
        except OSError as exc:
            raise StorageError(f"tier {self.name!r}: cannot list {rel}: {_describe(exc)}") from exc

    def read_manifest(self, rel_path: str) -> Manifest | None:
        if self.hot:
            return None
        parts = _split_rel(rel_path)
        try:
            with self._parent_fd(parts, dev_check=False) as dir_fd:
                if not _exists_at(dir_fd, parts[-1]):
                    return None  # orphan manifest (interrupted commit/delete): not a committed copy
                try:
                    fd = os.open(
                        parts[-1] + MANIFEST_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd
                    )
                except FileNotFoundError:
                    return None
                with os.fdopen(fd, "rb") as f:
                    text = f.read(_MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(
                f"tier {self.name!r}: cannot read manifest of {rel_path}: {_describe(exc)}"
            ) from exc
        return _parse_manifest(rel_path, text)

    def list_manifests(self) -> list[tuple[str, Manifest | None, str | None]]:
        if self.hot:
            raise StorageError(f"tier {self.name!r} is the hot tier: it holds no manifests")
        out: list[tuple[str, Manifest | None, str | None]] = []

        def fail(exc: OSError) -> None:
            raise exc

        with self._root_fd(TierUnavailable) as root_fd:
            try:
                for dirpath, dirnames, filenames, dfd in os.fwalk(
                    ".", dir_fd=root_fd, follow_symlinks=False, onerror=fail
                ):
                    reldir = os.path.normpath(dirpath)
                    present = set(dirnames) | set(filenames)
                    committed_dirs: set[str] = set()
                    for fname in filenames:
                        if not fname.endswith(MANIFEST_SUFFIX) or STAGING_MARK in fname:
                            continue
                        base = fname[: -len(MANIFEST_SUFFIX)]
                        if base not in present:
                            continue  # orphan: reported by list_staging
                        rel = base if reldir == "." else f"{reldir}/{base}"
                        committed_dirs.add(base)
                        try:
                            fd = os.open(fname, os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dfd)
                            with os.fdopen(fd, "rb") as f:
                                text = f.read(_MAX_MANIFEST_BYTES + 1)
                            out.append((rel, _parse_manifest(rel, text), None))
                        except FileNotFoundError:
                            continue  # deleted while we listed
                        except OSError as exc:
                            if exc.errno != errno.ELOOP:
                                raise  # unreadable is unknown, not corrupt: the whole listing fails
                            out.append((rel, None, "manifest is a symlink"))
                        except StorageError as exc:
                            out.append((rel, None, str(exc)))
                    # neither staging nor committed checkpoint contents can hold more manifests
                    dirnames[:] = [d for d in dirnames if STAGING_MARK not in d and d not in committed_dirs]
            except OSError as exc:
                raise TierUnavailable(
                    f"tier {self.name!r}: listing {self.root} failed: {_describe(exc)}"
                ) from exc
        return sorted(out, key=lambda t: t[0])

    def delete(self, rel_path: str) -> int:
        """Delete ``rel_path`` (and its manifest) without following symlinks or leaving the root.

        The data is first renamed to a staging name (de-commit; an interrupted delete is then
        reported by :meth:`list_staging`), the manifest removed, then the tree removed through
        directory fds. A symlink inside is unlinked, its target untouched; a directory on another
        filesystem makes the whole delete refuse before anything is removed.
        """
        parts = _split_rel(rel_path)
        try:
            with self._root_fd() as root_fd:
                dev = os.fstat(root_fd).st_dev
                with _fd(_open_dirs(root_fd, parts[:-1], dev=dev)) as dir_fd:
                    name = parts[-1]
                    manifest_name = name + MANIFEST_SUFFIX
                    if not _exists_at(dir_fd, name):
                        if not self.hot and _exists_at(dir_fd, manifest_name):
                            os.unlink(manifest_name, dir_fd=dir_fd)
                            os.fsync(dir_fd)
                        return 0
                    _scan_tree(dir_fd, name, dev)  # refuse before touching anything
                    tomb = f"{name}{STAGING_MARK}{_token()}"
                    os.rename(name, tomb, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    os.fsync(dir_fd)
                    if not self.hot and _exists_at(dir_fd, manifest_name):
                        os.unlink(manifest_name, dir_fd=dir_fd)
                    freed = _remove_tree(dir_fd, tomb, dev)
                    os.fsync(dir_fd)
                    return freed
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise StorageError(f"tier {self.name!r}: delete {rel_path} failed: {_describe(exc)}") from exc

    def rename_from(self, src: LocalTierStorage, manifest: Manifest, *, rehash: bool = True) -> None:
        """Move a checkpoint from ``src`` on the same filesystem with one ``rename``.

        Order: verify the source against the manifest in place (sizes always, hashes unless
        ``rehash=False``), write the manifest beside the destination (an orphan until…), then the
        atomic rename that is the commit point. There is never a moment where the only copy sits
        under a staging name the reaper could remove.
        """
        if not self.same_filesystem(src):
            raise StorageError(f"tiers {src.name!r} and {self.name!r} are not on one filesystem")
        _check_manifest(manifest)
        rel = _rel_of(manifest)
        parts = _split_rel(rel)
        problems = src.verify(manifest, deep=rehash)
        if problems:
            raise VerificationError(f"{src.name}:{rel} does not match its manifest: " + "; ".join(problems))
        try:
            with src._root_fd() as s_root, self._root_fd() as d_root:
                dev = os.fstat(d_root).st_dev
                with (
                    _fd(_open_dirs(s_root, parts[:-1], dev=dev)) as s_dir,
                    _fd(_open_dirs(d_root, parts[:-1], create=True, dev=dev)) as d_dir,
                ):
                    name = parts[-1]
                    if _exists_at(d_dir, name):
                        raise StorageError(f"{self.root}/{rel} already exists; refusing to overwrite")
                    if not self.hot:
                        _write_file_atomic(d_dir, name + MANIFEST_SUFFIX, manifest.to_json().encode())
                    try:
                        os.rename(name, name, src_dir_fd=s_dir, dst_dir_fd=d_dir)
                    except BaseException:
                        if not self.hot:
                            with contextlib.suppress(OSError):
                                os.unlink(name + MANIFEST_SUFFIX, dir_fd=d_dir)
                        raise
                    os.fsync(d_dir)
                    os.fsync(s_dir)
        except OSError as exc:
            raise StorageError(
                f"rename of {rel} from {src.name!r} to {self.name!r} failed: {_describe(exc)}"
            ) from exc

    def list_staging(self) -> list[Artifact]:
        out: list[Artifact] = []

        def fail(exc: OSError) -> None:
            raise exc

        with self._root_fd(TierUnavailable) as root_fd:
            dev = os.fstat(root_fd).st_dev
            try:
                for dirpath, dirnames, filenames, dfd in os.fwalk(
                    ".", dir_fd=root_fd, follow_symlinks=False, onerror=fail
                ):
                    reldir = os.path.normpath(dirpath)
                    present = set(dirnames) | set(filenames)
                    committed: set[str] = set()
                    for entry in sorted(present):
                        rel = entry if reldir == "." else f"{reldir}/{entry}"
                        if STAGING_MARK in entry:
                            size, mtime = _scan_tree(dfd, entry, dev)
                            out.append(_staging_artifact(self.name, rel, size, mtime))
                        elif entry.endswith(MANIFEST_SUFFIX) and not self.hot:
                            base = entry[: -len(MANIFEST_SUFFIX)]
                            if base in present:
                                committed.add(base)
                            else:
                                st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
                                out.append(_staging_artifact(self.name, rel, st.st_size, st.st_mtime))
                    dirnames[:] = [d for d in dirnames if STAGING_MARK not in d and d not in committed]
            except OSError as exc:
                raise TierUnavailable(
                    f"tier {self.name!r}: listing {self.root} failed: {_describe(exc)}"
                ) from exc
        return out

    def discard_staging(self, artifact: Artifact) -> int:
        parts = _split_rel(artifact.path)
        name = parts[-1]
        if STAGING_MARK in name:
            return self.delete(artifact.path)
        if name.endswith(MANIFEST_SUFFIX):
            base = name[: -len(MANIFEST_SUFFIX)]
            try:
                with self._parent_fd(parts) as dir_fd:
                    if _exists_at(dir_fd, base):
                        raise StorageError(f"{artifact.path} is no longer an orphan manifest; keeping it")
                    try:
                        size = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
                        os.unlink(name, dir_fd=dir_fd)
                    except FileNotFoundError:
                        return 0
                    os.fsync(dir_fd)
                    return size
            except OSError as exc:
                raise StorageError(
                    f"tier {self.name!r}: cannot remove {artifact.path}: {_describe(exc)}"
                ) from exc
        raise StorageError(f"{artifact.path} is not a ckptkeeper staging artifact")


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _staging_artifact(tier: str, rel: str, size: int, mtime: float) -> Artifact:
    return Artifact(
        tier=tier, path=rel, kind=STAGING_KIND, bytes=size, last_write=mtime, run=rel.split("/", 1)[0]
    )


def _parse_manifest(rel: str, text: bytes) -> Manifest:
    if len(text) > _MAX_MANIFEST_BYTES:
        raise StorageError(f"manifest of {rel} is larger than {_MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = Manifest.from_json(text)
    except ValueError as exc:
        raise StorageError(f"manifest of {rel}: {exc}") from exc
    if _rel_of(manifest) != rel:
        raise StorageError(f"manifest found at {rel} describes {_rel_of(manifest)}")
    return manifest


# --------------------------------------------------------------------------------------------
# S3 backend

_URL_USERINFO = re.compile(r"(\w+://)[^/@\s]+@")
_SECRET_NAMES = ("secret", "token", "password", "key", "credential", "username")
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def _collect_secrets(options: Mapping[str, Any]) -> list[str]:
    """String values of credential-like options (recursively), longest first, for redaction."""
    found: list[str] = []

    def walk(obj: Any, name: str) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, str(k).lower())
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, name)
        elif isinstance(obj, str) and len(obj) >= 4 and any(s in name for s in _SECRET_NAMES):
            found.append(obj)

    walk(options, "")
    return sorted(set(found), key=len, reverse=True)


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

    def __init__(self, tier: S3TierStorage, key: str) -> None:
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


class _PartStream(io.BytesIO):
    """A read-only stream over ``buf[:size]`` that never copies the whole part.

    A ``BytesIO`` subclass because aiohttp streams those inline in 256 KiB reads (other file-likes
    cost an executor hop per read; a ``bytes``/``bytearray`` body is copied whole into the socket
    transport's buffer); each ``read`` copies out just that chunk.
    """

    def __init__(self, buf: bytearray, size: int) -> None:
        super().__init__()
        self._view = memoryview(buf)[:size]
        self._pos = 0

    def read(self, size: int | None = -1, /) -> bytes:
        start = self._pos
        end = len(self._view) if size is None or size < 0 else min(len(self._view), start + size)
        self._pos = end
        return self._view[start:end].tobytes()

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getbuffer(self) -> memoryview:
        return self._view[self._pos :]

    def getvalue(self) -> bytes:
        return self._view.tobytes()


class _Extent:
    """What :meth:`_FilePart.getbuffer` hands aiohttp, which only takes its ``len`` in a ``with``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __enter__(self) -> _Extent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _FilePart(io.BytesIO):
    """One part of a local source file, read from the file while it is sent: no part buffer.

    The copy loop already hashed these bytes (content hash, CRC32, and a hash of the part alone);
    the re-read is hashed too and checked before its last byte is handed out, so a file changed in
    between fails the part (``failure``) instead of storing other bytes under the CRC32 we send (a
    store that does not check checksums would keep them). A ``BytesIO`` for the same reason as
    :class:`_PartStream`; every attempt of a request reads from offset 0 again.
    """

    def __init__(self, source: io.FileIO, offset: int, size: int, digest: str, where: str) -> None:
        super().__init__()
        self._source = source
        self._offset = offset
        self._size = size
        self._digest = digest
        self._where = where
        self._pos = 0
        self._hasher = hashing.new_hasher()
        self._hashed = 0
        self.failure: VerificationError | None = None
        """Set when the bytes read were not the bytes hashed (the HTTP stack wraps what we raise)."""

    def _fail(self, what: str) -> VerificationError:
        self.failure = VerificationError(
            f"{self._where}: part at bytes {self._offset}-{self._offset + self._size}: {what}"
        )
        return self.failure

    def read(self, size: int | None = -1, /) -> bytes:
        if self.failure is not None:  # sticky: a retry cannot make the bytes right
            raise self.failure
        start = self._pos
        left = self._size - start
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        if start != self._hashed:
            if start:  # neither aiohttp nor botocore skips into a body
                raise self._fail("read out of order")
            self._hasher, self._hashed = hashing.new_hasher(), 0
        data = os.pread(self._source.fileno(), n, self._offset + start)
        if len(data) != n:
            raise self._fail(f"file ends at byte {self._offset + start + len(data)} after it was hashed")
        self._hasher.update(data)
        self._pos = self._hashed = start + n
        if self._pos == self._size and self._hasher.hexdigest() != self._digest:
            raise self._fail("changed after it was hashed")
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getbuffer(self) -> memoryview:
        return _Extent(self._size)  # type: ignore[return-value]  # aiohttp takes only its len()

    def getvalue(self) -> bytes:
        self.seek(0)
        return self.read()


def _rereadable(source: _Reader | None) -> io.FileIO | None:
    """A private handle on ``source``'s file if it is a regular local file, else None.

    With it, parts are read from the file while they are sent instead of being held in buffers;
    a handle of our own, so that it stays valid until every part in flight is over.
    """
    fileno = getattr(source, "fileno", None)
    if fileno is None:
        return None
    try:
        fd = fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return io.FileIO(os.dup(fd), "rb", closefd=True)
    except (OSError, ValueError):
        return None


class _PartPool:
    """Part buffers reused across the parts and files of one copy: at most ``max_inflight + 1``
    of a size exist, and no part pays page faults on fresh memory."""

    def __init__(self) -> None:
        self.free: dict[int, list[bytearray]] = {}

    def get(self, size: int) -> bytearray:
        free = self.free.get(size)
        return free.pop() if free else bytearray(size)

    def put(self, buf: bytearray) -> None:
        self.free.setdefault(len(buf), []).append(buf)


class _S3FileWriter:
    """Streams one object: a single PUT if it fits in one part, else a multipart upload.

    At most ``max_inflight`` parts upload concurrently on fsspec's IO loop. From a local file
    (``source``) a part is read from the file again while it is sent (:class:`_FilePart`): no
    part is held in memory, and each byte is copied once more, 256 KiB at a time, on its way to
    the socket. From any other source the part being filled and the parts in flight are held in
    buffers of the copy's :class:`_PartPool` (``(max_inflight + 1) * part_size``).
    Every request carries the CRC32 of its body, computed here from the bytes that were hashed.
    """

    def __init__(
        self,
        tier: S3TierStorage,
        key: str,
        entry: FileEntry,
        where: str,
        pool: _PartPool,
        source: io.FileIO | None = None,
    ) -> None:
        self.tier = tier
        self.key = key
        self.entry = entry
        self.where = where
        self.pool = pool
        self.source = source
        """Our own handle on the local source file (closed by finish/abort), or None: buffered."""
        self.part_size = tier._part_size_for(entry.size)
        self.single = entry.size <= self.part_size
        """The whole object fits in one part: one PUT, no multipart upload."""
        self.capacity = max(1, min(self.part_size, entry.size))
        self.buf: bytearray | None = None
        self.filled = 0
        self.offset = 0
        """Where the part being filled starts in the file."""
        self.crc = 0
        self.part_hash: hashing.Hasher | None = None
        self.upload_id: str | None = None
        self.next_part = 1
        self.parts: list[dict[str, Any]] = []
        self.part_crcs: list[int] = []
        self.pending: deque[tuple[int, int, Future[Any], bytearray | None]] = deque()
        self.trusted = True
        """False when the store echoed no checksum: then the object is read back before commit."""

    def write(self, data: bytes | memoryview, /) -> None:
        view = memoryview(data)
        while view:
            n = min(len(view), self.capacity - self.filled)
            if n == 0:  # only a single-PUT object can fill its one part before finish()
                raise VerificationError(f"{self.where}: more than the {self.entry.size} bytes expected")
            take = view[:n]
            if self.source is None:
                if self.buf is None:
                    self.buf = self.pool.get(self.capacity)
                self.buf[self.filled : self.filled + n] = take
            else:
                if self.part_hash is None:
                    self.part_hash = hashing.new_hasher()
                self.part_hash.update(take)
            self.crc = zlib.crc32(take, self.crc)
            self.filled += n
            view = view[n:]
            if self.filled == self.capacity and not self.single:
                self._send_part()

    def _take_part(self) -> tuple[_PartStream | _FilePart, int, bytearray | None]:
        """The body of the part filled so far, its CRC32 and its buffer (None: read from the file)."""
        body: _PartStream | _FilePart
        buf: bytearray | None = None
        if self.source is None:
            buf = self.buf if self.buf is not None else bytearray(0)
            body = _PartStream(buf, self.filled)
        else:
            digest = (self.part_hash or hashing.new_hasher()).hexdigest()
            body = _FilePart(self.source, self.offset, self.filled, digest, self.where)
        taken = (body, self.crc, buf)
        self.offset += self.filled
        self.buf, self.filled, self.crc, self.part_hash = None, 0, 0, None
        return taken

    def _send_part(self) -> None:
        import asyncio

        tier = self.tier
        if self.upload_id is None:
            resp = tier._call(
                "create_multipart_upload", Bucket=tier.bucket, Key=self.key, ChecksumAlgorithm="CRC32"
            )
            self.upload_id = resp["UploadId"]
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
        would resend a half-consumed one (botocore's retries rewind it too). A body whose file
        changed under it is not retried: it fails with its own error. The request gets the same
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
        attempt = 0
        while True:
            body.seek(0)
            try:
                return await call(**request)
            except Exception as exc:
                _raise_body_failure(body, exc)
                attempt += 1
                if not isinstance(exc, S3_RETRYABLE_ERRORS) or attempt >= fs.retries:
                    raise
                await asyncio.sleep(min(0.1 * 1.7**attempt, 15.0))

    def _drain(self, keep: int) -> None:
        while len(self.pending) > keep:
            number, crc, fut, buf = self.pending.popleft()
            resp = fut.result()
            if buf is not None:
                self.pool.put(buf)  # the request is over: nothing reads the buffer any more
            self._check_echo(resp, _crc32_b64(crc), f"part {number}")
            self.parts.append({"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32": _crc32_b64(crc)})
            self.part_crcs.append(crc)

    def _check_echo(self, resp: Mapping[str, Any], expected: str, what: str) -> None:
        echoed = resp.get("ChecksumCRC32")
        if echoed is None:
            self.trusted = False
        elif echoed != expected:
            raise VerificationError(f"{self.where}: {what}: store reports CRC32 {echoed}, sent {expected}")

    def finish(self) -> None:
        tier = self.tier
        if self.upload_id is None:
            import asyncio

            body, crc, buf = self._take_part()
            expected = _crc32_b64(crc)
            resp = asyncio.run_coroutine_threadsafe(
                self._send("put_object", body, expected), tier.fs.loop
            ).result()
            if buf is not None:
                self.pool.put(buf)
            self._check_echo(resp, expected, "put")
        else:
            if self.filled:
                self._send_part()
            self._drain(0)
            combined = b"".join(c.to_bytes(4, "big") for c in self.part_crcs)
            expected = f"{_crc32_b64(zlib.crc32(combined))}-{len(self.parts)}"
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
        head = tier._head(self.key, checksum=True)
        if head is None:
            raise VerificationError(f"{self.where}: object missing right after upload")
        size = int(head["ContentLength"])
        if size != self.entry.size:
            raise VerificationError(f"{self.where}: store holds {size} bytes, expected {self.entry.size}")
        stored = head.get("ChecksumCRC32")
        if stored is None:
            self.trusted = False
        elif not _same_checksum(stored, expected):
            raise VerificationError(f"{self.where}: stored CRC32 {stored} != {expected} of the bytes sent")
        self._close_source()

    def _close_source(self) -> None:
        if self.source is not None:
            self.source.close()  # a straggling read then fails (closed file), never reads another

    def abort(self) -> None:
        import concurrent.futures

        for _, _, fut, _ in self.pending:
            fut.cancel()
        concurrent.futures.wait([f for _, _, f, _ in self.pending], timeout=60)
        self.pending.clear()  # their buffers are dropped, not reused: a cancelled send may hold them
        self.buf, self.filled = None, 0
        self._close_source()
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


def _raise_body_failure(body: io.BytesIO, exc: BaseException) -> None:
    """Surface a file part's own verdict; the HTTP stack reports it as a connection error."""
    failure = getattr(body, "failure", None)
    if failure is not None:
        raise failure from exc


def _same_checksum(stored: str, expected: str) -> bool:
    """Compare a HEAD checksum with ours; the ``-N`` part count suffix is optional (moto omits it)."""
    value, _, parts = stored.partition("-")
    want_value, _, want_parts = expected.partition("-")
    return value == want_value and (not parts or parts == want_parts)


class _S3Sink:
    """Data at final keys, marker first, manifest last (the commit point)."""

    def __init__(self, tier: S3TierStorage, rel: str, manifest: Manifest, *, with_manifest: bool) -> None:
        self.tier = tier
        self.rel = rel
        self.key = tier._key(rel)
        self.marker = f"{self.key}{STAGING_MARK}{_token()}"
        self.with_manifest = with_manifest
        self.written: list[str] = []
        self.writer: _S3FileWriter | None = None
        self.pool = _PartPool()
        self.untrusted: list[tuple[str, FileEntry]] = []
        self.commit_attempted = False
        self.committed = False
        with tier._errors(f"start copy of {rel}"):
            tier._put_json(self.marker, _marker_doc("copy", rel, manifest.is_dir))
            # leftovers of an earlier interrupted copy: uncommitted (no manifest), so ours to drop
            tier._delete_keys([k for k, _, _ in tier._target_objects(self.key)])
            tier._abort_uploads_under(self.key)

    def open_file(self, entry: FileEntry, source: _Reader | None = None) -> _FileWriter:
        key = f"{self.key}/{entry.path}" if entry.path else self.key
        self.written.append(key)
        self.writer = _S3FileWriter(
            self.tier, key, entry, f"{self.tier.name}:{self.rel}/{entry.path}", self.pool, _rereadable(source)
        )
        return _GuardedWriter(self, self.writer)

    def commit(self, manifest: Manifest) -> None:
        tier = self.tier
        for key, entry in self.untrusted:
            with tier._errors(f"read-back of {key}"):
                reader = _S3Reader(tier, key)
                try:
                    size, digest = hashing.hash_stream(reader)  # type: ignore[arg-type]
                finally:
                    reader.close()
            if (size, digest) != (entry.size, entry.hash):
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

    def abort(self) -> None:
        if self.committed:
            return
        if self.writer is not None:
            self.writer.abort()
        if self.commit_attempted:
            # The manifest PUT failed without a clear answer. All data is uploaded and verified, so
            # the copy is either committed (valid) or staging; deleting data could orphan a manifest.
            log.warning("%s: commit of %s uncertain; leaving it for list_staging", self.tier.name, self.rel)
            return
        try:
            self.tier._delete_keys(self.written)
            self.tier._abort_uploads_under(self.key)
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

    def finish(self) -> None:
        with self.sink.tier._errors(f"upload of {self.writer.key}"):
            self.writer.finish()
        if not self.writer.trusted:
            self.sink.untrusted.append((self.writer.key, self.writer.entry))


def _marker_doc(op: str, rel: str, is_dir: bool | None) -> dict[str, Any]:
    return {
        "op": op,
        "target": rel,
        "is_dir": is_dir,
        "started": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


class S3TierStorage(TierStorage):
    """A tier in S3-compatible object storage, through s3fs/aiobotocore."""

    is_local = False
    part_size: int = 16 * 2**20
    """Multipart part size (grown for objects that would need more than ~9000 parts); objects up
    to it are one PUT.

    Fewer requests cost less client CPU (each is ~ms of botocore) and, read from the file while
    sent, a part costs no memory: bench/s3_transfer.py, 4 x 256 MiB, medians of 5 alternating
    runs: 16 MiB parts 1.75 client CPU-s/GiB and 9.6 s, 8 MiB parts 2.09 CPU-s/GiB and 10.2 s,
    both 65.6 MiB peak RSS (boto3: 2.83 CPU-s/GiB, 10.8 s, 82.0 MiB)."""
    max_inflight: int = 3
    """Parts uploaded concurrently per file.

    From a local file the parts are read from it while they are sent (:class:`_FilePart`): memory
    does not depend on part size or this (bench/s3_transfer.py, 4 x 256 MiB: the transfer adds
    ~1 MiB to the worker's peak RSS; it added 33 MiB when parts were held in buffers). From other
    sources part buffers take ≈ (max_inflight + 1) * part_size.

    Measured against a local moto server, 4 x 256 MiB, with buffered parts: 16 MiB x 4 took 1.39
    client CPU-s/GiB, 8 MiB x 3 1.57 CPU-s/GiB, 5 MiB x 4 1.71 CPU-s/GiB; all at or above boto3's
    wall speed."""
    default_config: ClassVar[dict[str, Any]] = {
        "retries": {"max_attempts": 3, "mode": "standard"},
        "read_timeout": 120,
        "s3": {"payload_signing_enabled": False},
    }
    """botocore defaults unless ``storage_options["config_kwargs"]`` says otherwise: bounded retries
    (on top of s3fs's own 5 for transient errors), a read timeout long enough for
    CompleteMultipartUpload of a large object (s3fs's 15 s made moto time out at 1 GB), and no
    SHA-256 of every body for the signature: each body already carries its CRC32 in a signed header
    that the store checks, which is what botocore itself settles for over HTTPS; over plain HTTP it
    would otherwise hash every byte a second time (~0.9 CPU-s/GiB, bench/s3_transfer.py)."""

    def __init__(self, spec: TierSpec, *, hot: bool = False) -> None:
        super().__init__(spec, hot=hot)
        if hot:
            raise StorageError(f"tier {spec.name!r}: the hot tier must be a local path")
        rest = spec.url.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StorageError(f"tier {spec.name!r}: no bucket in URL {spec.url!r}")
        self.bucket = bucket
        prefix = prefix.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        self._secrets = _collect_secrets(spec.storage_options)
        # credentials botocore would find on its own are just as secret as configured ones
        self._add_secrets(os.environ.get(name, "") for name in _CREDENTIAL_ENV)
        self._fs: S3FileSystem | None = None

    @property
    def fs(self) -> S3FileSystem:
        """The s3fs filesystem, created on first use (importing s3fs costs ~0.5 s)."""
        if self._fs is None:
            import s3fs

            opts = dict(self.spec.storage_options)
            config = {**self.default_config, **dict(opts.pop("config_kwargs", None) or {})}
            # private instance, no listing cache: a catalog listing must never be stale
            self._fs = s3fs.S3FileSystem(
                **opts, config_kwargs=config, skip_instance_cache=True, use_listings_cache=False
            )
            # Every failed attempt that botocore or s3fs may retry is logged with its cause: a
            # flaky store should be visible before it becomes a failed move.
            self._fs.s3.meta.events.register("needs-retry.s3", self._log_retryable_failure)
            self._register_resolved_credentials()
        return self._fs

    def _log_retryable_failure(
        self,
        attempts: int = 0,
        caught_exception: BaseException | None = None,
        response: Any = None,
        **kw: Any,
    ) -> None:
        operation = getattr(kw.get("operation"), "name", "request")
        if caught_exception is not None:
            cause = _describe(caught_exception)
        else:
            http, parsed = response if isinstance(response, tuple) else (None, {})
            status = getattr(http, "status_code", 0)
            code = (parsed or {}).get("Error", {}).get("Code") or ""
            if not (status >= 500 or status == 429 or "Throttl" in code or code == "SlowDown"):
                return  # success, or an answer no retry changes (404, 412, …)
            cause = f"HTTP {status} {code}".rstrip()
        log.warning(
            "%s: S3 %s failed on attempt %d (%s); retried within the configured bounds",
            self.name,
            operation,
            attempts,
            self._redact(cause),
        )

    def _add_secrets(self, values: Iterable[str]) -> None:
        from ckptkeeper.util import logs

        found = {v for v in values if isinstance(v, str) and len(v) >= 4}
        self._secrets = sorted(set(self._secrets) | found, key=len, reverse=True)
        logs.register_secrets(self._secrets)

    def _register_resolved_credentials(self) -> None:
        """Credentials from ~/.aws, a profile or instance metadata: only the client knows them."""
        try:
            creds = self._fs.s3._request_signer._credentials  # type: ignore[union-attr]
            self._add_secrets(
                str(getattr(creds, f"_{n}", None) or "") for n in ("access_key", "secret_key", "token")
            )
        except Exception:  # private attributes of botocore: best effort
            pass

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return _URL_USERINFO.sub(r"\1***@", text)

    @contextlib.contextmanager
    def _errors(self, what: str, exc_type: type[StorageError] = StorageError) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            raise exc_type(self._redact(f"tier {self.name!r}: {what}: {_describe(exc)}")) from exc

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self.fs.call_s3(method, **kwargs)

    def _key(self, rel: str) -> str:
        _split_rel(rel)
        return self.prefix + rel

    def _part_size_for(self, size: int) -> int:
        part = self.part_size
        if size > part * 9000:
            part = -(-size // 9000)
            part = -(-part // 2**20) * 2**20
        return part

    def _put_json(self, key: str, doc: Mapping[str, Any]) -> None:
        self._call(
            "put_object",
            Bucket=self.bucket,
            Key=key,
            Body=json.dumps(doc).encode(),
            ContentType="application/json",
        )

    def _get(self, key: str) -> bytes | None:
        try:
            resp = self._call("get_object", Bucket=self.bucket, Key=key)
        except FileNotFoundError:
            return None
        from fsspec.asyn import sync

        body = resp["Body"]
        try:
            data: bytes = sync(self.fs.loop, body.read)
        finally:
            body.close()
        return data

    def _list_objects(self, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            resp = self._call("list_objects_v2", **kw)
            out.extend(resp.get("Contents", []))
            if not resp.get("IsTruncated"):
                return out
            kw["ContinuationToken"] = resp["NextContinuationToken"]

    def _head(self, key: str, *, checksum: bool = False) -> dict[str, Any] | None:
        kw = {"ChecksumMode": "ENABLED"} if checksum else {}
        try:
            resp: dict[str, Any] = self._call("head_object", Bucket=self.bucket, Key=key, **kw)
        except FileNotFoundError:
            return None
        return resp

    def _target_objects(self, key: str) -> list[tuple[str, int, float]]:
        """(key, size, mtime) of a checkpoint's data: the object ``key`` and everything under ``key/``."""
        found = [
            (o["Key"], int(o["Size"]), o["LastModified"].timestamp()) for o in self._list_objects(key + "/")
        ]
        head = self._head(key)
        if head is not None:
            found.append((key, int(head["ContentLength"]), head["LastModified"].timestamp()))
        return found

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            resp = self._call(
                "delete_objects",
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    self._redact(
                        f"tier {self.name!r}: {len(errors)} deletes failed, e.g. {first.get('Key')}: "
                        f"{first.get('Code')} {first.get('Message')}"
                    )
                )

    def _abort_uploads_under(self, key: str) -> None:
        """Abort every multipart upload in progress for ``key`` or a key under ``key/``.

        Called only by whoever holds the checkpoint's staging marker (a copy, or the discard of an
        interrupted one), so every such upload is a leftover of ours: an interrupted copy, or a
        CreateMultipartUpload whose reply was lost and that s3fs/botocore then retried.
        """
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key}
        while True:
            resp = self._call("list_multipart_uploads", **kw)
            for upload in resp.get("Uploads", []):
                if upload["Key"] == key or upload["Key"].startswith(key + "/"):
                    with contextlib.suppress(FileNotFoundError):  # completed or aborted meanwhile
                        self._call(
                            "abort_multipart_upload",
                            Bucket=self.bucket,
                            Key=upload["Key"],
                            UploadId=upload["UploadId"],
                        )
            if not resp.get("IsTruncated"):
                return
            kw["KeyMarker"] = resp.get("NextKeyMarker")
            kw["UploadIdMarker"] = resp.get("NextUploadIdMarker")

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
        except Exception:
            try:
                if self._get(key) == body:
                    return  # the first attempt landed; a retry then met If-None-Match
            except Exception:
                pass
            raise

    # -- primitives -------------------------------------------------------------------------

    def _open_read(self, rel: str, file_path: str) -> _Reader:
        if file_path:
            _split_rel(file_path, "file path in manifest")
        key = self._key(rel) + (f"/{file_path}" if file_path else "")
        return _GuardedReader(self, _S3Reader(self, key))

    def _begin_write(self, rel: str, manifest: Manifest) -> _Sink:
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
            text = self._get(key)
        return None if text is None else _parse_manifest(rel_path, text)

    def list_manifests(self) -> list[tuple[str, Manifest | None, str | None]]:
        import asyncio

        from fsspec.asyn import sync

        with self._errors(f"listing {self.url}", TierUnavailable):
            objs = self._list_objects(self.prefix)
            keys = [
                o["Key"]
                for o in objs
                if o["Key"].endswith(MANIFEST_SUFFIX) and STAGING_MARK not in o["Key"].rsplit("/", 1)[-1]
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
                out.append((rel, _parse_manifest(rel, result), None))
            except StorageError as exc:
                out.append((rel, None, str(exc)))
        return sorted(out, key=lambda t: t[0])

    def delete(self, rel_path: str) -> int:
        """Marker, then manifest (de-commit), then data; the marker goes last."""
        key = self._key(rel_path)
        with self._errors(f"delete {rel_path}"):
            objs = self._target_objects(key)
            manifest_key = key + MANIFEST_SUFFIX
            has_manifest = self._head(manifest_key) is not None
            if not objs and not has_manifest:
                return 0
            marker = f"{key}{STAGING_MARK}{_token()}"
            self._put_json(marker, _marker_doc("delete", rel_path, None))
            if has_manifest:
                self._delete_keys([manifest_key])
            self._delete_keys([k for k, _, _ in objs])
            self._delete_keys([marker])
        return sum(size for _, size, _ in objs)

    def list_staging(self) -> list[Artifact]:
        with self._errors(f"listing {self.url}", TierUnavailable):
            objs = {o["Key"]: o for o in self._list_objects(self.prefix)}
        out: list[Artifact] = []
        for key, obj in sorted(objs.items()):
            rel = key[len(self.prefix) :]
            if STAGING_MARK not in rel.rsplit("/", 1)[-1]:
                continue
            target_key = self.prefix + rel.rsplit(STAGING_MARK, 1)[0]
            newest = obj["LastModified"].timestamp()
            size = 0
            if target_key + MANIFEST_SUFFIX not in objs:  # else: a stale marker beside a committed copy
                for k, o in objs.items():
                    if k == target_key or k.startswith(target_key + "/"):
                        size += int(o["Size"])
                        newest = max(newest, o["LastModified"].timestamp())
            out.append(_staging_artifact(self.name, rel, size, newest))
        return out

    def discard_staging(self, artifact: Artifact) -> int:
        """Remove an interrupted copy (marker + uncommitted data) or just a stale marker.

        Only for artifacts older than the reaper's ``partial_after``: a copy in progress has a
        fresh marker and must not be discarded.
        """
        parts = _split_rel(artifact.path)
        if STAGING_MARK not in parts[-1]:
            raise StorageError(f"{artifact.path} is not a ckptkeeper staging artifact")
        marker = self.prefix + artifact.path
        target = artifact.path.rsplit(STAGING_MARK, 1)[0]
        target_key = self._key(target)
        with self._errors(f"discarding {artifact.path}"):
            freed = 0
            if self._head(target_key + MANIFEST_SUFFIX) is None:
                objs = self._target_objects(target_key)
                self._delete_keys([k for k, _, _ in objs])
                freed = sum(size for _, size, _ in objs)
            # uploads are never part of a committed copy: whatever is in progress under the target
            # belongs to the interrupted copy this marker records
            self._abort_uploads_under(target_key)
            self._delete_keys([marker])
        return freed

    def list_multipart_uploads(self) -> list[Artifact]:
        out: list[Artifact] = []
        with self._errors("listing multipart uploads", TierUnavailable):
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix}
            uploads: list[dict[str, Any]] = []
            while True:
                resp = self._call("list_multipart_uploads", **kw)
                uploads.extend(resp.get("Uploads", []))
                if not resp.get("IsTruncated"):
                    break
                kw["KeyMarker"] = resp.get("NextKeyMarker")
                kw["UploadIdMarker"] = resp.get("NextUploadIdMarker")
            for upload in uploads:
                size = 0
                pkw: dict[str, Any] = {
                    "Bucket": self.bucket,
                    "Key": upload["Key"],
                    "UploadId": upload["UploadId"],
                }
                while True:
                    parts = self._call("list_parts", **pkw)
                    size += sum(int(p.get("Size", 0)) for p in parts.get("Parts", []))
                    if not parts.get("IsTruncated"):
                        break
                    pkw["PartNumberMarker"] = parts["NextPartNumberMarker"]
                rel = upload["Key"][len(self.prefix) :]
                out.append(
                    Artifact(
                        tier=self.name,
                        path=rel,
                        kind=MULTIPART_KIND,
                        bytes=size,
                        last_write=upload["Initiated"].timestamp(),
                        run=rel.split("/", 1)[0],
                        upload_id=upload["UploadId"],
                    )
                )
        return out

    def abort_multipart(self, artifact: Artifact) -> None:
        if artifact.kind != MULTIPART_KIND or not artifact.upload_id:
            raise StorageError(f"{artifact.path} is not a multipart upload")
        if artifact.path.startswith("/"):
            raise StorageError(f"absolute path refused: {artifact.path!r}")
        # FileNotFoundError: already completed or aborted
        with (
            self._errors(f"aborting multipart upload of {artifact.path}"),
            contextlib.suppress(FileNotFoundError),
        ):
            self._call(
                "abort_multipart_upload",
                Bucket=self.bucket,
                Key=self.prefix + artifact.path,
                UploadId=artifact.upload_id,
            )


class _GuardedReader:
    def __init__(self, tier: S3TierStorage, reader: _S3Reader) -> None:
        self.tier = tier
        self.reader = reader

    def read(self, n: int, /) -> bytes:
        with self.tier._errors(f"reading {self.reader.key}"):
            return self.reader.read(n)

    def close(self) -> None:
        self.reader.close()
