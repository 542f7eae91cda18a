"""``status`` says when the last real pass found this node's clock off a tier filesystem's
(docs/many-nodes-clocks.md, "File ages"): read from ``<index>.clocks.json``, never a probe.

Real ``ckptkeeper`` processes whose wall clock is off (``tests/clockshift``, through
``test_clock_files.run_skewed``) while the kernel dates the files, as an NFS server dates them for
a node whose NTP broke.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_clock_files import DAY, node, run_skewed

SKEWED = (
    "this node's clock was 3d ahead of the filesystem's when a prune pass last read it, "
    # then "<age> ago"
)
FIX = "; file ages there are judged by the filesystem's clock (fix NTP: chrony/timesyncd)"


def status(config: Path, offset: float) -> tuple[str, dict[str, Any]]:
    """``status`` and ``status --json`` by a node whose clock runs ``offset`` seconds off."""
    text = run_skewed(config, offset, "status")
    assert text.returncode == 0, text.stderr
    assert "Traceback" not in text.stderr, text.stderr
    doc = run_skewed(config, offset, "status", "--json")
    assert doc.returncode == 0, doc.stderr
    got: dict[str, Any] = json.loads(doc.stdout)
    return text.stdout, got


def state(base: Path) -> dict[str, bytes]:
    """The record and every hidden file (a probe would be one) in the tiers: what status must not touch."""
    out = {p.name: p.read_bytes() for p in base.glob("index.db.clocks.json*")}
    for tier in ("hot", "warm"):
        out.update({f"{tier}/{p.name}": b"" for p in (base / tier).iterdir() if p.name.startswith(".")})
    return out


def test_status_warns_when_the_last_pass_found_this_nodes_clock_off_a_filesystems(tmp_path: Path) -> None:
    """A real pass by a node 3 days ahead keeps its reading; ``status`` (read only: no probe, no
    write) warns for each tier in text and JSON, and says how old the reading is."""
    cfg = node(tmp_path)
    prune = run_skewed(cfg, 3 * DAY, "prune", "--json")
    assert prune.returncode == 0, prune.stderr
    before = state(tmp_path)
    assert "index.db.clocks.json" in before

    text, doc = status(cfg, 3 * DAY)
    assert state(tmp_path) == before  # no probe touched, the record not rewritten
    lines = [line for line in text.splitlines() if line.startswith("WARNING clock ")]
    assert [line.split(":")[0] for line in lines] == ["WARNING clock hot", "WARNING clock warm"], text
    for tier, line in zip(("hot", "warm"), lines, strict=True):
        assert line.startswith(f"WARNING clock {tier}: {SKEWED}") and line.endswith(f" ago{FIX}"), line

    clocks = doc["filesystem_clocks"]
    assert clocks["error"] is None
    assert sorted(clocks["tiers"]) == ["hot", "warm"]
    for tier, got in clocks["tiers"].items():
        assert abs(got["skew_seconds"] - 3 * DAY) < 600, got  # node minus filesystem: ahead
        assert 0 <= got["age_seconds"] < DAY, got  # this reading, not one 3 days old
        assert got["warning"].startswith(f"{tier}: {SKEWED}"), got
        assert got["warning"] in doc["warnings"]


def test_status_says_nothing_of_clocks_that_agree_and_tells_no_reading_apart(tmp_path: Path) -> None:
    """Before any real pass there is no reading: ``filesystem_clocks`` is null. After a pass by a
    node whose clock is right: each tier measured, no warning anywhere."""
    cfg = node(tmp_path)
    text, doc = status(cfg, 0)
    assert doc["filesystem_clocks"] is None
    assert "clock" not in text

    prune = run_skewed(cfg, 0, "prune", "--json")
    assert prune.returncode == 0, prune.stderr
    text, doc = status(cfg, 0)
    clocks = doc["filesystem_clocks"]
    assert clocks["error"] is None
    assert sorted(clocks["tiers"]) == ["hot", "warm"]
    for got in clocks["tiers"].values():
        assert abs(got["skew_seconds"]) < 30 and got["warning"] is None, got
    assert "clock" not in text
    assert not [w for w in doc["warnings"] if "clock" in w]


def _nested() -> bytes:
    return b"[" * 50000  # json.loads: RecursionError, not a ValueError


HOSTILE = {
    "truncated": lambda valid: valid[: len(valid) // 2],
    "huge": lambda valid: b" " * (1 << 20) + valid,
    "not an object": lambda valid: b'[{"hot": 1}]',
    "nested too deep": lambda valid: _nested(),
    "binary": lambda valid: b"\xff\xfe\x00garbage",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_an_unreadable_record_is_one_line_and_status_still_answers(tmp_path: Path, case: str) -> None:
    """A corrupt, truncated, huge or wrong-typed ``<index>.clocks.json``: ``status`` says it cannot
    read it (one line; ``error`` in JSON), shows no clock warning, and exits 0 as before; a dry
    run judges by this node's clock and says so, and the next real pass writes the record again."""
    cfg = node(tmp_path)
    prune = run_skewed(cfg, 3 * DAY, "prune", "--json")
    assert prune.returncode == 0, prune.stderr
    record = tmp_path / "index.db.clocks.json"
    record.write_bytes(HOSTILE[case](record.read_bytes()))

    text, doc = status(cfg, 3 * DAY)
    (line,) = [line for line in text.splitlines() if "clock" in line]
    assert line.startswith(f"filesystem clocks: cannot read {record}: "), line
    assert line.endswith("(the next prune pass writes it again)"), line
    assert doc["filesystem_clocks"]["tiers"] == {}
    assert doc["filesystem_clocks"]["error"].startswith(f"cannot read {record}: ")
    assert not [w for w in doc["warnings"] if "clock" in w]

    dry = run_skewed(cfg, 3 * DAY, "prune", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert any(
        n.startswith("hot: no reading of the filesystem's clock yet") for n in json.loads(dry.stdout)["notes"]
    )

    again = run_skewed(cfg, 3 * DAY, "prune", "--json")
    assert again.returncode == 0, again.stderr
    assert status(cfg, 3 * DAY)[1]["filesystem_clocks"]["error"] is None


def test_a_tier_whose_reading_is_wrong_typed_is_named_and_the_others_still_warn(tmp_path: Path) -> None:
    """One tier's entry holds no usable times (a string, a number too large for a float): that
    tier is named in the one unreadable line; the other tier's reading still warns."""
    cfg = node(tmp_path)
    prune = run_skewed(cfg, 3 * DAY, "prune", "--json")
    assert prune.returncode == 0, prune.stderr
    record = tmp_path / "index.db.clocks.json"
    kept = json.loads(record.read_text())
    hot = f'{{"root": {json.dumps(kept["hot"]["root"])}, "filesystem": 1{"0" * 400}, "node": "x"}}'
    record.write_text(f'{{"hot": {hot}, "warm": {json.dumps(kept["warm"])}}}')

    text, doc = status(cfg, 3 * DAY)
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("WARNING clock ")] == [
        "WARNING clock warm"
    ]
    (line,) = [line for line in text.splitlines() if line.startswith("filesystem clocks: ")]
    assert line == (
        f"filesystem clocks: {record}: unreadable reading of hot: times that are not numbers "
        "(the next prune pass writes it again)"
    )
    clocks = doc["filesystem_clocks"]
    assert sorted(clocks["tiers"]) == ["warm"] and clocks["tiers"]["warm"]["warning"]
    assert clocks["error"] == f"{record}: unreadable reading of hot: times that are not numbers"

    dry = run_skewed(cfg, 3 * DAY, "prune", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
