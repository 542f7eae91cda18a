"""The S3 backend: a tier in S3-compatible object storage, through s3fs/aiobotocore (see the
package docstring for its commit protocol and verification)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ckptkeeper.core.model import (
    MANIFEST_SUFFIX,
    Artifact,
    Manifest,
    TierSpec,
    TierUsage,
)
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.storage.base import (
    _MAX_PIN_BYTES,
    DAMAGED_COPY,
    MULTIPART_KIND,
    PIN_SUFFIX,
    StorageError,
    TierUnavailable,
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
from ckptkeeper.storage.s3_fleet import FleetObjects
from ckptkeeper.storage.s3_transfer import (
    _marker_doc,
    _S3Reader,
    _S3Sink,
)
from ckptkeeper.storage.tier import TierStorage, _compare_sizes

if TYPE_CHECKING:
    from s3fs import S3FileSystem

# fsspec and s3fs are imported where used: the CLI imports this package and local tiers need neither.

_URL_USERINFO = re.compile(r"(\w+://)[^/@\s]+@")
_SECRET_NAMES = ("secret", "token", "password", "key", "credential", "username")
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


_DEGRADED: set[tuple[str, str]] = set()
"""(tier URL, feature) pairs already warned about in this process: one warning per missing feature."""


def _not_implemented(exc: BaseException) -> bool:
    """The store answered 501 / ``NotImplemented``: it lacks the feature, it is not failing."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSYS:  # s3fs's translation of 501
            return True
        response = getattr(seen, "response", None)
        if isinstance(response, Mapping):
            code = str((response.get("Error") or {}).get("Code") or "")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code == "NotImplemented" or status == 501:
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _collect_secrets(options: Mapping[str, Any]) -> list[str]:
    """String values of credential-like options (recursively), longest first, for redaction."""
    found: list[str] = []

    def walk(obj: Any, name: str) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, str(k).lower())
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, name)
        elif isinstance(obj, str) and len(obj) >= 4 and any(s in name for s in _SECRET_NAMES):
            found.append(obj)

    walk(options, "")
    return sorted(set(found), key=len, reverse=True)


_NO_UPLOAD_LISTING = (
    "abandoned multipart uploads cannot be found or aborted by ckptkeeper on this tier: add a bucket "
    "lifecycle rule AbortIncompleteMultipartUpload; copies go on"
)
_NO_CONDITIONAL_WRITE = (
    "manifests are committed with a read-then-write (two nodes committing the same path at the same "
    "instant are not detected); copies go on"
)


