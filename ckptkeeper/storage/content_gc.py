"""Collection of a dedup tier's content store (docs/dedup.md): this node's content objects, the
references every manifest of the tier holds, and the removal of what none references once older
than the grace period by the store's clock. Run by the owner node's prune pass only, under the
executor lock every write to a tier holds (:mod:`ckptkeeper.actions.pruning.dedup`)."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import StorageError, _describe, _split_rel
from ckptkeeper.storage.content_codec import ENCODED_SUFFIX, refs
from ckptkeeper.storage.content_store import _HEX, _is_s3, content_rel, node_dir

if TYPE_CHECKING:
    from ckptkeeper.storage.content import TierStorage


@dataclass(frozen=True)
class ContentObject:
    digest: str
    size: int
    mtime: float
    """When the store wrote it, by the store's clock (mtime; S3 ``LastModified``)."""
    staging: str = ""
    """The name of an interrupted write of it (a local staging file, never referenced)."""
    encoded: bool = False
    """``<hash>.z``: stored in the codec's framed format."""

    @property
    def name(self) -> str:
        """Its name in the store, as :attr:`~.content.Ref.name` spells a reference to it."""
        return self.digest + (ENCODED_SUFFIX if self.encoded else "")


def list_content(tier: TierStorage) -> list[ContentObject]:
    """Every content object of this node in the tier (staging names and strays skipped)."""
    base = node_dir(tier)
    out: list[ContentObject] = []
    if _is_s3(tier):
        s3: Any = tier
        prefix = s3._key(base) + "/"
        with s3._errors("listing the content store"):
            objs = s3._list_objects(prefix)
        for o in objs:
            rest = str(o["Key"])[len(prefix) :]
            sub, _, name = rest.partition("/")
            digest, encoded = _split_name(name)
            if _valid_name(sub, digest):
                out.append(
                    ContentObject(digest, int(o["Size"]), o["LastModified"].timestamp(), encoded=encoded)
                )
        return out
    local: Any = tier
    parts = _split_rel(base)
    try:
        with local._root_fd() as root_fd:
            try:
                fd = _walk_open(root_fd, parts)
            except FileNotFoundError:
                return []
            try:
                for sub in sorted(os.listdir(fd)):
                    for name, st in _local_entries(fd, sub):
                        base = name.split(STAGING_MARK, 1)[0]
                        digest, encoded = _split_name(base)
                        staging = name if name != base else ""
                        out.append(ContentObject(digest, st.st_size, st.st_mtime, staging, encoded))
            finally:
                os.close(fd)
    except OSError as exc:
        raise StorageError(f"tier {tier.name!r}: listing the content store failed: {_describe(exc)}") from exc
    return out


def _walk_open(root_fd: int, parts: tuple[str, ...]) -> int:
    from ckptkeeper.storage.localfs import _open_dirs

    return _open_dirs(root_fd, parts)


