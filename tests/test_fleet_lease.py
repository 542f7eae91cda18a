"""The fleet lease by S3 conditional writes, node heartbeats, cleanup by the lease holder and the
``fleet`` command (docs/design.md, "Many nodes"), against a real S3 endpoint (moto over HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, manifest_of, s3_tier, write_config

from ckptkeeper.actions import fleet as fleet_action
from ckptkeeper.config import load_settings
from ckptkeeper.core.model import TierPolicy, TierSpec
from ckptkeeper.fleet.cleanup import clean_gone_nodes, gone_nodes
from ckptkeeper.fleet.lease import Lease, LeaseInfo, Step, decide, probe_conditional_writes, read_lease
from ckptkeeper.fleet.nodes import NodeBeat, fleet_view, read_beats, write_beat
from ckptkeeper.hook.protocol import STAGING_MARK
from ckptkeeper.index import Index
from ckptkeeper.storage import LocalTierStorage, TierStorage, s3_transfer

MiB = 2**20
T = 1_800_000_000.0


@pytest.mark.parametrize(
    ("current", "exists", "step"),
    [
        (None, False, Step.CREATE),
        (None, True, Step.TAKE_OVER),  # unreadable lease: nobody can prove they hold it
        (LeaseInfo("me", 1, T - 10, T + 10), True, Step.RENEW),
        (LeaseInfo("me", 1, T - 10, T - 1), True, Step.RENEW),
        (LeaseInfo("other", 1, T - 10, T + 10), True, Step.WAIT),
        (LeaseInfo("other", 1, T - 10, T), True, Step.TAKE_OVER),
    ],
)
def test_decide(current: LeaseInfo | None, exists: bool, step: Step) -> None:
    assert decide(current, exists, "me", T) is step


def test_gone_nodes_and_fleet_view_are_pure() -> None:
    beats = [
        NodeBeat("a", T - 10, runs_held=2, newest_verified=T - 100),
        NodeBeat("b", T - 5000),
        NodeBeat("me", T - 9000),
    ]
    assert gone_nodes(beats, "me", T, 3600) == ["b"]
    view = fleet_view(beats, [], LeaseInfo("a", 7, T - 60, T + 240), T, 3600)
    rows = {n["node"]: n for n in view["nodes"]}
    assert rows["a"]["rpo_seconds"] == 100 and rows["a"]["runs_held"] == 2 and rows["a"]["gone"] is False
    assert rows["b"]["gone"] is True and rows["b"]["rpo_seconds"] is None
    assert view["lease"] == {"node": "a", "pid": 7, "expires": T + 240, "expires_in": 240, "live": True}


def _shared(bucket: str, options: dict[str, Any], node: str) -> Any:
    return TierStorage(TierSpec("cold", f"s3://{bucket}/ckpt", TierPolicy(), options, node=node, shared=True))


def test_lease_by_conditional_writes(s3_bucket: str, s3_storage_options: dict[str, Any]) -> None:
    a = Lease(_shared(s3_bucket, s3_storage_options, "node-a"), "node-a", 60)
    b_now = [time.time()]
    b = Lease(_shared(s3_bucket, s3_storage_options, "node-b"), "node-b", 60, clock=lambda: b_now[0])
    assert probe_conditional_writes(a.tier, "node-a")  # moto enforces If-None-Match
    assert a.acquire() and a.held
    assert not b.acquire() and not b.held
    assert a.acquire()  # renewed (If-Match on its own etag)
    info, _ = read_lease(a.tier)
    assert info is not None and info.node == "node-a"
    b_now[0] = time.time() + 61  # B's view: A's lease has expired
    assert b.acquire() and b.held
    assert not a.acquire()  # A read B's live lease: it waits
    b.release()
    assert a.acquire()  # released: taken at once, no TTL to wait out


def test_two_creators_one_winner(s3_bucket: str, s3_storage_options: dict[str, Any]) -> None:
    tier = _shared(s3_bucket, s3_storage_options, "node-a")
    body = LeaseInfo("node-a", 1, T, T + 60).to_json()
    assert tier.put_fleet_object("lease", body, if_none_match=True)
    assert tier.put_fleet_object("lease", body, if_none_match=True) is None  # 412
    _, etag = read_lease(tier)
    assert tier.put_fleet_object("lease", body, if_match='"stale"') is None
    assert tier.put_fleet_object("lease", body, if_match=etag)


def _node_config(base: Path, name: str, bucket: str, endpoint: str, **fleet: Any) -> Path:
    home = base / name
    (home / "hot").mkdir(parents=True, exist_ok=True)
    cold = {**s3_tier("cold", bucket, endpoint, replicate=True), "shared": True}
    cfg = write_config(
        home / "config.toml",
        index=home / "index.db",
        node=name,
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},  # back-dated mtimes
        tiers=[local_tier("hot", home / "hot", keep_last=5), cold],
    )
    if fleet:
        cfg.write_text(cfg.read_text() + "\n[fleet]\n" + "".join(f'{k} = "{v}"\n' for k, v in fleet.items()))
    return cfg


def _abandoned_copy(tmp_path: Path, bucket: str, options: dict[str, Any], node: str) -> str:
    """An interrupted copy by ``node`` (its process died): a marker and a multipart upload."""
    root = tmp_path / f"src-{node}"
    ckpt = root / "exp" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    (ckpt / "model.bin").write_bytes(os.urandom(11 * MiB))
    m = manifest_of(root, "exp", 1)
    hot = LocalTierStorage(TierSpec("hot", str(root), TierPolicy()), hot=True)
    tier = _shared(bucket, options, node)
    tier.part_size = 5 * MiB
    sink = s3_transfer._S3Sink(tier, "exp/checkpoint-1", m, with_manifest=True)
    reader = hot._open_read("exp/checkpoint-1", "model.bin")
    sink.open_file(m.files[0], reader).write(reader.read(6 * MiB))
    sink.writer._drain(0)
    reader.close()
    return sink.marker


def _uploads(client: Any, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_lease_holder_cleans_a_gone_nodes_litter_exactly_once(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str, s3_storage_options: dict[str, Any]
) -> None:
    now = time.time()
    gone_marker = _abandoned_copy(tmp_path, s3_bucket, s3_storage_options, "node-z")
    skewed_marker = _abandoned_copy(tmp_path, s3_bucket, s3_storage_options, "node-y")
    tier = _shared(s3_bucket, s3_storage_options, "node-a")
    write_beat(tier, "node-z", runs_held=1, checkpoints_held=1, newest_verified=None, now=now - 7200)
    later = now + 3700  # the store's clock then: both markers are older than heartbeat_ttl; both
    # heartbeat objects are older than orphan_after, though node-y's says (by its clock, which runs
    # an hour ahead) it passed just now: what a heartbeat says is its own clock, and decides nothing
    write_beat(tier, "node-y", runs_held=1, checkpoints_held=1, newest_verified=None, now=later)
    assert len(_uploads(s3_client, s3_bucket)) == 2
    notes = {}
    for name in ("node-a", "node-b"):
        cfg = _node_config(tmp_path, name, s3_bucket, s3_reset, orphan_after="1h", heartbeat_ttl="5m")
        settings = load_settings(cfg)
        with Index(settings.index) as ix:
            notes[name] = fleet_action.after_pass(settings, ix, now=later)
    cleaned = [n for n in notes["node-a"] + notes["node-b"] if "lease holder" in n]
    # the marker's discard aborts the upload under its target: one cleanup, reported once (an
    # "aborted" note for the same upload again was a second, empty claim — fleet stress mode)
    assert len(cleaned) == 2, cleaned
    assert "discarded node-y/exp/checkpoint-1.ckptkeeper-tmp-" in cleaned[0], cleaned
    assert "discarded node-z/exp/checkpoint-1.ckptkeeper-tmp-" in cleaned[1], cleaned
    assert notes["node-b"] == []  # nothing left for the second node: cleaned once
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert gone_marker not in keys and skewed_marker not in keys
    assert _uploads(s3_client, s3_bucket) == []
    info, _ = read_lease(tier)
    assert info is not None and info.expires == 0.0  # released after the pass
    beats, _ = read_beats(tier)
    assert {b.node for b in beats} == {"node-a", "node-b", "node-y", "node-z"}


def test_no_conditional_writes_no_fleet_deletes(
    tmp_path: Path,
    s3_bucket: str,
    s3_client: Any,
    s3_reset: str,
    s3_storage_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store that ignores If-None-Match: the probe says so, one warning, no lease, no cleanup."""
    from ckptkeeper.storage.s3 import S3TierStorage

    original = S3TierStorage.put_fleet_object

    def unconditional(self: Any, name: str, body: bytes, **_: Any) -> str | None:
        return original(self, name, body)

    monkeypatch.setattr(S3TierStorage, "put_fleet_object", unconditional)
    monkeypatch.setattr(fleet_action, "_CONDITIONAL", {})
    now = time.time()
    marker = _abandoned_copy(tmp_path, s3_bucket, s3_storage_options, "node-z")
    write_beat(
        _shared(s3_bucket, s3_storage_options, "x"),
        "node-z",
        runs_held=0,
        checkpoints_held=0,
        newest_verified=None,
        now=now - 7200,
    )
    settings = load_settings(_node_config(tmp_path, "node-a", s3_bucket, s3_reset, orphan_after="1h"))
    with Index(settings.index) as ix:
        notes = fleet_action.after_pass(settings, ix, now=now + 3600)
    assert notes == [f"cold: {fleet_action.NO_CONDITIONAL_WRITES}"]
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert marker in keys and not any(k.endswith("/lease") for k in keys)
    assert len(_uploads(s3_client, s3_bucket)) == 1


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_fleet_command_shows_every_node(tmp_path: Path, s3_bucket: str, s3_reset: str) -> None:
    configs = {}
    for name in ("node-a", "node-b"):
        configs[name] = _node_config(tmp_path, name, s3_bucket, s3_reset)
        ckpt = tmp_path / name / "hot" / f"run-{name}" / "checkpoint-10"
        ckpt.mkdir(parents=True)
        (ckpt / "model.bin").write_bytes(os.urandom(1000))
        (ckpt / "trainer_state.json").write_text("{}")
        old = time.time() - 600
        for p in (ckpt / "model.bin", ckpt / "trainer_state.json", ckpt):
            os.utime(p, (old, old))
        done = _cli(configs[name], "prune")
        assert done.returncode == 0, done.stderr
    c = _node_config(tmp_path, "node-c", s3_bucket, s3_reset)
    shown = _cli(c, "fleet", "--json")
    assert shown.returncode == 0, shown.stderr
    (t,) = json.loads(shown.stdout)["tiers"]
    rows = {n["node"]: n for n in t["nodes"]}
    assert set(rows) == {"node-a", "node-b"}
    for n in rows.values():
        assert n["runs_held"] == 1 and n["checkpoints_held"] == 1 and n["gone"] is False
        assert 500 < n["rpo_seconds"] < 3600  # the newest verified copy was written ~10 minutes ago
        assert n["last_pass_age"] < 600
    assert t["lease"] is None or t["lease"]["live"] is False
    text = _cli(configs["node-a"], "fleet")
    assert text.returncode == 0, text.stderr
    assert "node-a (this node)" in text.stdout and "node-b" in text.stdout and "lease held by" in text.stdout
    alone = _cli(tmp_path / "node-a" / "config.toml", "fleet")
    assert alone.returncode == 0
    assert STAGING_MARK not in shown.stdout


