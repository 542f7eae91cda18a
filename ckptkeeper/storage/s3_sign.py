"""AWS Signature Version 4 for the plain GETs of a restore (:mod:`.s3_get`), signed here per request.

botocore decides where a key lives (endpoint, addressing style, region, FIPS or dual-stack hosts):
one URL it presigns shows the host, the path before the key and the signing scope. Every other
key's URL is that prefix plus the key, quoted as botocore quotes it, and each request is signed
in its headers with the client's current credentials (refreshed by botocore when they expire).
botocore's presigning costs ~0.13 ms per URL (endpoint rules, event hooks); this ~15 µs, which a
checkpoint of thousands of files notices. A URL that is not SigV4 (a configured other signature
version) gives no signer: the caller presigns every key with botocore instead.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


def quote_key(key: str) -> str:
    """A key as botocore puts it in a URL path (and as SigV4's canonical URI for S3 takes it)."""
    return quote(key, safe="/~")


class GetSigner:
    """URLs and ``Authorization`` headers for GETs of keys of one bucket."""

    def __init__(self, base: str, host: str, region: str, service: str, credentials: Any) -> None:
        self.base = base
        """``scheme://host[:port]/path-before-the-key``."""
        self.host = host
        self.region = region
        self.service = service
        self.credentials = credentials
        """botocore credentials (``get_frozen_credentials()``); None: unsigned (anonymous) requests."""
        self._keys: dict[tuple[str, str], bytes] = {}

    @classmethod
    def from_probe(cls, url: str, key: str, credentials: Any) -> GetSigner | None:
        """The signer for the bucket of ``url``, botocore's presigned GET of ``key``; None when it
        is not a SigV4 URL of that key."""
        parts = urlsplit(url)
        quoted = quote_key(key)
        if not parts.path.endswith(quoted) or not parts.netloc:
            return None
        base = f"{parts.scheme}://{parts.netloc}{parts.path[: len(parts.path) - len(quoted)]}"
        query = parse_qs(parts.query)
        if not query:  # unsigned (anonymous) client: plain URLs
            return cls(base, parts.netloc, "", "", None)
        scope = (query.get("X-Amz-Credential") or [""])[0].split("/")
        if (query.get("X-Amz-Algorithm") or [""])[0] != ALGORITHM or len(scope) != 5 or credentials is None:
            return None
        return cls(base, parts.netloc, scope[2], scope[3], credentials)

    def url(self, key: str) -> str:
        return self.base + quote_key(key)

    def headers(self, path: str, now: float | None = None) -> dict[str, str]:
        """Headers signing ``GET path`` (no query string) at ``now``; Range and If-Match, which
        SigV4 lets go unsigned, are added by the caller."""
        if self.credentials is None:
            return {"Host": self.host}
        frozen = self.credentials.get_frozen_credentials()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        headers = {"Host": self.host, "X-Amz-Content-SHA256": UNSIGNED_PAYLOAD, "X-Amz-Date": stamp}
        if frozen.token:
            headers["X-Amz-Security-Token"] = frozen.token
        return {**headers, "Authorization": self.authorization(path, headers, frozen, stamp)}

    def authorization(self, path: str, headers: dict[str, str], frozen: Any, stamp: str) -> str:
        canonical = sorted((k.lower(), " ".join(v.split())) for k, v in headers.items())
        signed = ";".join(k for k, _ in canonical)
        request = "\n".join(
            ["GET", path, "", *(f"{k}:{v}" for k, v in canonical), "", signed, UNSIGNED_PAYLOAD]
        )
        scope = f"{stamp[:8]}/{self.region}/{self.service}/aws4_request"
        to_sign = f"{ALGORITHM}\n{stamp}\n{scope}\n{hashlib.sha256(request.encode()).hexdigest()}"
        signature = hmac.new(self._key(frozen.secret_key, stamp[:8]), to_sign.encode(), hashlib.sha256)
        return (
            f"{ALGORITHM} Credential={frozen.access_key}/{scope}, SignedHeaders={signed}, "
            f"Signature={signature.hexdigest()}"
        )

    def _key(self, secret: str, day: str) -> bytes:
        found = self._keys.get((secret, day))
        if found is None:
            found = f"AWS4{secret}".encode()
            for part in (day, self.region, self.service, "aws4_request"):
                found = hmac.new(found, part.encode(), hashlib.sha256).digest()
            self._keys = {(secret, day): found}  # one day, one secret at a time
        return found


class StaticCredentials:
    """Credentials given outright (storage options or ``AWS_*`` variables): nothing to refresh."""

    def __init__(self, access_key: str, secret_key: str, token: str | None) -> None:
        self.access_key = access_key
        self.secret_key = secret_key
        self.token = token

    def get_frozen_credentials(self) -> StaticCredentials:
        return self


_PLAIN_CONFIG = frozenset({"retries", "read_timeout", "connect_timeout", "max_pool_connections"})
"""``config_kwargs`` that change how botocore sends a request, never where or how it is signed."""


def plain_signer(options: Mapping[str, Any], environ: Mapping[str, str], bucket: str) -> GetSigner | None:
    """The signer botocore would give, without botocore (~0.1 CPU-s of import and client set-up per
    process), in the one case where nothing needs resolving: an explicit ``endpoint_url`` (path-style
    URLs, as botocore makes for a custom endpoint), credentials given as options or ``AWS_*``
    variables, the region given as an option or a variable. Anything else (a profile, instance
    metadata, a region from ``~/.aws/config``, an addressing or signature setting): None."""
    client_kwargs = dict(options.get("client_kwargs") or {})
    endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
    config = dict(options.get("config_kwargs") or {})
    s3_config = dict(config.pop("s3", None) or {})
    if (
        not isinstance(endpoint, str)
        or set(config) - _PLAIN_CONFIG
        or set(s3_config) - {"payload_signing_enabled"}
        or set(client_kwargs) - {"endpoint_url", "region_name", "verify"}
        or options.get("profile")
        or options.get("anon")
        or options.get("requester_pays")
        or "use_ssl" in options
    ):
        return None
    if options.get("key") or options.get("secret"):
        key, secret, token = options.get("key"), options.get("secret"), options.get("token")
    else:
        key, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
        token = environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN")
    region = (
        client_kwargs.get("region_name") or environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
    )
    parts = urlsplit(endpoint)
    if not (key and secret and region and parts.scheme in ("http", "https") and parts.netloc):
        return None
    if parts.query or "@" in parts.netloc or parts.netloc != parts.netloc.lower():
        return None
    base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}/{quote_key(bucket)}/"
    return GetSigner(base, parts.netloc, str(region), "s3", StaticCredentials(key, secret, token or None))
