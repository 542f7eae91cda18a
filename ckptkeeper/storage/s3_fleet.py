"""The fleet's side of a shared S3 tier (docs/design.md, "Many nodes"): its own small objects, the lease and node
heartbeats under ``<root>/.ckptkeeper/``, written with conditional PUTs (``If-None-Match`` /
``If-Match``); and views of the bucket beyond this node's prefix (other nodes' copies, the
single-node layout at the root).

A mixin of :class:`~ckptkeeper.storage.s3.S3TierStorage` (kept apart so the backend module stays
small); it uses only the request helpers of :class:`~.s3_client.S3Objects`.
"""

from __future__ import annotations

from typing import Any, Self

from ckptkeeper.core.model import MANIFEST_SUFFIX, Manifest
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import StorageError, TierUnavailable, _describe, _parse_manifest, _split_rel
from ckptkeeper.storage.s3_client import S3Objects, _not_implemented

__all__ = ["FLEET_DIR", "ConditionalWritesUnsupported", "FleetObjects", "precondition_failed"]

FLEET_DIR = ".ckptkeeper"
"""Under a shared tier's root: the lease and node heartbeats. A run name never starts with a dot
(hidden directories are not runs), so no copy can ever land here."""


def precondition_failed(exc: BaseException) -> bool:
    """A conditional write lost: 412 Precondition Failed, or 409 ConditionalRequestConflict."""
    text = f"{type(exc).__name__} {exc}"
    response = getattr(exc, "response", None) or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    code = (response.get("Error") or {}).get("Code", "")
    if status in (412, 409) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
        return True
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc and precondition_failed(cause):
        return True
    return "PreconditionFailed" in text or "Precondition Failed" in text or "(412)" in text


class ConditionalWritesUnsupported(StorageError):
    """A conditional PUT answered 501 / ``NotImplemented``: the store (now) lacks conditional
    writes. Not a failing store: no lease can live there (docs/design.md, "Many nodes")."""


