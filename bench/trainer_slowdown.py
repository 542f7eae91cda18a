"""Does the daemon steal from training? A CPU-bound stand-in trainer (numpy on one pinned core,
:mod:`bench._trainer`) runs for a fixed window, alternately while the daemon idles and while it
catalogs and moves freshly committed checkpoints (hot on tmpfs → warm on disk, hot keeps the last
one). The daemon runs as the deploy unit starts it: ``Nice=10``, best-effort I/O priority 7.
Slowdown = 1 - (steps/s under load) / (steps/s alone), medians of alternating windows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench._daemon import DaemonProcess, write_hf_checkpoint
from bench._harness import Config, MiB, Row, alternate, median, python_env, read_proc_cpu_seconds


class _Bench:
    def __init__(
        self, cfg: Config, daemon: DaemonProcess, staging: Path, window: float, n: int, size: int
    ) -> None:
        self.cfg = cfg
        self.daemon = daemon
        self.staging = staging
        self.window = window
        self.n = n
        self.size = size
        self.step = 0
        self.daemon_cpu: list[float] = []
        import ckptkeeper

        self.run = ckptkeeper.track_run(daemon.hot / "run-train")
        self.payload = os.urandom(size)

    def _trainer(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "bench._trainer", str(self.window)],
            stdout=subprocess.PIPE,
            text=True,
            env={**python_env(), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        )

    def alone(self) -> float:
        time.sleep(1.0)  # let the last move's writeback drain
        proc = self._trainer()
        out, _ = proc.communicate()
        return float(out)

    def under_load(self) -> float:
        staged = []
        for _ in range(self.n):  # written before the window: the trainer's own save is not measured
            self.step += 100
            staged.append(write_hf_checkpoint(self.staging, self.step, self.payload))
        os.sync()
        cpu0 = read_proc_cpu_seconds(self.daemon.pid)
        proc = self._trainer()
        time.sleep(0.3)
        for ckpt in staged:
            dest = self.daemon.hot / "run-train" / ckpt.name
            os.rename(ckpt, dest)
            self.run.commit(dest, step=int(ckpt.name.split("-")[1]), metrics={"eval_loss": 1.0})
        out, _ = proc.communicate()
        self.daemon_cpu.append(read_proc_cpu_seconds(self.daemon.pid) - cpu0)
        self._wait_moved()
        return float(out)

    def _wait_moved(self) -> None:
        """Until hot holds only the newest checkpoint again (the daemon finished its moves)."""
        run_dir = self.daemon.hot / "run-train"
        deadline = time.monotonic() + 300
        while len([p for p in run_dir.iterdir() if p.name.startswith("checkpoint-")]) > 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon did not move the checkpoints within 300 s")
            time.sleep(0.2)


def run(cfg: Config) -> list[Row]:
    window = cfg.pick(8.0, 6.0, 1.0)
    n, size = cfg.pick((6, 512 * MiB), (4, 256 * MiB), (2, 1 * MiB))
    reps = cfg.pick(cfg.reps, 3, 1)
    with cfg.tempdir(cfg.fast_dir, "trainer-hot") as hot, cfg.tempdir(cfg.disk_dir, "trainer") as root:
        daemon = DaemonProcess(
            root / "node",
            hot=hot / "hot",
            nice=10,
            tiers=[
                {"name": "hot", "url": str(hot / "hot"), "keep_last": 1},
                # replicate: every new checkpoint gets a warm copy at once (a prompt retention pass)
                {"name": "warm", "url": str(root / "node" / "warm"), "replicate": True},
            ],
        )
        (hot / "staging").mkdir()
        with daemon:
            daemon.start()
            bench = _Bench(cfg, daemon, hot / "staging", window, n, size)
            try:
                alone, loaded = alternate(
                    bench.alone, bench.under_load, reps, log=cfg.log, names=("alone", "loaded")
                )
            finally:
                bench.run.finish()
    slowdown = (1 - median(loaded) / median(alone)) * 100
    moved = n * size / MiB
    return [
        Row(
            metric=f"CPU-bound trainer slowdown while the daemon moves {moved:.0f} MiB",
            baseline=median(alone),
            ours=median(loaded),
            unit="steps/s",
            ratio=median(loaded) / median(alone),
            target="slowdown <= 3 %",
            ok=slowdown <= 3.0,
            baseline_label="daemon idle",
            note=f"slowdown {slowdown:.1f} %; daemon used {median(bench.daemon_cpu):.2f} CPU-s per {window:.0f} s "
            f"window (nice 10); {os.cpu_count()} cores, trainer pinned to one",
            samples={"baseline": alone, "ckptkeeper": loaded, "daemon_cpu": bench.daemon_cpu},
        )
    ]
