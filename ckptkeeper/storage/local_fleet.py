"""The fleet's side of a shared *filesystem* tier (Lustre, NFS, Weka seen by several nodes;
docs/design.md, "Many nodes"): small objects under ``<root>/.ckptkeeper/`` — node heartbeats, and the lease when no
shared S3 tier can hold it — with the same conditional-write contract as
:class:`~ckptkeeper.storage.s3_fleet.FleetObjects`, built from the filesystem's own atomic steps:

* create only (``If-None-Match: *``): the body goes to a private temp file, then ``link(2)`` to the
  final name — atomic, and refused (``EEXIST``) when the name exists, also over NFS (unlike
  ``O_EXCL`` on old NFSv2 clients); a reader never sees a half-written body;
* replace only that version (``If-Match: <etag>``): ``rename(2)`` the current file to a private
  name (of two racers exactly one succeeds; the other gets ``ENOENT``), check it is the version
  expected (its etag is the SHA-256 of its bytes), then create the new one as above. A version that
  was not the expected one is put back (``link``, never over a newer one), and the write fails.
  Between the two steps the name is free: a third node may create it there, and then our create
  fails — the lease is lost, never held twice.

The etag is content-based, so it needs bodies that differ per write: a lease body carries its
expiry and pid, a heartbeat its time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from pathlib import Path

from ckptkeeper.storage.base import StorageError, _split_rel
from ckptkeeper.storage.fs_clock import filesystem_now

__all__ = ["FLEET_DIR", "LocalFleetObjects"]

FLEET_DIR = ".ckptkeeper"
"""Under a shared filesystem tier's root, like under a shared bucket's prefix. Hidden: never a run."""

_MAX_BODY = 1 << 20


def _etag(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class LocalFleetObjects:
    """``<root>/.ckptkeeper/<name>`` on a filesystem several nodes mount, with conditional writes."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = Path(root)
        self.name = name
        """The tier's name (for messages)."""
        self.base = self.root / FLEET_DIR

    def _path(self, name: str) -> Path:
        _split_rel(name, "fleet object name")
        return self.base / name

    def get_fleet_object(self, name: str) -> tuple[bytes, str] | None:
        """``(body, etag)``, None if absent (an oversized one reads as empty: untrusted)."""
        got = self.get_fleet_object_dated(name)
        return None if got is None else (got[0], got[1])

    def get_fleet_object_dated(self, name: str) -> tuple[bytes, str, float] | None:
        """``(body, etag, mtime)``: the mtime is the filesystem's clock (an NFS/Lustre server's)."""
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                body = f.read(_MAX_BODY + 1)
                mtime = os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"tier {self.name!r}: reading {path}: {exc}") from exc
        if len(body) > _MAX_BODY:
            body = b""
        return body, _etag(body), mtime

    def store_now(self) -> float:
        """The filesystem's time now (:func:`~ckptkeeper.storage.fs_clock.filesystem_now`: the
        mtime it gives a file touched now, on NFS set by the server). One clock for cross-node
        time: docs/design.md, "Cluster reality"."""
        try:
            return filesystem_now(self.root)[0]
        except StorageError as exc:
            raise StorageError(f"tier {self.name!r}: {exc}") from exc

    def put_fleet_object(
        self, name: str, body: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str | None:
        """Write ``name``; with a condition, None when it failed (someone else got there first)."""
        path = self._path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(6)}")
            with open(tmp, "xb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            try:
                if if_match is not None:
                    return self._replace(path, tmp, body, if_match)
                if if_none_match:
                    return _etag(body) if _link(tmp, path) else None
                os.replace(tmp, path)
                return _etag(body)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        except OSError as exc:
            raise StorageError(f"tier {self.name!r}: writing {path}: {exc}") from exc

    def _replace(self, path: Path, tmp: Path, body: bytes, if_match: str) -> str | None:
        aside = path.with_name(f"{path.name}.cas-{secrets.token_hex(6)}")
        try:
            os.rename(path, aside)  # exactly one racer moves this version away
        except FileNotFoundError:
            return None
        try:
            current = aside.read_bytes()
            if _etag(current) != if_match:
                _link(aside, path)  # not the version we judged: put it back, unless replaced already
                return None
            return _etag(body) if _link(tmp, path) else None
        finally:
            with contextlib.suppress(FileNotFoundError):
                aside.unlink()

    def delete_fleet_object(self, name: str) -> None:
        path = self._path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StorageError(f"tier {self.name!r}: deleting {path}: {exc}") from exc

    def list_fleet_objects(self, sub: str) -> list[tuple[str, float]]:
        """``(name, mtime)`` of the files right under ``<root>/.ckptkeeper/<sub>/`` (no temp files)."""
        base = self._path(sub)
        out: list[tuple[str, float]] = []
        try:
            entries = list(os.scandir(base))
        except FileNotFoundError:
            return out
        except OSError as exc:
            raise StorageError(f"tier {self.name!r}: listing {base}: {exc}") from exc
        for e in entries:
            if ".tmp-" in e.name or ".cas-" in e.name:
                continue
            with contextlib.suppress(OSError):
                if e.is_file(follow_symlinks=False):
                    out.append((e.name, e.stat(follow_symlinks=False).st_mtime))
        return sorted(out)


def _link(src: Path, dst: Path) -> bool:
    """Create ``dst`` as ``src`` atomically; False when ``dst`` exists."""
    try:
        os.link(src, dst)
    except FileExistsError:
        return False
    return True
