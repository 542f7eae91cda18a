"""No secret in any output (docs/design.md, safety invariant 8): S3 credentials never reach logs, errors or JSON.

Distinctive fake credentials go in through ``storage_options`` or the AWS environment variables;
then every command runs with ``log_level = "debug"`` **and** the stdlib loggers of botocore,
aiobotocore, s3fs and fsspec at DEBUG (botocore prints each request's headers there: the access
key id sits in ``Authorization``). stdout + stderr + the log are searched for the key id and the
secret, verbatim and JSON-escaped.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from faultnode import FaultNode, Template, kill

KEY_ID = "AKIAFAKEKEYID7QXZ9ZW"
SECRET = "fAkE/sEcReT+unmistakable/0123456789abcdefXYZ"
TOKEN = "FwoGZXIvYXdzEFAKESESSIONTOKEN//unmistakable+token=="

DEBUG_WRAPPER = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
for name in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp", "asyncio"):
    logging.getLogger(name).setLevel(logging.DEBUG)
from ckptkeeper.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return Template.build(tmp_path_factory.mktemp("small"), multipart=False)


def leaks(text: str) -> list[str]:
    needles = [KEY_ID, SECRET, TOKEN, json.dumps(SECRET)[1:-1], json.dumps(TOKEN)[1:-1]]
    return [line[:200] for line in text.splitlines() if any(n in line for n in needles)]


EVERYTHING = (
    ("scan", "--json"),
    ("prune", "--json"),
    ("ls", "--json"),
    ("status", "--json"),
    ("restore", "train", "--step", "300", "--to", "{tmp}/restored"),
)


def run(node: FaultNode, commands: tuple[tuple[str, ...], ...], env: dict[str, str] | None = None) -> str:
    out = []
    for args in commands:
        args = tuple(a.format(tmp=node.tmp) for a in args)
        result = node.cli(*args, env=env, wrapper=DEBUG_WRAPPER)
        assert result.returncode in (0, 1), (args, result.stderr[-2000:])
        out.append(result.stdout + result.stderr)
    return "\n".join(out)


def test_credentials_from_config_never_appear_even_in_botocore_debug_output(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    node = FaultNode(
        tmp_path,
        small,
        endpoint=s3_client.meta.endpoint_url,
        bucket=s3_bucket,
        storage_options={"key": KEY_ID, "secret": SECRET, "token": TOKEN},
        log_level="debug",
    )
    output = run(node, EVERYTHING)
    assert "Authorization" in output and "botocore" in output  # the debug output really was on
    assert (tmp_path / "restored" / "checkpoint-300").is_dir()
    assert leaks(output) == []


def test_credentials_from_the_environment_never_appear(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    node = FaultNode(
        tmp_path,
        small,
        endpoint=s3_client.meta.endpoint_url,
        bucket=s3_bucket,
        storage_options={},
        log_level="debug",
    )
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN}
    output = run(node, (("prune", "--json"), ("status", "--json")), env)
    assert "Authorization" in output
    assert leaks(output) == []


def test_errors_and_a_failing_tier_name_no_credentials(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    """Failures are where secrets slip out: a missing bucket, an unreachable endpoint, a config error."""
    node = FaultNode(
        tmp_path,
        small,
        endpoint=s3_client.meta.endpoint_url,
        bucket=s3_bucket,
        storage_options={"key": KEY_ID, "secret": SECRET},
        log_level="debug",
        populate=False,
    )
    node.bucket = "no-such-bucket-anywhere"
    node.write_config()
    outputs = [run(node, (("prune",), ("status", "--json")))]
    node.storage_options["endpoint_url"] = "http://127.0.0.1:9"  # nothing listens on the discard port
    node.write_config()
    outputs.append(run(node, (("scan",),)))
    status = json.loads(node.cli("status", "--json").stdout)
    assert any(t["error"] for t in status["tiers"] if t["name"] == "cold")
    # a config error that has the secret in a bad value
    node.config.write_text(
        node.config.read_text().replace("storage_options = {", f'bogus = "{SECRET}"\nstorage_options = {{')
    )
    result = node.cli("ls")
    assert result.returncode == 2
    outputs.append(result.stdout + result.stderr)
    assert leaks("\n".join(outputs)) == []


def test_daemon_logs_name_no_credentials(
    small: Template, tmp_path: Path, s3_bucket: str, s3_client: Any
) -> None:
    node = FaultNode(
        tmp_path,
        small,
        endpoint=s3_client.meta.endpoint_url,
        bucket=s3_bucket,
        storage_options={"key": KEY_ID, "secret": SECRET},
        log_level="debug",
    )
    proc = node.popen("daemon", wrapper=DEBUG_WRAPPER, log="daemon")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "prune done" not in node.log("daemon"):
            time.sleep(0.3)
    finally:
        kill(proc, signal.SIGTERM)
    log = node.log("daemon")
    assert "prune done" in log and "Authorization" in log, log[-2000:]
    assert leaks(log) == []
