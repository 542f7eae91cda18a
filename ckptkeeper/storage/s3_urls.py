"""How a plain GET of a restore reaches the store: which tiers it can reach at all, each object's
URL and the signer of its requests, TLS as the S3 client checks it, connections, and what an error
answer means. Shared by the ranged restore (:mod:`.s3_get`) and the one-manifest read
(:mod:`.s3_plain`), so both reach the store exactly as the tier's S3 client would."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import ssl
import threading
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from ckptkeeper.storage.base import StorageError, _describe, log
from ckptkeeper.storage.s3_sign import GetSigner, plain_signer

if TYPE_CHECKING:
    from ckptkeeper.core.model import TierSpec


class S3TierStorage(Protocol):
    """What a plain GET uses of the S3 backend (:class:`~ckptkeeper.storage.s3.S3TierStorage`)."""

    name: str
    bucket: str
    spec: TierSpec

    def _redact(self, text: str) -> str: ...
    def _key(self, rel: str) -> str: ...


URL_SECONDS = 6 * 3600
"""Lifetime of a presigned URL (a failed request signs its URL again before it is retried)."""
PROXY_ENV = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")


_OPTIONS = frozenset(
    {"key", "secret", "token", "endpoint_url", "client_kwargs", "config_kwargs", "profile", "anon"}
    | {"requester_pays", "use_ssl"}
)
"""``storage_options`` the signing client understands as s3fs does; any other keeps the S3 client."""
ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def usable(tier: S3TierStorage) -> bool:
    """Plain GETs reach the store the way the tier's S3 client would: no proxy is configured, every
    storage option is one :func:`signer_client` maps, and the endpoint or the bucket's region is given."""
    options = options_of(tier)
    if set(options) - _OPTIONS or any(os.environ.get(k) for k in PROXY_ENV):
        return False
    config = options.get("config_kwargs") or {}
    client_kwargs = options.get("client_kwargs") or {}
    verify = client_kwargs.get("verify")
    if config.get("proxies") or not (verify is None or isinstance(verify, bool | str)):
        return False
    # On AWS itself only a region given in the tier's options is trusted to be the bucket's (an
    # AWS_REGION in the environment is often the compute's): botocore follows a wrong one, we cannot.
    return bool(
        options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or client_kwargs.get("region_name")
        or config.get("region_name")
        or any(os.environ.get(k) for k in ENDPOINT_ENV)
    )


def options_of(tier: S3TierStorage) -> dict[str, Any]:
    return dict(tier.spec.storage_options or {})


def urls(tier: S3TierStorage, keys: list[str]) -> tuple[GetSigner | None, list[str]]:
    """Each key's URL, and the signer of each request to it (:mod:`.s3_sign`): built from the options
    alone when they say everything (endpoint, credentials, region), else from what botocore's
    presigned URL of the first key shows; failing both, URLs presigned by botocore (no signer)."""
    if not keys:
        return None, []
    plain = plain_signer(options_of(tier), os.environ, tier.bucket)
    if plain is not None:
        return plain, [plain.url(k) for k in keys]
    client, params = signer_client(tier)
    probe = presign(tier, keys[:1])[0]
    signer = None
    if not params:  # a RequestPayer parameter goes in the query, which GetSigner does not sign
        with contextlib.suppress(Exception):  # private attribute of botocore: else presign each
            signer = GetSigner.from_probe(probe, keys[0], client._request_signer._credentials)
    if signer is None:
        return None, [probe, *presign(tier, keys[1:])]
    return signer, [signer.url(k) for k in keys]


def presign(tier: S3TierStorage, keys: list[str]) -> list[str]:
    """A GET URL per key, signed (SigV4) by a botocore client built from the tier's options."""
    client, params = signer_client(tier)
    try:
        return [
            client.generate_presigned_url(
                "get_object", Params={"Bucket": tier.bucket, "Key": k, **params}, ExpiresIn=URL_SECONDS
            )
            for k in keys
        ]
    except Exception as exc:
        raise StorageError(tier._redact(f"tier {tier.name!r}: cannot sign GET requests: {exc}")) from exc


_SIGNERS: dict[tuple[int, str, str, str], tuple[Any, dict[str, str]]] = {}
_SIGNERS_LOCK = threading.Lock()


