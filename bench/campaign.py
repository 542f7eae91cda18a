"""A simulated week on one node: framework rotation alone vs ckptkeeper, on a fixed-size hot tier.

Workload (the same for both, deterministic): a new run starts every few hours; each saves one
checkpoint per simulated hour in one of three layouts (HF Trainer dirs, Lightning ``.ckpt`` zips,
torch DCP dirs) at 1-3 size units. Runs end in one of three ways: finished (the hook says so),
failed (the hook says so; the last save is cut short: a partial checkpoint), or abandoned (the
process vanished mid-save: no word from the hook, a partial checkpoint left). Files are real but
small; time is simulated (file mtimes, ``now`` passed to the catalog, planner and executor).

* framework rotation: each run deletes all but its last 2 complete checkpoints after every save
  (``save_total_limit=2``); nothing else ever deletes anything.
* ckptkeeper: no rotation in the runs; after every save the daemon's retention + reap pass runs
  (catalog → planner → executor, real files): hot keeps last 2 + best 1, watermarks 80 % / 60 % of
  the budget, older checkpoints move to a warm tier on disk, failed and stale runs are reaped down
  to their newest complete checkpoint, partials after an hour.

A save that would take the hot tier over its budget fails (the disk is full) and is counted.

Headroom: the same node runs a second workload of bigger saves (5-15 % of the budget
each) against watermarks at 90 % / 75 %, once watermark-only (``headroom = false``) and once with
headroom on (the default), and counts the saves that failed for lack of space in each.
Wasted bytes: what is still in hot at the end that nobody needs — partial checkpoints and every
checkpoint of a failed or abandoned run but its newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._harness import Config, Row

HOUR = 3600.0
BIG_UNITS = (2, 6)
"""Save sizes (units of a 40-unit hot budget) of the headroom comparison: 5-15 % of hot each."""
BIG_WATERMARKS = (0.9, 0.75)
LAYOUTS = ("hf", "lightning", "dcp")
_ENDS = ("finished", "failed", "finished", "abandoned", "finished", "finished", "failed", "finished")
"""5 in 8 runs finish, 2 fail, 1 is abandoned."""


@dataclass
class SimRun:
    name: str
    start: int
    """Tick (hour) of its first save."""
    saves: int
    end: str
    """finished | failed | abandoned"""
    layout: str
    units: int
    written: list[tuple[int, str, bool]] = field(default_factory=list)
    """(step, name, complete) of every checkpoint it wrote, in order."""


def workload(days: int, seed: int = 8, units: tuple[int, int] = (1, 3)) -> list[SimRun]:
    """The runs of ``days``; each saves ``units`` (drawn between the two, per run) size units."""
    rng = random.Random(seed)
    runs: list[SimRun] = []
    tick = 0
    i = 0
    while tick < days * 24 - 3:
        end = _ENDS[i % len(_ENDS)]
        runs.append(
            SimRun(
                name=f"run-{i:02d}-{end[:4]}",
                start=tick,
                saves=rng.randint(4, 24),
                end=end,
                layout=LAYOUTS[i % len(LAYOUTS)],
                units=rng.randint(*units),
            )
        )
        i += 1
        tick += rng.randint(2, 7)
    return runs


class Node:
    """The hot tier (and for ckptkeeper, warm + index) of one simulated node."""

    def __init__(self, root: Path, unit: int, budget: int, dead_pid: int) -> None:
        self.root = root
        self.hot = root / "hot"
        self.hot.mkdir(parents=True)
        self.unit = unit
        self.budget = budget
        self.dead_pid = dead_pid
        self.full_events = 0
        self.peak = 0

    def usage(self) -> int:
        total = 0
        for dirpath, dirnames, filenames in os.walk(self.hot):
            dirnames[:] = [d for d in dirnames if d != ".ckptkeeper"]
            for f in filenames:
                total += os.lstat(os.path.join(dirpath, f)).st_size
        return total

    def note_usage(self) -> None:
        self.peak = max(self.peak, self.usage())

    # -- what the training jobs write ------------------------------------------------------

    def hook_state(self, run: SimRun, state: str, when: float) -> None:
        d = self.hot / run.name / ".ckptkeeper"
        d.mkdir(parents=True, exist_ok=True)
        doc = {
            "version": 1,
            "name": run.name,
            "state": state,
            "host": socket.gethostname(),
            "pid": self.dead_pid,
            "started": when,
            "ended": when if state != "active" else None,
            "reason": "CUDA error: an illegal memory access" if state == "failed" else None,
            "parent": None,
            "heartbeat_interval": 10.0,
        }
        (d / "run.json").write_text(json.dumps(doc))
        hb = d / "heartbeat"
        hb.touch()
        os.utime(hb, (when, when))
        os.utime(d / "run.json", (when, when))

    def save(self, run: SimRun, step: int, when: float, *, complete: bool, loss: float) -> bool:
        """Write one checkpoint; False (nothing written) if it does not fit in the budget."""
        size = run.units * self.unit
        if self.usage() + size > self.budget:
            self.full_events += 1
            return False
        run_dir = self.hot / run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        data = os.urandom(size if complete else size // 2)
        if run.layout == "hf":
            name = f"checkpoint-{step}"
            path = run_dir / name
            path.mkdir()
            (path / "model.safetensors").write_bytes(_safetensors(data))
            if complete:
                state = {"global_step": step, "log_history": [{"step": step, "eval_loss": loss}]}
                (path / "trainer_state.json").write_text(json.dumps(state))
        elif run.layout == "lightning":
            name = f"epoch=0-step={step}.ckpt"
            path = run_dir / name
            with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
                z.writestr("archive/data/0", data)
                z.writestr("archive/data.pkl", json.dumps({"eval_loss": loss}))
            if not complete:  # killed mid-write: no end of central directory
                with open(path, "r+b") as f:
                    f.truncate(len(data) // 2)
        else:
            name = f"step_{step}"
            path = run_dir / name
            path.mkdir()
            (path / "__0_0.distcp").write_bytes(data)
            (path / (".metadata" if complete else ".metadata.tmp")).write_bytes(b"\x80\x04meta")
        for p in [*path.rglob("*"), path] if path.is_dir() else [path]:
            os.utime(p, (when, when))
        run.written.append((step, name, complete))
        return True

    def remove(self, run: SimRun, name: str) -> None:
        path = self.hot / run.name / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    def newest_bytes(self, runs: list[SimRun]) -> int:
        """Bytes in hot of every run's newest complete checkpoint (protected: never deleted)."""
        total = 0
        for run in runs:
            complete = [n for _, n, ok in run.written if ok]
            if complete and (self.hot / run.name / complete[-1]).exists():
                total += _bytes(self.hot / run.name / complete[-1])
        return total

    def wasted(self, runs: list[SimRun]) -> int:
        """Bytes in hot nobody needs: partials, and all but the newest complete of dead runs."""
        waste = 0
        for run in runs:
            complete = [n for _, n, ok in run.written if ok]
            keep = set(complete[-1:])
            for _, name, ok in run.written:
                path = self.hot / run.name / name
                if not path.exists():
                    continue
                if not ok or (run.end != "finished" and name not in keep):
                    waste += _bytes(path)
        return waste


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _safetensors(payload: bytes) -> bytes:
    import struct

    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}
    ).encode()
    return struct.pack("<Q", len(header)) + header + payload


