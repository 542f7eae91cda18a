"""`ckptkeeper demo` as a person runs it (issue 19): every line fits 100 columns, no log line of
another program (moto's werkzeug request log) mixes in, the bucket name is printed intact, and
the reclaimed figure is the same in the plan, the prune and the status. Plus the two helpers
that make it so: table wrapping and whole-token redaction of short secrets."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ckptkeeper.util import logs
from ckptkeeper.util.fmt import table, wrap_text


def test_demo_fits_100_columns_with_no_foreign_lines() -> None:
    pytest.importorskip("moto")  # the demo's cold tier is a moto S3 server when moto is installed
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CKPTKEEPER_", "AWS_")) and k != "COLUMNS"
    }
    result = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    lines = out.splitlines()
    assert len(lines) > 100
    wide = [line for line in lines if len(line) > 100]
    assert not wide, wide[:5]
    foreign = [line for line in lines if "HTTP/1.1" in line or re.match(r"\d+\.\d+\.\d+\.\d+ - - \[", line)]
    assert not foreign, foreign[:5]
    assert "***" not in out
    assert "s3://demo-checkpoints/ckpt" in result.stdout
    would = re.search(r"^would reclaim (\S+ \S+):", result.stdout, re.M)
    done = re.search(r"^done: .*; reclaimed (\S+ \S+)", result.stdout, re.M)
    status = re.search(r"^reclaimed so far: (\S+ \S+)$", result.stdout, re.M)
    assert would and done and status, result.stdout[-2000:]
    assert would.group(1) == done.group(1) == status.group(1)


def test_table_wraps_the_last_column_into_the_width() -> None:
    rows = [
        ("copy", 400, "a/checkpoint-400", "demote: " + "word " * 30),
        ("delete", 100, "a/c-100", "expired"),
    ]
    text = table(["ACTION", "STEP", "PATH", "REASON"], rows, right=(1,), width=70)
    lines = text.splitlines()
    assert all(len(line) <= 70 for line in lines) and len(lines) > 4
    assert lines[0].split() == ["ACTION", "STEP", "PATH", "REASON"]
    assert " ".join(" ".join(lines).split()).count("word") == 30  # nothing lost
    # Unbounded, or wide enough: exactly the old table.
    assert table(["A", "B"], [(1, "x")]) == table(["A", "B"], [(1, "x")], width=100) == "A  B\n-  -\n1  x"


def test_table_too_narrow_puts_the_last_cell_under_its_row() -> None:
    rows = [("copy", "run/" + "p" * 40, "demote: not in hot keep-set")]
    lines = table(["ACTION", "PATH", "REASON"], rows, width=60).splitlines()
    assert lines[0].split() == ["ACTION", "PATH"]
    assert lines[2].startswith("copy") and lines[3] == "    demote: not in hot keep-set"
    assert all(len(line) <= 60 for line in lines)


def test_wrap_text() -> None:
    assert wrap_text("short", 10) == "short"
    wrapped = wrap_text("policy  " + "rule, " * 30, 40, indent="        ")
    assert all(len(line) <= 40 for line in wrapped.splitlines())
    assert all(line.startswith("        ") for line in wrapped.splitlines()[1:])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("GET /demo-checkpoints?list-type=2", "GET /demo-checkpoints?list-type=2"),  # part of a name
        ("demos and ademo", "demos and ademo"),
        ("aws_secret_access_key=demo", "aws_secret_access_key=***"),
        ("Credential=demo/20261202/us-east-1", "Credential=***/20261202/us-east-1"),
        ('{"key": "demo"}', '{"key": "***"}'),
        ("Credential=AKIAFAKEKEYID7QXZ9ZW/2026", "Credential=***/2026"),
        ("xAKIAFAKEKEYID7QXZ9ZWy", "x***y"),  # a long secret: wherever it appears
    ],
)
def test_short_secrets_are_redacted_as_whole_tokens_only(text: str, expected: str) -> None:
    logs.register_secrets(["demo", "AKIAFAKEKEYID7QXZ9ZW"])
    assert logs.redact(text) == expected
