"""ckptkeeper's side-by-side performance harness: ``python -m bench [--quick] [--json]``.

One module per benchmark, each exposing ``run(cfg) -> list[Row]``; :mod:`bench.__main__` runs
them in order and prints one table (metric, baseline, ckptkeeper, ratio, target, result).
"""

BENCHMARKS = (
    "tier_move",
    "daemon_move",
    "s3_transfer",
    "upload_resume",
    "prune_e2e",
    "restore_s3",
    "restore_paced",
    "upload_s3",
    "restore_daemon",
    "hook_latency",
    "planning",
    "daemon_idle",
    "trainer_slowdown",
    "campaign",
    "fleet",
    "job_end",
    "prestage",
    "history",
    "dedup",
    "compression",
)
"""Run order: I/O-heavy first (a quiet machine), then the latency and CPU-share measurements."""