# -- the two strategies ----------------------------------------------------------------------


def _events(runs: list[SimRun]) -> list[tuple[int, int, SimRun, int]]:
    """(tick, order, run, save index) of every save, in time order."""
    out = []
    for order, run in enumerate(runs):
        for k in range(run.saves):
            out.append((run.start + k, order, run, k))
    return sorted(out, key=lambda e: (e[0], e[1]))


def simulate(node: Node, runs: list[SimRun], t0: float, keeper: Any | None) -> None:
    for tick, _, run, k in _events(runs):
        when = t0 + tick * HOUR + 60 * (hash(run.name) % 50)
        last = k == run.saves - 1
        if k == 0 and run.end != "abandoned":
            node.hook_state(run, "active", when)
        complete = not (last and run.end != "finished")
        loss = 2.0 / (1 + 0.3 * k) + 0.05 * ((k * 7919) % 5)
        node.save(run, (k + 1) * 1000, when, complete=complete, loss=loss)
        if last and run.end != "abandoned":
            node.hook_state(run, run.end, when + 60)
        if keeper is None:
            complete_names = [n for _, n, ok in run.written if ok]
            for name in complete_names[:-2]:  # save_total_limit=2
                node.remove(run, name)
            node.note_usage()
        else:
            node.note_usage()  # the save landed before the daemon could react
            keeper.prune(when + 120)
            node.note_usage()
    end = t0 + (max(r.start + r.saves for r in runs) + 1) * HOUR
    if keeper is not None:
        keeper.prune(end)
    node.note_usage()


