"""The bottom of the storage package: errors, shared constants, checks of tier-relative paths and
of manifests (a tier is untrusted input, docs/design.md, safety invariant 9), and the protocols of readers, writers and sinks.

Every other module of the package builds on this one; it imports none of them.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from ckptkeeper.core.model import (
    HASH_ALGORITHM,
    Artifact,
    FileEntry,
    Manifest,
)

log = logging.getLogger("ckptkeeper.storage")
"""The one logger of the package (its name predates the split into modules; log lines keep it)."""

STAGING_KIND = "ckptkeeper-staging"
PIN_SUFFIX = ".ckptkeeper-pin.json"
"""A pin object beside a checkpoint's manifest, ``<run>/<name>.ckptkeeper-pin.json`` (docs/design.md, "Many nodes"):
pins survive a lost index, and other nodes see them. Written to every slower tier on ``pin``
(whether or not the tier holds a copy yet), removed on ``unpin``, read back by every listing."""
_MAX_PIN_BYTES = 64 * 1024
MULTIPART_KIND = "multipart-upload"

Progress = Callable[[int], None]
"""Called with the number of bytes just copied (an increment, not a total)."""

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
_MAX_MANIFEST_BYTES = 256 * 2**20

DAMAGED_COPY = "damaged copy: "
"""Start of the error :meth:`TierStorage.list_manifests` gives, beside a valid manifest, for a copy
whose data does not match it (files missing, of another size or type)."""


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


def _pin_doc(run: str, name: str, step: int, node: str) -> bytes:
    import json
    import time

    return json.dumps(
        {
            "kind": "ckptkeeper-pin",
            "run": run,
            "name": name,
            "step": step,
            "node": node,
            "pinned_at": time.time(),
        },
        sort_keys=True,
    ).encode()


def _parse_pin(rel: str, data: bytes) -> tuple[str, str] | None:
    """(run, name) of a pin object found at ``rel`` (the checkpoint's path); None if it is not a
    valid pin for that path (untrusted input: ignored, never a crash)."""
    import json

    if len(data) > _MAX_PIN_BYTES:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    run, name = doc.get("run"), doc.get("name")
    if not isinstance(run, str) or not isinstance(name, str) or f"{run}/{name}" != rel:
        return None
    try:
        _split_rel(rel)
    except StorageError:
        return None
    return run, name


FileCopy = Callable[[FileEntry, "Progress | None", threading.Event], None]
"""Copies one file of a checkpoint, reporting bytes to the progress given and stopping at its next
chunk once the event is set (another file failed)."""


def largest_first(
    entries: Iterable[FileEntry],
    workers: int,
    make_worker: Callable[[], FileCopy],
    progress: Progress | None,
    name: str,
) -> None:
    """Run ``make_worker()``'s copy (one per thread, so each may keep its own buffer) over every
    entry on ``workers`` threads, the largest files first, so no big file is left to run alone at
    the end. The first failure stops the other threads at their next chunk and is raised once all
    of them have returned, so the caller's abort (its staging removed) never races a writer;
    Ctrl-C while waiting does the same."""
    pending = iter(sorted(entries, key=lambda e: (-e.size, e.path)))
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    report: Progress | None = None
    if progress is not None:
        outer = progress

        def report(n: int) -> None:
            with lock:
                outer(n)

    def work() -> None:
        copy = make_worker()
        while not stop.is_set():
            with lock:
                entry = next(pending, None)
            if entry is None:
                return
            try:
                copy(entry, report, stop)
            except BaseException as exc:  # raised by the caller's thread below
                with lock:
                    errors.append(exc)  # before stop is set: the first error is a real one
                stop.set()
                return

    threads = [threading.Thread(target=work, name=f"{name}-{i}") for i in range(workers)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C while waiting: stop the workers before the staging goes
        stop.set()
        for t in threads:
            t.join()
        raise
    if errors:
        raise errors[0]
