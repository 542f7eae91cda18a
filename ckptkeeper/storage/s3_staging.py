"""Staging in an S3 tier: staging markers, interrupted copies and abandoned multipart uploads,
found by one listing and matched to their markers (docs/design.md, "Many nodes": each carries its node), for the
reaper to discard or abort.

A mixin of :class:`~ckptkeeper.storage.s3.S3TierStorage` (kept apart so the backend module stays
small); it uses only the request helpers of :class:`~.s3_client.S3Objects`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ckptkeeper.core.model import MANIFEST_SUFFIX, Artifact
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import (
    MULTIPART_KIND,
    StorageError,
    TierUnavailable,
    _split_rel,
    _staging_artifact,
)
from ckptkeeper.storage.s3_client import S3Objects

_NO_UPLOAD_LISTING = (
    "abandoned multipart uploads cannot be found or aborted by ckptkeeper on this tier: add a bucket "
    "lifecycle rule AbortIncompleteMultipartUpload; copies go on"
)


class StagingObjects(S3Objects):
    """Markers, interrupted copies and multipart uploads under the tier's prefix."""

    def _abort_uploads_under(self, key: str) -> None:
        """Abort every multipart upload in progress for ``key`` or a key under ``key/``.

        Called only by whoever holds the checkpoint's staging marker (a copy, or the discard of an
        interrupted one), so every such upload is a leftover of ours: an interrupted copy, or a
        CreateMultipartUpload whose reply was lost and that s3fs/botocore then retried.
        """
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key}
        while True:
            try:
                resp = self._call("list_multipart_uploads", **kw)
            except Exception as exc:
                if self._degraded("ListMultipartUploads", exc, _NO_UPLOAD_LISTING):
                    return
                raise
            for upload in resp.get("Uploads", []):
                if upload["Key"] == key or upload["Key"].startswith(key + "/"):
                    with contextlib.suppress(FileNotFoundError):  # completed or aborted meanwhile
                        self._call(
                            "abort_multipart_upload",
                            Bucket=self.bucket,
                            Key=upload["Key"],
                            UploadId=upload["UploadId"],
                        )
            if not resp.get("IsTruncated"):
                return
            kw["KeyMarker"] = resp.get("NextKeyMarker")
            kw["UploadIdMarker"] = resp.get("NextUploadIdMarker")

    def _other_writers(self, key: str) -> list[str]:
        """Other nodes with a staging marker on ``key`` (a copy in progress, or its litter):
        their data and uploads there are not ours to clear (docs/design.md, "Many nodes")."""
        if not self.node:
            return []
        markers = [o["Key"] for o in self._list_objects(key + STAGING_MARK)]
        nodes = {d.get("node") for d in self._marker_docs(markers).values()}
        return sorted(n for n in nodes if isinstance(n, str) and n and n != self.node)

    def _marker_docs(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Staging marker key -> its JSON body ({} when gone or not a JSON object: an old marker).

        A failed read raises: a marker whose node is unknown must not pass for one of ours.
        """
        out: dict[str, dict[str, Any]] = {}
        for key in keys:
            body = self._get(key)
            try:
                doc = json.loads(body) if body else {}
            except (ValueError, RecursionError):
                doc = {}
            out[key] = doc if isinstance(doc, dict) else {}
        return out

    def list_staging(self) -> list[Artifact]:
        with self._errors(f"listing {self.url}", TierUnavailable):
            objs = {o["Key"]: o for o in self._list_objects(self.prefix)}
            docs = self._marker_docs(
                k for k in objs if STAGING_MARK in k[len(self.prefix) :].rsplit("/", 1)[-1]
            )
        out: list[Artifact] = []
        for key, obj in sorted(objs.items()):
            rel = key[len(self.prefix) :]
            if STAGING_MARK not in rel.rsplit("/", 1)[-1]:
                continue
            target_key = self.prefix + rel.rsplit(STAGING_MARK, 1)[0]
            newest = obj["LastModified"].timestamp()
            size = 0
            if target_key + MANIFEST_SUFFIX not in objs:  # else: a stale marker beside a committed copy
                for k, o in objs.items():
                    if k == target_key or k.startswith(target_key + "/"):
                        size += int(o["Size"])
                        newest = max(newest, o["LastModified"].timestamp())
            node = docs.get(key, {}).get("node")
            artifact = _staging_artifact(self.name, rel, size, newest)
            out.append(dataclasses.replace(artifact, node=node) if isinstance(node, str) else artifact)
        return out

    def discard_staging(self, artifact: Artifact) -> int:
        """Remove an interrupted copy (marker + uncommitted data) or just a stale marker.

        Only for artifacts older than the reaper's ``partial_after``: a copy in progress has a
        fresh marker and must not be discarded.
        """
        parts = _split_rel(artifact.path)
        if STAGING_MARK not in parts[-1]:
            raise StorageError(f"{artifact.path} is not a ckptkeeper staging artifact")
        self._check_writable(f"discard of {artifact.path}")
        marker = self.prefix + artifact.path
        target = artifact.path.rsplit(STAGING_MARK, 1)[0]
        target_key = self._key(target)
        with self._errors(f"discarding {artifact.path}"):
            freed = 0
            if self._head(target_key + MANIFEST_SUFFIX) is None:
                objs = self._target_objects(target_key)
                self._delete_keys([k for k, _, _ in objs])
                freed = sum(size for _, size, _ in objs)
            # uploads are never part of a committed copy: whatever is in progress under the target
            # belongs to the interrupted copy this marker records
            self._abort_uploads_under(target_key)
            self._delete_keys([marker])
        return freed

    def list_multipart_uploads(self) -> list[Artifact]:
        out: list[Artifact] = []
        with self._errors("listing multipart uploads", TierUnavailable):
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix}
            uploads: list[dict[str, Any]] = []
            while True:
                try:
                    resp = self._call("list_multipart_uploads", **kw)
                except Exception as exc:
                    if self._degraded("ListMultipartUploads", exc, _NO_UPLOAD_LISTING):
                        return []
                    raise
                uploads.extend(resp.get("Uploads", []))
                if not resp.get("IsTruncated"):
                    break
                kw["KeyMarker"] = resp.get("NextKeyMarker")
                kw["UploadIdMarker"] = resp.get("NextUploadIdMarker")
            live = self._uploads_of_markers() if uploads else {}
            for upload in uploads:
                size = 0
                pkw: dict[str, Any] = {
                    "Bucket": self.bucket,
                    "Key": upload["Key"],
                    "UploadId": upload["UploadId"],
                }
                while True:
                    parts = self._call("list_parts", **pkw)
                    size += sum(int(p.get("Size", 0)) for p in parts.get("Parts", []))
                    if not parts.get("IsTruncated"):
                        break
                    pkw["PartNumberMarker"] = parts["NextPartNumberMarker"]
                rel = upload["Key"][len(self.prefix) :]
                # Matched to its copy's marker by upload id (or, for an upload a lost reply left
                # behind, by the marker's target): that marker's age and node, not the store's
                # reported start time, say whether it is abandoned and whose it is.
                node, beat = live.get(upload["UploadId"]) or _covering(live, upload["Key"]) or ("", 0.0)
                out.append(
                    Artifact(
                        tier=self.name,
                        path=rel,
                        kind=MULTIPART_KIND,
                        bytes=size,
                        last_write=max(upload["Initiated"].timestamp(), beat),
                        run=rel.split("/", 1)[0],
                        upload_id=upload["UploadId"],
                        node=node,
                    )
                )
        return out

    def _uploads_of_markers(self) -> dict[str, tuple[str, float]]:
        """upload id (and ``target:<key>`` per marker) -> (node, marker LastModified)."""
        markers = {
            o["Key"]: o["LastModified"].timestamp()
            for o in self._list_objects(self.prefix)
            if STAGING_MARK in o["Key"].rsplit("/", 1)[-1]
        }
        out: dict[str, tuple[str, float]] = {}
        for key, doc in self._marker_docs(markers).items():
            node = doc.get("node")
            seen = (node if isinstance(node, str) else "", markers[key])
            target = "target:" + key.rsplit(STAGING_MARK, 1)[0]
            if out.get(target, ("", 0.0))[1] < seen[1]:
                out[target] = seen
            for upload_id in doc.get("uploads") or []:
                if isinstance(upload_id, str):
                    out[upload_id] = seen
        return out

    def abort_multipart(self, artifact: Artifact) -> None:
        if artifact.kind != MULTIPART_KIND or not artifact.upload_id:
            raise StorageError(f"{artifact.path} is not a multipart upload")
        if artifact.path.startswith("/"):
            raise StorageError(f"absolute path refused: {artifact.path!r}")
        # FileNotFoundError: already completed or aborted
        with (
            self._errors(f"aborting multipart upload of {artifact.path}"),
            contextlib.suppress(FileNotFoundError),
        ):
            self._call(
                "abort_multipart_upload",
                Bucket=self.bucket,
                Key=self.prefix + artifact.path,
                UploadId=artifact.upload_id,
            )


def _covering(live: Mapping[str, tuple[str, float]], key: str) -> tuple[str, float] | None:
    """The marker entry whose target is ``key`` or a "directory" above it."""
    parts = key.split("/")
    for i in range(len(parts), 0, -1):
        found = live.get("target:" + "/".join(parts[:i]))
        if found is not None:
            return found
    return None
