"""What an operator sees at a terminal and in scripts (issue 19): progress with bytes, rate and ETA
on a TTY (and none in a pipe), the prune plan before the first byte moves, ``--json`` for
``restore`` / ``pin`` / ``unpin``, and one reclaimed figure across prune, status and the metric.

The CLI runs as a user runs it: a subprocess with a config file, under a real pseudo-terminal
(``pty``) where the test is about a terminal.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from builders import local_tier, write_config
from layout_fixtures import make_hf

BLOB = 8 * 1024 * 1024
"""Bytes of payload per checkpoint: 32 chunks of the copy loop, so a copy reports progress many
times, yet the whole module runs in seconds."""

RATE_ETA = re.compile(
    r"\d+(\.\d+)? [KMGT]iB/\d+(\.\d+)? [KMGT]iB \(\d+%\) \d+(\.\d+)? ([KMGT]i)?B/s (ETA|in) \S+"
)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def make_checkpoint(run_dir: Path, step: int, when: float) -> None:
    """An HF checkpoint with an ``BLOB``-byte payload, written ``when`` (settled long ago)."""
    ckpt = run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "payload.bin").write_bytes(os.urandom(BLOB))
    make_hf(run_dir, step)
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (when, when))


class Node:
    """hot keeps the newest checkpoint, warm the newest two and replicates: a prune of steps
    10..40 expires 10 and 20 from hot, demotes 30 (a same-disk rename) and copies 40 to warm
    (a byte copy, which reports progress)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.warm = tmp / "warm"
        self.warm.mkdir()
        self.metrics = tmp / "metrics" / "ckptkeeper.prom"
        self.config = tmp / "config.toml"
        write_config(
            self.config,
            index=tmp / "index.db",
            # The checkpoints are back-dated with utime, which cannot back-date ctime.
            daemon={"settle_seconds": "1s", "trust_mtimes": True, "textfile": self.metrics},
            tiers=[
                local_tier("hot", self.hot, keep_last=1),
                local_tier("warm", self.warm, keep_last=2, replicate=True),
            ],
        )
        when = time.time() - 3600
        for step in (10, 20, 30, 40):
            make_checkpoint(self.hot / "run", step, when + step)

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), *args]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
        env.pop("COLUMNS", None)
        return env

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env(),
            stdin=subprocess.DEVNULL,
        )

    def tty(self, *args: str, columns: int = 100) -> tuple[int, str]:
        """Run the CLI with stdin, stdout and stderr on a pseudo-terminal ``columns`` wide; returns
        the exit code and everything the terminal received."""
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        proc = subprocess.Popen(self.argv(*args), stdin=slave, stdout=slave, stderr=slave, env=self.env())
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError as exc:  # EIO: the child closed the terminal
                if exc.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            chunks.append(data)
        os.close(master)
        code = proc.wait(timeout=120)
        return code, b"".join(chunks).decode()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    n = Node(tmp_path)
    assert n.cli("scan").returncode == 0
    return n


def screen_lines(out: str) -> list[str]:
    """What stays on screen: each ``\\r`` redraw replaces the line before it."""
    return [ANSI.sub("", line.split("\r")[-1]) for line in out.replace("\r\n", "\n").split("\n")]


def test_prune_on_a_tty_prints_the_plan_first_then_bytes_rate_and_eta(node: Node) -> None:
    code, out = node.tty("prune")
    assert code == 0, out
    progress = [m.start() for m in RATE_ETA.finditer(out)]
    assert progress, out
    assert "copy run/checkpoint-40 hot->warm" in out
    plan_at = out.index("will carry out")
    assert plan_at < progress[0], "the plan must be printed before the first byte is copied"
    assert "done: " in out[progress[-1] :]
    # The redrawn line fits the terminal, so `\r` overwrites it instead of scrolling.
    frames = [ANSI.sub("", f) for line in out.replace("\r\n", "\n").split("\n") for f in line.split("\r")]
    assert all(len(f) <= 100 for f in frames if RATE_ETA.search(f))


def test_restore_on_a_tty_shows_bytes_rate_and_eta(node: Node, tmp_path: Path) -> None:
    assert node.cli("prune").returncode == 0
    code, out = node.tty("restore", "run", "--step", "30", "--to", str(tmp_path / "out"))
    assert code == 0, out
    final = [line for line in screen_lines(out) if RATE_ETA.search(line)]
    assert final and final[-1].startswith("restore run@30: 8.0 MiB/8.0 MiB (100%)"), out
    assert "ETA" in out  # while it ran, not only the summary
    assert str(tmp_path / "out" / "checkpoint-30") in out


