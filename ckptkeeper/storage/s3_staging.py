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
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from ckptkeeper.core.model import MANIFEST_SUFFIX, Artifact
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import (
    MULTIPART_KIND,
    StorageError,
    TierUnavailable,
    _split_rel,
    _staging_artifact,
    log,
)
from ckptkeeper.storage.s3_client import S3Objects

_COPY_OP = "copy"
_RESUME_OP = "resume"
"""A marker's ``op`` once its interrupted copy was discarded but uploads it can resume were kept."""

_NO_UPLOAD_LISTING = (
    "abandoned multipart uploads cannot be found or aborted by ckptkeeper on this tier: add a bucket "
    "lifecycle rule AbortIncompleteMultipartUpload; copies go on"
)


class StagingObjects(S3Objects):
    """Markers, interrupted copies and multipart uploads under the tier's prefix."""

    def _abort_uploads_under(self, key: str, keep: Collection[str] = ()) -> set[str]:
        """Abort every multipart upload in progress for ``key`` or a key under ``key/``, except
        those whose id is in ``keep``; returns the ids of ``keep`` found still in progress.

        Called only by whoever holds the checkpoint's staging marker (a copy, or the discard of an
        interrupted one), so every such upload is a leftover of ours: an interrupted copy, or a
        CreateMultipartUpload whose reply was lost and that s3fs/botocore then retried. ``keep``:
        this node's uploads that a copy may still resume (docs/uploads.md).
        """
        kept: set[str] = set()
        for upload in self._uploads_under(key):
            if upload["UploadId"] in keep:
                kept.add(upload["UploadId"])
                continue
            with contextlib.suppress(FileNotFoundError):  # completed or aborted meanwhile
                self._call(
                    "abort_multipart_upload",
                    Bucket=self.bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                )
        return kept

    def _uploads_under(self, key: str) -> list[dict[str, Any]]:
        """Multipart uploads in progress for ``key`` or a key under ``key/`` (every page)."""
        out: list[dict[str, Any]] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key}
        while True:
            try:
                resp = self._call("list_multipart_uploads", **kw)
            except Exception as exc:
                if self._degraded("ListMultipartUploads", exc, _NO_UPLOAD_LISTING):
                    return out
                raise
            for upload in resp.get("Uploads", []):
                if upload["Key"] == key or upload["Key"].startswith(key + "/"):
                    out.append(upload)
            if not resp.get("IsTruncated"):
                return out
            kw["KeyMarker"] = resp.get("NextKeyMarker")
            kw["UploadIdMarker"] = resp.get("NextUploadIdMarker")

    def _resumable_uploads(self, key: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """What an interrupted copy of ``key`` by this node left to resume, for a new copy of it.

        Returns (object key -> resume record of an upload still in progress, this node's resume
        markers on ``key``: the new copy's marker supersedes them). Records come only from
        this node's markers, each checked for shape and for naming an object of ``key``; whether
        one fits the file being copied (size, content hash, part size) the writer checks.
        """
        records, _, ours = self._interrupted_copies(key)
        return records, ours

    def _interrupted_copies(
        self, key: str
    ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
        """:meth:`_resumable_uploads`, and the objects those copies finished: object key -> its
        finished-object record (:func:`_done_records`), from this node's markers only. Whether
        the store still holds each as recorded, :meth:`_still_finished` asks."""
        markers = [o["Key"] for o in self._list_objects(key + STAGING_MARK)]
        ours: list[str] = []
        records: dict[str, dict[str, Any]] = {}
        done: dict[str, dict[str, Any]] = {}
        for marker, doc in self._marker_docs(markers).items():
            if doc.get("node") != self.node or doc.get("op") not in (_COPY_OP, _RESUME_OP):
                continue
            if doc.get("op") == _RESUME_OP:
                ours.append(marker)
            for record in _resume_records(doc, key):
                records.setdefault(record["upload"], record)
            for record in _done_records(doc, key):
                done.setdefault(record["key"], record)
        if not records:
            return {}, done, ours
        live = {(u["Key"], u["UploadId"]) for u in self._uploads_under(key)}
        out: dict[str, dict[str, Any]] = {}
        for upload_id, record in sorted(records.items()):
            if (record["key"], upload_id) in live:
                out.setdefault(record["key"], record)
        return out, done, ours

    def _still_finished(self, records: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Object key -> record, for each finished-object record whose object the store still
        holds as recorded: its ETag, size and CRC32 (HEAD). Any other is not kept."""
        out: dict[str, dict[str, Any]] = {}
        for record in records:
            head = self._head(record["key"], checksum=True)
            if head is None or str(head.get("ETag") or "") != record["etag"]:
                continue
            crc = head.get("ChecksumCRC32")
            if int(head.get("ContentLength", -1)) != record["size"] or not isinstance(crc, str):
                continue
            value, _, parts = crc.partition("-")
            want, _, want_parts = record["crc"].partition("-")
            if value == want and (not parts or parts == want_parts):
                out[record["key"]] = record
        return out

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
            committed = self._head(target_key + MANIFEST_SUFFIX) is not None
            # Uploads are never part of a committed copy: whatever is in progress under the target
            # belongs to the interrupted copy this marker records, and is aborted unless this
            # node's copy can resume it; the objects it finished go too, unless recorded by this
            # node's copy and still as recorded (docs/uploads.md).
            keep, done, doc = (set(), [], {}) if committed else self._resume_keep(marker, target_key)
            finished = self._still_finished(done)
            if not committed:
                objs = [o for o in self._target_objects(target_key) if o[0] not in finished]
                self._delete_keys([k for k, _, _ in objs])
                freed = sum(size for _, size, _ in objs)
            kept = self._abort_uploads_under(target_key, keep)
            if (kept or finished) and doc.get("op") == _COPY_OP:
                # Once: the marker stays as a resume marker, fresh, naming only what is kept;
                # the next discard of it (the reaper's, once it is stale) removes it all.
                records = [r for r in _resume_records(doc, target_key) if r["upload"] in kept]
                doc.update(
                    op=_RESUME_OP,
                    uploads=sorted(kept),
                    resume=records,
                    done=list(finished.values()),
                    heartbeat=time.time(),
                )
                self._put_json(marker, doc)
                log.info(
                    "%s: kept %d multipart upload(s) and %d finished object(s) of %s for the next copy",
                    self.name,
                    len(records),
                    len(finished),
                    artifact.path.rsplit(STAGING_MARK, 1)[0],
                )
                return freed
            self._delete_keys([marker])
        return freed

    def _resume_keep(
        self, marker: str, target_key: str
    ) -> tuple[set[str], list[dict[str, Any]], dict[str, Any]]:
        """Ids of uploads under ``target_key`` a copy of this node may resume, the records of the
        objects such a copy finished (:func:`_done_records`), and ``marker``'s body.

        Those a copy marker of this node records (``marker`` itself, when a copy; others on the
        same target, whatever ``marker`` is): a resume marker being discarded is stale, and its
        uploads and objects go with it unless a newer copy took them over.
        """
        keys = [o["Key"] for o in self._list_objects(target_key + STAGING_MARK)]
        docs = self._marker_docs(sorted({*keys, marker}))
        keep: set[str] = set()
        done: list[dict[str, Any]] = []
        for doc in docs.values():
            if doc.get("node") == self.node and doc.get("op") == _COPY_OP:
                keep.update(r["upload"] for r in _resume_records(doc, target_key))
                done.extend(_done_records(doc, target_key))
        return keep, done, docs.get(marker, {})

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


def _resume_records(doc: Mapping[str, Any], target_key: str) -> list[dict[str, Any]]:
    """The well-formed resume records of a marker body: each names an upload of an object at
    ``target_key`` or under ``target_key/``, with the size, content hash and part size of the file
    it was uploading. Anything else in a body read back from the store is ignored."""
    out: list[dict[str, Any]] = []
    records = doc.get("resume")
    for r in records if isinstance(records, list) else []:
        if not isinstance(r, dict):
            continue
        upload, key, size, digest, part = (r.get(k) for k in ("upload", "key", "size", "hash", "part_size"))
        if not (isinstance(upload, str) and upload and isinstance(key, str) and isinstance(digest, str)):
            continue
        if not digest or not (key == target_key or key.startswith(target_key + "/")):
            continue
        if type(size) is not int or type(part) is not int or size <= 0 or part <= 0:
            continue
        out.append({"upload": upload, "key": key, "size": size, "hash": digest, "part_size": part})
    return out


_DONE_FIELDS = {
    "key": str,
    "size": int,
    "hash": str,
    "digest": str,
    "etag": str,
    "crc": str,
    "part_size": int,
}


def _done_records(doc: Mapping[str, Any], target_key: str) -> list[dict[str, Any]]:
    """The well-formed finished-object records of a marker body (``done``): each names an object
    at ``target_key`` or under ``target_key/`` that the copy completed and checked, with the size
    and hash of the file it was given, the content hash, ETag and CRC32 of what it stored, and
    its part size (:meth:`~.s3_upload._S3FileWriter.done_record`). Anything else is ignored."""
    out: list[dict[str, Any]] = []
    records = doc.get("done")
    for r in records if isinstance(records, list) else []:
        if not isinstance(r, dict) or any(type(r.get(k)) is not t for k, t in _DONE_FIELDS.items()):
            continue
        key = r["key"]
        if not (key == target_key or key.startswith(target_key + "/")):
            continue
        if r["size"] <= 0 or r["part_size"] <= 0 or not all(r[k] for k in ("hash", "digest", "etag", "crc")):
            continue
        out.append({k: r[k] for k in _DONE_FIELDS})
    return out


def _covering(live: Mapping[str, tuple[str, float]], key: str) -> tuple[str, float] | None:
    """The marker entry whose target is ``key`` or a "directory" above it."""
    parts = key.split("/")
    for i in range(len(parts), 0, -1):
        found = live.get("target:" + "/".join(parts[:i]))
        if found is not None:
            return found
    return None
