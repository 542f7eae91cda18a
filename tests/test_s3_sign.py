"""The restore's own SigV4 signing (ckptkeeper/storage/s3_sign.py) signs exactly as botocore does.

S3 test servers (moto, SeaweedFS without identities) accept any signature, so the end-to-end
restore tests cannot catch a wrong one: here each signed GET is compared, header for header, with
botocore's own S3 SigV4 signer at the same instant, for plain and awkward keys, with and without a
session token, on AWS and on a custom endpoint with a port; and the URL of a key is the one
botocore presigns for it.
"""

from __future__ import annotations

import calendar
import datetime
from urllib.parse import urlsplit

import botocore.auth
import botocore.config
import botocore.session
import pytest
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from ckptkeeper.storage import s3_urls
from ckptkeeper.storage.s3_sign import GetSigner, plain_signer

KEYS = [
    "ckpt/run-a/checkpoint-100/model.safetensors",
    "ckpt/run a/checkpoint+1/naïve shard~(1)=&.bin",
    "ckpt/run-a/ckpt-2/optim/0_0.distcp",
]
WHEN = datetime.datetime(2026, 12, 5, 2, 30, 7)


@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzE/session+token=="])
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize(
    ("endpoint", "region"),
    [(None, "eu-west-1"), ("http://127.0.0.1:9000", "us-east-1"), ("https://s3.example.org:8443", "ca-1")],
)
def test_each_get_is_signed_as_botocore_signs_it(
    monkeypatch: pytest.MonkeyPatch, token: str | None, key: str, endpoint: str | None, region: str
) -> None:
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    client = botocore.session.Session().create_client(
        "s3",
        region_name=region,
        endpoint_url=endpoint,
        aws_access_key_id=creds.access_key,
        aws_secret_access_key=creds.secret_key,
        aws_session_token=token,
        config=botocore.config.Config(signature_version="s3v4"),
    )
    probe = client.generate_presigned_url("get_object", Params={"Bucket": "bkt", "Key": KEYS[0]})
    signer = GetSigner.from_probe(probe, KEYS[0], creds)
    assert signer is not None
    url = signer.url(key)
    presigned = client.generate_presigned_url("get_object", Params={"Bucket": "bkt", "Key": key})
    assert url == presigned.partition("?")[0]  # the key's URL is botocore's

    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: WHEN)
    ours = signer.headers(urlsplit(url).path, now=calendar.timegm(WHEN.timetuple()))
    theirs = AWSRequest(method="GET", url=url)
    # botocore's own switch for an unsigned payload (the GET has no body to sign)
    theirs.context["client_config"] = botocore.config.Config(s3={"payload_signing_enabled": False})
    botocore.auth.S3SigV4Auth(creds, "s3", region).add_auth(theirs)
    assert theirs.headers["X-Amz-Content-SHA256"] == "UNSIGNED-PAYLOAD"
    assert ours["X-Amz-Date"] == theirs.headers["X-Amz-Date"]
    assert ours["Authorization"] == theirs.headers["Authorization"]
    assert ours["Host"] == urlsplit(url).netloc


def test_a_url_that_is_not_sigv4_gives_no_signer() -> None:
    creds = Credentials("AKIDEXAMPLE", "secret")
    v2 = "http://127.0.0.1:9000/bkt/k?AWSAccessKeyId=AKIDEXAMPLE&Signature=abc&Expires=1"
    assert GetSigner.from_probe(v2, "k", creds) is None
    assert GetSigner.from_probe("http://127.0.0.1:9000/bkt/other?X-Amz-Algorithm=x", "k", creds) is None


ENV = {
    "AWS_ACCESS_KEY_ID": "AKIDENV",
    "AWS_SECRET_ACCESS_KEY": "envsecret",
    "AWS_DEFAULT_REGION": "eu-central-1",
}