class Keeper:
    """The daemon's retention + reap pass, driven with a simulated clock."""

    def __init__(
        self, node: Node, budget: int, *, headroom: bool = True, watermarks: tuple[float, float] = (0.8, 0.6)
    ) -> None:
        from ckptkeeper.config import settings_from_mapping
        from ckptkeeper.index import Index
        from ckptkeeper.ingest.catalog import Catalog

        self.node = node
        warm = node.root / "warm"
        warm.mkdir()
        self.settings = settings_from_mapping(
            {
                "index": str(node.root / "index.db"),
                "max_delete": 10**6,
                # the trees are back-dated: judge them by mtime
                "daemon": {"metrics_addr": "", "settle_seconds": 30, "trust_mtimes": True},
                "tiers": [
                    {
                        "name": "hot",
                        "url": str(node.hot),
                        "keep_last": 2,
                        "keep_best": 1,
                        "metric": "eval_loss",
                        "high_watermark": watermarks[0],
                        "low_watermark": watermarks[1],
                        "headroom": headroom,
                    },
                    {"name": "warm", "url": str(warm), "keep_last": 5, "keep_within": "7d"},
                ],
                "reaper": {"failed_after": "2h", "partial_after": "1h", "keep_last_of_failed": 1},
            }
        )
        self.index = Index(self.settings.index)
        self.now = 0.0
        self.catalog = Catalog(self.settings, self.index, clock=lambda: self.now)
        self.budget = budget
        self.passes = 0
        self.failed: list[str] = []

    def prune(self, now: float) -> None:
        from ckptkeeper.core.model import TierUsage
        from ckptkeeper.core.planner import plan
        from ckptkeeper.executor import Executor

        self.now = now
        self.catalog.reconcile()
        specs = self.settings.tier_specs()
        snapshot = self.index.snapshot([t.name for t in specs])
        usage = {"hot": TierUsage(total_bytes=self.budget, used_bytes=self.node.usage()), "warm": None}
        p = plan(snapshot, specs, usage, now, reaper=self.settings.reaper.to_policy(), max_delete=10**6)
        result = Executor(
            self.index,
            specs,
            partial_after=self.settings.reaper.partial_after,
            clock=lambda: self.now,
            trust_mtimes=self.settings.daemon.trust_mtimes,
        ).apply(p)
        self.failed += [f"{a.action.value} {a.path}: {err}" for a, err in result.failed]
        self.passes += 1


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def run(cfg: Config) -> list[Row]:
    days = cfg.pick(7, 3, 1)
    unit = cfg.pick(256 * 1024, 64 * 1024, 8 * 1024)
    budget = 40 * unit
    runs_a = workload(days)
    runs_b = workload(days)
    t0 = time.time() - (days + 2) * 86400
    pid = _dead_pid()
    with cfg.tempdir(cfg.disk_dir, "campaign") as root:
        base = Node(root / "rotation", unit, budget, pid)
        simulate(base, runs_a, t0, None)
        ours = Node(root / "ckptkeeper", unit, budget, pid)
        keeper = Keeper(ours, budget)
        t_start = time.perf_counter()
        simulate(ours, runs_b, t0, keeper)
        elapsed = time.perf_counter() - t_start
        keeper.index.close()
        b_waste, o_waste = base.wasted(runs_a), ours.wasted(runs_b)
        b_end, o_end = base.usage(), ours.usage()
        protected = ours.newest_bytes(runs_b)
        # Headroom: big saves against a 90 % watermark, watermark-only vs headroom on.
        big: dict[bool, Node] = {}
        for headroom in (False, True):
            big[headroom] = Node(root / f"headroom-{'on' if headroom else 'off'}", unit, budget, pid)
            big_keeper = Keeper(big[headroom], budget, headroom=headroom, watermarks=BIG_WATERMARKS)
            simulate(big[headroom], workload(days, units=BIG_UNITS), t0, big_keeper)
            big_keeper.index.close()
            keeper.failed += big_keeper.failed
    if keeper.failed:
        raise RuntimeError(f"executor actions failed: {keeper.failed[:3]}")
    kinds = {e: sum(r.end == e for r in runs_a) for e in ("finished", "failed", "abandoned")}
    what = f"{len(runs_a)} runs ({kinds['finished']} finished, {kinds['failed']} failed, {kinds['abandoned']} abandoned)"
    return [
        Row(
            metric=f"campaign {days} d, {what}: peak hot usage (% of budget)",
            baseline=base.peak / budget * 100,
            ours=ours.peak / budget * 100,
            unit="%",
            ratio=ours.peak / base.peak if base.peak else None,
            target="<= baseline",
            ok=ours.peak <= base.peak,
            baseline_label="rotation, save_total_limit=2",
            note=f"hot budget {budget // 1024} KiB; ckptkeeper: {keeper.passes} retention+reap passes "
            f"({elapsed / max(keeper.passes, 1) * 1e3:.0f} ms each, simulated clock); hot at the end "
            f"{o_end / budget * 100:.0f} % vs {b_end / budget * 100:.0f} %",
        ),
        Row(
            metric="campaign: wasted bytes left in hot at the end (% of budget)",
            baseline=b_waste / budget * 100,
            ours=o_waste / budget * 100,
            unit="%",
            target="< baseline",
            ok=o_waste < b_waste or (o_waste == 0 and b_waste == 0),
            baseline_label="rotation",
            note="partial checkpoints + all but the newest complete checkpoint of failed/abandoned runs",
        ),
        Row(
            metric="campaign: saves that failed because hot was full",
            baseline=float(base.full_events),
            ours=float(ours.full_events),
            unit="",
            target="0",
            ok=ours.full_events == 0,
            baseline_label="rotation",
            note=(
                f"the runs' newest complete checkpoints (protected: never deleted) still in hot at the end "
                f"hold {protected / budget * 100:.0f} % of the budget; above the high watermark those of "
                "ended runs move to warm once every unprotected checkpoint has"
            ),
        ),
        Row(
            metric=(
                f"campaign: saves that failed for lack of space (saves of {BIG_UNITS[0] * 100 // 40}-"
                f"{BIG_UNITS[1] * 100 // 40} % of hot, watermarks {BIG_WATERMARKS[0]:.0%}/{BIG_WATERMARKS[1]:.0%})"
            ),
            baseline=float(big[False].full_events),
            ours=float(big[True].full_events),
            unit="",
            target="0",
            ok=big[True].full_events == 0,
            baseline_label="watermarks only, headroom = false",
            note=(
                "same node and workload with bigger saves; a save fails (nothing written) when hot has not "
                "its size free. headroom = true demotes before the next saves, predicted from each active "
                f"run's last 3; peak hot {big[True].peak / budget * 100:.0f} % vs {big[False].peak / budget * 100:.0f} %. "
                "No policy helps where the active runs' newest checkpoints plus their next saves exceed hot "
                "(saves of 7.5-20 %, 7 d: 7 vs 164 failed; the plan's notes say so)"
            ),
        ),
    ]
