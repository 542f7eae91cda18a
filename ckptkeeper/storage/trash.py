"""The trash of a tier (``undo_window``, docs/undo-window.md): names, and the local backend's moves.

An expired or reaped copy is moved aside, never copied byte for byte, into an *entry*
``<root>/.ckptkeeper-trash/<stamp>/<run>/<name>`` with its manifest beside it
(``…/<run>/<name>.ckptkeeper-manifest.json``, written for the hot tier too, which keeps none in
place), so the trash describes itself and a rebuilt index finds every entry again. ``<stamp>`` is
``<deleted_at in ms>-<token>``: when it was moved aside, and unique per move.

Local order, so a ``kill -9`` at any instant leaves something the executor's journal can finish or
undo (:meth:`~ckptkeeper.executor.Executor.recover`):

* **move aside**: entry manifest written (an orphan until…), one ``rename`` of the data into the
  entry (the commit point: same directory tree, same filesystem, never a copy), then the manifest
  at the old place is removed (slower tiers);
* **undelete**: the entry is re-hashed against its manifest, the manifest written at the old place
  (slower tiers; an orphan until…), one ``rename`` back (the commit point), then the entry removed;
* **purge**: the entry's tree removed through directory fds (no symlink followed, no mount crossed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from ckptkeeper.core.model import MANIFEST_SUFFIX, Manifest
from ckptkeeper.hook.protocol import TRASH_DIR
from ckptkeeper.storage.base import (
    _MAX_MANIFEST_BYTES,
    _O_CLOEXEC,
    StorageError,
    TierUnavailable,
    VerificationError,
    _check_manifest,
    _describe,
    _parse_manifest,
    _rel_of,
    _split_rel,
    _token,
)
from ckptkeeper.storage.localfs import _exists_at, _open_dirs, _remove_tree, _write_file_atomic


class LocalTierStorage(Protocol):
    """What these functions use of :class:`~ckptkeeper.storage.local.LocalTierStorage` (which
    imports this module: a protocol, not an import, keeps the package free of cycles)."""

    name: str
    hot: bool

    def _root_fd(self, exc_type: type[StorageError] = ...) -> AbstractContextManager[int]: ...
    def _parent_fd(self, parts: tuple[str, ...], *, dev_check: bool = ...) -> AbstractContextManager[int]: ...
    def _refuse_mounts(self, rel: str, what: str) -> None: ...
    def _list_files(self, rel: str, is_dir: bool) -> dict[str, int | None] | None: ...
    def verify(self, manifest: Manifest, *, deep: bool = ...) -> list[str]: ...
    def _stored_form(self, manifest: Manifest) -> Manifest: ...


__all__ = ["TRASH_DIR", "TrashListing", "entry_time", "in_entry", "new_entry"]

_STAMP = re.compile(r"^(\d{1,16})-([0-9a-f]{12})$")

TrashListing = list[tuple[str, "Manifest | None", float, "str | None"]]
"""``(entry, manifest, deleted_at, None)`` per entry holding a whole copy; ``(entry, None,
deleted_at, why)`` per entry that does not (quarantined, never purged or undeleted by guess)."""


def new_entry(now: float) -> str:
    """A fresh entry name for a copy moved aside at ``now``."""
    return f"{TRASH_DIR}/{int(now * 1000)}-{_token()}"


def entry_time(entry: str) -> float | None:
    """When the copy in ``entry`` was moved aside; None if ``entry`` is no entry name of ours."""
    parts = entry.split("/")
    if len(parts) != 2 or parts[0] != TRASH_DIR:
        return None
    m = _STAMP.match(parts[1])
    return int(m.group(1)) / 1000.0 if m else None


def check_entry(entry: str) -> tuple[str, ...]:
    """Split an entry name, refusing anything else (the index and journal are not trusted blindly)."""
    if entry_time(entry) is None:
        raise StorageError(f"not a trash entry: {entry!r}")
    return _split_rel(entry, "trash entry")


def in_entry(manifest: Manifest, entry: str) -> Manifest:
    """``manifest`` as seen inside ``entry``: its path is ``<entry>/<run>/<name>``, so the contract's
    verify / list primitives read the copy in the trash."""
    return dataclasses.replace(manifest, run=f"{entry}/{manifest.run}")


# -- the local backend ------------------------------------------------------------------------


def local_move_aside(tier: LocalTierStorage, manifest: Manifest, entry: str) -> None:
    """Move the copy of ``manifest`` into ``entry`` with one rename (see the module docstring)."""
    _check_manifest(manifest)
    manifest = _as_stored(tier, manifest)
    eparts = check_entry(entry)
    rel = _rel_of(manifest)
    parts = _split_rel(rel)
    tier._refuse_mounts(rel, "move aside")
    try:
        with tier._root_fd() as root_fd:
            dev = os.fstat(root_fd).st_dev
            with (
                _dir(root_fd, parts[:-1], dev=dev) as src_dir,
                _dir(root_fd, eparts + parts[:-1], dev=dev, create=True) as dst_dir,
            ):
                name = parts[-1]
                if not _exists_at(src_dir, name):
                    raise StorageError(f"tier {tier.name!r}: {rel} is not there to move aside")
                if os.stat(name, dir_fd=src_dir, follow_symlinks=False).st_dev != dev:
                    raise StorageError(f"tier {tier.name!r}: {rel} is on another filesystem")
                body = tier._stored_form(manifest).to_json().encode()  # how the moved files are stored
                _write_file_atomic(dst_dir, name + MANIFEST_SUFFIX, body)
                os.fsync(dst_dir)
                os.rename(name, name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
                os.fsync(dst_dir)
                os.fsync(src_dir)
                if not tier.hot and _exists_at(src_dir, name + MANIFEST_SUFFIX):
                    os.unlink(name + MANIFEST_SUFFIX, dir_fd=src_dir)
                    os.fsync(src_dir)
    except OSError as exc:
        raise StorageError(f"tier {tier.name!r}: moving {rel} aside failed: {_describe(exc)}") from exc


def local_probe(tier: LocalTierStorage, manifest: Manifest, entry: str) -> tuple[bool, bool]:
    """(the data is in ``entry``, the data is at its place): what recovery decides from."""
    check_entry(entry)
    return _exists(tier, _rel_of(in_entry(manifest, entry))), _exists(tier, _rel_of(manifest))


def local_finish_move(tier: LocalTierStorage, manifest: Manifest) -> None:
    """After the data reached the entry: drop the manifest left at the old place (slower tiers)."""
    if tier.hot or _exists(tier, _rel_of(manifest)):
        return
    parts = _split_rel(_rel_of(manifest))
    try:
        with tier._parent_fd(parts) as dir_fd:
            if _exists_at(dir_fd, parts[-1] + MANIFEST_SUFFIX):
                os.unlink(parts[-1] + MANIFEST_SUFFIX, dir_fd=dir_fd)
                os.fsync(dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(f"tier {tier.name!r}: {_describe(exc)}") from exc


def local_purge(tier: LocalTierStorage, entry: str) -> int:
    """Remove ``entry`` for good; bytes freed (0 if it is gone already)."""
    eparts = check_entry(entry)
    tier._refuse_mounts(entry, "purge")
    try:
        with tier._root_fd() as root_fd:
            dev = os.fstat(root_fd).st_dev
            with _dir(root_fd, eparts[:-1], dev=dev) as trash_fd:
                if not _exists_at(trash_fd, eparts[-1]):
                    return 0
                freed = _remove_tree(trash_fd, eparts[-1], dev)
                os.fsync(trash_fd)
                return freed
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise StorageError(f"tier {tier.name!r}: purging {entry} failed: {_describe(exc)}") from exc


def local_restore(tier: LocalTierStorage, manifest: Manifest, entry: str) -> None:
    """Undelete: re-hash the entry against ``manifest``, then rename it back into place."""
    _check_manifest(manifest)
    eparts = check_entry(entry)
    manifest = _entry_manifest(tier, manifest, entry)
    rel = _rel_of(manifest)
    parts = _split_rel(rel)
    tier._refuse_mounts(rel, "undelete")
    if _exists(tier, rel):
        raise StorageError(f"tier {tier.name!r}: a copy already occupies {rel}; not undeleting over it")
    problems = tier.verify(in_entry(manifest, entry), deep=True)
    if problems:
        raise VerificationError(
            f"tier {tier.name!r}: the trashed copy of {rel} does not match its manifest: "
            + "; ".join(problems[:5])
        )
    try:
        with tier._root_fd() as root_fd:
            dev = os.fstat(root_fd).st_dev
            with (
                _dir(root_fd, eparts + parts[:-1], dev=dev) as src_dir,
                _dir(root_fd, parts[:-1], dev=dev, create=True) as dst_dir,
            ):
                name = parts[-1]
                if not tier.hot:
                    _write_file_atomic(dst_dir, name + MANIFEST_SUFFIX, manifest.to_json().encode())
                    os.fsync(dst_dir)
                os.rename(name, name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
                os.fsync(dst_dir)
                os.fsync(src_dir)
    except OSError as exc:
        raise StorageError(f"tier {tier.name!r}: undelete of {rel} failed: {_describe(exc)}") from exc
    local_purge(tier, entry)  # what is left: the entry's manifest and directories


def local_list(tier: LocalTierStorage) -> TrashListing:
    """Every entry of the tier's trash (see :data:`TrashListing`). Raises
    :class:`TierUnavailable` when the trash cannot be read: unknown, never empty."""
    out: TrashListing = []
    try:
        with tier._root_fd(TierUnavailable) as root_fd:
            try:
                trash_fd = os.open(
                    TRASH_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=root_fd
                )
            except FileNotFoundError:
                return []
            try:
                for stamp in sorted(os.listdir(trash_fd)):
                    entry = f"{TRASH_DIR}/{stamp}"
                    when = entry_time(entry)
                    if when is None:
                        continue  # not ours (never touched)
                    out.append(_local_entry(tier, trash_fd, stamp, entry, when))
            finally:
                os.close(trash_fd)
    except OSError as exc:
        raise TierUnavailable(f"tier {tier.name!r}: listing its trash failed: {_describe(exc)}") from exc
    return out


def _local_entry(
    tier: LocalTierStorage, trash_fd: int, stamp: str, entry: str, when: float
) -> tuple[str, Manifest | None, float, str | None]:
    """The one manifest under an entry, its data present; else why not."""
    found: list[str] = []
    for dirpath, dirnames, filenames, _dfd in os.fwalk(stamp, dir_fd=trash_fd, follow_symlinks=False):
        present = set(dirnames) | set(filenames)
        for fname in filenames:
            if fname.endswith(MANIFEST_SUFFIX) and fname[: -len(MANIFEST_SUFFIX)] in present:
                found.append(f"{dirpath}/{fname}"[len(stamp) + 1 :])
        dirnames[:] = [d for d in dirnames if d + MANIFEST_SUFFIX not in present]
    if len(found) != 1:
        return entry, None, when, f"{len(found)} copies with a manifest in it (want 1)"
    rel = found[0][: -len(MANIFEST_SUFFIX)]
    try:
        fd = os.open(f"{stamp}/{found[0]}", os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=trash_fd)
        with os.fdopen(fd, "rb") as f:
            manifest = _parse_manifest(rel, f.read(_MAX_MANIFEST_BYTES + 1))
    except (OSError, StorageError) as exc:
        return entry, None, when, f"manifest: {exc}"
    damage = _sizes(tier, manifest, entry)
    if damage:
        return entry, None, when, "damaged: " + "; ".join(damage[:3])
    return entry, manifest, when, None


def _as_stored(tier: LocalTierStorage, manifest: Manifest) -> Manifest:
    """The tier's committed manifest of this version when it keeps the bytes in the content store
    (the trash entry must say so, or its content would look unreferenced); else ``manifest``."""
    from ckptkeeper.storage import content

    return content.layout(tier, manifest) or manifest  # type: ignore[arg-type]


def _entry_manifest(tier: LocalTierStorage, manifest: Manifest, entry: str) -> Manifest:
    """The manifest stored in ``entry`` if it is of this version (it says where the bytes are)."""
    moved = _rel_of(in_entry(manifest, entry))
    parts = _split_rel(moved)
    try:
        with tier._parent_fd(parts, dev_check=False) as dir_fd:
            fd = os.open(parts[-1] + MANIFEST_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
            with os.fdopen(fd, "rb") as f:
                stored = _parse_manifest(_rel_of(manifest), f.read(_MAX_MANIFEST_BYTES + 1))
    except (OSError, StorageError):
        return manifest
    return stored if stored.digest == manifest.digest else manifest


def _sizes(tier: LocalTierStorage, manifest: Manifest, entry: str) -> list[str]:
    from ckptkeeper.storage.tier import _compare_sizes

    moved = in_entry(manifest, entry)
    present = tier._list_files(_rel_of(moved), manifest.is_dir)
    return (
        [f"{_rel_of(moved)}: missing"]
        if present is None
        else _compare_sizes(_rel_of(moved), manifest, present)
    )


def _exists(tier: LocalTierStorage, rel: str) -> bool:
    parts = _split_rel(rel)
    try:
        with tier._parent_fd(parts, dev_check=False) as dir_fd:
            return _exists_at(dir_fd, parts[-1])
    except FileNotFoundError:
        return False
    except (OSError, StorageError) as exc:
        if isinstance(exc, StorageError):
            raise
        raise StorageError(f"tier {tier.name!r}: cannot look at {rel}: {_describe(exc)}") from exc


@contextlib.contextmanager
def _dir(root_fd: int, parts: tuple[str, ...], *, dev: int, create: bool = False) -> Iterator[int]:
    """A directory fd under ``root_fd``, opened without following symlinks, on filesystem ``dev``."""
    fd = _open_dirs(root_fd, parts, create=create, dev=dev)
    try:
        yield fd
    finally:
        os.close(fd)