def test_two_machines_with_one_node_name_are_a_config_error(
    tmp_path: Path, s3_bucket: str, s3_reset: str, s3_storage_options: dict[str, Any]
) -> None:
    from ckptkeeper.fleet.nodes import NodeClash, name_clash

    def beat(host: str, keeper: str = "", stored_at: float | None = T - 10) -> NodeBeat:
        return NodeBeat("n", 0.0, host=host, keeper=keeper, stored_at=stored_at)

    assert name_clash(beat("box-1"), "box-2:/i.db", "cold", T, 3600) is not None  # an older writer: its host
    assert name_clash(beat("box-1"), "box-1:/i.db", "cold", T, 3600) is None
    assert name_clash(beat("box-1", "box-1:/a.db"), "box-1:/b.db", "cold", T, 3600) is not None  # two indexes
    assert (
        name_clash(beat("box-1", stored_at=T - 7200), "box-2:/i.db", "cold", T, 3600) is None
    )  # moved long ago
    tier = _shared(s3_bucket, s3_storage_options, "node-a")
    other = NodeBeat("node-a", time.time(), host="some-other-box", keeper="some-other-box:/var/index.db")
    tier.put_fleet_object("nodes/node-a.json", other.to_json())
    settings = load_settings(_node_config(tmp_path, "node-a", s3_bucket, s3_reset))
    with Index(settings.index) as ix, pytest.raises(NodeClash) as err:
        fleet_action.before_pass(settings, ix)  # checked before the pass writes its heartbeat
    assert str(err.value).startswith("node: node name 'node-a' is also used by another keeper")
    assert "some-other-box:/var/index.db" in str(err.value)