def test_pipes_get_clean_output_and_json_parses(node: Node, tmp_path: Path) -> None:
    pruned = node.cli("prune")
    assert pruned.returncode == 0, pruned.stderr
    assert "\r" not in pruned.stdout + pruned.stderr and "ETA" not in pruned.stderr
    assert pruned.stdout.index("will carry out") < pruned.stdout.index("done: ")

    restored = node.cli("restore", "run", "--step", "30", "--to", str(tmp_path / "out"), "--json")
    assert restored.returncode == 0, restored.stderr
    assert restored.stderr == ""
    doc = json.loads(restored.stdout)
    assert doc == {
        "run": "run",
        "step": 30,
        "name": "checkpoint-30",
        "path": str(tmp_path / "out" / "checkpoint-30"),
        "from_tier": "warm",
        "bytes": doc["bytes"],
        "skipped": [],
    }
    assert doc["bytes"] > BLOB
    assert (tmp_path / "out" / "checkpoint-30" / "payload.bin").read_bytes() == (
        node.warm / "run" / "checkpoint-30" / "payload.bin"
    ).read_bytes()

    pinned = node.cli("pin", "run", "40", "--json")
    assert pinned.returncode == 0 and json.loads(pinned.stdout) == {
        "run": "run",
        "step": 40,
        "pinned": True,
        "checkpoints": 1,
        "failed": {},
    }
    unpinned = node.cli("unpin", "run", "40", "--json")
    assert json.loads(unpinned.stdout)["pinned"] is False
    missing = node.cli("pin", "run", "99", "--json")
    assert missing.returncode == 2 and missing.stdout == "" and "no checkpoint run@99" in missing.stderr


def test_pin_json_says_which_tier_failed_and_what_is_pinned_now(node: Node, tmp_path: Path) -> None:
    """Pins live in the tiers too (pin objects): a tier that cannot be written or cleaned is named
    in ``failed``, the command exits 1, and ``pinned`` is the state the checkpoint is in now."""
    assert node.cli("pin", "run", "40", "--json").returncode == 0
    # warm's root becomes a plain file: no pin object can be written to it or removed from it.
    node.warm.rename(tmp_path / "warm-away")
    node.warm.write_text("not a directory")

    unpinned = node.cli("unpin", "run", "40", "--json")
    assert unpinned.returncode == 1, unpinned.stderr
    doc = json.loads(unpinned.stdout)
    assert doc["pinned"] is True and doc["checkpoints"] == 0 and list(doc["failed"]) == ["warm"]
    assert "run@40 stays pinned" in unpinned.stderr
    listed = json.loads(node.cli("ls", "--json").stdout)["runs"][0]["checkpoints"]
    assert {c["step"]: c["pinned"] for c in listed}[40] is True

    pinned = node.cli("pin", "run", "30", "--json")
    assert pinned.returncode == 1, pinned.stderr
    doc = json.loads(pinned.stdout)
    assert doc["pinned"] is True and doc["checkpoints"] == 1 and list(doc["failed"]) == ["warm"]
    assert "pin object is missing from warm" in pinned.stderr

    node.warm.unlink()
    (tmp_path / "warm-away").rename(node.warm)
    unpinned = node.cli("unpin", "run", "40", "--json")
    assert unpinned.returncode == 0, unpinned.stderr
    assert json.loads(unpinned.stdout) == {
        "run": "run",
        "step": 40,
        "pinned": False,
        "checkpoints": 1,
        "failed": {},
    }


