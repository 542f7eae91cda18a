"""The S3 backend's requests: the s3fs client, retries logged with their cause, secrets kept out
of every message, and the small object helpers (GET, PUT of JSON, HEAD, listing, batch delete)
that the tier, its staging reaper and the fleet's objects are built from.

:class:`S3Objects` is the base of :class:`~ckptkeeper.storage.s3.S3TierStorage` and of its
mixins (:mod:`.s3_staging`, :mod:`.s3_fleet`), kept apart so the backend module stays small.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC
from typing import TYPE_CHECKING, Any, ClassVar

from ckptkeeper.core.model import TierSpec
from ckptkeeper.storage import deadline
from ckptkeeper.storage.base import StorageError, TierUnavailable, _describe, _split_rel, log
from ckptkeeper.storage.store_clock import StoreClock, clock_for

if TYPE_CHECKING:
    from s3fs import S3FileSystem

# fsspec, s3fs and aiobotocore are imported where used: the CLI imports this package and local
# tiers need none of them.


_URL_USERINFO = re.compile(r"(\w+://)[^/@\s]+@")
_SECRET_NAMES = ("secret", "token", "password", "key", "credential", "username")
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


_DEGRADED: set[tuple[str, str]] = set()
"""(tier URL, feature) pairs already warned about in this process: one warning per missing feature."""


def _date_of(exc: BaseException) -> str | None:
    """The ``Date`` header of the error answer behind ``exc`` (s3fs wraps botocore's), if any."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        response = getattr(seen, "response", None)
        if isinstance(response, Mapping):
            date = ((response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date")
            if date:
                return str(date)
        seen = seen.__cause__ or seen.__context__
    return None


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


class S3Objects:
    """Requests to one bucket under one prefix, with the tier's error and secret handling."""

    spec: TierSpec
    name: str
    url: str
    node: str
    bucket: str
    root_prefix: str
    prefix: str
    read_only: bool
    part_size: int
    _secrets: list[str]
    _fs: S3FileSystem | None

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

    @property
    def fs(self) -> S3FileSystem:
        """The s3fs filesystem, created on first use (importing s3fs costs ~0.5 s).

        One per tier and credentials in a process (:func:`_shared_fs`): a prune opens the same
        tier for the index rebuild, the reconcile before the plan, the executor and the reconcile
        after it, and each new client cost ~0.1 CPU-s and ~13 MiB (botocore's models, an aiohttp
        session) — bench/prune_e2e.py."""
        if self._fs is None:
            self._fs = _shared_fs(self.spec, self.default_config, self._log_retryable_failure)
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
        what = f"{method} {kwargs.get('Key') or kwargs.get('Prefix') or kwargs.get('Bucket') or ''}".rstrip()
        try:
            resp = self._bounded(what, self.fs._call_s3, method, **kwargs)
        except Exception as exc:  # an error answer (404, 412) carries the store's clock too
            self.store_clock.note(_date_of(exc))
            raise
        if isinstance(resp, dict):  # the store's clock rides on every answer (its Date header)
            headers = (resp.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
            self.store_clock.note(headers.get("date"))
        return resp

    def _bounded(self, what: str, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``func`` (a coroutine function of the client) on fsspec's loop, for at most the
        request deadline (:mod:`ckptkeeper.storage.deadline`): past it, it is cancelled and a
        :class:`StorageError` names the request."""
        from fsspec.asyn import sync
        from fsspec.exceptions import FSTimeoutError

        # TierUnavailable: a listing that hung is a listing that failed (never read as empty)
        try:
            timeout = deadline.remaining(what, self.name)
        except TimeoutError as exc:
            raise TierUnavailable(self._redact(str(exc))) from None
        try:
            return sync(self.fs.loop, func, *args, timeout=timeout, **kwargs)
        except FSTimeoutError:
            raise TierUnavailable(self._redact(deadline.hung(self.name, what, timeout))) from None

    @property
    def store_clock(self) -> StoreClock:
        """This store's clock (:mod:`ckptkeeper.storage.store_clock`): one per endpoint and bucket."""
        opts = self.spec.storage_options
        endpoint = str(
            opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url") or ""
        )
        return clock_for(f"{endpoint}|{self.bucket}")

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

    def _get(self, key: str, *, plain: bool = False) -> bytes | None:
        """The body of ``key``; None when missing. ``plain``: before this tier has a client, read
        it with a plain signed GET where one reaches the store alike (:mod:`.s3_plain`)."""
        if plain:
            from ckptkeeper.storage import s3_plain

            if s3_plain.usable(self):
                return s3_plain.get(self, key)
        try:
            resp = self._call("get_object", Bucket=self.bucket, Key=key)
        except FileNotFoundError:
            return None
        body = resp["Body"]
        try:
            data: bytes = self._bounded(f"reading the body of {key}", body.read)
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

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise StorageError(
                f"tier {self.name!r}: {what} refused: a view of another node's copies is read-only"
            )


_FS_CACHE: dict[tuple[int, str, str, str], S3FileSystem] = {}
"""(pid, tier name, storage options, AWS_* environment) -> its client; at most :data:`_FS_CACHE_MAX`."""
_FS_CACHE_MAX = 16
_FS_LOCK = threading.Lock()


def _shared_fs(spec: TierSpec, default_config: Mapping[str, Any], on_retry: Any) -> S3FileSystem:
    """The process's s3fs client for ``spec``'s tier, created on first use.

    Sharing is safe because nothing in a client is a view of the bucket: the listing cache is off
    (a catalog listing must never be stale) and every request goes to the store. The key holds
    everything the client was built from — the tier's name (its retry warnings name it), its
    storage options and the ``AWS_*`` environment botocore reads credentials and endpoints from —
    so a changed config or credential gets a new client, never a stale one."""
    import os

    options = json.dumps(spec.storage_options, sort_keys=True, default=repr)
    environment = json.dumps(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    # A forked child (a DataLoader worker of a script that restored) must not reuse the parent's
    # client: its aiohttp session belongs to the parent's event loop (fsspec's own instance cache
    # is per-process for the same reason).
    key = (os.getpid(), spec.name, options, environment)
    with _FS_LOCK:
        fs = _FS_CACHE.get(key)
        if fs is not None:
            return fs
        import s3fs

        opts = dict(spec.storage_options)
        client_kwargs = dict(opts.get("client_kwargs") or {})
        endpoint = str(opts.get("endpoint_url") or client_kwargs.get("endpoint_url") or "")
        if endpoint.lower().startswith("http://") and "verify" not in client_kwargs:
            # Plain HTTP never makes a TLS connection: without this, aiobotocore still builds a
            # verifying SSL context from the system's CA store (a thread, ~1 MiB, ~25 ms).
            opts["client_kwargs"] = {**client_kwargs, "verify": False}
        config = {
            **default_config,
            "http_session_cls": _http_session_without_silent_resend(),
            **dict(opts.pop("config_kwargs", None) or {}),
        }
        # no instance cache of s3fs's own (it keys on fewer things), no listing cache
        fs = s3fs.S3FileSystem(
            **opts, config_kwargs=config, skip_instance_cache=True, use_listings_cache=False
        )
        if fs.session is None:  # s3fs's own session, with a quicker timestamp parser
            import aiobotocore.session

            fs.session = aiobotocore.session.AioSession(**fs.kwargs)
            factory = fs.session.get_component("response_parser_factory")
            factory.set_parser_defaults(timestamp_parser=_parse_timestamp)
        # Every failed attempt that botocore or s3fs may retry is logged with its cause: a
        # flaky store should be visible before it becomes a failed move.
        fs.s3.meta.events.register("needs-retry.s3", on_retry)
        if len(_FS_CACHE) >= _FS_CACHE_MAX:
            _FS_CACHE.pop(next(iter(_FS_CACHE)))
        _FS_CACHE[key] = fs
        return fs


def _parse_timestamp(value: Any) -> Any:
    """botocore's timestamp parser, with the two forms S3 sends parsed by the standard library.

    Every object of a listing carries an ISO 8601 ``LastModified``, which botocore parses with
    dateutil's general parser: ~0.1 ms each, a tenth of the client CPU of a prune of 800 small
    files (two listings of each checkpoint; bench/prune_e2e.py). ``datetime.fromisoformat`` reads
    ``2026-12-03T13:53:37.000Z`` and ``email.utils`` the RFC 1123 dates of headers; anything else
    goes to botocore's parser, as before. Both give the same aware UTC instant botocore would."""
    from datetime import datetime

    if isinstance(value, str):
        try:
            if len(value) >= 20 and value[10] == "T" and value.endswith("Z"):
                return datetime.fromisoformat(value[:-1]).replace(tzinfo=UTC)
            if value.endswith(" GMT"):
                from email.utils import parsedate_to_datetime

                return parsedate_to_datetime(value)
        except (TypeError, ValueError):
            pass
    from botocore.utils import parse_timestamp

    return parse_timestamp(value)


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