class FleetObjects(S3Objects):
    """Reading and (conditionally) writing ``<root>/.ckptkeeper/<name>``; views of other prefixes."""

    def get_fleet_object(self, name: str) -> tuple[bytes, str] | None:
        """``(body, etag)`` of ``<root>.ckptkeeper/<name>``, None if absent."""
        got = self.get_fleet_object_dated(name)
        return None if got is None else (got[0], got[1])

    def get_fleet_object_dated(self, name: str) -> tuple[bytes, str, float] | None:
        """``(body, etag, last_modified)``: when the store last wrote it, by the store's clock."""
        key = self._fleet_key(name)
        with self._errors(f"reading {key}"):
            try:
                resp = self._call("get_object", Bucket=self.bucket, Key=key)
            except FileNotFoundError:
                return None
            body = resp["Body"]
            try:
                data: bytes = self._bounded(f"reading the body of {key}", body.read)
            finally:
                body.close()
        modified = resp.get("LastModified")
        when = modified.timestamp() if modified is not None else (self.store_now())
        return data, str(resp.get("ETag") or ""), when

    def store_now(self) -> float:
        """The store's time now (:mod:`ckptkeeper.storage.store_clock`): free after any request;
        else one small listing to read the store's ``Date``."""
        now = self.store_clock.now()
        if now is None:
            with self._errors("reading the store's clock", TierUnavailable):
                self._call("list_objects_v2", Bucket=self.bucket, Prefix=self._fleet_key("clock"), MaxKeys=1)
            now = self.store_clock.now()
        if now is None:
            raise TierUnavailable(f"tier {self.name!r}: the store sent no Date header: no clock to judge by")
        return now

    def put_fleet_object(
        self, name: str, body: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str | None:
        """PUT ``<root>.ckptkeeper/<name>``, optionally conditional (``If-None-Match: *`` creates
        only; ``If-Match`` replaces only that version). Returns the new ETag, or None when the
        condition failed (HTTP 412 / 409: someone else got there first)."""
        key = self._fleet_key(name)
        kw: dict[str, Any] = {}
        if if_none_match:
            kw["IfNoneMatch"] = "*"
        if if_match is not None:
            kw["IfMatch"] = if_match
        try:
            resp = self._call(
                "put_object", Bucket=self.bucket, Key=key, Body=body, ContentType="application/json", **kw
            )
        except Exception as exc:
            if precondition_failed(exc):
                return None
            if kw and _not_implemented(exc):
                raise ConditionalWritesUnsupported(
                    self._redact(
                        f"tier {self.name!r}: writing {key}: the store does not implement conditional writes ({_describe(exc)})"
                    )
                ) from exc
            raise StorageError(self._redact(f"tier {self.name!r}: writing {key}: {_describe(exc)}")) from exc
        return str(resp.get("ETag") or "")

    def delete_fleet_object(self, name: str) -> None:
        key = self._fleet_key(name)
        with self._errors(f"deleting {key}"):
            self._delete_keys([key])

    def list_fleet_objects(self, sub: str) -> list[tuple[str, float]]:
        """``(name, last_modified)`` of objects under ``<root>.ckptkeeper/<sub>/``."""
        base = self._fleet_key(sub) + "/"
        with self._errors(f"listing {base}", TierUnavailable):
            return [(o["Key"][len(base) :], o["LastModified"].timestamp()) for o in self._list_objects(base)]

    def _fleet_key(self, name: str) -> str:
        _split_rel(name, "fleet object name")
        return f"{self.root_prefix}{FLEET_DIR}/{name}"

    # -- the fleet's view of a shared bucket (docs/design.md, "Many nodes") ---------------------------------------

    def view(self, node: str | None) -> Self:
        """A read-only view of ``node``'s copies (``<root><node>/``), or with None of the
        single-node layout at the root (copies written before the tier was shared)."""
        if node is not None:
            _split_rel(node, "node name")
        other = object.__new__(type(self))  # TierStorage.__new__ wants a spec; share the client
        other.__dict__.update(self.__dict__)
        other.prefix = self.root_prefix + (f"{node}/" if node else "")
        other.read_only = True
        return other

    def adopt(self, node: str) -> Self:
        """A writable view of ``node``'s prefix, for the fleet lease holder cleaning a gone node's
        litter (docs/design.md, "Many nodes"); its deletes are this node's, under the lease."""
        other = self.view(node)
        other.read_only = False
        return other

    def top_level_dirs(self) -> list[str]:
        """Names of the "directories" right under the root (node prefixes, old-layout runs, and the
        fleet's own ``.ckptkeeper``): one delimited listing."""
        out: list[str] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.root_prefix, "Delimiter": "/"}
        with self._errors(f"listing {self.url}", TierUnavailable):
            while True:
                resp = self._call("list_objects_v2", **kw)
                out += [
                    p["Prefix"][len(self.root_prefix) :].rstrip("/") for p in resp.get("CommonPrefixes", [])
                ]
                if not resp.get("IsTruncated"):
                    break
                kw["ContinuationToken"] = resp["NextContinuationToken"]
        return sorted(out)

    def run_manifests(self, run: str) -> list[Manifest]:
        """Committed copies of ``run`` in this tier (or view): one listing of ``<prefix><run>/``.

        A manifest that does not describe the key it sits at (e.g. an old-layout run that happens
        to be named like a node) is skipped, never taken for a copy of ``run``.
        """
        _split_rel(run, "run name")
        base = f"{self.prefix}{run}/"
        with self._errors(f"listing {run}", TierUnavailable):
            keys = [
                o["Key"]
                for o in self._list_objects(base)
                if o["Key"].endswith(MANIFEST_SUFFIX) and STAGING_MARK not in o["Key"].rsplit("/", 1)[-1]
            ]
        out: list[Manifest] = []
        for key in keys:
            rel = key[len(self.prefix) : -len(MANIFEST_SUFFIX)]
            with self._errors(f"reading {key}"):
                text = self._get(key)
            if text is None:
                continue
            try:
                manifest = _parse_manifest(rel, text)
            except StorageError:
                continue
            if manifest.run == run:
                out.append(manifest)
        return out
