"""The local backend: a tier on a local (or NFS/Lustre-mounted) filesystem, through directory fds."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from ckptkeeper.core.model import (
    MANIFEST_SUFFIX,
    Artifact,
    Manifest,
    TierSpec,
    TierUsage,
)
from ckptkeeper.hook.protocol import STAGING_MARK, TRASH_DIR
from ckptkeeper.storage import content, trash
from ckptkeeper.storage.base import (
    _MAX_MANIFEST_BYTES,
    _MAX_PIN_BYTES,
    _O_CLOEXEC,
    DAMAGED_COPY,
    PIN_SUFFIX,
    StorageError,
    TierUnavailable,
    VerificationError,
    _check_manifest,
    _describe,
    _parse_manifest,
    _parse_pin,
    _pin_doc,
    _Reader,
    _rel_of,
    _Sink,
    _split_rel,
    _staging_artifact,
    _token,
    log,
)
from ckptkeeper.storage.localfs import (
    _alongside,
    _exists_at,
    _LocalSink,
    _open_dirs,
    _remove_tree,
    _scan_tree,
    _stage_file,
    _write_file_atomic,
)
from ckptkeeper.storage.tier import TierStorage, _compare_sizes
from ckptkeeper.util.mounts import mounts_crossed, mounts_under


class LocalTierStorage(TierStorage):
    """A tier on a local (or NFS/Lustre-mounted) filesystem."""

    is_local = True
    schemes = ("", "file", "local")

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

    def _mounts_under(self) -> frozenset[str]:
        """Mount points below the root (relative paths): never walked, copied or deleted into."""
        return mounts_under(self.root)

    def _refuse_mounts(self, rel: str, what: str) -> None:
        crossed = mounts_crossed(self.root, rel)
        if crossed:
            raise StorageError(
                f"tier {self.name!r}: refusing to {what} {rel}: mount point {', '.join(crossed)} "
                "(mount points under a tier root, bind mounts included, are never crossed; unmount it)"
            )

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
                mounts = self._mounts_under()

                def fail(exc: OSError) -> None:
                    raise exc

                for dirpath, dirnames, filenames, dfd in os.fwalk(
                    parts[-1], dir_fd=dir_fd, follow_symlinks=False, onerror=fail
                ):
                    base = dirpath[len(parts[-1]) + 1 :]
                    inside = f"{rel}/{base}" if base else rel
                    if mounts:  # a bind mount is not part of the copy: neither listed nor entered
                        dirnames[:] = [d for d in dirnames if f"{inside}/{d}" not in mounts]
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
        return _parse_at(rel_path, text)

    def list_manifests(self) -> list[tuple[str, Manifest | None, str | None]]:
        if self.hot:
            raise StorageError(f"tier {self.name!r} is the hot tier: it holds no manifests")
        listing: list[tuple[str, Manifest | None, str | None]] = []
        self._scan(listing, None)
        return sorted(listing, key=lambda t: t[0])

    def list_manifests_and_pins(
        self,
    ) -> tuple[list[tuple[str, Manifest | None, str | None]], set[tuple[str, str]]]:
        """Both from one walk of the tier: a reconcile needs both, and a walk of a large tier on a
        network filesystem is its costliest part."""
        if self.hot:
            raise StorageError(f"tier {self.name!r} is the hot tier: it holds no manifests")
        listing: list[tuple[str, Manifest | None, str | None]] = []
        pins: set[tuple[str, str]] = set()
        self._scan(listing, pins)
        return sorted(listing, key=lambda t: t[0]), pins

    def _scan(
        self, listing: list[tuple[str, Manifest | None, str | None]] | None, pins: set[tuple[str, str]] | None
    ) -> None:
        """One walk of the tier, adding to ``listing`` what :meth:`list_manifests` reports and to
        ``pins`` what :meth:`list_pins` does (each skipped when None).

        Manifests and pins sit beside the checkpoint they describe, so the walk enters neither
        staging directories nor a committed checkpoint's contents (a manifest or pin in there
        would describe nothing of ours). Any unreadable directory fails the whole walk
        (:class:`TierUnavailable`): what a tier holds is unknown, never taken for absent.
        """
        mounts = self._mounts_under()

        def fail(exc: OSError) -> None:
            raise exc

        with self._root_fd(TierUnavailable) as root_fd:
            try:
                for dirpath, dirnames, filenames, dfd in os.fwalk(
                    ".", dir_fd=root_fd, follow_symlinks=False, onerror=fail
                ):
                    reldir = os.path.normpath(dirpath)
                    _skip_mounts(dirnames, reldir, mounts)
                    if reldir == ".":  # the trash is listed by list_trash, never as copies or litter
                        dirnames[:] = [d for d in dirnames if d != TRASH_DIR]
                    present = set(dirnames) | set(filenames)
                    committed_dirs: set[str] = set()
                    for fname in filenames:
                        if STAGING_MARK in fname:
                            continue
                        if fname.endswith(PIN_SUFFIX):
                            if pins is not None:
                                self._read_pin(dfd, fname, reldir, pins)
                            continue
                        if not fname.endswith(MANIFEST_SUFFIX):
                            continue
                        base = fname[: -len(MANIFEST_SUFFIX)]
                        if base not in present:
                            continue  # orphan: reported by list_staging
                        committed_dirs.add(base)
                        if listing is not None:
                            rel = base if reldir == "." else f"{reldir}/{base}"
                            self._read_listed_manifest(dfd, fname, rel, listing)
                    # neither staging nor committed checkpoint contents can hold more manifests
                    dirnames[:] = [d for d in dirnames if STAGING_MARK not in d and d not in committed_dirs]
            except OSError as exc:
                raise TierUnavailable(
                    f"tier {self.name!r}: listing {self.root} failed: {_describe(exc)}"
                ) from exc

    @staticmethod
    def _read_listed_manifest(
        dfd: int, fname: str, rel: str, listing: list[tuple[str, Manifest | None, str | None]]
    ) -> None:
        """Add the manifest ``fname`` in directory ``dfd`` (of copy ``rel``) to ``listing``:
        damaged or unparsable ones with their reason."""
        try:
            fd = os.open(fname, os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                text = f.read(_MAX_MANIFEST_BYTES + 1)
            manifest = _parse_manifest(rel, text)
            base = fname[: -len(MANIFEST_SUFFIX)]
            damage = _damage_at(dfd, base, rel, manifest)
            listing.append((rel, manifest, DAMAGED_COPY + "; ".join(damage) if damage else None))
        except FileNotFoundError:
            return  # deleted while we listed
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise  # unreadable is unknown, not corrupt: the whole listing fails
            listing.append((rel, None, "manifest is a symlink"))
        except StorageError as exc:
            listing.append((rel, None, str(exc)))

    @staticmethod
    def _read_pin(dfd: int, fname: str, reldir: str, pins: set[tuple[str, str]]) -> None:
        """Add the pin object ``fname`` in directory ``dfd`` to ``pins`` if it is a valid one."""
        base = fname[: -len(PIN_SUFFIX)]
        rel = base if reldir == "." else f"{reldir}/{base}"
        try:
            fd = os.open(fname, os.O_RDONLY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                data = f.read(_MAX_PIN_BYTES + 1)
        except FileNotFoundError:
            return  # unpinned while we listed
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            return  # a symlink is no pin of ours
        pin = _parse_pin(rel, data)
        if pin is not None:
            pins.add(pin)

    def delete(self, rel_path: str) -> int:
        """Delete ``rel_path`` (and its manifest) without following symlinks or leaving the root.

        The data is first renamed to a staging name (de-commit; an interrupted delete is then
        reported by :meth:`list_staging`), the manifest removed, then the tree removed through
        directory fds. A symlink inside is unlinked, its target untouched; a directory on another
        filesystem makes the whole delete refuse before anything is removed.
        """
        parts = _split_rel(rel_path)
        self._refuse_mounts(rel_path, "delete")
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

    def rename_from(
        self,
        src: LocalTierStorage,
        manifest: Manifest,
        *,
        rehash: bool = True,
        replace_damaged: bool = False,
        before_rename: Callable[[], object] | None = None,
        step: Callable[[str], None] | None = None,
    ) -> None:
        """Move a checkpoint from ``src`` on the same filesystem with one ``rename``.

        Order: verify the source against the manifest in place (sizes always, hashes unless
        ``rehash=False``); write the manifest beside the destination under a staging name and
        flush it, while ``before_rename`` runs in the flush thread (the caller's journal flush: it
        must be durable before anything is renamed, and the two flushes share one wait); rename the
        manifest into place (an orphan until…); the atomic rename that is the commit point; flush
        both directories, together. There is never a moment where the only copy sits under a
        staging name the reaper could remove. ``replace_damaged``: as for :meth:`copy_from`.
        ``step`` is called at each point a crash leaves a distinct state (``rename-staged``,
        ``rename-manifest``, ``rename-done``; the executor's crash-point tests).
        """
        if not self.same_filesystem(src):
            raise StorageError(f"tiers {src.name!r} and {self.name!r} are not on one filesystem")
        _check_manifest(manifest)
        rel = _rel_of(manifest)
        parts = _split_rel(rel)
        src._refuse_mounts(rel, "move")
        self._refuse_mounts(rel, "move")
        if content.layout(src, manifest) is not None or self.spec.dedup:
            raise StorageError(f"{rel}: a copy in a dedup tier is copied, never renamed")
        problems = src.verify(manifest, deep=rehash)
        if problems:
            raise VerificationError(f"{src.name}:{rel} does not match its manifest: " + "; ".join(problems))
        mark = step or (lambda _where: None)
        try:
            with src._root_fd() as s_root, self._root_fd() as d_root:
                dev = os.fstat(d_root).st_dev
                with (
                    _fd(_open_dirs(s_root, parts[:-1], dev=dev)) as s_dir,
                    _fd(_open_dirs(d_root, parts[:-1], create=True, dev=dev)) as d_dir,
                ):
                    name = parts[-1]
                    if _exists_at(d_dir, name) and self._drop_damaged(manifest, replace_damaged):
                        raise StorageError(f"{self.root}/{rel} already exists; refusing to overwrite")
                    staged = None
                    if self.hot:  # no manifest in hot: nothing to overlap the caller's flush with
                        if before_rename is not None:
                            before_rename()
                    else:
                        body = src._stored_form(manifest).to_json().encode()  # the files move as stored
                        made: list[str] = []
                        try:
                            _alongside(
                                before_rename,
                                lambda: made.append(_stage_file(d_dir, name + MANIFEST_SUFFIX, body)),
                            )
                        except BaseException:  # the caller's flush failed: nothing renamed, no litter
                            for tmp in made:
                                with contextlib.suppress(OSError):
                                    os.unlink(tmp, dir_fd=d_dir)
                            raise
                        staged = made[0]
                    mark("rename-staged")
                    try:
                        if staged is not None:
                            os.rename(staged, name + MANIFEST_SUFFIX, src_dir_fd=d_dir, dst_dir_fd=d_dir)
                            staged = None
                            mark("rename-manifest")
                        os.rename(name, name, src_dir_fd=s_dir, dst_dir_fd=d_dir)
                    except BaseException:
                        if not self.hot:
                            with contextlib.suppress(OSError):
                                os.unlink(staged or name + MANIFEST_SUFFIX, dir_fd=d_dir)
                        raise
                    mark("rename-done")
                    _alongside(lambda: os.fsync(s_dir), lambda: os.fsync(d_dir))
        except OSError as exc:
            raise StorageError(
                f"rename of {rel} from {src.name!r} to {self.name!r} failed: {_describe(exc)}"
            ) from exc

    def _drop_damaged(self, manifest: Manifest, known_bad: bool = False) -> bool:
        """Before a rename onto ``manifest``'s path, which exists: remove it if it is a damaged
        copy of this very version (a committed manifest over missing or changed files),
        as :meth:`copy_from` does; True if something else is there (the caller refuses)."""
        rel = _rel_of(manifest)
        existing = None if self.hot else self.read_manifest(rel)
        if existing is None or existing.digest != manifest.digest:
            return True
        damage = self.recheck(manifest) or (
            ["bytes do not match the manifest (found by a scrub)"] if known_bad else []
        )
        if not damage:
            return True
        log.warning(
            "%s: %s holds a damaged copy of version %s (%s); replacing it",
            self.name,
            rel,
            manifest.digest,
            "; ".join(damage[:3]),
        )
        self.delete(rel)
        return False

    # -- trash (undo_window): :mod:`ckptkeeper.storage.trash` -------------------------------

    def move_aside(self, manifest: Manifest, entry: str) -> None:
        trash.local_move_aside(self, manifest, entry)

    def probe_aside(self, manifest: Manifest, entry: str) -> tuple[bool, bool]:
        return trash.local_probe(self, manifest, entry)

    def finish_aside(self, manifest: Manifest) -> None:
        trash.local_finish_move(self, manifest)

    def list_trash(self) -> list[tuple[str, Manifest | None, float, str | None]]:
        return trash.local_list(self)

    def purge_trash(self, entry: str) -> int:
        return trash.local_purge(self, entry)

    def undelete(self, manifest: Manifest, entry: str) -> None:
        trash.local_restore(self, manifest, entry)

    # -- pins ------------------------------------------------------------------------------

    def write_pin(self, run: str, name: str, step: int, node: str) -> None:
        rel = f"{run}/{name}"
        parts = _split_rel(rel)
        if len(parts) > 1:
            self._refuse_mounts("/".join(parts[:-1]), "pin")
        try:
            with self._root_fd() as root_fd:
                dev = os.fstat(root_fd).st_dev
                with _fd(_open_dirs(root_fd, parts[:-1], create=True, dev=dev)) as dir_fd:
                    _write_file_atomic(dir_fd, parts[-1] + PIN_SUFFIX, _pin_doc(run, name, step, node))
                    os.fsync(dir_fd)
        except OSError as exc:
            raise StorageError(
                f"tier {self.name!r}: cannot write the pin of {rel}: {_describe(exc)}"
            ) from exc

    def remove_pin(self, run: str, name: str) -> None:
        rel = f"{run}/{name}"
        parts = _split_rel(rel)
        try:
            with self._parent_fd(parts) as dir_fd:
                try:
                    os.unlink(parts[-1] + PIN_SUFFIX, dir_fd=dir_fd)
                except FileNotFoundError:
                    return
                os.fsync(dir_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(
                f"tier {self.name!r}: cannot remove the pin of {rel}: {_describe(exc)}"
            ) from exc

    def list_pins(self) -> set[tuple[str, str]]:
        pins: set[tuple[str, str]] = set()
        self._scan(None, pins)
        return pins

    def list_staging(self) -> list[Artifact]:
        out: list[Artifact] = []
        mounts = self._mounts_under()

        def fail(exc: OSError) -> None:
            raise exc

        with self._root_fd(TierUnavailable) as root_fd:
            dev = os.fstat(root_fd).st_dev
            try:
                for dirpath, dirnames, filenames, dfd in os.fwalk(
                    ".", dir_fd=root_fd, follow_symlinks=False, onerror=fail
                ):
                    reldir = os.path.normpath(dirpath)
                    _skip_mounts(dirnames, reldir, mounts)
                    if reldir == ".":  # the trash is listed by list_trash, never as copies or litter
                        dirnames[:] = [d for d in dirnames if d != TRASH_DIR]
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


def _damage_at(dir_fd: int, base: str, rel: str, manifest: Manifest) -> list[str]:
    """What of ``manifest`` is not under ``base`` in ``dir_fd``: one ``lstat`` per file, the cost
    of keeping a listing from reporting a copy whose data is gone. A vanished file
    is damage; any other error makes the listing fail (unknown, not damaged)."""
    if manifest.is_dir and manifest.files:
        try:
            top = os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return [f"{rel}: missing"]
        if not stat.S_ISDIR(top.st_mode):
            return [f"{rel}: not a directory"]
    present: dict[str, int | None] = {}
    for entry in manifest.files:
        path = f"{base}/{entry.path}" if entry.path else base
        try:
            st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            continue
        present[entry.path] = st.st_size if stat.S_ISREG(st.st_mode) else None
    return _compare_sizes(rel, manifest, present)


def _skip_mounts(dirnames: list[str], reldir: str, mounts: frozenset[str]) -> None:
    """Drop mount points from an ``fwalk`` listing (in place): they are never entered."""
    if mounts:
        dirnames[:] = [d for d in dirnames if (d if reldir == "." else f"{reldir}/{d}") not in mounts]


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _parse_at(rel: str, text: bytes) -> Manifest:
    """The manifest found at ``rel``. In a trash entry (``<entry>/<run>/<name>``) it names the
    copy's own path (where ``undelete`` brings it back): read as the entry's, so whatever asks how
    the entry's files are stored (compressed, in the content store) is told, as for a committed
    copy."""
    parts = rel.split("/")
    if len(parts) > 2 and parts[0] == TRASH_DIR:
        entry = "/".join(parts[:2])
        if trash.entry_time(entry) is not None:
            return trash.in_entry(_parse_manifest("/".join(parts[2:]), text), entry)
    return _parse_manifest(rel, text)