@pytest.mark.parametrize(
    ("options", "environ"),
    [
        (
            {"endpoint_url": "http://127.0.0.1:8333", "key": "AKID", "secret": "s3cr3t"},
            {"AWS_REGION": "us-east-1"},
        ),
        (
            {
                "endpoint_url": "https://s3.example.org:8443/gw",
                "key": "AKID",
                "secret": "s",
                "token": "t/k+n",
            },
            ENV,
        ),
        ({"client_kwargs": {"endpoint_url": "https://store.lab", "region_name": "lab-1"}}, ENV),
        ({"endpoint_url": "http://minio:9000", "config_kwargs": {"retries": {"max_attempts": 9}}}, ENV),
    ],
)
def test_explicit_options_sign_without_botocore_as_botocore_would(
    options: dict[str, object], environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = plain_signer(options, environ, "bkt")
    assert plain is not None
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    client_kwargs = dict(options.get("client_kwargs") or {})  # type: ignore[call-overload]
    client = botocore.session.Session().create_client(
        "s3",
        endpoint_url=options.get("endpoint_url") or client_kwargs.pop("endpoint_url", None),
        aws_access_key_id=options.get("key"),
        aws_secret_access_key=options.get("secret"),
        aws_session_token=options.get("token"),
        config=botocore.config.Config(signature_version="s3v4"),
        **client_kwargs,
    )
    probe = client.generate_presigned_url("get_object", Params={"Bucket": "bkt", "Key": KEYS[1]})
    theirs = GetSigner.from_probe(probe, KEYS[1], client._request_signer._credentials)
    assert theirs is not None
    assert (plain.base, plain.host, plain.region, plain.service) == (
        theirs.base,
        theirs.host,
        theirs.region,
        theirs.service,
    )
    path = urlsplit(plain.url(KEYS[1])).path
    assert plain.headers(path, now=1e9) == theirs.headers(path, now=1e9)


@pytest.mark.parametrize(
    "options",
    [
        {"key": "AKID", "secret": "s"},  # no endpoint: AWS itself (region, addressing: botocore's)
        {"endpoint_url": "http://127.0.0.1:8333"},  # no credentials given: a profile, metadata…
        {"endpoint_url": "http://h:1", "key": "A", "secret": "s", "profile": "lab"},
        {
            "endpoint_url": "http://h:1",
            "key": "A",
            "secret": "s",
            "config_kwargs": {"s3": {"addressing_style": "virtual"}},
        },
        {
            "endpoint_url": "http://h:1",
            "key": "A",
            "secret": "s",
            "config_kwargs": {"signature_version": "s3"},
        },
        {"endpoint_url": "http://h:1", "key": "A", "secret": "s", "requester_pays": True},
    ],
)
def test_anything_to_resolve_is_left_to_botocore(options: dict[str, object]) -> None:
    assert plain_signer(options, {"AWS_REGION": "us-east-1"}, "bkt") is None
    assert (
        plain_signer(
            {**options, "key": "A", "secret": "s"} if "endpoint_url" in options else options, {}, "b"
        )
        is None
    )


class _Tier:
    def __init__(self, options: dict[str, object]) -> None:
        self.spec = type("Spec", (), {"storage_options": options})()


@pytest.mark.parametrize(
    ("options", "environ", "direct"),
    [
        ({"endpoint_url": "http://127.0.0.1:8333", "key": "A", "secret": "s"}, {}, True),
        ({"client_kwargs": {"region_name": "eu-west-1"}}, {}, True),  # AWS, region known
        ({}, {"AWS_REGION": "eu-west-1"}, False),  # maybe the compute's region, not the bucket's
        ({}, {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:8333"}, True),
        ({}, {}, False),  # AWS, region unknown: s3fs follows the bucket's region redirect
        ({"endpoint_url": "http://h:1", "session": "x"}, {}, False),  # an option plain GETs cannot honour
        ({"endpoint_url": "http://h:1", "config_kwargs": {"proxies": {"http": "http://p:3128"}}}, {}, False),
        ({"endpoint_url": "http://h:1"}, {"HTTPS_PROXY": "http://p:3128"}, False),
    ],
)
def test_which_restores_take_plain_gets(
    options: dict[str, object], environ: dict[str, str], direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (*s3_urls.PROXY_ENV, *s3_urls.ENDPOINT_ENV, "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert s3_urls.usable(_Tier(options)) is direct  # type: ignore[arg-type]
