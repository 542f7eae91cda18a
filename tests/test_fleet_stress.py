"""The fleet stress mode (``tests/stress_fleet.py``, issue #14) at CI size: a few node processes,
two rounds, a fixed seed — kill -9 at crash points and at random instants, one orphan killed with
its multipart upload in flight, the same run name on every node. The checker reads the store's own
listings; every invariant of #14's Done-when must hold, and the run must actually have done what
it claims (kills, an orphan with litter, its cleanup, kept checkpoints verified).

Lease holders are not stopped past the TTL here (``--stall-chance 0``: each stop costs
``lease_ttl`` + 1.5 s); a stop between the holder's last renewal and the end of its delete is
what per-item claims cover (README "Reliability"). ``test_fleet_lease.py`` and
``test_fleet_adopt.py`` cover the lease-loss and claim cases deterministically. An orphan dies
with copies the fleet's rules expire: their adoption is checked exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
from stress_fleet import Fleet, parser, run_stress

from ckptkeeper.core.model import MANIFEST_SUFFIX


@pytest.mark.slow
def test_fleet_stress_small(tmp_path: Path, s3_reset: str) -> None:
    cli = "--nodes 4 --rounds 2 --seed 7 --parallel 4 --kill-chance 0.6 --stall-chance 0 --orphan-after 6"
    args = parser().parse_args(cli.split(" "))
    fig = run_stress(tmp_path, s3_reset, "fleet-stress", args)
    assert fig.violations == []
    assert fig.orphans == 1 and fig.orphan_litter >= 1 and fig.cleanup_events >= 1, fig
    assert fig.adopt_expected >= 1 and fig.adopted_events >= fig.adopt_expected, (
        fig
    )  # the orphan's extra steps
    assert fig.killed_crash_point + fig.killed_timed >= 1, fig
    assert fig.kept_checked > 0 and fig.objects_hashed > 0 and fig.keys_diffed > 0, fig


def test_the_checker_sees_each_kind_of_violation(tmp_path: Path, s3_reset: str) -> None:
    """The checker is what makes the stress run mean something: each invariant, broken behind the
    nodes' backs in the store, is reported."""
    args = parser().parse_args(
        ["--nodes", "2", "--rounds", "1", "--seed", "3", "--kill-chance", "0", "--stall-chance", "0"]
    )
    fleet = Fleet(tmp_path, s3_reset, "fleet-check", args)
    fleet.store.client.create_bucket(Bucket="fleet-check")
    fleet.round(0)
    assert fleet.fig.violations == [] and fleet.fig.kept_checked > 0
    s3, bucket = fleet.store.client, "fleet-check"
    ours = f"ckpt/node-00/exp/checkpoint-100{MANIFEST_SUFFIX}"
    theirs = f"ckpt/node-01/exp/checkpoint-100{MANIFEST_SUFFIX}"
    body = fleet.store.get(ours)

    before = fleet.store.objects()
    s3.delete_object(Bucket=bucket, Key=ours)  # a kept copy of node-00 gone while node-00 ran no pass
    s3.put_object(Bucket=bucket, Key=theirs, Body=body)  # node-01's manifest now names node-00
    s3.put_object(Bucket=bucket, Key="ckpt/exp/checkpoint-100/model.bin", Body=b"x")  # outside any node
    fleet.check_owner_deletes(before, fleet.store.objects(), ran=set(), where="t")
    fleet.check_cold("t")
    got = "\n".join(fleet.fig.violations)
    assert f"t: {ours} of node-00 deleted while node-00 ran no pass" in got
    assert f"t: {theirs} of node-01 overwritten while node-01 ran no pass" in got
    assert "t: node-00 exp/checkpoint-100 kept by policy: cold copy no manifest" in got
    assert f"t: {theirs} under node-01's prefix names node 'node-00'" in got
    assert "t: ckpt/exp/checkpoint-100/model.bin written outside any node's prefix" in got

    from stress_fleet_adopt import check_adoption  # an orphan whose expired copies nobody adopted

    gone = fleet.nodes[1]
    gone.dead = True
    fleet._committed[gone.name] = {
        k for k in fleet.store.objects() if k.startswith("ckpt/node-01/") and k.endswith(MANIFEST_SUFFIX)
    }
    check_adoption(fleet, 0)  # a policy keeping nothing: every copy of node-01 is expired
    got = "\n".join(fleet.fig.violations)
    assert "orphan node-01: ckpt/node-01/exp/checkpoint-100 adopted 0 times (want exactly once)" in got