def test_a_holder_whose_lease_was_taken_over_stops_cleaning(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_storage_options: dict[str, Any]
) -> None:
    """Lease expiry mid-cleanup (the fleet stress mode stops the holder past lease_ttl): another
    node took the lease over, cleaned and released it; the first holder wakes up with a stale
    listing and must not clean again — not even by taking the released lease back."""
    marker = _abandoned_copy(tmp_path, s3_bucket, s3_storage_options, "node-z")
    later = time.time() + 3700
    a = Lease(_shared(s3_bucket, s3_storage_options, "node-a"), "node-a", 60)
    b = Lease(_shared(s3_bucket, s3_storage_options, "node-b"), "node-b", 60, clock=lambda: later)
    assert a.acquire() and a.renew()  # renewing our own lease works
    assert b.acquire()  # A stalled past its TTL: B takes over ...
    b.release()  # ... and is done
    report = clean_gone_nodes(a.tier, a, ["node-z"], later, 300.0)
    assert report.lost_lease and report.discarded == [] and report.aborted == []
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert marker in keys and len(_uploads(s3_client, s3_bucket)) == 1
    assert not a.renew() and a.acquire()  # a new pass may take the released lease back


def test_a_delete_that_outlived_the_lease_is_reported_and_cleaning_stops(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_storage_options: dict[str, Any]
) -> None:
    """The window no lease closes on S3 (deletes carry no fencing token): the holder renewed, then
    was stalled past lease_ttl inside the delete. It cannot undo the delete; it says so and stops
    (the fleet stress mode saw one marker discarded by both holders, 0.7 s apart)."""
    _abandoned_copy(tmp_path, s3_bucket, s3_storage_options, "node-z")
    _abandoned_copy(tmp_path / "second", s3_bucket, s3_storage_options, "node-z")  # same key: one marker each
    later = time.time() + 3700
    ticks = iter([later, later])  # acquire, renew; every later reading is past the TTL
    a = Lease(
        _shared(s3_bucket, s3_storage_options, "node-a"), "node-a", 60, clock=lambda: next(ticks, later + 61)
    )
    assert a.acquire()
    report = clean_gone_nodes(a.tier, a, ["node-z"], later, 300.0)
    assert report.lost_lease and len(report.discarded) == 1 and report.late == report.discarded
    markers = [
        o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"] if STAGING_MARK in o["Key"]
    ]
    assert len(markers) == 1  # the second item is left for the next holder
