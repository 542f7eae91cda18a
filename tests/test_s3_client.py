"""The S3 client a tier builds: what it parses and what it sets up, checked against botocore's
own answers and a real moto server over HTTP."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from builders import tier as spec
from hypothesis import given
from hypothesis import strategies as st

from ckptkeeper import storage
from ckptkeeper.storage import TierStorage

# timestamps: the standard library's parse of S3's two forms, botocore's for anything else


@given(
    when=st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC)),
    form=st.sampled_from(["iso-ms", "iso-us", "iso", "rfc1123", "offset", "epoch"]),
)
def test_s3_timestamps_parse_to_the_instant_botocore_gives(when: datetime, form: str) -> None:
    from email.utils import format_datetime

    from botocore.utils import parse_timestamp

    from ckptkeeper.storage.s3_client import _parse_timestamp

    text: Any = {
        "iso-ms": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z",
        "iso-us": when.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "iso": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "rfc1123": format_datetime(when, usegmt=True),
        "offset": when.astimezone(timezone(timedelta(hours=5, minutes=30))).isoformat(),
        "epoch": str(int(when.timestamp())),
    }[form]
    ours, theirs = _parse_timestamp(text), parse_timestamp(text)
    assert ours == theirs and ours.tzinfo is not None
    assert ours.timestamp() == theirs.timestamp()


def test_plain_http_endpoints_skip_the_tls_context_and_an_explicit_verify_is_kept(
    s3_storage_options: dict[str, Any],
) -> None:
    def client_kwargs(options: dict[str, Any], name: str) -> dict[str, Any]:
        tier = TierStorage(spec(name, "s3://bucket-x/p", storage_options=options))
        assert isinstance(tier, storage.S3TierStorage)
        return dict(tier.fs.client_kwargs)

    assert s3_storage_options["endpoint_url"].startswith("http://")
    assert client_kwargs(s3_storage_options, "plain")["verify"] is False
    explicit = {**s3_storage_options, "client_kwargs": {"verify": "/etc/ssl/certs/ca-certificates.crt"}}
    assert client_kwargs(explicit, "explicit")["verify"] == "/etc/ssl/certs/ca-certificates.crt"
    https = {**s3_storage_options, "endpoint_url": "https://s3.example.invalid"}
    assert "verify" not in client_kwargs(https, "tls")


@given(
    data=st.binary(max_size=4096),
    split=st.integers(min_value=0, max_value=4096),
    start=st.integers(0, 2**32 - 1),
)
def test_the_crc32_sent_to_s3_is_zlibs(data: bytes, split: int, start: int) -> None:
    """ISA-L's CRC32 (or zlib's where isal is missing) gives zlib's values, also continued across
    chunks, which is what S3 and moto check ``ChecksumCRC32`` against."""
    import zlib

    from ckptkeeper.util import hashing

    assert hashing.crc32(data) == zlib.crc32(data)
    assert hashing.crc32(data, start) == zlib.crc32(data, start)
    head, tail = data[:split], data[split:]
    assert hashing.crc32(memoryview(tail), hashing.crc32(head)) == zlib.crc32(data)