def signer_client(tier: S3TierStorage) -> tuple[Any, dict[str, str]]:
    """The process's signing client for ``tier`` (botocore alone: it resolves credentials, region,
    endpoint and addressing as the tier's s3fs client does, at half the start-up of s3fs) and the
    extra GET parameters. Kept per tier, options and ``AWS_*`` environment, as s3fs clients are."""
    options = dict(options_of(tier))
    environment = json.dumps(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    cache_key = (os.getpid(), tier.name, json.dumps(options, sort_keys=True, default=repr), environment)
    with _SIGNERS_LOCK:
        found = _SIGNERS.get(cache_key)
        if found is not None:
            return found
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        client_kwargs = dict(options.get("client_kwargs") or {})
        client_kwargs.pop("verify", None)  # no request is sent by this client
        init = {
            "aws_access_key_id": options.get("key"),
            "aws_secret_access_key": options.get("secret"),
            "aws_session_token": options.get("token"),
            "endpoint_url": options.get("endpoint_url"),
        }
        init = {k: v for k, v in init.items() if v is not None}
        if "use_ssl" in options:
            init["use_ssl"] = options["use_ssl"]
        config = {"signature_version": "s3v4", **dict(options.get("config_kwargs") or {})}
        if options.get("anon"):
            config["signature_version"] = UNSIGNED
        session = botocore.session.Session(profile=options.get("profile"))
        client = session.create_client("s3", config=Config(**config), **{**init, **client_kwargs})
        params = {"RequestPayer": "requester"} if options.get("requester_pays") else {}
        with contextlib.suppress(Exception):  # credentials from a profile or instance metadata
            creds = client._request_signer._credentials
            add = getattr(tier, "_add_secrets", None)
            if creds is not None and add is not None:
                add(str(getattr(creds, f"_{n}", None) or "") for n in ("access_key", "secret_key", "token"))
        _SIGNERS[cache_key] = (client, params)
        return client, params


def tls_context(tier: S3TierStorage) -> ssl.SSLContext:
    """Certificates checked as the S3 client checks them (``verify``, ``AWS_CA_BUNDLE``, botocore's bundle)."""
    verify = (options_of(tier).get("client_kwargs") or {}).get("verify")
    if verify is False:
        return ssl._create_unverified_context()
    cafile = verify if isinstance(verify, str) else os.environ.get("AWS_CA_BUNDLE")
    if cafile is None:
        with contextlib.suppress(Exception):
            from botocore.httpsession import get_cert_path

            cafile = get_cert_path(True)
    return ssl.create_default_context(cafile=cafile if isinstance(cafile, str) else None)


def connect(url: str, timeout: float, context: ssl.SSLContext | None) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme == "https":
        return http.client.HTTPSConnection(host, parts.port, timeout=timeout, context=context)
    return http.client.HTTPConnection(host, parts.port, timeout=timeout)


def error_code(body: bytes, status: int) -> str:
    """The S3 error code in an error answer's XML body (``NoSuchKey``), else ``HTTP <status>``."""
    return body.decode(errors="replace").partition("<Code>")[2].partition("</Code>")[0] or f"HTTP {status}"


def region_hint(region: str) -> str:
    """What to do about a redirect to the bucket's own region (``x-amz-bucket-region``)."""
    return f": the bucket is in region {region}; set client_kwargs.region_name to it in the tier's storage_options"


def resume_or_fail(
    tier: S3TierStorage, where: str, key: str, at: int, exc: BaseException, attempt: int, retries: int
) -> None:
    """A read of ``key`` broke at byte ``at`` (``attempt`` of ``retries``): logged as resumed, or,
    past the last attempt, the restore fails naming the file, the byte and why. Shared by the plain
    GETs (:mod:`.s3_get`) and the S3 client's path (:mod:`.s3_fetch`)."""
    why = tier._redact(_describe(exc))
    if attempt > retries:
        raise StorageError(f"{where}: read broke at byte {at}: {why}") from exc
    log.warning(
        "%s: read of s3://%s/%s broke at byte %d (%s); resuming, attempt %d of %d",
        tier.name,
        tier.bucket,
        key,
        at,
        why,
        attempt,
        retries,
    )