def _local_entries(fd: int, sub: str) -> list[tuple[str, os.stat_result]]:
    from ckptkeeper.storage.base import _O_DIR

    if len(sub) != 2 or not set(sub) <= _HEX:
        return []
    try:
        sfd = os.open(sub, _O_DIR, dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        found = []
        for name in os.listdir(sfd):
            digest, _encoded = _split_name(name.split(STAGING_MARK, 1)[0])
            if _valid_name(sub, digest):
                st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    found.append((name, st))
        return found
    finally:
        os.close(sfd)


def _split_name(name: str) -> tuple[str, bool]:
    """``(hash, encoded)`` of a content object's name (``<hash>`` or ``<hash>.z``)."""
    if name.endswith(ENCODED_SUFFIX):
        return name[: -len(ENCODED_SUFFIX)], True
    return name, False


def _valid_name(sub: str, digest: str) -> bool:
    return len(digest) == 32 and set(digest) <= _HEX and digest[:2] == sub and STAGING_MARK not in digest


def remove(tier: TierStorage, digest: str, staging: str = "", *, encoded: bool = False) -> None:
    """Remove the content object ``digest`` (its ``.z`` form if ``encoded``; or its interrupted
    write ``staging``)."""
    rel = content_rel(tier, digest, encoded)
    name = rel.rsplit("/", 1)[-1]
    if staging:
        if not staging.startswith(name + STAGING_MARK) or "/" in staging:
            raise StorageError(f"tier {tier.name!r}: {staging!r} is not a staging name of {name}")
        rel = rel[: -len(name)] + staging
    if _is_s3(tier):
        s3: Any = tier
        with s3._errors(f"removing content {digest}"):
            s3._delete_keys([s3._key(rel)])
        return
    parts = _split_rel(rel)
    local: Any = tier
    try:
        with local._parent_fd(parts, dev_check=False) as dir_fd:
            os.unlink(parts[-1], dir_fd=dir_fd)
            os.fsync(dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(f"tier {tier.name!r}: removing {rel} failed: {_describe(exc)}") from exc


def store_now(tier: TierStorage) -> float:
    """The store's time now (docs/design.md, "Cluster reality"): an S3 response's ``Date``; for a
    local tier the filesystem's clock (:func:`~ckptkeeper.storage.fs_clock.filesystem_now`)."""
    skew = float(os.environ.get(CLOCK_ENV, "0") or 0)
    if _is_s3(tier):
        s3: Any = tier
        return float(s3.store_now()) + skew
    from ckptkeeper.storage.fs_clock import filesystem_now

    local: Any = tier
    try:
        now = filesystem_now(local.root)[0]
    except StorageError as exc:
        raise StorageError(f"tier {tier.name!r}: reading the store's clock failed: {exc}") from exc
    return now + skew


CLOCK_ENV = "CKPTKEEPER_TEST_STORE_CLOCK_AHEAD"
"""Seconds added to the store's clock when judging content age (tests only: no sleeps)."""


# -- collection ----------------------------------------------------------------------------------


@dataclass
class Collected:
    tier: str
    objects: int = 0
    stored_bytes: int = 0
    referenced: int = 0
    removed: int = 0
    removed_bytes: int = 0
    young: int = 0
    """Unreferenced, but younger than the grace period: left for a later pass."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def live_refs(tier: TierStorage) -> set[str]:
    """Every content object (by name: ``<hash>`` or ``<hash>.z``) a manifest of this node in the
    tier references: committed copies (damaged ones too) and trash entries. Raises
    :class:`TierUnavailable` if either listing is incomplete: unknown references are never taken
    for none."""
    names: set[str] = set()
    for _rel, manifest, _err in tier.list_manifests():
        if manifest is not None:
            names.update(r.name for e in manifest.files if e.location for r in refs(e))
    for _entry, manifest, _when, _why in tier.list_trash():
        if manifest is not None:
            names.update(r.name for e in manifest.files if e.location for r in refs(e))
    return names


def collect(
    tier: TierStorage,
    *,
    grace: float,
    now: float | None = None,
    dry_run: bool = False,
    before_remove: Callable[[str], None] | None = None,
) -> Collected:
    """Remove this node's content objects no manifest references, older than ``grace``.

    Content is listed before the references: an object written after the listing is not a
    candidate, and every manifest committed before the reference listing is seen (every tier
    write of this node holds the executor lock the pass holds, so none commits in between)."""
    objects = list_content(tier)
    live = live_refs(tier)
    clock = store_now(tier) if now is None else now
    out = Collected(tier=tier.name, objects=len(objects), stored_bytes=sum(o.size for o in objects))
    for obj in objects:
        if obj.name in live and not obj.staging:
            out.referenced += 1
        elif clock - obj.mtime <= grace:
            out.young += 1
        else:
            if not dry_run:
                if before_remove is not None:
                    before_remove(obj.name)
                remove(tier, obj.digest, obj.staging, encoded=obj.encoded)
            out.removed += 1
            out.removed_bytes += obj.size
    return out
