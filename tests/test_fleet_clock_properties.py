"""Property (docs/design.md, "Cluster reality"; docs/many-nodes-clocks.md): for any clock offset of
any node within ±7 days, no adoption plan deletes a copy its owner's policy keeps, no live node is
judged gone, and no live lease is judged expired.

The decisions are the fleet's own (:func:`ckptkeeper.fleet.adopt.gone_beats`, ``plan_node``,
:func:`ckptkeeper.fleet.lease.read_lease` and ``decide``) over an in-memory store: objects dated by
the store (real time), with bodies the owner and the lease holder wrote by their own clocks, and
``now`` the store's clock, as the fleet's callers pass it. The owner's policy is planned by the
owner at its own clock.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkeeper.core import planner
from ckptkeeper.core.model import (
    ActionKind,
    Checkpoint,
    CheckpointState,
    FileEntry,
    Manifest,
    Snapshot,
    TierPolicy,
    TierSpec,
)
from ckptkeeper.fleet.adopt import gone_beats, plan_node
from ckptkeeper.fleet.lease import Step, decide, read_lease
from ckptkeeper.fleet.nodes import NodeBeat


class _Store:
    """An in-memory shared tier as the fleet functions read it: objects with the store's dates."""

    def __init__(self, spec: TierSpec, copies: list[tuple[str, Manifest, None]]) -> None:
        self.name = spec.name
        self.spec = spec
        self.objects: dict[str, tuple[bytes, str, float]] = {}
        self.copies = copies

    def put(self, name: str, body: bytes, written: float) -> None:
        self.objects[name] = (body, f'"{len(self.objects)}"', written)

    def get_fleet_object_dated(self, name: str) -> tuple[bytes, str, float] | None:
        return self.objects.get(name)

    def get_fleet_object(self, name: str) -> tuple[bytes, str] | None:
        got = self.objects.get(name)
        return None if got is None else (got[0], got[1])

    def list_fleet_objects(self, sub: str) -> list[tuple[str, float]]:
        return [(k[len(sub) + 1 :], v[2]) for k, v in sorted(self.objects.items()) if k.startswith(sub + "/")]

    def adopt(self, node: str) -> _Store:
        return self

    def list_manifests_and_pins(self) -> tuple[list[tuple[str, Manifest, None]], set[tuple[str, str]]]:
        return self.copies, set()


DAY = 86400.0
REAL_NOW = 1_800_000_000.0
offsets = st.floats(min_value=-7 * DAY, max_value=7 * DAY, allow_nan=False)
policies = st.builds(
    TierPolicy,
    keep_last=st.none() | st.integers(1, 4),
    keep_within=st.none() | st.sampled_from([3600.0, DAY, 7 * DAY]),
    keep_daily=st.none() | st.integers(1, 5),
    keep_every=st.none() | st.sampled_from([2, 5]),
)


def _manifest(step: int, created_at: float) -> Manifest:
    files = (FileEntry("model.bin", 10, f"h{step}"),)
    return Manifest("exp", step, f"checkpoint-{step}", "hf", True, files, created_at=created_at, node="owner")


def _owner_keeps(manifests: list[Manifest], spec: TierSpec, owner_clock_now: float) -> set[int]:
    """The steps the owner's own rules keep in the tier, planned by the owner at its own clock."""
    checkpoints = tuple(
        Checkpoint(
            run=m.run,
            step=m.step,
            name=m.name,
            layout=m.layout,
            state=CheckpointState.COMPLETE,
            created_at=m.created_at,
            bytes=10,
            version=m.digest,
            tiers=frozenset({spec.name}),
            committed=True,
        )
        for m in manifests
    )
    plan = planner.plan(Snapshot(runs=(), checkpoints=checkpoints, node="owner"), [spec], {}, owner_clock_now)
    deleted = {a.step for a in plan.actions if a.action is ActionKind.DELETE}
    return {m.step for m in manifests} - deleted


@settings(max_examples=300, deadline=None)
@given(
    owner_offset=offsets,
    holder_offset=offsets,
    silence=st.floats(min_value=0.0, max_value=30 * DAY, allow_nan=False),
    orphan_after=st.sampled_from([3600.0, DAY, 7 * DAY]),
    ages=st.lists(st.floats(min_value=0.0, max_value=60 * DAY, allow_nan=False), min_size=1, max_size=8),
    policy=policies,
)
def test_no_adoption_deletes_what_the_owner_keeps_whatever_the_clocks(
    owner_offset: float,
    holder_offset: float,
    silence: float,
    orphan_after: float,
    ages: list[float],
    policy: TierPolicy,
) -> None:
    heartbeat_real = REAL_NOW - silence  # when the store wrote the owner's last heartbeat
    manifests = [
        _manifest(i + 1, heartbeat_real - age + owner_offset)
        for i, age in enumerate(sorted(ages, reverse=True))
    ]
    spec = TierSpec("cold", "s3://b/ckpt", policy, shared=True)
    store = _Store(spec, [(f"exp/{m.name}", m, None) for m in manifests])
    beat = NodeBeat("owner", last_pass=heartbeat_real + owner_offset)  # by the owner's clock
    store.put("nodes/owner.json", beat.to_json(), heartbeat_real)
    # The holder's own heartbeat, written just now by a holder whose clock is off by holder_offset
    store.put("nodes/holder.json", NodeBeat("holder", REAL_NOW + holder_offset).to_json(), REAL_NOW)

    judged = gone_beats(store, "holder", REAL_NOW, orphan_after)  # type: ignore[arg-type]
    assert [b.node for b in judged] == (["owner"] if silence > orphan_after else [])
    if not judged:
        return  # a live node is never adopted, whatever anyone's clock says
    adoption = plan_node(store, judged[0], REAL_NOW, max_delete=1000)  # type: ignore[arg-type]
    deleted = {a.step for a in adoption.plan.actions}
    owner_keeps = _owner_keeps(manifests, spec, REAL_NOW + owner_offset)
    assert not deleted & owner_keeps, (deleted, owner_keeps)


@settings(max_examples=300, deadline=None)
@given(
    holder_offset=offsets,
    ttl=st.sampled_from([5.0, 30.0, 300.0, 3600.0]),
    elapsed=st.floats(min_value=0.0, max_value=2 * 3600.0, allow_nan=False),
)
def test_a_live_lease_is_never_taken_over_and_a_dead_one_only_waits_its_ttl(
    holder_offset: float, ttl: float, elapsed: float
) -> None:
    written_real = REAL_NOW  # the store's LastModified of the lease
    holder_clock = written_real + holder_offset
    store = _Store(TierSpec("cold", "s3://b/ckpt", TierPolicy()), [])
    body = {"node": "holder", "pid": 1, "acquired": holder_clock, "expires": holder_clock + ttl, "ttl": ttl}
    store.put("lease", json.dumps(body).encode(), written_real)  # as the holder wrote it, by its clock
    seen, etag = read_lease(store)  # type: ignore[arg-type]
    store_now = written_real + elapsed  # the reader judges by the store's clock, whatever its own says
    step = decide(seen, etag is not None, "reader", store_now)
    if elapsed < ttl:
        assert step is Step.WAIT  # live by the store's clock: never two holders
    else:
        assert step is Step.TAKE_OVER  # dead: the others wait one TTL, not the holder's skew
