"""An idle daemon: CPU share and memory while it watches a hot tier with 10k cataloged checkpoints.

The node: 100 runs x 100 small HF checkpoints, written (and settled) before the daemon starts, a
warm tier, default intervals. The daemon catalogs them in its initial scan; the measurement window
opens after the first scheduled retention and reap passes (60 s after start) and lasts 60 s (quick:
20 s). CPU is utime + stime of the daemon process (all threads) from /proc/PID/stat, RSS is VmRSS.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench._daemon import DaemonProcess, open_index_readonly, write_hf_checkpoint
from bench._harness import Config, Row, read_proc_cpu_seconds, read_proc_rss_bytes


def populate(hot: Path, runs: int, per_run: int) -> int:
    """Finished runs (the hook said so), checkpoints settled a day ago: nothing for the jobs to do."""
    import ckptkeeper

    old = time.time() - 86400
    payload = b"\0" * 512
    for r in range(runs):
        run_dir = hot / f"run-{r:03d}"
        with ckptkeeper.track_run(run_dir):
            for i in range(per_run):
                write_hf_checkpoint(run_dir, (i + 1) * 100, payload, when=old)
    return runs * per_run


def run(cfg: Config) -> list[Row]:
    runs, per_run = cfg.pick((100, 100), (100, 100), (5, 4))
    window = cfg.pick(60.0, 20.0, 2.0)
    warmup = cfg.pick(60.0, 60.0, 1.0)  # FIRST_RUN_DELAY: retention at 30 s, reap at 60 s
    with cfg.tempdir(cfg.disk_dir, "idle") as root:
        daemon = DaemonProcess(root / "node")
        n = populate(daemon.hot, runs, per_run)
        t_start = time.monotonic()
        with daemon:
            daemon.start(ready_timeout=900)
            ready_after = time.monotonic() - t_start
            db = open_index_readonly(daemon.index)
            (indexed,) = db.execute("SELECT count(*) FROM checkpoints WHERE state = 'complete'").fetchone()
            db.close()
            if indexed != n:
                raise RuntimeError(f"daemon indexed {indexed} of {n} checkpoints")
            jobs_cpu0 = read_proc_cpu_seconds(daemon.pid)
            time.sleep(max(0.0, warmup - (time.monotonic() - t_start)))
            deadline = time.monotonic() + 600
            while daemon.log.read_text().count('"event": "job finished"') < (2 if not cfg.tiny else 0):
                if time.monotonic() > deadline:  # the first retention and reap passes are done
                    raise RuntimeError("the daemon's first retention and reap passes did not finish")
                time.sleep(0.5)
            time.sleep(cfg.pick(5.0, 5.0, 0.0))
            cpu0, t0 = read_proc_cpu_seconds(daemon.pid), time.monotonic()
            jobs_cpu = cpu0 - jobs_cpu0
            rss_peak = 0
            while time.monotonic() - t0 < window:
                time.sleep(min(1.0, window / 10))
                rss_peak = max(rss_peak, read_proc_rss_bytes(daemon.pid))
            cpu1, t1 = read_proc_cpu_seconds(daemon.pid), time.monotonic()
        cfg.log(f"initial scan of {n} checkpoints took {ready_after:.1f} s")
    share = (cpu1 - cpu0) / (t1 - t0) * 100
    rss = rss_peak / 2**20
    return [
        Row(
            metric=f"idle daemon, {n} checkpoints: CPU over {window:.0f} s",
            baseline=None,
            ours=share,
            unit="%",
            target="<= 0.2 % of a core",
            ok=share <= 0.2,
            note=f"{cpu1 - cpu0:.3f} CPU-s in {t1 - t0:.0f} s, between scheduled jobs; the first retention + "
            f"reap passes before the window took {jobs_cpu:.1f} CPU-s (a pass syncs the runs the watcher "
            f"queued, not the whole hot tier); "
            f"initial scan took {ready_after:.0f} s",
        ),
        Row(
            metric=f"idle daemon, {n} checkpoints: RSS",
            baseline=None,
            ours=rss,
            unit="MiB",
            target="<= 80 MB (76.3 MiB)",
            ok=rss_peak <= 80e6,
        ),
    ]
