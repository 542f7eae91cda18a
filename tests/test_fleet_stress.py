"""The fleet stress mode (``tests/stress_fleet.py``, issue #14) at CI size: a few node processes,
two rounds, a fixed seed — kill -9 at crash points and at random instants, one orphan killed with
its multipart upload in flight, lease holders stopped past the lease TTL, the same run name on
every node. The checker reads the store's own listings; every invariant of #14's Done-when must
hold, and the run must actually have done what it claims (kills, an orphan with litter, its
cleanup, kept checkpoints verified)."""

from __future__ import annotations

from pathlib import Path

import pytest
from stress_fleet import parser, run_stress


@pytest.mark.slow
def test_fleet_stress_small(tmp_path: Path, s3_reset: str) -> None:
    cli = "--nodes 4 --rounds 2 --seed 7 --parallel 4 --kill-chance 0.6 --stall-chance 1 --orphan-after 6"
    args = parser().parse_args(cli.split(" "))
    fig = run_stress(tmp_path, s3_reset, "fleet-stress", args)
    assert fig.violations == []
    assert fig.orphans == 1 and fig.orphan_litter >= 1 and fig.cleanup_events >= 1, fig
    assert fig.killed_crash_point + fig.killed_timed >= 1, fig
    assert fig.kept_checked > 0 and fig.objects_hashed > 0 and fig.keys_diffed > 0, fig
