"""What happened to a checkpoint, afterwards (docs/history.md): one log event per executed action,
``history`` equal to what ``prune`` reported, ``why`` for a kept, a demoted, an expired and a
trashed-then-purged checkpoint, the history surviving an index rebuilt from the tiers, and its
bounds (age, rows).

Real parts: local directories and the CLI in a subprocess (its stderr is not a terminal: JSON log
lines, as under systemd).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from builders import hf_checkpoint, local_tier, run_cli, write_config

from ckptkeeper.core.history import ACTION_EVENT, HistoryEvent
from ckptkeeper.index import Index

FIELDS = ("action", "run", "step", "tier", "to_tier", "path", "bytes", "rule", "reason")


def _node(tmp: Path, *, hot: dict[str, Any] | None = None, **top: Any) -> Path:
    """hot keeps the last 2, warm the last 3 (so one checkpoint is demoted per new save)."""
    (tmp / "hot").mkdir(exist_ok=True)
    (tmp / "warm").mkdir(exist_ok=True)
    return write_config(
        tmp / "config.toml",
        index=tmp / "index.db",
        node="node-a",
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},
        tiers=[
            local_tier("hot", tmp / "hot", keep_last=2, **(hot or {})),
            local_tier("warm", tmp / "warm", keep_last=3),
        ],
        **top,
    )


def _hot_only(tmp: Path, **hot: Any) -> Path:
    """Only a hot tier that keeps the last 2 (and ``hot``: e.g. an ``undo_window``)."""
    (tmp / "hot").mkdir(exist_ok=True)
    return write_config(
        tmp / "config.toml",
        index=tmp / "index.db",
        node="node-a",
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},
        tiers=[local_tier("hot", tmp / "hot", keep_last=2, **hot)],
    )


def _text(config: Path, *args: str) -> str:
    """Human output, its wrapped lines joined again."""
    done = run_cli(config, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return " ".join(done.stdout.split())


def _save(tmp: Path, *steps: int) -> None:
    for step in steps:
        hf_checkpoint(tmp / "hot" / "exp", step, b"w" * (1000 + step))


def _json(config: Path, *args: str, code: int = 0) -> Any:
    done = run_cli(config, *args, "--json")
    assert done.returncode == code, done.stdout + done.stderr
    return json.loads(done.stdout)


def _events(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        try:
            doc = json.loads(line.lstrip("<0123456789>"))
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == ACTION_EVENT:
            out.append(doc)
    return out


def _key(doc: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(doc[f] for f in FIELDS)


def test_every_action_logs_one_line_with_its_rule_and_reason(tmp_path: Path) -> None:
    config = _node(tmp_path)
    _save(tmp_path, 1, 2, 3, 4)
    done = run_cli(config, "prune", "--json")
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)["actions"]
    logged = _events(done.stderr)
    assert [_key(e) for e in logged] == [_key(a) for a in planned] and len(logged) == 3
    demote = logged[0]
    assert demote["action"] == "copy" and demote["tier"] == "hot" and demote["to_tier"] == "warm"
    assert demote["rule"] == "demote" and demote["reason"].startswith("demote: not in hot keep-set (last 2)")
    assert demote["node"] == "node-a" and demote["level"] == "info" and demote["duration_s"] >= 0
    assert demote["bytes"] > 0 and demote["step"] == 2


def test_under_systemd_the_line_carries_its_journald_priority(tmp_path: Path) -> None:
    """stderr connected to journald ($JOURNAL_STREAM names it): JSON, prefixed ``<6>`` (info)."""
    config = _node(tmp_path)
    _save(tmp_path, 1, 2, 3)
    log = tmp_path / "journal.stream"
    with open(log, "w") as stream:
        st = os.fstat(stream.fileno())
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        cmd = [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), "prune"]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stream, env=env, timeout=180)
    assert done.returncode == 0
    lines = [line for line in log.read_text().splitlines() if ACTION_EVENT in line]
    assert [line[:22] for line in lines] == ['<6>{"action": "copy", ', '<6>{"action": "delete"']
    assert [json.loads(line[3:])["rule"] for line in lines] == ["demote", "moved"]


def test_history_lists_what_prune_reported_over_several_passes(tmp_path: Path) -> None:
    config = _node(tmp_path)
    reported: list[dict[str, Any]] = []
    for steps in ((1, 2, 3, 4, 5), (6, 7), (8,)):
        _save(tmp_path, *steps)
        reported += _json(config, "prune")["actions"]
    assert {a["action"] for a in reported} == {"copy", "delete"}
    shown = _json(config, "history")
    assert shown["node"] == "node-a"
    assert [_key(e) for e in shown["events"]] == [_key(a) for a in reported]
    assert {(e["outcome"], e["node"], e["source"]) for e in shown["events"]} == {("done", "node-a", "index")}
    one = _json(config, "history", "exp", "--step", "3")["events"]
    assert [(e["action"], e["tier"], e["rule"]) for e in one] == [
        ("copy", "hot", "demote"),
        ("delete", "hot", "moved"),
        ("delete", "warm", "expired"),
    ]
    assert _json(config, "history", "other-run")["events"] == []
    assert _json(config, "history", "--since", "1h")["events"] == shown["events"]
    assert "expired: no tier keeps it" in _text(config, "history", "exp", "--step", "3")
    bad = run_cli(config, "history", "--since", "soon")
    assert bad.returncode == 2 and "--since" in bad.stderr


def test_why_tells_a_kept_a_demoted_and_an_expired_checkpoint(tmp_path: Path) -> None:
    config = _node(tmp_path)
    _save(tmp_path, 1, 2, 3, 4, 5, 6)
    assert run_cli(config, "prune").returncode == 0

    demoted = _json(config, "why", "exp", "4")
    assert demoted["state"] == "present" and demoted["next_pass"] == []
    assert [(c["tier"], c["kept_by"]) for c in demoted["copies"]] == [("warm", ["last 3"])]
    assert [(e["action"], e["tier"], e["to_tier"]) for e in demoted["events"]] == [
        ("copy", "hot", "warm"),
        ("delete", "hot", None),
    ]
    assert demoted["events"][0]["reason"] == "demote: not in hot keep-set (last 2), kept by warm (last 3)"
    text = _text(config, "why", "exp", "4")
    assert "copy in warm (" in text and "kept by last 3" in text and "next pass: nothing changes" in text

    _save(tmp_path, 7)
    assert run_cli(config, "scan").returncode == 0  # cataloged (the daemon's watcher would)
    kept = _json(config, "why", "exp", "7")
    assert kept["state"] == "present" and kept["gone"] is None and kept["next_pass"] == []
    assert [(c["tier"], c["kept_by"]) for c in kept["copies"]] == [
        ("hot", ["last 2", "newest complete checkpoint of run"])
    ]
    # the next pass (planned now, from the index): 5 goes to warm, 4 falls out of warm's last 3
    nxt = _json(config, "why", "exp", "5")["next_pass"]
    assert [(a["action"], a["tier"], a["to_tier"], a["rule"]) for a in nxt] == [
        ("copy", "hot", "warm", "demote"),
        ("delete", "hot", None, "moved"),
    ]
    doomed = _json(config, "why", "exp", "4")
    assert [(c["tier"], c["kept_by"]) for c in doomed["copies"]] == [("warm", [])]
    assert [(a["action"], a["tier"], a["reason"]) for a in doomed["next_pass"]] == [
        ("delete", "warm", "expired: no tier keeps it")
    ]

    expired = _json(config, "why", "exp", "1")
    assert expired["state"] == "gone" and expired["copies"] == [] and expired["undelete"] is False
    gone = expired["gone"]
    assert (gone["action"], gone["tier"], gone["rule"], gone["node"]) == (
        "delete",
        "hot",
        "expired",
        "node-a",
    )
    assert gone["reason"] == "expired: no tier keeps it"
    text = _text(config, "why", "exp", "1")
    assert "gone: delete in hot by node-a on " in text and "expired: no tier keeps it" in text
    assert "undelete cannot bring it back" in text

    unknown = run_cli(config, "why", "exp", "99")
    assert unknown.returncode == 2 and "nothing known about exp@99" in unknown.stderr


def test_why_follows_a_checkpoint_into_the_trash_and_out_of_it(tmp_path: Path) -> None:
    """hot's undo_window moves expiries aside: ``why`` says undelete brings it back, and until
    when; once the window is off the next pass purges it, and ``why`` says it is gone for good."""
    config = _hot_only(tmp_path, undo_window="7d")
    _save(tmp_path, 1, 2, 3)
    assert run_cli(config, "prune").returncode == 0

    trashed = _json(config, "why", "exp", "1")
    assert trashed["state"] == "in-trash" and trashed["undelete"] is True
    (entry,) = trashed["trash"]
    assert entry["tier"] == "hot" and entry["purge_after"] - entry["deleted_at"] == 7 * 86400
    (event,) = trashed["events"]
    assert event["action"] == "delete" and event["trash"] == entry["entry"]
    assert event["reason"] == "expired: no tier keeps it; to trash for 7d"
    assert "`ckptkeeper undelete exp 1 --tier hot` brings it back until" in _text(config, "why", "exp", "1")

    config = _hot_only(tmp_path)  # the window is off: the next pass purges the trash
    purged = _json(config, "prune")["actions"]
    assert [(a["action"], a["rule"]) for a in purged] == [("purge", "undo-window-off")]
    gone = _json(config, "why", "exp", "1")
    assert gone["state"] == "gone" and gone["undelete"] is False and gone["trash"] == []
    assert [e["action"] for e in gone["events"]] == ["delete", "purge"]
    assert (gone["gone"]["action"], gone["gone"]["rule"]) == ("purge", "undo-window-off")
    text = _text(config, "why", "exp", "1")
    assert "gone: purge in hot by node-a" in text and "undelete cannot bring it back (purged" in text


def test_an_undelete_is_history_too(tmp_path: Path) -> None:
    config = _hot_only(tmp_path, undo_window="7d")
    _save(tmp_path, 1, 2, 3)
    assert run_cli(config, "prune").returncode == 0
    done = run_cli(config, "undelete", "exp", "1")
    assert done.returncode == 0, done.stderr
    (line,) = _events(done.stderr)
    assert (line["action"], line["run"], line["step"], line["tier"]) == ("undelete", "exp", 1, "hot")
    story = _json(config, "why", "exp", "1")
    assert story["state"] == "present"
    assert [e["action"] for e in story["events"]] == ["delete", "undelete"]


def _corrupt_tail(index: Path) -> None:
    """Damage the tail pages (a bulky journal), leaving the early tables readable."""
    con = sqlite3.connect(index)
    con.executemany(
        "INSERT INTO journal (action, phase, detail, started_at, updated_at, done) VALUES (?, 'done', '{}', 0, 0, 1)",
        [(json.dumps({"pad": "x" * 200}),) for _ in range(3000)],
    )
    con.commit()
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    size = index.stat().st_size
    with open(index, "r+b") as f:
        f.seek(size - 4096 * 3)
        f.write(os.urandom(4096 * 2))


def test_the_history_survives_a_corrupt_index_rebuilt_from_the_tiers(tmp_path: Path) -> None:
    config = _node(tmp_path)
    _save(tmp_path, 1, 2, 3, 4)
    before = _json(config, "prune")["actions"]
    _corrupt_tail(tmp_path / "index.db")
    rebuilt = run_cli(config, "prune")
    assert "index corrupt: moved aside" in rebuilt.stderr
    assert list(tmp_path.glob("index.db.corrupt-*"))
    shown = _json(config, "history")["events"]
    assert [_key(e) for e in shown] == [_key(a) for a in before]
    assert _json(config, "why", "exp", "1")["gone"]["rule"] == "expired"


def test_a_lost_index_still_tells_what_is_in_the_trash_and_since_when(tmp_path: Path) -> None:
    """``rm index.db*``: the rows are gone; the trash entries in the tier still say when and what."""
    config = _hot_only(tmp_path, undo_window="7d")
    _save(tmp_path, 1, 2, 3)
    assert run_cli(config, "prune").returncode == 0
    was = _json(config, "why", "exp", "1")["trash"]
    for p in tmp_path.glob("index.db*"):
        p.unlink()
    assert run_cli(config, "scan").returncode == 0
    story = _json(config, "why", "exp", "1")
    assert story["state"] == "in-trash" and story["undelete"] is True and story["trash"] == was
    (event,) = story["events"]
    assert event["source"] == "trash" and event["trash"] == was[0]["entry"]
    assert event["time"] == was[0]["deleted_at"] and event["tier"] == "hot"
    assert "why was recorded in an index since lost" in event["reason"]


def test_the_history_is_bounded_in_age_and_rows(tmp_path: Path) -> None:
    config = _node(tmp_path)
    config.write_text(config.read_text() + '\n[history]\nkeep = "30d"\nmax_rows = 100\n')
    _save(tmp_path, 1, 2, 3)
    assert run_cli(config, "prune").returncode == 0
    first = _json(config, "history")["events"]
    now = first[0]["time"]
    old = HistoryEvent(now - 31 * 86400, "delete", "exp", 0, "hot", reason="long ago")
    recent = [HistoryEvent(now - 3600 + i, "delete", "bulk", i, "hot", reason="bulk") for i in range(300)]
    with Index(tmp_path / "index.db") as ix:
        ix.add_history([old, *recent], durable=True)
        assert ix.history_count() == len(first) + 301
    _save(tmp_path, 4)
    this_pass = _json(config, "prune")["actions"]
    assert this_pass
    events = _json(config, "history")["events"]
    assert len(events) == 100  # the newest: this pass's, then the most recent bulk ones
    assert all(e["reason"] != "long ago" for e in events)
    assert [_key(e) for e in events[-len(this_pass) :]] == [_key(a) for a in this_pass]
    assert [e["step"] for e in events if e["run"] == "bulk"] == list(range(300 - 100 + len(this_pass), 300))
