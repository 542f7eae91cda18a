"""The fleet's own small objects in a shared S3 tier (DESIGN §10): the lease and node heartbeats
under ``<root>/.ckptkeeper/``, written with conditional PUTs (``If-None-Match`` / ``If-Match``).

A mixin of :class:`~ckptkeeper.storage.s3.S3TierStorage` (kept apart so the backend module stays
small); it uses only the backend's request helpers.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ckptkeeper.storage.base import StorageError, TierUnavailable, _describe, _split_rel

if TYPE_CHECKING:
    from s3fs import S3FileSystem

__all__ = ["FLEET_DIR", "FleetObjects", "precondition_failed"]

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


class FleetObjects:
    """Reading and (conditionally) writing ``<root>/.ckptkeeper/<name>``."""

    bucket: str
    root_prefix: str
    name: str

    if TYPE_CHECKING:

        @property
        def fs(self) -> S3FileSystem: ...
        def _call(self, method: str, **kwargs: Any) -> Any: ...
        def _errors(
            self, what: str, exc_type: type[StorageError] = StorageError
        ) -> contextlib.AbstractContextManager[None]: ...
        def _redact(self, text: str) -> str: ...
        def _list_objects(self, prefix: str) -> list[dict[str, Any]]: ...
        def _delete_keys(self, keys: list[str]) -> None: ...

    def get_fleet_object(self, name: str) -> tuple[bytes, str] | None:
        """``(body, etag)`` of ``<root>.ckptkeeper/<name>``, None if absent."""
        key = self._fleet_key(name)
        with self._errors(f"reading {key}"):
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
        return data, str(resp.get("ETag") or "")

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
