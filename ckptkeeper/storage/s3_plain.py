"""One small object (a manifest) read with a plain signed GET, before the process has an S3 client.

A standalone ``ckptkeeper restore`` reads the checkpoint's committed manifest, then fetches the
files with plain GETs (:mod:`.s3_get`). Reading that one manifest through the tier's s3fs client
cost more CPU than fetching a checkpoint of 200 files: importing s3fs, aiobotocore and aiohttp and
building the client (botocore's service model) took ~0.3-0.4 CPU-s of a ~1 CPU-s process
(bench/restore_s3.py). Here the GET is signed as :mod:`.s3_get` signs its requests (:mod:`.s3_urls`: the tier's
options and credentials, resolved as its S3 client would) and sent with ``http.client``.

Used only where :func:`.s3_urls.usable` says plain GETs reach the store as the client would (no
proxy, every storage option understood) and the tier has no client yet: once it has one, that
client is used. Answers mean what they mean through the client: 404 is a missing object (None);
5xx, 429 and broken connections are retried a bounded number of times, each attempt within the
request deadline (:mod:`.deadline`); any other answer fails the read, naming the key and the code.
"""

from __future__ import annotations

import http.client
import time
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from ckptkeeper.storage import deadline
from ckptkeeper.storage.base import TierUnavailable, log

if TYPE_CHECKING:
    from ckptkeeper.core.model import TierSpec
    from ckptkeeper.storage.store_clock import StoreClock


class S3Objects(Protocol):
    """What a plain GET uses of the S3 backend (:class:`~ckptkeeper.storage.s3_client.S3Objects`)."""

    name: str
    bucket: str
    spec: TierSpec
    _fs: Any

    @property
    def store_clock(self) -> StoreClock: ...
    def _redact(self, text: str) -> str: ...
    def _key(self, rel: str) -> str: ...


RETRIES = 5
"""Attempts after the first for a transient failure (as s3fs retries one)."""
MAX_BYTES = 64 * 2**20
"""Larger answers are refused: this reads manifests, never checkpoint data."""


class _Transient(Exception):
    """A failure worth another attempt (5xx, 429, a connection that broke)."""


class _Final(Exception):
    """An answer no retry changes (403, 400, a redirect to another region, an oversized body)."""


def usable(tier: S3Objects) -> bool:
    """Plain GETs reach this tier's store as its client would, and it has no client yet."""
    if tier._fs is not None:
        return False
    from ckptkeeper.storage import s3_urls

    return s3_urls.usable(tier)


def get(tier: S3Objects, key: str) -> bytes | None:
    """The body of ``key`` in the tier's bucket; None when the store answers 404.

    Raises :class:`~ckptkeeper.storage.base.TierUnavailable` when the request deadline passes,
    ``OSError`` naming the key and the store's code for any other failure (the caller's error
    context names the tier and what it was reading)."""
    from ckptkeeper.storage import s3_urls

    signer, urls = s3_urls.urls(tier, [key])
    url = urls[0]
    context = s3_urls.tls_context(tier) if url.startswith("https:") else None
    what = f"GET {key}"
    attempt = 0
    while True:
        try:
            timeout = deadline.remaining(what, tier.name)
        except TimeoutError as exc:
            raise TierUnavailable(tier._redact(str(exc))) from None
        try:
            return _get_once(tier, url, signer, key, timeout, context)
        except _Final as exc:
            raise OSError(str(exc)) from None
        except TimeoutError:
            raise TierUnavailable(tier._redact(deadline.hung(tier.name, what, timeout))) from None
        except (_Transient, OSError, http.client.HTTPException) as exc:
            attempt += 1
            if attempt > RETRIES:
                raise OSError(f"GET {key}: {type(exc).__name__}: {exc}") from exc
            log.warning(
                "%s: S3 GetObject failed on attempt %d (%s); retried within the configured bounds",
                tier.name,
                attempt,
                tier._redact(f"{type(exc).__name__}: {exc}"),
            )
            time.sleep(min(0.2 * 2**attempt, 5.0))
            if signer is None:  # a presigned URL: sign it again (it may have expired)
                url = s3_urls.presign(tier, [key])[0]


def _get_once(tier: S3Objects, url: str, signer: Any, key: str, timeout: float, context: Any) -> bytes | None:
    from ckptkeeper.storage import s3_urls

    parts = urlsplit(url)
    path = f"{parts.path}?{parts.query}" if parts.query else parts.path
    conn = s3_urls.connect(url, timeout, context)
    try:
        conn.request("GET", path, headers=signer.headers(path) if signer is not None else {})
        resp = conn.getresponse()
        tier.store_clock.note(resp.getheader("Date"))  # the store's clock rides on every answer
        if resp.status == 200:
            length = resp.getheader("Content-Length")
            if length is not None and int(length) > MAX_BYTES:
                raise _Final(f"GET {key}: {length} bytes, more than a manifest holds")
            body = resp.read(MAX_BYTES + 1)
            if length is not None and len(body) != int(length):
                raise _Transient(f"connection closed after {len(body)} of {length} bytes")
            return body
        body = resp.read(4096)
    finally:
        conn.close()
    code = s3_urls.error_code(body, resp.status)
    if resp.status == 404:
        return None
    if resp.status >= 500 or resp.status == 429 or (resp.status == 403 and signer is None):
        raise _Transient(f"{code} (HTTP {resp.status})")
    region = resp.getheader("x-amz-bucket-region")
    hint = s3_urls.region_hint(region) if resp.status in (301, 307) and region else ""
    raise _Final(f"GET {key}: {code} (HTTP {resp.status}){hint}")