def _metric_total(text: str, name: str) -> int:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def test_one_reclaimed_figure_across_prune_status_and_metric(node: Node) -> None:
    sizes = {
        c["step"]: c["bytes"] for c in json.loads(node.cli("ls", "--json").stdout)["runs"][0]["checkpoints"]
    }
    pruned = node.cli("prune", "--json")
    assert pruned.returncode == 0, pruned.stderr
    doc = json.loads(pruned.stdout)
    kinds = {(a["action"], a["step"], a["reason"].split(":")[0]) for a in doc["actions"]}
    assert any(k[0] == "delete" and k[1] == 30 for k in kinds)  # demoted: freed on hot
    expired = [a for a in doc["actions"] if a["action"] == "delete" and a["step"] in (10, 20)]
    assert len(expired) == 2
    # Bytes freed per tier: everything that left hot (10 and 20 expired, 30 demoted to warm).
    expected = sizes[10] + sizes[20] + sizes[30]
    assert doc["result"]["reclaimed_bytes"] == {"hot": expected}
    assert sum(doc["reclaim_bytes"].values()) == expected  # what the plan said it would free

    status = json.loads(node.cli("status", "--json").stdout)
    assert status["reclaimed"]["total_bytes"] == expected
    assert status["reclaimed"]["by_reason"]["moved"]["bytes"] == sizes[30]
    assert status["reclaimed"]["by_reason"]["expired"]["bytes"] == sizes[10] + sizes[20]
    assert _metric_total(node.metrics.read_text(), "ckptkeeper_reclaimed_bytes_total") == expected
    assert _metric_total(node.metrics.read_text(), "ckptkeeper_prune_last_reclaimed_bytes") == expected

    # The human forms print the same number.
    from ckptkeeper.util.fmt import human_bytes

    text = node.cli("status").stdout
    assert f"reclaimed so far: {human_bytes(expected)}" in text
    assert not (node.hot / "run" / "checkpoint-10").exists()
    assert (node.warm / "run" / "checkpoint-30").is_dir()


@pytest.mark.parametrize(
    ("done", "total", "rate", "elapsed", "expected"),
    [
        (0, 1 << 30, 0.0, 0.0, "x: 0 B/1.0 GiB (0%) 0 B/s ETA ?"),
        (256 << 20, 1 << 30, 128 << 20, 2.0, "x: 256.0 MiB/1.0 GiB (25%) 128.0 MiB/s ETA 6s"),
        (1 << 20, 1 << 30, 1 << 20, 1.0, "x: 1.0 MiB/1.0 GiB (0%) 1.0 MiB/s ETA 17m03s"),
        (1 << 30, 1 << 30, 300 << 20, 3.4, "x: 1.0 GiB/1.0 GiB (100%) 300.0 MiB/s in 3s"),
    ],
)
def test_progress_line(done: int, total: int, rate: float, elapsed: float, expected: str) -> None:
    from ckptkeeper.cli.progress import progress_line

    assert progress_line("x", done, total, rate, elapsed) == expected


def test_progress_line_shortens_the_label_to_the_width() -> None:
    from ckptkeeper.cli.progress import progress_line

    line = progress_line("copy " + "r" * 200 + "/checkpoint-7 hot->warm", 1, 2, 1.0, 1.0, width=80)
    assert len(line) == 80 and line.startswith("…") and "checkpoint-7 hot->warm: " in line


def test_latest_skips_a_corrupt_newest_checkpoint_and_says_so(node: Node, tmp_path: Path) -> None:
    assert node.cli("prune").returncode == 0  # 40: hot and warm; 30: warm only
    with open(node.hot / "run" / "checkpoint-40" / "payload.bin", "r+b") as f:
        f.truncate(BLOB // 2)  # cut short on hot
    with open(node.warm / "run" / "checkpoint-40" / "payload.bin", "r+b") as f:
        f.seek(BLOB // 3)
        f.write(b"\xff" * 16)  # bit rot on warm: same size, other bytes

    result = node.cli("restore", "run", "--to", str(tmp_path / "out"), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["step"] == 30 and doc["from_tier"] == "warm"
    assert [s["step"] for s in doc["skipped"]] == [40]
    assert "run@40 has no verified copy left" in result.stderr and "run@30" in result.stderr
    assert not (tmp_path / "out" / "checkpoint-40").exists()

    # The resume helper: the same fallback, into the run's own hot directory. (It re-catalogs the
    # hot run dir first, where a changed checkpoint is a rewrite, so the hot copy goes away here.)
    import shutil

    import ckptkeeper

    shutil.rmtree(node.hot / "run" / "checkpoint-40")

    path = ckptkeeper.latest("run", config=node.config)
    assert path == node.hot / "run" / "checkpoint-30"
    assert (path / "payload.bin").read_bytes() == (
        node.warm / "run" / "checkpoint-30" / "payload.bin"
    ).read_bytes()

    # An explicit step never turns into another one.
    explicit = node.cli("restore", "run", "--step", "40", "--to", str(tmp_path / "out2"))
    assert explicit.returncode == 1 and "could not restore run@40" in explicit.stderr
