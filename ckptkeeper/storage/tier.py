"""The tier contract: :class:`TierStorage` (which also picks the backend for a URL), and the one
read → hash → write pass every copy and restore makes."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ckptkeeper.core.model import (
    Artifact,
    FileEntry,
    Manifest,
    TierSpec,
    TierUsage,
)
from ckptkeeper.hook.protocol import TRASH_DIR
from ckptkeeper.storage import compressed, content
from ckptkeeper.storage.base import (
    FileCopy,
    Progress,
    StorageError,
    VerificationError,
    _check_manifest,
    _describe,
    _Reader,
    _rel_of,
    _Sink,
    _split_rel,
    largest_first,
    log,
)
from ckptkeeper.storage.localfs import _LocalSink
from ckptkeeper.storage.ratelimit import tier_bucket as _tier_bucket
from ckptkeeper.util import hashing
from ckptkeeper.util.fingerprint import Fingerprint
from ckptkeeper.util.fingerprint import of as _fingerprint_of

_BACKENDS: dict[str, type[TierStorage]] = {}
"""URL scheme → backend class, filled by :meth:`TierStorage.__init_subclass__`."""


@dataclass(frozen=True, slots=True)
class Copied:
    """What :meth:`TierStorage.copy_from` committed: the manifest (with the hashes a copy that
    hashed its source computed) and, when the tier compresses, what it stored; when it dedups,
    what it uploaded and what it referenced instead."""

    manifest: Manifest
    stats: compressed.CopyStats | None = None
    deduped: content.CopyStats | None = None


class TierStorage:
    """Access to one tier. ``TierStorage(spec)`` returns the backend for the URL (as pathlib.Path does).

    ``hot=True`` marks the watched local root: no manifests are stored beside checkpoints there.
    """

    name: str
    url: str
    is_local: bool
    hot: bool
    node: str
    """This node's name (docs/design.md, "Many nodes"): the writer recorded in the manifests of copies it makes."""

    fetch_workers: ClassVar[int] = 1
    """Files of one checkpoint :meth:`fetch` copies at once. A backend whose reads wait on the
    network (S3: a round trip per object) raises it, so that a checkpoint of many objects is not
    one request after another; a local read is bound by the disk, where one stream is best."""

    schemes: ClassVar[tuple[str, ...]] = ()
    """URL schemes a backend serves (``""``: a plain path); a backend class registers itself by
    declaring them (the package imports every backend, so all are registered before any use)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for scheme in cls.__dict__.get("schemes", ()):  # declared here, not inherited
            _BACKENDS[scheme] = cls

    def __new__(cls, spec: TierSpec, *, hot: bool = False) -> TierStorage:
        if cls is TierStorage:
            scheme = spec.url.split("://", 1)[0].lower() if "://" in spec.url else ""
            backend = _BACKENDS.get(scheme)
            if backend is not None:
                return object.__new__(backend)
            raise StorageError(f"tier {spec.name!r}: unsupported URL scheme {scheme!r} (local path or s3://)")
        return object.__new__(cls)

    def __init__(self, spec: TierSpec, *, hot: bool = False) -> None:
        self.spec = spec
        self.name = spec.name
        self.url = spec.url
        self.hot = hot
        self.node = spec.node

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
        """``(rel_path, manifest, None)`` per committed copy, ``(rel_path, None, error)`` per bad one,
        ``(rel_path, manifest, "damaged copy: …")`` when the manifest is fine but the data is not
        what it says (a file missing, of another size or not a regular file): not a copy.

        Raises :class:`TierUnavailable` if the listing is incomplete for any reason.
        """
        raise NotImplementedError

    def list_manifests_and_pins(
        self,
    ) -> tuple[list[tuple[str, Manifest | None, str | None]], set[tuple[str, str]]]:
        """:meth:`list_manifests` and :meth:`list_pins` from one listing of the tier (what a
        reconcile needs: a walk of a large tier is its costliest part). Raises
        :class:`TierUnavailable` if the listing is incomplete."""
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

    def write_pin(self, run: str, name: str, step: int, node: str) -> None:
        """Store a pin object for checkpoint ``run/name`` (idempotent; the copy need not be here)."""
        raise NotImplementedError

    def remove_pin(self, run: str, name: str) -> None:
        """Remove the pin object of ``run/name``; no error if there is none."""
        raise NotImplementedError

    def list_pins(self) -> set[tuple[str, str]]:
        """(run, name) of every valid pin object. Raises :class:`TierUnavailable` if the listing
        is incomplete: pins of a tier we could not list are unknown, not absent."""
        raise NotImplementedError

    def list_multipart_uploads(self) -> list[Artifact]:
        return []

    def abort_multipart(self, artifact: Artifact) -> None:
        raise StorageError(f"tier {self.name!r} has no multipart uploads")

    def same_filesystem(self, other: TierStorage) -> bool:
        return False

    # -- trash (undo_window; layout and order in :mod:`ckptkeeper.storage.trash`) -------------

    def move_aside(self, manifest: Manifest, entry: str) -> None:
        """Move this tier's copy of ``manifest`` into trash entry ``entry`` (never a byte copy
        through this host: a rename locally, a server-side copy + delete in S3), manifest beside it."""
        raise StorageError(f"tier {self.name!r} has no trash")

    def probe_aside(self, manifest: Manifest, entry: str) -> tuple[bool, bool]:
        """(a whole copy is in ``entry``, data is still at its place): what journal recovery reads."""
        raise StorageError(f"tier {self.name!r} has no trash")

    def finish_aside(self, manifest: Manifest) -> None:
        """Once the copy is whole in its entry: remove what is left at the old place (idempotent)."""
        raise StorageError(f"tier {self.name!r} has no trash")

    def list_trash(self) -> list[tuple[str, Manifest | None, float, str | None]]:
        """Every trash entry: ``(entry, manifest, deleted_at, None)``, or ``(entry, None,
        deleted_at, why)`` for one that holds no whole copy. Raises :class:`TierUnavailable`."""
        return []

    def purge_trash(self, entry: str) -> int:
        """Remove ``entry`` for good; bytes freed (0 if already gone)."""
        raise StorageError(f"tier {self.name!r} has no trash")

    def undelete(self, manifest: Manifest, entry: str) -> None:
        """Bring the copy in ``entry`` back to its place, checked against ``manifest``; refuses
        when something occupies the place."""
        raise StorageError(f"tier {self.name!r} has no trash")

    def copy_from(
        self,
        src: TierStorage,
        manifest: Manifest,
        *,
        progress: Progress | None = None,
        replace_damaged: bool = False,
        fingerprints: Mapping[str, Fingerprint] | None = None,
        before_commit: Callable[[], object] | None = None,
    ) -> Copied:
        """Copy checkpoint ``manifest`` from ``src`` into this tier, verified and committed; return
        the manifest committed and, when this tier compresses, what it stored (raw and stored
        bytes, CPU).

        One pass over the source: each chunk is read once, hashed and written. The source's size
        and hash must equal the manifest (else :class:`VerificationError`: it changed since it
        was cataloged), the destination's size (and, for S3, checksum) is checked, then the copy
        is committed. If this tier already holds a committed copy of the same version the call is
        a no-op (idempotent for journal replay); a different version raises :class:`StorageError`.
        ``replace_damaged``: the index knows this tier's copy of this version is bad (a scrub found
        its bytes wrong, which the size check here cannot see): it is replaced, never kept.
        On failure nothing is committed, the source is untouched, and staging is removed or left
        where :meth:`list_staging` finds it.

        ``fingerprints`` (file path -> :class:`Fingerprint`, as the catalog saw a local source):
        the source was not hashed yet. Its hashes are computed in this one pass (``manifest``'s are
        ignored) and each file must keep its fingerprint from before its first byte is read until
        the copy is committed, or :class:`VerificationError`: it changed since it was cataloged.
        The manifest committed (and returned) carries the hashes computed.

        ``before_commit``: called once every byte is written and checked, right before the copy is
        committed (the caller's journal flush, run beside the copy: it must be durable first).
        """
        _check_manifest(manifest)
        manifest = compressed.raw_form(
            content.plain(manifest)
        )  # how another tier holds the bytes says nothing here
        if self.node and not self.hot and manifest.node != self.node:
            # A copy belongs to the node that wrote it (docs/design.md, "Many nodes"); the digest is content only.
            manifest = dataclasses.replace(manifest, node=self.node)
        rel = _rel_of(manifest)
        if not self.hot:
            existing = self.read_manifest(rel)
            if existing is not None and fingerprints is not None:
                raise StorageError(
                    f"tier {self.name!r} already holds a copy of {rel}; the source is hashed in place"
                )
            if existing is not None and existing.digest == manifest.digest:
                damage = self.recheck(manifest) or (
                    ["bytes do not match the manifest (found by a scrub)"] if replace_damaged else []
                )
                if not damage:
                    log.info("%s: %s already holds version %s", self.name, rel, manifest.digest)
                    return Copied(existing)
                # A committed manifest over missing or changed data is not a copy: drop what is
                # left of it (de-commit first, as every delete does) and copy it again.
                log.warning(
                    "%s: %s holds a damaged copy of version %s (%s); copying it again",
                    self.name,
                    rel,
                    manifest.digest,
                    "; ".join(damage[:3]),
                )
                self.delete(rel)
                existing = None
            if existing is not None:
                raise StorageError(_other_version(self.name, rel, content.plain(existing), manifest))
        if self.spec.dedup and not self.hot:
            if fingerprints is not None:
                raise StorageError(
                    f"{rel}: a dedup tier takes only hashed checkpoints (the content store is keyed by hash)"
                )
            return Copied(
                manifest,
                deduped=content.copy_deduped(
                    self, src, manifest, _limiter(src, self, progress), rehash=replace_damaged
                ),
            )
        source, src_stored = src._how_stored(manifest)
        sink = self._encoding(self._begin_write(rel, manifest), rel)
        limit = _limiter(src, self, progress)
        try:
            if source is not None:  # a dedup copy in src: its bytes are in src's content store
                content.stream_into(src, rel, source, sink, limit)
            else:
                hashed = _stream_checkpoint(src, rel, src_stored, sink, limit, fingerprints)
                if fingerprints is not None:
                    _check_unchanged(src, rel, manifest, fingerprints)
                    manifest = dataclasses.replace(manifest, files=tuple(hashed))
            if before_commit is not None:
                before_commit()
            sink.commit(manifest)
        except BaseException as exc:
            sink.abort()
            if isinstance(exc, StorageError) or not isinstance(exc, Exception):
                raise
            raise StorageError(
                f"copy of {rel} from {src.name!r} to {self.name!r} failed: {_describe(exc)}"
            ) from exc
        return Copied(manifest, sink.stats if isinstance(sink, compressed.EncodingSink) else None)

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
            layout, stored = self._how_stored(manifest)  # in the try: a manifest unreadable leaves no staging
            if layout is not None:
                content.stream_into(self, rel, layout, sink, progress, workers=self.fetch_workers)
            elif any(e.encoding for e in stored.files):  # decoded as it streams: no ranged fast path
                _stream_concurrently(
                    self, rel, stored, sink, progress, max(1, min(self.fetch_workers, len(stored.files)))
                )
            else:
                self._fetch_files(rel, manifest, sink, progress)
            sink.commit(manifest)
        except BaseException as exc:
            sink.abort()  # every worker has stopped: the staging directory goes, nothing partial stays
            if isinstance(exc, StorageError) or not isinstance(exc, Exception):
                raise
            raise StorageError(f"restore of {rel} from {self.name!r} failed: {_describe(exc)}") from exc
        return to_dir / manifest.name

    def _fetch_files(self, rel: str, manifest: Manifest, sink: _LocalSink, progress: Progress | None) -> None:
        """Write every file of ``manifest`` into ``sink``, each checked against its entry (size and
        hash) as it is written; not committed. A backend may fetch its own way (S3: ranged GETs)."""
        workers = min(self.fetch_workers, len(manifest.files))
        if workers > 1:
            _stream_concurrently(self, rel, manifest, sink, progress, workers)
        else:
            _stream_checkpoint(self, rel, manifest, sink, progress)

    def verify(self, manifest: Manifest, *, deep: bool = True, on_bytes: Progress | None = None) -> list[str]:
        """Check this tier's copy against ``manifest``; return mismatch descriptions ([] = ok).

        ``deep`` re-hashes every byte (a download for S3); otherwise only presence and sizes.
        Files present but not in the manifest are reported too. ``on_bytes(n)`` is called after
        each chunk read (the scrub's throttle: it may sleep, or raise to stop the check).
        """
        _check_manifest(manifest)
        rel = _rel_of(manifest)
        in_content, stored = self._how_stored(manifest)
        if in_content is not None:
            return content.verify(self, in_content, deep=deep, on_bytes=on_bytes)
        present = self._list_files(rel, manifest.is_dir)
        if present is None:
            return [f"{rel}: missing"]
        manifest = stored
        problems = _compare_sizes(rel, manifest, present)
        for entry in manifest.files:
            where = f"{rel}/{entry.path}" if entry.path else rel
            if present.get(entry.path) != entry.stored_size:
                continue  # already reported by _compare_sizes
            if deep:
                reader = self._open_entry(rel, entry)
                try:
                    got_size, digest = _hash_reader(reader, on_bytes)
                except VerificationError as exc:  # compressed bytes that do not decode
                    problems.append(str(exc))
                    continue
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

    def recheck(self, manifest: Manifest) -> list[str]:
        """Is this tier's copy still what ``manifest`` says, in storage, now? ([] = intact).

        The check made right before a delete that leaves this copy as a survivor (and before a
        copy is skipped because the destination "already holds" it): the committed manifest is
        there and names this version (slower tiers), and every file is present, a regular file,
        of the manifest's size. Nothing is read or hashed, so it costs a stat per file here (a
        HEAD per object in S3): cheap enough to run before every delete. Content changed in
        place at the same size is :meth:`verify`'s job. Raises :class:`StorageError` when the
        tier cannot answer: unknown is not damaged.
        """
        _check_manifest(manifest)
        rel = _rel_of(manifest)
        committed = None
        if not self.hot:
            committed = self.read_manifest(rel)
            if committed is None:
                return [f"{rel}: no committed copy (manifest or data missing)"]
            if committed.digest != manifest.digest:
                return [f"{rel}: holds version {committed.digest}, not {manifest.digest}"]
            if content.has_content(committed):
                return content.recheck(self, committed)
        present = self._list_files(rel, manifest.is_dir)
        if present is None:
            return [f"{rel}: missing"]
        return _compare_sizes(rel, committed or manifest, present)  # the sizes this tier stores

    # -- compression (docs/compression.md; :mod:`ckptkeeper.storage.compressed`) ---------------

    def _encoding(self, sink: _Sink, rel: str) -> _Sink:
        """The sink of a new copy: compressing when this slower tier's ``compression`` is on."""
        mode = getattr(self.spec, "compression", "none")
        if self.hot or mode == "none":
            return sink
        root = getattr(self, "root", None) if self.is_local else None  # spool on the tier's own disk
        spool = None if root is None else str(root)
        return compressed.EncodingSink(sink, mode, f"{self.name}:{rel}", spool, store_behind=1)

    def _stored_form(self, manifest: Manifest) -> Manifest:
        """``manifest`` with how this tier stores each file, from its committed manifest (the
        index's copy says nothing about a tier's encoding)."""
        if self.hot:
            return compressed.raw_form(manifest)
        return compressed.with_stored_form(manifest, self._committed(manifest))

    def _how_stored(self, manifest: Manifest) -> tuple[Manifest | None, Manifest]:
        """Where this tier holds ``manifest``'s bytes, from one read of its committed manifest
        (a GET on S3): the content store's layout (:func:`content.layout`; None: files at their
        paths) and :meth:`_stored_form`."""
        if self.hot:
            return None, compressed.raw_form(manifest)
        committed = self._committed(manifest)
        return content.layout_from(self, manifest, committed), compressed.with_stored_form(
            manifest, committed
        )

    def _committed(self, manifest: Manifest) -> Manifest | None:
        """This tier's committed manifest at ``manifest``'s path (None: none there, or a trash
        entry's, whose manifest names the copy's own path and is read as raw)."""
        rel = _rel_of(manifest)
        try:
            return self.read_manifest(rel)
        except StorageError:
            if not rel.startswith(TRASH_DIR + "/"):
                raise
            return None

    def _open_entry(self, rel: str, entry: FileEntry) -> _Reader:
        """A reader of ``entry``'s raw bytes: decoded on the way when the tier stores it encoded."""
        where = f"{self.name}:{rel}/{entry.path}" if entry.path else f"{self.name}:{rel}"
        return compressed.open_entry(self._open_read(rel, entry.path), entry, where)


def _hash_reader(reader: _Reader, on_bytes: Progress | None) -> tuple[int, str]:
    """(size, digest) of everything ``reader`` gives, reporting each chunk to ``on_bytes``."""
    hasher = hashing.new_hasher()
    size = 0
    while chunk := reader.read(hashing.CHUNK_SIZE):
        hasher.update(chunk)
        size += len(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return size, hasher.hexdigest()


def _compare_sizes(rel: str, manifest: Manifest, present: dict[str, int | None]) -> list[str]:
    """What is missing, not a regular file, or of another size than ``manifest`` says."""
    problems: list[str] = []
    for entry in manifest.files:
        if entry.location:
            continue  # in the content store: checked there (storage/content.py), not at its path
        where = f"{rel}/{entry.path}" if entry.path else rel
        if entry.path not in present:
            problems.append(f"{where}: missing")
            continue
        size = present[entry.path]
        if size is None:
            problems.append(f"{where}: not a regular file")
        elif size != entry.stored_size:
            problems.append(f"{where}: size {size} != {entry.stored_size} in manifest")
    return problems


def _stream_checkpoint(
    src: TierStorage,
    rel: str,
    manifest: Manifest,
    sink: _Sink,
    progress: Progress | None,
    fingerprints: Mapping[str, Fingerprint] | None = None,
) -> list[FileEntry]:
    """The single read → hash → write pass over every file of a checkpoint; returns the entries
    as hashed (``fingerprints``: the source is checked by them, not by ``manifest``'s hashes).

    A local source is read with ``readinto`` into one reused buffer (no allocation per chunk);
    writers get a view of it that is only valid during ``write`` and must copy what they keep.
    """
    buf = bytearray(hashing.CHUNK_SIZE)
    out = []
    for entry in manifest.files:
        fp = None if fingerprints is None else fingerprints[entry.path]
        digest = _stream_file(src, rel, entry, sink, progress, buf, fingerprint=fp)
        out.append(dataclasses.replace(entry, hash=digest))
    return out


def _stream_concurrently(
    src: TierStorage,
    rel: str,
    manifest: Manifest,
    sink: _LocalSink,
    progress: Progress | None,
    workers: int,
) -> None:
    """:func:`_stream_checkpoint` with ``workers`` files in flight at once (a restore from S3).

    Each file is still read, hashed against its manifest entry and written in one pass by one
    thread; the largest files start first, so that no big object is left to run alone at the end.
    The first failure stops the other workers (at their next chunk) and is raised once all of them
    have returned, so the caller's abort never races a writer. Returns only when every file is
    written and checked; the commit (fsync, rename into place) stays with the caller.
    """

    def make_worker() -> FileCopy:
        buf = bytearray(hashing.CHUNK_SIZE)  # one per thread, reused for every file it copies

        def copy(entry: FileEntry, report: Progress | None, stop: threading.Event) -> None:
            _stream_file(src, rel, entry, sink, report, buf, stop)

        return copy

    largest_first(manifest.files, workers, make_worker, progress, "ckptkeeper-fetch")


def _stream_file(
    src: TierStorage,
    rel: str,
    entry: FileEntry,
    sink: _Sink,
    progress: Progress | None,
    buf: bytearray,
    stop: threading.Event | None = None,
    *,
    fingerprint: Fingerprint | None = None,
) -> str:
    """Read → hash → write one file of a checkpoint, checked against its manifest entry; returns
    the hash. With ``fingerprint`` the hash is the one to record (the entry's is not known yet):
    the open file must show that fingerprint before the first byte is read and after the last.

    ``stop`` (set when another file of a concurrent fetch failed) ends the copy early.
    """
    view = memoryview(buf)
    where = f"{src.name}:{rel}/{entry.path}" if entry.path else f"{src.name}:{rel}"
    reader = src._open_entry(rel, entry)
    try:
        if fingerprint is not None:
            _check_fingerprint(where, reader, fingerprint)
        # Hashed on the way: a backend's sink gets no source to read again (an S3 upload sends
        # the bytes read here, docs/uploads.md), so every byte stored is one this pass read.
        rereadable = fingerprint is None or isinstance(sink, compressed.EncodingSink)
        writer = sink.open_file(entry, reader if rereadable else None)
        hasher = hashing.new_hasher()
        size = 0
        readinto = getattr(reader, "readinto", None)
        while True:
            if stop is not None and stop.is_set():
                raise StorageError(f"{where}: stopped, another file of the checkpoint failed")
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
        if fingerprint is not None:
            _check_fingerprint(where, reader, fingerprint)
        elif digest != entry.hash:
            raise VerificationError(
                f"{where}: hash {digest} != {entry.hash} in manifest (changed since cataloged)"
            )
        writer.finish()
        return digest
    finally:
        reader.close()


def _check_fingerprint(where: str, reader: _Reader, expected: Fingerprint) -> None:
    """The open source file is the one the catalog saw, unchanged (size, times, inode)."""
    fileno = getattr(reader, "fileno", None)
    if fileno is None:
        raise StorageError(f"{where}: cannot be checked by its fingerprint (not a local file)")
    got = _fingerprint_of(os.fstat(fileno()))
    if got != expected:
        raise VerificationError(f"{where}: {_fingerprint_change(got, expected)} (changed since cataloged)")


def _check_unchanged(
    src: TierStorage, rel: str, manifest: Manifest, fingerprints: Mapping[str, Fingerprint]
) -> None:
    """Right before the commit: every source path still names the file the catalog saw,
    unchanged (a file renamed over one already copied is caught here)."""
    for entry in manifest.files:
        where = f"{src.name}:{rel}/{entry.path}" if entry.path else f"{src.name}:{rel}"
        reader = src._open_read(rel, entry.path)
        try:
            _check_fingerprint(where, reader, fingerprints[entry.path])
        finally:
            reader.close()


def _fingerprint_change(got: Fingerprint, expected: Fingerprint) -> str:
    if (got.ino, got.dev) != (expected.ino, expected.dev):
        return "another file than the one cataloged"
    if got.size != expected.size:
        return f"{got.size} bytes, {expected.size} when cataloged"
    return "written to (mtime or ctime moved)"


def _limiter(src: TierStorage, dst: TierStorage, progress: Progress | None) -> Progress | None:
    """``progress``, preceded by the ``max_rate`` throttles of both tiers (docs/bandwidth.md)."""
    buckets = [b for b in (_tier_bucket(src.spec), _tier_bucket(dst.spec)) if b is not None]
    if not buckets:
        return progress

    def limit(n: int) -> None:
        for bucket in buckets:
            bucket.consume(n)
        if progress is not None:
            progress(n)

    return limit


def _other_version(tier: str, rel: str, existing: Manifest, manifest: Manifest) -> str:
    """Why a copy is not made over another version: whose that version is, and that it stays (it
    may be its only copy: nothing here advises removing it)."""
    import time

    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(existing.created_at))
    whose = f"node {existing.node}'s" if existing.node else "a"
    missing = sorted({e.path for e in manifest.files} - {e.path for e in existing.files})
    if missing and set(existing.files) < set(manifest.files):
        # Every file of that copy is in this version, byte for byte: an older listing of the same
        # checkpoint (cataloged before a committed checkpoint's temp-named files were its files).
        return (
            f"tier {tier!r} holds an older listing of {rel}, {whose} copy (version {existing.digest[:12]}, "
            f"saved {when}) without {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}; every file it "
            f"has is in this version ({manifest.digest[:12]}) too, byte for byte. It is kept and this one stays "
            "where it is. Removing that copy (and its manifest) by hand loses nothing this version does not "
            "hold while this copy stays in its tier; then scan, to have it copied whole "
            "(docs/concepts.md, Completeness)"
        )
    return (
        f"tier {tier!r} already holds another version of {rel}: {whose} version {existing.digest[:12]} "
        f"(saved {when}), not this one ({manifest.digest[:12]}). Both are kept (that copy may be the only "
        "one of its version) and this one stays where it is. Several nodes writing one tier need "
        "shared = true on it, on every node (docs/configuration-safety.md)"
    )
