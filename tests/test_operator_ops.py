"""The daemon as systemd and Prometheus see it (issue 19): JSON log lines carry their journald
priority when stderr is the journal (and only then), and /metrics has the process_* series."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from builders import local_tier, write_config

LOGGER = """
import sys
from ckptkeeper.util import logs
logs.configure("debug", json=True)
log = logs.get_logger("t")
log.debug("d"); log.info("i"); log.warning("w"); log.error("e")
try:
    raise ValueError("boom")
except ValueError:
    log.exception("x")
import logging
from ckptkeeper.daemon.logbridge import bridge_stdlib_logging
bridge_stdlib_logging()
logging.getLogger("lib").warning("from the stdlib")
"""


def _run_logger(tmp_path: Path, *, journal: str | None) -> list[str]:
    """Run LOGGER with stderr on a file; ``journal`` = "match" sets $JOURNAL_STREAM to that file's
    device:inode (what systemd does for a stream connected to journald), "other" to another's."""
    err = tmp_path / "stderr"
    other = tmp_path / "other"
    other.write_text("")
    with err.open("w") as f:
        env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
        if journal is not None:
            st = os.fstat(f.fileno()) if journal == "match" else other.stat()
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        subprocess.run([sys.executable, "-c", LOGGER], stderr=f, env=env, check=True, timeout=60)
    return err.read_text().splitlines()


def test_json_lines_carry_the_journald_priority_under_systemd(tmp_path: Path) -> None:
    lines = _run_logger(tmp_path, journal="match")
    got = []
    for line in lines:
        assert line.startswith("<") and line[2] == ">", line
        doc = json.loads(line[3:])
        got.append((int(line[1]), doc["level"], doc["event"]))
    assert got == [
        (7, "debug", "d"),
        (6, "info", "i"),
        (4, "warning", "w"),
        (3, "error", "e"),
        (3, "error", "x"),
        (4, "warning", "from the stdlib"),
    ]
    assert "boom" in json.loads(lines[4][3:])["exception"]


def test_no_prefix_when_stderr_is_not_the_journal(tmp_path: Path) -> None:
    for journal in (None, "other"):
        lines = _run_logger(tmp_path, journal=journal)
        assert len(lines) == 6
        assert [json.loads(line)["event"] for line in lines][:4] == ["d", "i", "w", "e"]


def test_metrics_include_the_process_collector(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from ckptkeeper.config import load_settings
    from ckptkeeper.daemon.metrics import Metrics
    from ckptkeeper.index import Index

    (tmp_path / "hot").mkdir()
    config = write_config(
        tmp_path / "c.toml", index=tmp_path / "i.db", tiers=[local_tier("hot", tmp_path / "hot")]
    )
    settings = load_settings(config)
    Index(Path(settings.index)).close()
    body = generate_latest(Metrics(settings).registry).decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in body.splitlines()
        if line.startswith("process_")
    }
    assert values["process_resident_memory_bytes"] > 1 << 20
    assert values["process_cpu_seconds_total"] > 0
    assert values["process_open_fds"] >= 3
    assert "ckptkeeper_reclaimed_bytes_total" in body


def test_shell_completion_as_documented() -> None:
    script = Path(sys.executable).parent / "ckptkeeper"
    if not script.exists():
        import pytest

        pytest.skip("no ckptkeeper console script next to this interpreter")
    env = {
        **os.environ,
        "COMP_WORDS": "ckptkeeper pru",
        "COMP_CWORD": "1",
        "_CKPTKEEPER_COMPLETE": "bash_complete",
    }
    out = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=60).stdout
    assert out.split() == ["plain,prune"]
    env = {**os.environ, "_CKPTKEEPER_COMPLETE": "bash_source"}
    source = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=60).stdout
    assert "complete -o nosort -F _ckptkeeper_completion ckptkeeper" in source