class S3TierStorage(FleetObjects, TierStorage):
    """A tier in S3-compatible object storage, through s3fs/aiobotocore."""

    is_local = False
    schemes = ("s3", "s3a")
    part_size: int = 16 * 2**20
    """Multipart part size (grown for objects that would need more than ~9000 parts); objects up
    to it are one PUT.

    Fewer requests cost less client CPU (each is ~ms of botocore) and, read from the file while
    sent, a part costs no memory: bench/s3_transfer.py, 4 x 256 MiB, medians of 5 alternating
    runs: 16 MiB parts 1.75 client CPU-s/GiB and 9.6 s, 8 MiB parts 2.09 CPU-s/GiB and 10.2 s,
    both 65.6 MiB peak RSS (boto3: 2.83 CPU-s/GiB, 10.8 s, 82.0 MiB)."""
    recheck_concurrency: int = 16
    """Requests in flight at once when re-checking a copy before a delete (:meth:`recheck`)."""
    max_inflight: int = 3
    """Parts uploaded concurrently per file.

    From a local file the parts are read from it while they are sent (:class:`_FilePart`): memory
    does not depend on part size or this (bench/s3_transfer.py, 4 x 256 MiB: the transfer adds
    ~1 MiB to the worker's peak RSS; it added 33 MiB when parts were held in buffers). From other
    sources part buffers take ≈ (max_inflight + 1) * part_size.

    Measured against a local moto server, 4 x 256 MiB, with buffered parts: 16 MiB x 4 took 1.39
    client CPU-s/GiB, 8 MiB x 3 1.57 CPU-s/GiB, 5 MiB x 4 1.71 CPU-s/GiB; all at or above boto3's
    wall speed."""
    default_config: ClassVar[dict[str, Any]] = {
        "retries": {"max_attempts": 3, "mode": "standard"},
        "read_timeout": 120,
        "s3": {"payload_signing_enabled": False},
    }
    """botocore defaults unless ``storage_options["config_kwargs"]`` says otherwise: bounded retries
    (on top of s3fs's own 5 for transient errors), a read timeout long enough for
    CompleteMultipartUpload of a large object (s3fs's 15 s made moto time out at 1 GB), and no
    SHA-256 of every body for the signature: each body already carries its CRC32 in a signed header
    that the store checks, which is what botocore itself settles for over HTTPS; over plain HTTP it
    would otherwise hash every byte a second time (~0.9 CPU-s/GiB, bench/s3_transfer.py)."""

    def __init__(self, spec: TierSpec, *, hot: bool = False) -> None:
        super().__init__(spec, hot=hot)
        if hot:
            raise StorageError(f"tier {spec.name!r}: the hot tier must be a local path")
        rest = spec.url.split("://", 1)[1]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StorageError(f"tier {spec.name!r}: no bucket in URL {spec.url!r}")
        self.bucket = bucket
        prefix = prefix.strip("/")
        self.root_prefix = f"{prefix}/" if prefix else ""
        """The tier URL's prefix: the bucket-wide root every node of a shared tier shares."""
        self.prefix = self.root_prefix
        """Where this tier object reads and writes copies: the root, or ``<root><node>/`` in a
        shared tier (DESIGN §10: one node's keys can never be another's)."""
        self.read_only = False
        if spec.shared:
            if not spec.node:
                raise StorageError(
                    f"tier {spec.name!r}: a shared tier needs this node's name (config `node`)"
                )
            _split_rel(spec.node, "node name")
            self.prefix = f"{self.root_prefix}{spec.node}/"
        self._secrets = _collect_secrets(spec.storage_options)
        # credentials botocore would find on its own are just as secret as configured ones
        self._add_secrets(os.environ.get(name, "") for name in _CREDENTIAL_ENV)
        self._fs: S3FileSystem | None = None
        self._listed_pins: list[dict[str, Any]] | None = None
        """Pin objects seen by the last :meth:`list_manifests`, for the :meth:`list_pins` that a
        reconcile makes right after it (one listing of the prefix instead of two)."""

    @property
    def fs(self) -> S3FileSystem:
        """The s3fs filesystem, created on first use (importing s3fs costs ~0.5 s)."""
        if self._fs is None:
            import s3fs

            opts = dict(self.spec.storage_options)
            config = {
                **self.default_config,
                "http_session_cls": _http_session_without_silent_resend(),
                **dict(opts.pop("config_kwargs", None) or {}),
            }
            # private instance, no listing cache: a catalog listing must never be stale
            self._fs = s3fs.S3FileSystem(
                **opts, config_kwargs=config, skip_instance_cache=True, use_listings_cache=False
            )
            # Every failed attempt that botocore or s3fs may retry is logged with its cause: a
            # flaky store should be visible before it becomes a failed move.
            self._fs.s3.meta.events.register("needs-retry.s3", self._log_retryable_failure)
            self._register_resolved_credentials()
        return self._fs

    def _log_retryable_failure(
        self,
        attempts: int = 0,
        caught_exception: BaseException | None = None,
        response: Any = None,
        **kw: Any,
    ) -> None:
        operation = getattr(kw.get("operation"), "name", "request")
        if caught_exception is not None:
            cause = _describe(caught_exception)
        else:
            http, parsed = response if isinstance(response, tuple) else (None, {})
            status = getattr(http, "status_code", 0)
            code = (parsed or {}).get("Error", {}).get("Code") or ""
            if not (status >= 500 or status == 429 or "Throttl" in code or code == "SlowDown"):
                return  # success, or an answer no retry changes (404, 412, …)
            cause = f"HTTP {status} {code}".rstrip()
        log.warning(
            "%s: S3 %s failed on attempt %d (%s); retried within the configured bounds",
            self.name,
            operation,
            attempts,
            self._redact(cause),
        )

    def _add_secrets(self, values: Iterable[str]) -> None:
        from ckptkeeper.util import logs

        found = {v for v in values if isinstance(v, str) and len(v) >= 4}
        self._secrets = sorted(set(self._secrets) | found, key=len, reverse=True)
        logs.register_secrets(self._secrets)

    def _register_resolved_credentials(self) -> None:
        """Credentials from ~/.aws, a profile or instance metadata: only the client knows them."""
        try:
            creds = self._fs.s3._request_signer._credentials  # type: ignore[union-attr]
            self._add_secrets(
                str(getattr(creds, f"_{n}", None) or "") for n in ("access_key", "secret_key", "token")
            )
        except Exception:  # private attributes of botocore: best effort
            pass

    def _redact(self, text: str) -> str:
        from ckptkeeper.util import logs  # the one redaction rule (short secrets: whole tokens only)

        return _URL_USERINFO.sub(r"\1***@", logs.redact(text))

    def _degraded(self, feature: str, exc: BaseException, consequence: str) -> bool:
        """True if ``exc`` says the store lacks ``feature``; warns once per tier and feature.

        A store without one optional feature (s3rver and some gateways answer NotImplemented to
        ListMultipartUploads, older ones to conditional writes) stays usable for copies: only what
        needs the feature is done without it, and the operator is told once, not on every call.
        """
        if not _not_implemented(exc):
            return False
        if (self.url, feature) not in _DEGRADED:
            _DEGRADED.add((self.url, feature))
            log.warning(
                "%s: the store does not implement %s (%s); %s",
                self.name,
                feature,
                self._redact(_describe(exc)),
                consequence,
            )
        return True

    @contextlib.contextmanager
    def _errors(self, what: str, exc_type: type[StorageError] = StorageError) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            raise exc_type(self._redact(f"tier {self.name!r}: {what}: {_describe(exc)}")) from exc

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self.fs.call_s3(method, **kwargs)

    def _key(self, rel: str) -> str:
        _split_rel(rel)
        return self.prefix + rel

    def _part_size_for(self, size: int) -> int:
        part = self.part_size
        if size > part * 9000:
            part = -(-size // 9000)
            part = -(-part // 2**20) * 2**20
        return part

    def _put_json(self, key: str, doc: Mapping[str, Any]) -> None:
        self._call(
            "put_object",
            Bucket=self.bucket,
            Key=key,
            Body=json.dumps(doc).encode(),
            ContentType="application/json",
        )

    def _get(self, key: str) -> bytes | None:
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
        return data

    def _list_objects(self, prefix: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            resp = self._call("list_objects_v2", **kw)
            out.extend(resp.get("Contents", []))
            if not resp.get("IsTruncated"):
                return out
            kw["ContinuationToken"] = resp["NextContinuationToken"]

    def _head(self, key: str, *, checksum: bool = False) -> dict[str, Any] | None:
        kw = {"ChecksumMode": "ENABLED"} if checksum else {}
        try:
            resp: dict[str, Any] = self._call("head_object", Bucket=self.bucket, Key=key, **kw)
        except FileNotFoundError:
            return None
        return resp

    def _target_objects(self, key: str) -> list[tuple[str, int, float]]:
        """(key, size, mtime) of a checkpoint's data: the object ``key`` and everything under ``key/``."""
        found = [
            (o["Key"], int(o["Size"]), o["LastModified"].timestamp()) for o in self._list_objects(key + "/")
        ]
        head = self._head(key)
        if head is not None:
            found.append((key, int(head["ContentLength"]), head["LastModified"].timestamp()))
        return found

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            resp = self._call(
                "delete_objects",
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    self._redact(
                        f"tier {self.name!r}: {len(errors)} deletes failed, e.g. {first.get('Key')}: "
                        f"{first.get('Code')} {first.get('Message')}"
                    )
                )

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

    def _commit_manifest(self, key: str, body: bytes) -> None:
        """PUT the manifest once (``If-None-Match: *``); an ambiguous failure is resolved by reading it."""
        try:
            self._call(
                "put_object",
                Bucket=self.bucket,
                Key=key,
                Body=body,
                IfNoneMatch="*",
                ContentType="application/json",
            )
        except Exception as exc:
            if self._degraded("conditional writes (If-None-Match)", exc, _NO_CONDITIONAL_WRITE):
                self._commit_manifest_unconditionally(key, body)
                return
            try:
                if self._get(key) == body:
                    return  # the first attempt landed; a retry then met If-None-Match
            except Exception:
                pass
            raise

    def _commit_manifest_unconditionally(self, key: str, body: bytes) -> None:
        """The commit on a store without conditional writes: look, then PUT. Another writer of
        the same path between the two is not detected (the staging marker makes that rare)."""
        existing = self._get(key)
        if existing == body:
            return
        if existing is not None:
            raise StorageError(self._redact(f"tier {self.name!r}: {key} was committed by someone else"))
        self._call("put_object", Bucket=self.bucket, Key=key, Body=body, ContentType="application/json")

    # -- primitives -------------------------------------------------------------------------

    def _open_read(self, rel: str, file_path: str) -> _Reader:
        if file_path:
            _split_rel(file_path, "file path in manifest")
        key = self._key(rel) + (f"/{file_path}" if file_path else "")
        return _GuardedReader(self, _S3Reader(self, key))

    def _begin_write(self, rel: str, manifest: Manifest) -> _Sink:
        self._check_writable(f"copy to {rel}")
        return _S3Sink(self, rel, manifest, with_manifest=True)

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise StorageError(
                f"tier {self.name!r}: {what} refused: a view of another node's copies is read-only"
            )

    # -- the fleet's view of a shared bucket (DESIGN §10) ---------------------------------------

    def view(self, node: str | None) -> S3TierStorage:
        """A read-only view of ``node``'s copies (``<root><node>/``), or with None of the
        single-node layout at the root (copies written before the tier was shared)."""
        if node is not None:
            _split_rel(node, "node name")
        other = object.__new__(type(self))  # TierStorage.__new__ wants a spec; share the client
        other.__dict__.update(self.__dict__)
        other.prefix = self.root_prefix + (f"{node}/" if node else "")
        other.read_only = True
        return other

    def adopt(self, node: str) -> S3TierStorage:
        """A writable view of ``node``'s prefix, for the fleet lease holder cleaning a gone node's
        litter (DESIGN §10); its deletes are this node's, under the lease."""
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

    def _list_files(self, rel: str, is_dir: bool) -> dict[str, int | None] | None:
        key = self._key(rel)
        with self._errors(f"listing {rel}"):
            if is_dir:  # an empty "directory" and a missing one look alike in S3
                found: dict[str, int | None] = {
                    o["Key"][len(key) + 1 :]: int(o["Size"]) for o in self._list_objects(key + "/")
                }
                return found or None
            head = self._head(key)
            return None if head is None else {"": int(head["ContentLength"])}

    # -- public API -------------------------------------------------------------------------

    def usage(self) -> TierUsage | None:
        return None  # object stores have no capacity; watermarks do not apply

    def read_manifest(self, rel_path: str) -> Manifest | None:
        key = self._key(rel_path) + MANIFEST_SUFFIX
        with self._errors(f"reading manifest of {rel_path}"):
            text = self._get(key)
        return None if text is None else _parse_manifest(rel_path, text)

    def list_manifests(self) -> list[tuple[str, Manifest | None, str | None]]:
        import asyncio

        from fsspec.asyn import sync

        with self._errors(f"listing {self.url}", TierUnavailable):
            objs = self._list_objects(self.prefix)
            sizes = {o["Key"]: int(o["Size"]) for o in objs}
            self._listed_pins = [o for o in objs if o["Key"].endswith(PIN_SUFFIX)]
            keys = [
                o["Key"]
                for o in objs
                if o["Key"].endswith(MANIFEST_SUFFIX) and STAGING_MARK not in o["Key"].rsplit("/", 1)[-1]
            ]

            async def fetch_all() -> list[bytes | BaseException]:
                sem = asyncio.Semaphore(16)

                async def one(key: str) -> bytes | BaseException:
                    async with sem:
                        try:
                            data: bytes = await self.fs._cat_file(f"{self.bucket}/{key}")
                            return data
                        except Exception as exc:
                            return exc

                return await asyncio.gather(*(one(k) for k in keys))

            results = sync(self.fs.loop, fetch_all)
        out: list[tuple[str, Manifest | None, str | None]] = []
        for key, result in zip(keys, results, strict=True):
            rel = key[len(self.prefix) : -len(MANIFEST_SUFFIX)]
            if isinstance(result, FileNotFoundError):
                continue  # deleted since the listing
            if isinstance(result, BaseException):
                raise TierUnavailable(
                    self._redact(f"tier {self.name!r}: reading {key}: {_describe(result)}")
                ) from result
            try:
                manifest = _parse_manifest(rel, result)
            except StorageError as exc:
                out.append((rel, None, str(exc)))
                continue
            # The listing already holds every object's size: a manifest over missing data costs
            # no request to catch, and must not be reported as a copy (issue #13).
            base = key[: -len(MANIFEST_SUFFIX)]
            present: dict[str, int | None] = {
                e.path: sizes.get(f"{base}/{e.path}" if e.path else base) for e in manifest.files
            }
            damage = _compare_sizes(rel, manifest, {k: v for k, v in present.items() if v is not None})
            out.append((rel, manifest, DAMAGED_COPY + "; ".join(damage) if damage else None))
        return sorted(out, key=lambda t: t[0])

    def recheck(self, manifest: Manifest) -> list[str]:
        """:meth:`TierStorage.recheck` with one request per object, all in flight together.

        A GET of the manifest (it must still be committed, with this version) and a HEAD of each
        data object (present, of the manifest's size), at most :attr:`recheck_concurrency` at a
        time on fsspec's IO loop: a checkpoint of 100 objects is about one round trip of 16, not
        100 sequential ones (bench/tier_move.py). The manifest's SHA-256 is not something S3 can
        echo (it stores a CRC32), so content is :meth:`verify`'s job, as for local tiers.
        """
        import asyncio

        from fsspec.asyn import sync

        _check_manifest(manifest)
        rel = _rel_of(manifest)
        key = self._key(rel)
        targets = [(e.path, f"{key}/{e.path}" if e.path else key) for e in manifest.files]

        async def check_all() -> list[Any]:
            sem = asyncio.Semaphore(self.recheck_concurrency)

            async def head(k: str) -> Any:
                async with sem:
                    try:
                        return await self.fs._call_s3("head_object", Bucket=self.bucket, Key=k)
                    except FileNotFoundError:
                        return None

            async def committed() -> bytes | None:
                async with sem:
                    try:  # one GET (s3fs's _cat_file would HEAD first)
                        resp = await self.fs._call_s3(
                            "get_object", Bucket=self.bucket, Key=f"{key}{MANIFEST_SUFFIX}"
                        )
                    except FileNotFoundError:
                        return None
                    body = resp["Body"]
                    try:
                        data: bytes = await body.read()
                    finally:
                        body.close()
                    return data

            return await asyncio.gather(committed(), *(head(k) for _, k in targets), return_exceptions=True)

        with self._errors(f"re-checking {rel}"):
            results = sync(self.fs.loop, check_all)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        text, heads = results[0], results[1:]
        if text is None:
            return [f"{rel}: no committed copy (manifest missing)"]
        committed_manifest = _parse_manifest(rel, text)
        if committed_manifest.digest != manifest.digest:
            return [f"{rel}: holds version {committed_manifest.digest}, not {manifest.digest}"]
        present = {
            path: int(head["ContentLength"]) for (path, _), head in zip(targets, heads, strict=True) if head
        }
        return _compare_sizes(rel, manifest, dict(present))

    def delete(self, rel_path: str, *, adopt: bool = False) -> int:
        """Marker, then manifest (de-commit), then data; the marker goes last.

        A copy whose manifest names another node is refused (DESIGN §10: another node's copies
        are read-only here) unless ``adopt`` (the fleet lease holder cleaning an orphan).
        """
        self._check_writable(f"delete of {rel_path}")
        key = self._key(rel_path)
        with self._errors(f"delete {rel_path}"):
            manifest_key = key + MANIFEST_SUFFIX
            body = self._get(manifest_key)
            has_manifest = body is not None
            owner = _owner_of(body) if body is not None else ""
            if owner and self.node and owner != self.node and not adopt:
                raise StorageError(
                    f"tier {self.name!r}: {rel_path} is owned by node {owner}, not {self.node}: "
                    "refusing to delete another node's copy"
                )
            objs = self._target_objects(key)
            if not objs and not has_manifest:
                return 0
            marker = f"{key}{STAGING_MARK}{_token()}"
            self._put_json(marker, _marker_doc("delete", rel_path, None, self.node))
            if has_manifest:
                self._delete_keys([manifest_key])
            self._delete_keys([k for k, _, _ in objs])
            self._delete_keys([marker])
        return sum(size for _, size, _ in objs)

    def _other_writers(self, key: str) -> list[str]:
        """Other nodes with a staging marker on ``key`` (a copy in progress, or its litter):
        their data and uploads there are not ours to clear (DESIGN §10)."""
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

    # -- pins ------------------------------------------------------------------------------

    def write_pin(self, run: str, name: str, step: int, node: str) -> None:
        rel = f"{run}/{name}"
        self._check_writable(f"pin of {rel}")
        with self._errors(f"writing the pin of {rel}"):
            self._call(
                "put_object",
                Bucket=self.bucket,
                Key=self._key(rel) + PIN_SUFFIX,
                Body=_pin_doc(run, name, step, node),
                ContentType="application/json",
            )

    def remove_pin(self, run: str, name: str) -> None:
        rel = f"{run}/{name}"
        self._check_writable(f"unpin of {rel}")
        with self._errors(f"removing the pin of {rel}"):
            self._delete_keys([self._key(rel) + PIN_SUFFIX])

    def list_pins(self) -> set[tuple[str, str]]:
        out: set[tuple[str, str]] = set()
        listed, self._listed_pins = self._listed_pins, None
        with self._errors(f"listing pins in {self.url}", TierUnavailable):
            # a pin written since that listing is read at the next one (pins are only ever added
            # from a listing, so a late one costs nothing but a pass)
            for obj in listed if listed is not None else self._list_objects(self.prefix):
                key = obj["Key"]
                if not key.endswith(PIN_SUFFIX) or STAGING_MARK in key.rsplit("/", 1)[-1]:
                    continue
                if int(obj.get("Size", 0)) > _MAX_PIN_BYTES:
                    continue  # no pin of ours is that big: never downloaded
                data = self._get(key)
                if data is None:
                    continue  # unpinned since the listing
                pin = _parse_pin(key[len(self.prefix) : -len(PIN_SUFFIX)], data)
                if pin is not None:
                    out.add(pin)
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


def _owner_of(body: bytes) -> str:
    """The ``node`` a manifest names ('' when it names none or is not JSON: owner unknown)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    node = doc.get("node") if isinstance(doc, dict) else None
    return node if isinstance(node, str) else ""


def _http_session_without_silent_resend() -> type:
    """aiobotocore's HTTP session, minus aiohttp's own resend of a request that failed.

    aiohttp (3.11+) resends a GET/HEAD/PUT/DELETE once, silently, when its connection is reset or
    closed (RFC 9112 §9.3.1). That attempt happens below botocore: no ``needs-retry`` event (so
    no warning naming the cause), not counted against ``retries.max_attempts``. A store resetting
    connections then looked healthy while a flaky POST (CreateMultipartUpload, DeleteObjects) was
    logged: which faults showed depended on which requests they hit. With it off, every failed
    attempt surfaces to botocore, which retries it within the configured bounds and logs it.
    """
    from aiobotocore.httpsession import AIOHTTPSession

    class _NoSilentResend(AIOHTTPSession):
        async def _get_session(self, proxy_url: Any) -> Any:
            session = await super()._get_session(proxy_url)
            # aiohttp has no public switch; its own test client turns the resend off the same way.
            session._retry_connection = False
            return session

    return _NoSilentResend


class _GuardedReader:
    def __init__(self, tier: S3TierStorage, reader: _S3Reader) -> None:
        self.tier = tier
        self.reader = reader

    def read(self, n: int, /) -> bytes:
        with self.tier._errors(f"reading {self.reader.key}"):
            return self.reader.read(n)

    def close(self) -> None:
        self.reader.close()
