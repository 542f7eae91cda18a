"""Training-loop hook costs: ``run.commit()`` inside the trainer, and commit → visible in the index
of a running daemon.

* in-process: ``track_run(...).commit(path, step, metrics)`` on a run directory on disk, many
  times; baseline: appending the same JSON line to a file with ``open(..., "a")`` (what a
  trainer's own bookkeeping would cost). Target is absolute: p99 <= 0.5 ms.
* end to end: a ``ckptkeeper daemon`` subprocess watches the hot tier; the bench writes a small
  HF checkpoint, commits it, and polls the index (SQLite, read-only) every millisecond until the
  row is there, committed. Includes the watcher's wake-up, the run's reconcile and hashing the
  (small: 256 KiB) checkpoint. Target: p99 <= 100 ms.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench._daemon import DaemonProcess, open_index_readonly, write_hf_checkpoint
from bench._harness import Config, Row, percentile


def _commit_costs(cfg: Config, root: Path, n: int) -> tuple[list[float], list[float]]:
    import ckptkeeper

    run_dir = root / "inproc-run"
    ckpt = write_hf_checkpoint(run_dir, 1, b"x" * 1024)
    plain = root / "plain.jsonl"
    ours: list[float] = []
    base: list[float] = []
    with ckptkeeper.track_run(run_dir) as run:
        for i in range(n):
            metrics = {"eval_loss": 1.0 + i * 1e-6, "lr": 3e-4}
            t0 = time.perf_counter()
            run.commit(ckpt, step=i, metrics=metrics)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            line = json.dumps({"path": "checkpoint-1", "step": i, "metrics": metrics, "time": time.time()})
            with open(plain, "a") as f:
                f.write(line + "\n")
            base.append(time.perf_counter() - t0)
    return base, ours


def _commit_to_index(cfg: Config, root: Path, n: int) -> list[float]:
    import ckptkeeper

    with DaemonProcess(root / "node") as daemon:
        daemon.start()
        run_dir = daemon.hot / "run-hook"
        db = open_index_readonly(daemon.index)
        latencies: list[float] = []
        payload = os.urandom(256 * 1024)
        try:
            with ckptkeeper.track_run(run_dir) as run:
                for i in range(n + 3):  # the first commits warm the daemon up (imports, caches)
                    step = (i + 1) * 10
                    ckpt = write_hf_checkpoint(run_dir, step, payload)
                    time.sleep(0.05)  # a trainer commits after its save returned; let the write events pass
                    t0 = time.perf_counter()
                    run.commit(ckpt, step=step, metrics={"eval_loss": 1.0})
                    deadline = t0 + 30
                    while True:
                        row = db.execute(
                            "SELECT committed FROM checkpoints WHERE run = ? AND name = ?",
                            ("run-hook", ckpt.name),
                        ).fetchone()
                        if row is not None and row[0]:
                            break
                        if time.perf_counter() > deadline:
                            raise RuntimeError(f"commit of {ckpt.name} not indexed after 30 s")
                        time.sleep(0.001)
                    if i >= 3:
                        latencies.append(time.perf_counter() - t0)
                    cfg.log(
                        f"commit {step} visible after {(time.perf_counter() - t0) * 1e3:.1f} ms"
                    ) if i % 20 == 0 else None
        finally:
            db.close()
    return latencies


def run(cfg: Config) -> list[Row]:
    n_inproc = cfg.pick(5000, 2000, 200)
    n_e2e = cfg.pick(300, 100, 5)
    with cfg.tempdir(cfg.disk_dir, "hook") as root:
        base, ours = _commit_costs(cfg, root, n_inproc)
        e2e = _commit_to_index(cfg, root, n_e2e)
    p99, b99 = percentile(ours, 99), percentile(base, 99)
    e99 = percentile(e2e, 99)
    return [
        Row(
            metric=f"run.commit() in the training process, p99 of {n_inproc}",
            baseline=b99,
            ours=p99,
            unit="s",
            ratio=b99 / p99,
            target="p99 <= 0.5 ms",
            ok=p99 <= 0.5e-3,
            baseline_label="open('a').write(json)",
            note=f"median {sorted(ours)[len(ours) // 2] * 1e6:.0f} µs; appends one line under flock, no fsync",
            samples={"baseline": base, "ckptkeeper": ours},
        ),
        Row(
            metric=f"hook commit → visible in the daemon's index, p99 of {n_e2e}",
            baseline=None,
            ours=e99,
            unit="s",
            target="p99 <= 100 ms",
            ok=e99 <= 0.1,
            note=f"median {sorted(e2e)[len(e2e) // 2] * 1e3:.1f} ms; 256 KiB HF checkpoint, hashed before it is indexed",
            samples={"ckptkeeper": e2e},
        ),
    ]
