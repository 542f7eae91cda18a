"""Writing into a local directory the safe way: walks through directory file descriptors
(``O_NOFOLLOW``, ``st_dev`` checks), atomic small files, writeback while copying, and the sink
that stages a checkpoint and commits it with one ``rename``.

Used by the local backend (copies into a tier) and by every backend's restore (``fetch`` writes
into a local directory).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ckptkeeper.core.model import (
    MANIFEST_SUFFIX,
    FileEntry,
    Manifest,
)
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import (
    _O_CLOEXEC,
    _O_DIR,
    StorageError,
    VerificationError,
    _describe,
    _FileWriter,
    _Reader,
    _split_rel,
    _token,
    log,
)


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


_T = TypeVar("_T")


def _alongside(background: Callable[[], object] | None, foreground: Callable[[], _T]) -> _T:
    """Run ``background`` in a thread while ``foreground`` runs here; return once both have
    finished, raising the first failure (the foreground's first).

    Why: two flushes that do not depend on each other (the journal's intent and the manifest's
    data; the two directories of a rename) issued together wait for one device flush, where one
    after the other waits for two — an fsync releases the GIL, and journaling filesystems (ext4,
    xfs) commit concurrent fsyncs together. A thread per call (~80 µs, joined here) rather than a
    pool: nothing outlives the move."""
    if background is None:
        return foreground()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            background()
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    thread = threading.Thread(target=run, name="ckptkeeper-flush", daemon=True)
    thread.start()
    try:
        out = foreground()
    finally:
        thread.join()  # nothing after this may run before the flush is done
    if errors:
        raise errors[0]
    return out


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
    tmp = _stage_file(dir_fd, name, data)
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _stage_file(dir_fd: int, name: str, data: bytes) -> str:
    """Write ``data`` durably under a staging name for ``name`` in ``dir_fd`` (temp + fsync);
    return that name. The caller renames it into place (or unlinks it)."""
    tmp = f"{name}{STAGING_MARK}{_token()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC, 0o666, dir_fd=dir_fd)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return tmp


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
    regular files with a single link count as freed. Large files are unlinked on a few threads at
    once (:func:`_unlink_large`).
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return _freed(st)
    fd = os.open(name, _O_DIR, dir_fd=dir_fd)  # ELOOP if swapped for a symlink meanwhile
    try:
        fst = os.fstat(fd)
        if fst.st_dev != dev or fst.st_ino != st.st_ino:
            raise StorageError(f"refusing to delete {name!r}: another filesystem, or it changed under us")
        with os.scandir(fd) as it:
            children = [e.name for e in it]
        large: list[tuple[str, os.stat_result]] = []
        for child in children:
            cst = os.stat(child, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(cst.st_mode) and cst.st_size >= PARALLEL_UNLINK_MIN:
                large.append((child, cst))
        rest = [c for c in children if c not in {n for n, _ in large}]
        freed = _unlink_large(fd, large, lambda: sum(_remove_tree(fd, child, dev) for child in rest))
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)
    return freed


def _freed(st: os.stat_result) -> int:
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


PARALLEL_UNLINK_MIN = 64 * 2**20
"""Files at least this large are unlinked beside each other (:func:`_unlink_large`)."""
_UNLINK_THREADS = 4


def _unlink_large(dir_fd: int, large: list[tuple[str, os.stat_result]], rest: Callable[[], int]) -> int:
    """Unlink the regular files ``large`` of ``dir_fd`` on up to :data:`_UNLINK_THREADS` threads,
    largest first, while ``rest()`` (the other children) runs here; bytes freed by both.

    Why: the unlink of a file returns its pages or blocks to the system before it returns (on
    tmpfs, the hot tier's stand-in, ~0.15 s per GiB here), single-threaded per file; a checkpoint's
    few large files freed side by side take the time of the largest (bench/tier_move.py). The
    files are already de-committed (under the delete's tombstone) when this runs.
    """
    if not large:
        return rest()
    pending = iter(sorted(large, key=lambda item: -item[1].st_size))
    lock = threading.Lock()
    freed = [0]
    errors: list[BaseException] = []

    def drain() -> None:
        try:
            while not errors:
                with lock:
                    item = next(pending, None)
                if item is None:
                    return
                os.unlink(item[0], dir_fd=dir_fd)
                with lock:
                    freed[0] += _freed(item[1])
        except BaseException as exc:  # raised below, once every thread has stopped
            errors.append(exc)

    helpers = min(len(large), _UNLINK_THREADS, os.cpu_count() or 1)
    threads = [threading.Thread(target=drain, name=f"ckptkeeper-unlink-{i}") for i in range(helpers)]
    for t in threads:
        t.start()
    try:
        out = rest()
        drain()  # then help with what is left
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return out + freed[0]


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
        self.sink._written(self)
        self.fd = None

    def close(self) -> None:
        with self.sink.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            self.sink.writers.discard(self)


class _LocalSink:
    """Writes ``root/<parts>`` under a staging name; commit = manifest, then rename into place.

    Files may be written from several threads at once (a restore fetches the objects of a
    checkpoint concurrently): creating files and directories, and the bookkeeping of open and
    unsynced descriptors, happen under :attr:`lock`; each writer is used by one thread.
    """

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
        self.lock = threading.Lock()
        self.writers: set[_LocalFileWriter] = set()
        """Files open for writing (abort closes them all)."""
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
        parts = _split_rel(entry.path, "file path in manifest") if self.is_dir else ()
        with self.lock:
            try:
                if self.is_dir:
                    fd = os.open(parts[-1], flags, 0o666, dir_fd=self._dir(parts[:-1]))
                else:
                    fd = os.open(self.staging, flags, 0o666, dir_fd=self.parent_fd)
            except OSError as exc:
                raise StorageError(f"cannot create {where}: {_describe(exc)}") from exc
            writer = _LocalFileWriter(fd, entry, where, self)
            self.writers.add(writer)
        return writer

    def _written(self, writer: _LocalFileWriter) -> None:
        """``writer`` is done: its descriptor waits for the commit's fsync."""
        with self.lock:
            assert writer.fd is not None
            self.writers.discard(writer)
            self.unsynced.append(writer.fd)
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

    def _sync_contents(self) -> None:
        while self.unsynced:  # file data first, then the directory entries naming the files
            self._sync_oldest()
        # deepest first: a directory entry is durable once its parent directory is synced
        for parts in sorted(self.dir_fds, key=len, reverse=True):
            os.fsync(self.dir_fds[parts])
        self._close_dirs()

    def _commit_manifest(self, manifest: Manifest) -> None:
        """Flush the copy and, beside it, the manifest under a staging name (two flushes that
        depend on nothing but each other's end: see :func:`_alongside`); then rename the manifest
        into place, once both are durable."""
        staged: list[str] = []

        def stage() -> None:
            staged.append(_stage_file(self.parent_fd, self.manifest_name, manifest.to_json().encode()))

        try:
            _alongside(stage, self._sync_contents)
            os.rename(staged[0], self.manifest_name, src_dir_fd=self.parent_fd, dst_dir_fd=self.parent_fd)
        except BaseException:
            for tmp in staged:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self.parent_fd)
            raise
        self.manifest_written = True

    def commit(self, manifest: Manifest) -> None:
        try:
            if self.with_manifest:
                self._commit_manifest(manifest)
            else:
                self._sync_contents()
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
        for writer in list(self.writers):
            writer.close()
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
