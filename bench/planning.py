"""Planning time against catalog size: ``planner.plan`` on a synthetic snapshot, and the cost of
loading one from the SQLite index (``Index.snapshot``).

The synthetic node has 100 checkpoints per run (10k runs at 1M), every 100 steps, one hour apart,
with the docs/design.md, "Contracts" example policy (hot: last 2 + best 1 + watermarks; warm: last 10 within 7d;
cold: replicate, every 10000 steps, daily 30) and the reaper on. Checkpoints are spread over the
three tiers as a node in steady state would have them; a fifth of the runs are finished, a tenth
failed, a tenth stale, and the hot tier sits above its high watermark so the demotion pass runs too.
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench._harness import Config, Row, median
from ckptkeeper.core.model import (
    Checkpoint,
    CheckpointState,
    ReaperPolicy,
    Run,
    RunState,
    Snapshot,
    TierPolicy,
    TierSpec,
    TierUsage,
)

PER_RUN = 100
"""Average checkpoints per run in the steady state the generator produces (raw history is longer)."""
RAW_PER_RUN = 145
NOW = 1_800_000_000.0
TIERS = (
    TierSpec(
        "hot",
        "/nvme/checkpoints",
        TierPolicy(keep_last=2, keep_best=1, metric="eval_loss", high_watermark=0.85, low_watermark=0.70),
    ),
    TierSpec("warm", "/mnt/warm/ckpt", TierPolicy(keep_last=10, keep_within=7 * 86400.0)),
    TierSpec("cold", "s3://bucket/ckpt", TierPolicy(keep_every=1000, keep_daily=30, replicate=True)),
)


def synthetic_snapshot(n_checkpoints: int, seed: int = 8) -> Snapshot:
    """A node in steady state plus one retention interval of churn, ~``n_checkpoints`` in total.

    Every run wrote a checkpoint every 500 steps, one hour apart. What survives is what the policy
    keeps (computed with the same retention rules), placed where it resides, with cold replicas:
    the index of a node where retention has been running all along. Then the churn of one pass:
    every active run has a fresh checkpoint in hot only (a replica and a demotion to plan), one run
    in a hundred just failed with its whole history (reaps), failed and stale runs reaped earlier
    hold their last checkpoint only. Sorted by (run, step), as ``Index.snapshot()`` returns them.
    """
    from ckptkeeper.core.retention import rules_for, select_union

    rng = random.Random(seed)
    n_runs = max(1, n_checkpoints // PER_RUN)
    rules = [rules_for(t.policy, NOW) for t in TIERS]
    names = [t.name for t in TIERS]
    replicate = [t.policy.replicate for t in TIERS]
    tier_sets: dict[tuple[str, ...], frozenset[str]] = {}
    runs: list[Run] = []
    checkpoints: list[Checkpoint] = []
    complete = CheckpointState.COMPLETE
    for r in range(n_runs):
        name = f"run-{r:06d}"
        x = r % 100
        state = (
            RunState.ACTIVE
            if x < 40
            else RunState.FINISHED
            if x < 85
            else RunState.FAILED
            if x < 95 or x == 99
            else RunState.STALE
        )
        end = NOW if state is RunState.ACTIVE else NOW - rng.uniform(0.5, 20) * 86400
        history = [
            Checkpoint(
                run=name,
                step=(i + 1) * 500,
                name=f"checkpoint-{(i + 1) * 500}",
                layout="hf",
                state=complete,
                created_at=end - (RAW_PER_RUN - 1 - i) * 3600.0,
                bytes=2 * 2**30,
                metrics={"eval_loss": rng.uniform(0.5, 3.0)},
                pinned=i == 50 and r % 97 == 0,
                version=f"{r:016x}{i:016x}",
                last_write=end - (RAW_PER_RUN - 1 - i) * 3600.0,
                committed=True,
            )
            for i in range(RAW_PER_RUN)
        ]
        fresh = history.pop() if state is RunState.ACTIVE else None
        sels = [select_union(rs, history) for rs in rules]
        kept: list[Checkpoint] = []
        for c in history:
            rule_tier = next((t for t, sel in enumerate(sels) if c.step in sel), None)
            if rule_tier is None and not c.pinned:
                continue  # expired in an earlier pass
            rule_tier = rule_tier or 0
            where = (
                names[rule_tier],
                *(names[t] for t in range(rule_tier + 1, len(names)) if replicate[t] and c.step in sels[t]),
            )
            kept.append(replace(c, tiers=tier_sets.setdefault(where, frozenset(where))))
        if state in (RunState.FAILED, RunState.STALE) and x != 99:
            kept = kept[-1:]  # reaped by an earlier pass
        if fresh is not None:
            kept.append(replace(fresh, tiers=frozenset({"hot"})))
        runs.append(Run(name=name, state=state, last_seen=end))
        checkpoints.extend(kept)
    return Snapshot(runs=tuple(runs), checkpoints=tuple(checkpoints))


def _plan_once(snapshot: Snapshot) -> tuple[float, float]:
    """(seconds of ``plan()``, seconds of then reading every keep). The daemon's pass only executes
    the actions; ``prune --dry-run`` and ``--json`` read the keeps too, which builds them then."""
    from ckptkeeper.core.planner import plan
    from ckptkeeper.util.gc import gc_paused

    usage = {"hot": TierUsage(total_bytes=10**15, used_bytes=9 * 10**14), "warm": None, "cold": None}
    gc.collect()
    t0 = time.perf_counter()
    with gc_paused():  # as the prune action calls it; timed, GC restore included
        result = plan(snapshot, TIERS, usage, NOW, reaper=ReaperPolicy(), max_delete=10**9)
    elapsed = time.perf_counter() - t0
    assert result.actions, "the synthetic node should need work"
    t1 = time.perf_counter()
    with gc_paused():
        assert len(result.keep) > 0
    return elapsed, time.perf_counter() - t1


def _index_snapshot_time(n_checkpoints: int, reps: int, cfg: Config) -> float:
    """Fill a real index (manifests included, as the catalog writes them) and time ``snapshot()``."""
    from ckptkeeper.core.model import FileEntry, Manifest
    from ckptkeeper.index import Index

    snap = synthetic_snapshot(n_checkpoints)
    with tempfile.TemporaryDirectory(prefix="ckptkeeper-bench-index-", dir=cfg.disk_dir) as tmp:
        index = Index(Path(tmp) / "index.db")
        try:
            with index.transaction():
                for run in snap.runs:
                    index.upsert_run(run.name, state=run.state, last_seen=run.last_seen)
                for c in snap.checkpoints:
                    files = tuple(
                        FileEntry(p, 2**28, f"{c.step:032x}")
                        for p in ("model.safetensors", "optimizer.pt", "trainer_state.json", "rng_state.pth")
                    )
                    manifest = Manifest(
                        c.run, c.step, c.name, c.layout, True, files, dict(c.metrics), c.created_at
                    )
                    cid = index.upsert_checkpoint(
                        run=c.run,
                        name=c.name,
                        step=c.step,
                        layout=c.layout,
                        state=c.state,
                        created_at=c.created_at,
                        last_write=c.last_write,
                        bytes=c.bytes,
                        metrics=c.metrics,
                        committed=c.committed,
                        version=manifest.digest,
                        manifest_json=manifest.to_json(),
                        problem=None,
                    )
                    for tier in c.tiers:
                        index.set_location(cid, tier, manifest.digest)
                for t in TIERS:
                    index.set_tier_status(t.name, True)
            times = []
            for _ in range(reps):
                gc.collect()
                t0 = time.perf_counter()
                loaded = index.snapshot([t.name for t in TIERS])
                times.append(time.perf_counter() - t0)
                assert len(loaded.checkpoints) == len(snap.checkpoints)
                del loaded
        finally:
            index.close()
    cfg.log(f"Index.snapshot() at {n_checkpoints}: {[round(t, 3) for t in times]}")
    return median(times)


def run(cfg: Config) -> list[Row]:
    sizes = cfg.pick([10_000, 100_000, 1_000_000], [10_000, 100_000, 1_000_000], [10_000])
    rows: list[Row] = []
    for n in sizes:
        snapshot = synthetic_snapshot(n)
        reps = 3 if n >= 1_000_000 or cfg.quick else cfg.reps
        both = [_plan_once(snapshot) for _ in range(reps)]
        times = [t for t, _ in both]
        with_keeps = [t + k for t, k in both]
        per_checkpoint = median(times) / len(snapshot.checkpoints) * 1e6
        del snapshot
        cfg.log(
            f"plan() at {n}: {[round(t, 3) for t in times]}; with keeps read: {[round(t, 3) for t in with_keeps]}"
        )
        is_target = n == 1_000_000
        rows.append(
            Row(
                metric=f"plan() {n // 1000}k checkpoints / {max(1, n // PER_RUN)} runs",
                baseline=None,
                ours=median(times),
                unit="s",
                target="<= 2 s" if is_target else "curve",
                ok=(median(times) <= 2.0) if is_target else None,
                samples={"ckptkeeper": times},
                note=f"{per_checkpoint:.2f} us per checkpoint (the curve is linear when this stays flat)",
            )
        )
        if is_target:
            rows.append(
                Row(
                    metric=f"plan() {n // 1000}k + every keep read (what prune --dry-run pays)",
                    baseline=None,
                    ours=median(with_keeps),
                    unit="s",
                    target="info",
                    ok=None,
                    samples={"ckptkeeper": with_keeps},
                    note="keeps are built on first read; the daemon's pass never reads them",
                )
            )
    snap_n = cfg.pick(100_000, 100_000, 2_000)
    load = _index_snapshot_time(snap_n, 3, cfg)
    rows.append(
        Row(
            metric=f"Index.snapshot() load, {snap_n // 1000}k checkpoints",
            baseline=None,
            ours=load,
            unit="s",
            target="info",
            ok=None,
            note="the daemon loads a snapshot per retention pass; shown so plan() is not read alone",
        )
    )
    return rows
