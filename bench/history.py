"""The history's cost (docs/history.md): index size after N recorded actions, ``history RUN``'s
answer time against the baseline of parsing the journal (the same events as JSON log lines, one
run's filtered out), and the end-of-pass prune of the history to its bounds.

The synthetic node: N actions over 10k runs (one in a hundred of them per run), with reasons as
long as the planner's. The answer time is ``read_history`` on the index (what the command does
after startup); the baseline reads and filters a JSON-lines file of the same events, what an
operator does with ``journalctl -o cat | jq`` today, without journald's own cost.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench._harness import Config, Row, median
from ckptkeeper.core.history import HistoryEvent
from ckptkeeper.index import Index

RUNS = 10_000
NOW = 1_800_000_000.0
_REASON = "demote: not in hot keep-set (last 2, best by eval_loss (min)), kept by warm (last 10, within 7d)"


def _events(n: int) -> list[HistoryEvent]:
    out = []
    for i in range(n):
        run = f"team-{i % RUNS % 37}/run-{i % RUNS:05d}"
        step = (i // RUNS) * 500
        out.append(
            HistoryEvent(
                NOW - (n - i) * 0.5,
                "copy" if i % 3 else "delete",
                run,
                step,
                "hot",
                "warm" if i % 3 else None,
                path=f"{run}/checkpoint-{step}",
                bytes=3 << 30,
                rule="demote" if i % 3 else "expired",
                reason=_REASON,
                node="node-0042",
                duration=1.5,
            )
        )
    return out


def run(cfg: Config) -> list[Row]:
    n = cfg.pick(1_000_000, 200_000, 5_000)
    rows: list[Row] = []
    with cfg.tempdir(cfg.disk_dir, "history") as tmp:
        events = _events(n)
        path = tmp / "index.db"
        with Index(path) as ix:
            for start in range(0, n, 50_000):
                ix.add_history(events[start : start + 50_000], durable=True)
            ix._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = path.stat().st_size
        journal = tmp / "journal.jsonl"
        with open(journal, "w") as f:
            for e in events:
                f.write(
                    json.dumps({**e.to_dict(), "event": "checkpoint action done", "level": "info"}) + "\n"
                )
        del events
        target = "team-5/run-00042"
        ours, base = [], []
        with Index(path) as ix:
            for _ in range(cfg.pick(5, 3, 2)):
                t0 = time.perf_counter()
                got = ix.history(target)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                found = _grep_journal(journal, target)
                base.append(time.perf_counter() - t0)
            assert len(got) == len(found)
            t0 = time.perf_counter()
            dropped = ix.prune_history(NOW - 10 * 86400, n - n // 100)
            prune_time = time.perf_counter() - t0
        cfg.log(f"history: {n} events, {size} bytes; answers {ours} vs journal {base}; prune {prune_time}")
    rows.append(
        Row(
            metric=f"history: index size after {n // 1000}k actions",
            baseline=None,
            ours=size / 2**20,
            unit="MiB",
            target="info",
            ok=None,
            note=f"{size / n:.0f} bytes per action (history.max_rows bounds it: 200k by default)",
        )
    )
    rows.append(
        Row(
            metric=f"history RUN: answer for one run of {n // 1000}k actions",
            baseline=median(base),
            ours=median(ours),
            unit="s",
            target="faster than the journal",
            ok=median(ours) < median(base),
            ratio=median(base) / max(median(ours), 1e-9),
            baseline_label="parse JSON log lines",
            samples={"ckptkeeper": ours, "baseline": base},
            note=f"{len(got)} events of the run",
        )
    )
    rows.append(
        Row(
            metric=f"history: end-of-pass prune to its bounds ({dropped} rows dropped)",
            baseline=None,
            ours=prune_time,
            unit="s",
            target="info",
            ok=None,
            note="1% over max_rows: a pass drops at most 20k rows per bound (PRUNE_CHUNK)",
        )
    )
    return rows


def _grep_journal(path: Path, run: str) -> list[dict[str, object]]:
    out = []
    with open(path) as f:
        for line in f:
            doc = json.loads(line)
            if doc.get("run") == run:
                out.append(doc)
    return out
