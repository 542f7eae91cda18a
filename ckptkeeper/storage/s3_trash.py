"""The trash of an S3 tier (``undo_window``; layout in :mod:`ckptkeeper.storage.trash`).

S3 has no rename, so moving a copy aside is the only move S3 offers: a server-side ``CopyObject``
of every object into ``<prefix>.ckptkeeper-trash/<stamp>/<run>/<name>…`` (no byte passes through
this host; s3fs switches to a multipart copy above 5 GiB), the manifest PUT last beside it (the
entry's commit point), then the delete of the original keys (marker, manifest, data, as every
delete). Requests, not bytes, are what it costs. Undelete is the same in reverse under a staging
marker, committed by the manifest written with ``If-None-Match: *``.

A mixin of :class:`~ckptkeeper.storage.s3.S3TierStorage`; what it needs of the backend beyond
:class:`~.s3_client.S3Objects` is reached through :func:`_tier`.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from ckptkeeper.core.model import MANIFEST_SUFFIX, Manifest
from ckptkeeper.hook.protocol import STAGING_MARK, TRASH_DIR
from ckptkeeper.storage import compressed
from ckptkeeper.storage.base import (
    StorageError,
    TierUnavailable,
    VerificationError,
    _check_manifest,
    _parse_manifest,
    _rel_of,
    _token,
)
from ckptkeeper.storage.s3_client import S3Objects
from ckptkeeper.storage.s3_transfer import _marker_doc
from ckptkeeper.storage.trash import check_entry, entry_time, in_entry


class _Backend(Protocol):
    """What this mixin uses of :class:`~ckptkeeper.storage.s3.S3TierStorage` beyond
    :class:`S3Objects` (a protocol, not an import: the backend imports this module)."""

    def delete(self, rel_path: str, *, adopt: bool = ...) -> int: ...
    def _commit_manifest(self, key: str, body: bytes) -> None: ...
    def recheck(self, manifest: Manifest) -> list[str]: ...


_COPY_CONCURRENCY = 16


class TrashObjects(S3Objects):
    """Move aside, list, purge and undelete trash entries under the tier's prefix."""

    def move_aside(self, manifest: Manifest, entry: str) -> None:
        _check_manifest(manifest)
        check_entry(entry)
        rel = _rel_of(manifest)
        self._check_writable(f"move aside of {rel}")
        key = self._key(rel)
        dest = self.prefix + _rel_of(in_entry(manifest, entry))
        with self._errors(f"moving {rel} aside"):
            body = self._get(key + MANIFEST_SUFFIX)
            if body is None:
                raise StorageError(f"tier {self.name!r}: {rel} has no committed copy to move aside")
            stored = _parse_manifest(rel, body)
            if stored.digest != manifest.digest:
                raise StorageError(
                    f"tier {self.name!r}: {rel} holds version {stored.digest}, not {manifest.digest}"
                )
            if stored.node and self.node and stored.node != self.node:
                raise StorageError(
                    f"tier {self.name!r}: {rel} is owned by node {stored.node}, not {self.node}: "
                    "refusing to move another node's copy"
                )
            objs = self._target_objects(key)
            self._copy_keys([(k, dest + k[len(key) :]) for k, _, _ in objs])
            self._call(
                "put_object",
                Bucket=self.bucket,
                Key=dest + MANIFEST_SUFFIX,
                Body=body,
                ContentType="application/json",
            )
        _tier(self).delete(rel)

    def probe_aside(self, manifest: Manifest, entry: str) -> tuple[bool, bool]:
        check_entry(entry)
        rel = _rel_of(manifest)
        key = self._key(rel)
        with self._errors(f"looking at {rel} and its trash entry"):
            whole = self._head(self.prefix + _rel_of(in_entry(manifest, entry)) + MANIFEST_SUFFIX) is not None
            if whole:
                whole = not self._entry_damage(manifest, entry)
            here = bool(self._target_objects(key)) or self._head(key + MANIFEST_SUFFIX) is not None
        return whole, here

    def finish_aside(self, manifest: Manifest) -> None:
        _tier(self).delete(_rel_of(manifest))

    def list_trash(self) -> list[tuple[str, Manifest | None, float, str | None]]:
        base = f"{self.prefix}{TRASH_DIR}/"
        with self._errors(f"listing the trash of {self.url}", TierUnavailable):
            objs = self._list_objects(base)
            sizes = {o["Key"]: int(o["Size"]) for o in objs}
            by_entry: dict[str, list[str]] = {}
            for k in sizes:
                stamp = k[len(base) :].split("/", 1)[0]
                by_entry.setdefault(f"{TRASH_DIR}/{stamp}", []).append(k)
            out: list[tuple[str, Manifest | None, float, str | None]] = []
            for entry, keys in sorted(by_entry.items()):
                when = entry_time(entry)
                if when is None:
                    continue  # not ours: never touched
                manifests = [k for k in keys if k.endswith(MANIFEST_SUFFIX)]
                if len(manifests) != 1:
                    out.append((entry, None, when, f"{len(manifests)} manifests in it (want 1)"))
                    continue
                prefix = f"{self.prefix}{entry}/"
                rel = manifests[0][len(prefix) : -len(MANIFEST_SUFFIX)]
                body = self._get(manifests[0])
                if body is None:
                    continue  # purged or undeleted since the listing
                try:
                    manifest = _parse_manifest(rel, body)
                except StorageError as exc:
                    out.append((entry, None, when, f"manifest: {exc}"))
                    continue
                data = prefix + rel
                missing = [
                    e.path or rel
                    for e in manifest.files
                    if not e.location  # in the content store: checked by undelete's recheck
                    and sizes.get(f"{data}/{e.path}" if e.path else data) != e.stored_size
                ]
                if missing:
                    out.append(
                        (entry, None, when, f"damaged: {len(missing)} objects missing or of another size")
                    )
                else:
                    out.append((entry, manifest, when, None))
        return out

    def purge_trash(self, entry: str) -> int:
        check_entry(entry)
        self._check_writable(f"purge of {entry}")
        with self._errors(f"purging {entry}"):
            objs = self._list_objects(f"{self.prefix}{entry}/")
            # the manifest first: an interrupted purge leaves no entry that looks whole
            keys = sorted((o["Key"] for o in objs), key=lambda k: not k.endswith(MANIFEST_SUFFIX))
            self._delete_keys(keys)
        return sum(int(o["Size"]) for o in objs)

    def undelete(self, manifest: Manifest, entry: str) -> None:
        _check_manifest(manifest)
        check_entry(entry)
        rel = _rel_of(manifest)
        self._check_writable(f"undelete of {rel}")
        key = self._key(rel)
        src = self.prefix + _rel_of(in_entry(manifest, entry))
        tier = _tier(self)
        with self._errors(f"undelete of {rel}"):
            if self._target_objects(key) or self._head(key + MANIFEST_SUFFIX) is not None:
                raise StorageError(
                    f"tier {self.name!r}: a copy already occupies {rel}; not undeleting over it"
                )
            damage = self._entry_damage(manifest, entry)
            if damage:
                raise VerificationError(
                    f"tier {self.name!r}: the trashed copy of {rel} does not match its manifest: "
                    + "; ".join(damage[:5])
                )
            marker = f"{key}{STAGING_MARK}{_token()}"
            self._put_json(marker, _marker_doc("undelete", rel, manifest.is_dir, self.node))
            objs = self._target_objects(src)
            self._copy_keys([(k, key + k[len(src) :]) for k, _, _ in objs])
            body = self._get(src + MANIFEST_SUFFIX)
            if body is None:
                raise StorageError(f"tier {self.name!r}: the manifest of {entry} vanished during undelete")
            tier._commit_manifest(key + MANIFEST_SUFFIX, body)
            problems = tier.recheck(manifest)
            if problems:
                raise VerificationError(
                    f"tier {self.name!r}: undeleted {rel} is not whole: " + "; ".join(problems[:5])
                )
            self._delete_keys([marker])
        self.purge_trash(entry)

    # -- helpers ---------------------------------------------------------------------------

    def _entry_damage(self, manifest: Manifest, entry: str) -> list[str]:
        """What of ``manifest`` the entry lacks (sizes from one listing; the sizes the entry's own
        manifest says its objects are stored at, when they are compressed)."""
        data = self.prefix + _rel_of(in_entry(manifest, entry))
        sizes = {o["Key"]: int(o["Size"]) for o in self._list_objects(data)}
        body = self._get(data + MANIFEST_SUFFIX)
        try:
            moved = _parse_manifest(_rel_of(manifest), body) if body is not None else None
        except StorageError:
            moved = None
        manifest = compressed.with_stored_form(manifest, moved)
        out = []
        for e in manifest.files:
            if e.location:
                continue  # in the content store: checked by undelete's recheck
            k = f"{data}/{e.path}" if e.path else data
            if sizes.get(k) != e.stored_size:
                out.append(
                    f"{e.path or _rel_of(manifest)}: {'missing' if k not in sizes else 'size differs'}"
                )
        return out

    def _copy_keys(self, pairs: list[tuple[str, str]]) -> None:
        """Server-side copies ``src -> dst`` in this bucket, 16 in flight (s3fs copies objects over
        5 GiB part by part, still server-side)."""
        import asyncio

        from fsspec.asyn import sync

        async def copy_all() -> list[Any]:
            sem = asyncio.Semaphore(_COPY_CONCURRENCY)

            async def one(src: str, dst: str) -> Any:
                async with sem:
                    return await self.fs._cp_file(f"{self.bucket}/{src}", f"{self.bucket}/{dst}")

            return await asyncio.gather(*(one(s, d) for s, d in pairs), return_exceptions=True)

        for result in sync(self.fs.loop, copy_all):
            if isinstance(result, BaseException):
                raise result


def _tier(objs: TrashObjects) -> _Backend:
    return cast(_Backend, objs)
