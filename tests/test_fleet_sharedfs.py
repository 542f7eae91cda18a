"""A shared hot filesystem (docs/design.md, "Many nodes", the second topology): several keepers — real node
processes, each with its own config, index and ``node`` — see one hot directory (``shared = true``);
exactly one, the holder of the tier's lease, acts on it; the others only catalog and say so.

Counted from what users see: the hot directory's entries, the bucket's own listing (manifests and
their bytes), ``prune --json`` (actions, notes, exit codes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from builders import hf_checkpoint, local_tier, run_cli, s3_tier, start_cli, write_config

from ckptkeeper.config import load_settings
from ckptkeeper.core.model import MANIFEST_SUFFIX
from ckptkeeper.fleet.lease import Lease, LeaseInfo, read_lease
from ckptkeeper.fleet.nodes import NodeBeat, name_clash
from ckptkeeper.fleet.sharedfs import catalog_only_note, owned_by_the_tier
from ckptkeeper.storage.local_fleet import LocalFleetObjects

STEPS = [100, 200, 300, 400]


def _node(
    base: Path,
    name: str,
    hot: Path,
    *,
    bucket: str | None = None,
    endpoint: str | None = None,
    lease_ttl: str = "10m",
    home: str | None = None,
    daemon: dict[str, Any] | None = None,
) -> Path:
    """Node ``name``'s config: the shared hot dir ``hot`` (keep_last=1), and a slower tier: a
    replicate cold tier in the shared bucket, or (no bucket) a warm directory of its own."""
    own = base / (home or name)
    own.mkdir(parents=True, exist_ok=True)
    if bucket is not None and endpoint is not None:
        slower = s3_tier("cold", bucket, endpoint, replicate=True, shared=True)
    else:
        (own / "warm").mkdir(exist_ok=True)
        slower = local_tier("cold", own / "warm", replicate=True)
    return write_config(
        own / "config.toml",
        index=own / "index.db",
        node=name,
        fleet={"lease_ttl": lease_ttl},
        daemon=daemon
        or {"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": "", "retention_interval": "2s"},
        tiers=[local_tier("hot", hot, keep_last=1, shared=True), slower],
    )


def _payloads(hot: Path) -> dict[int, bytes]:
    out = {}
    for step in STEPS:
        out[step] = os.urandom(20_000 + step)
        hf_checkpoint(hot / "exp", step, out[step])
    return out


def _manifests(client: Any, bucket: str) -> dict[str, dict[str, Any]]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            if o["Key"].endswith(MANIFEST_SUFFIX):
                out[o["Key"]] = json.loads(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
    return out


def _cold_bytes(client: Any, bucket: str, manifest_key: str) -> bytes:
    base = manifest_key[: -len(MANIFEST_SUFFIX)]
    return bytes(client.get_object(Bucket=bucket, Key=f"{base}/model.bin")["Body"].read())


def _hot_steps(hot: Path) -> list[str]:
    return sorted(p.name for p in (hot / "exp").iterdir() if not p.name.startswith("."))


def test_three_nodes_one_hot_dir_exactly_one_acts(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    hot = tmp_path / "shared-hot"
    payloads = _payloads(hot)
    configs = {
        n: _node(tmp_path, n, hot, bucket=s3_bucket, endpoint=s3_reset)
        for n in ("node-a", "node-b", "node-c")
    }

    procs = {n: start_cli(c, "prune", "--json") for n, c in configs.items()}  # all at once
    docs = {}
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (n, err)
        docs[n] = json.loads(out)
    actors = [n for n, d in docs.items() if d["result"]["done"]]
    assert len(actors) == 1, {n: (d["result"]["done"], d["notes"]) for n, d in docs.items()}
    holder = actors[0]
    for n, d in docs.items():
        if n == holder:
            continue
        assert d["actions"] == []
        note = next(x for x in d["notes"] if x.startswith("hot is shared:"))
        assert note.startswith(f"hot is shared: {holder} holds the lease (expires in ")
        assert note.endswith("); this node only catalogs")

    # Each checkpoint copied exactly once (by the holder, under its prefix), the older three
    # removed from hot exactly once; the bytes in cold are the bytes written.
    manifests = _manifests(s3_client, s3_bucket)
    assert sorted(m["step"] for m in manifests.values()) == STEPS
    assert {m["node"] for m in manifests.values()} == {holder}
    for key, m in manifests.items():
        assert _cold_bytes(s3_client, s3_bucket, key) == payloads[m["step"]]
    assert _hot_steps(hot) == ["checkpoint-400"]

    # A second round, one node after the other: still only the holder acts (it renews; the others
    # see it live), in text as in JSON; their passes catalog what the holder did.
    for n, c in configs.items():
        again = run_cli(c, "prune", "--dry-run")
        assert again.returncode == 0, again.stderr
        if n != holder:
            assert f"hot is shared: {holder} holds the lease" in again.stdout
            assert "this node only catalogs" in again.stdout
        real = run_cli(c, "prune", "--json")
        assert real.returncode == 0, real.stderr
        assert json.loads(real.stdout)["actions"] == []
    assert len(_manifests(s3_client, s3_bucket)) == len(STEPS)
    # ls on every node catalogs the shared dir (its .ckptkeeper directory is not a run); restore of
    # a demoted step works from every node (from the holder's copy in the bucket)
    for n, c in configs.items():
        ls = run_cli(c, "ls", "--json")
        assert ls.returncode == 0, ls.stderr
        runs = {r["name"]: r for r in json.loads(ls.stdout)["runs"]}
        assert list(runs) == ["exp"]
        assert "hot" in next(x for x in runs["exp"]["checkpoints"] if x["step"] == 400)["tiers"]
        dest = tmp_path / f"restored-{n}"
        got = run_cli(c, "restore", "exp", "--step", "100", "--to", str(dest))
        assert got.returncode == 0, (n, got.stdout, got.stderr)
        assert (dest / "checkpoint-100" / "model.bin").read_bytes() == payloads[100]

    fleet = run_cli(configs["node-b"], "fleet", "--json")
    assert fleet.returncode == 0, fleet.stderr
    hot_view = next(t for t in json.loads(fleet.stdout)["tiers"] if t["tier"] == "hot")
    assert hot_view["lease"]["node"] == holder and hot_view["lease"]["live"]
    assert {n["node"] for n in hot_view["nodes"]} == set(configs)


def test_holder_killed_mid_pass_another_takes_over_after_expiry(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    hot = tmp_path / "shared-hot"
    payloads = _payloads(hot)
    a = _node(tmp_path, "node-a", hot, bucket=s3_bucket, endpoint=s3_reset, lease_ttl="5s")
    b = _node(tmp_path, "node-b", hot, bucket=s3_bucket, endpoint=s3_reset, lease_ttl="5s")

    # A takes the lease and is killed (SIGKILL) in the middle of its second copy.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    env["CKPTKEEPER_TEST_CRASH_AFTER"] = "6"
    killed = subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(a), "prune"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr

    lease_key = next(k for k in _keys(s3_client, s3_bucket) if "/.ckptkeeper/leases/hot-" in k)
    info = LeaseInfo.parse(s3_client.get_object(Bucket=s3_bucket, Key=lease_key)["Body"].read())
    assert info is not None and info.node == "node-a"

    acted = 0
    if time.time() < info.expires - 1:  # still live: B only catalogs (nothing wrong: exit 0)
        early = run_cli(b, "prune", "--json")
        assert early.returncode == 0, early.stderr
        doc = json.loads(early.stdout)
        acted += doc["result"]["done"]
        if time.time() < info.expires - 1:  # the run did not outlast the lease either
            assert doc["actions"] == []
            assert any(n.startswith("hot is shared: node-a holds the lease") for n in doc["notes"])

    while time.time() <= info.expires:  # the lease's own expiry, not a guess
        time.sleep(0.2)
    done = run_cli(b, "prune", "--json")
    assert done.returncode == 0, done.stderr
    acted += json.loads(done.stdout)["result"]["done"]
    assert acted  # B took over (in this run, or in the one above if A's lease expired during it)

    # Nothing lost: every step has a whole, byte-identical copy in cold; hot keeps only the newest.
    manifests = _manifests(s3_client, s3_bucket)
    assert {m["step"] for m in manifests.values()} == set(STEPS)
    for key, m in manifests.items():
        assert _cold_bytes(s3_client, s3_bucket, key) == payloads[m["step"]]
    assert _hot_steps(hot) == ["checkpoint-400"]
    verify = run_cli(b, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _keys(client: Any, bucket: str) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def test_file_lease_without_a_bucket_one_acts(tmp_path: Path) -> None:
    """No shared S3 tier: the lease is a file in the shared filesystem itself."""
    hot = tmp_path / "shared-hot"
    _payloads(hot)
    configs = {n: _node(tmp_path, n, hot) for n in ("node-a", "node-b")}
    procs = {n: start_cli(c, "prune", "--json") for n, c in configs.items()}
    docs = {}
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (n, err)
        docs[n] = json.loads(out)
    actors = [n for n, d in docs.items() if d["result"]["done"]]
    assert len(actors) == 1, docs
    other = next(n for n in docs if n not in actors)
    assert any(x.startswith(f"hot is shared: {actors[0]} holds the lease") for x in docs[other]["notes"])
    leases = list((hot / ".ckptkeeper" / "leases").iterdir())
    assert [p.name.startswith("hot-") for p in leases] == [True]
    warm_a = sorted(p.name for p in (tmp_path / actors[0] / "warm" / "exp").iterdir() if p.is_dir())
    assert warm_a == [f"checkpoint-{s}" for s in STEPS]
    assert not (tmp_path / other / "warm" / "exp").exists()
    assert _hot_steps(hot) == ["checkpoint-400"]

    # status shows the shared tier's keepers (their heartbeats in the shared dir) and the lease
    st = run_cli(configs[other], "status", "--json")
    assert st.returncode == 0, st.stderr
    (view,) = json.loads(st.stdout)["shared_fs"]
    assert view["tier"] == "hot" and view["lease"]["node"] == actors[0] and view["lease"]["live"]
    assert {n["node"] for n in view["nodes"]} == set(configs)
    assert view["lease_at"].startswith(f"file {hot / '.ckptkeeper' / 'leases' / 'hot-'}")
    text = run_cli(configs[other], "status")
    assert f"shared tier hot: {actors[0]} holds the lease (expires in " in text.stdout


def test_lease_must_outlive_the_pass_interval(tmp_path: Path) -> None:
    """The holder renews its lease once per pass: a TTL the pass interval outlasts is a config error."""
    cfg = write_config(
        tmp_path / "c.toml",
        index=tmp_path / "i.db",
        fleet={"lease_ttl": "5m"},
        tiers=[local_tier("hot", tmp_path, shared=True)],
    )
    result = run_cli(cfg, "ls")
    assert result.returncode == 2, result.stderr
    assert "fleet.lease_ttl (5m) must be longer than daemon.retention_interval (5m)" in result.stderr


def test_an_unset_lease_ttl_outlives_three_passes_on_a_shared_local_tier(tmp_path: Path) -> None:
    """The defaults work as they are: with no ``fleet.lease_ttl`` a shared local tier's lease lasts
    three pass intervals (15m at the 5m default), so the holder keeps it between passes."""
    cfg = write_config(
        tmp_path / "c.toml", index=tmp_path / "i.db", tiers=[local_tier("hot", tmp_path, shared=True)]
    )
    assert run_cli(cfg, "ls").returncode == 0
    assert load_settings(cfg).fleet.lease_ttl == 900.0
    cfg = write_config(
        tmp_path / "d.toml",
        index=tmp_path / "i.db",
        daemon={"retention_interval": "10m"},
        tiers=[local_tier("hot", tmp_path, shared=True)],
    )
    assert load_settings(cfg).fleet.lease_ttl == 1800.0
    plain = write_config(tmp_path / "e.toml", index=tmp_path / "i.db", tiers=[local_tier("hot", tmp_path)])
    assert load_settings(plain).fleet.lease_ttl == 300.0  # no shared local tier: the fleet default


def test_same_node_name_on_one_shared_tier_exits_2(tmp_path: Path) -> None:
    hot = tmp_path / "shared-hot"
    _payloads(hot)
    first = _node(tmp_path, "n1", hot, home="machine-1")
    second = _node(tmp_path, "n1", hot, home="machine-2")
    ok = run_cli(first, "prune", "--dry-run")
    assert ok.returncode == 0, ok.stderr
    ok = run_cli(first, "prune")  # writes its heartbeat in the shared dir
    assert ok.returncode == 0, ok.stderr
    for args in (("prune",), ("prune", "--dry-run")):
        clash = run_cli(second, *args)
        assert clash.returncode == 2, clash.stdout + clash.stderr
        assert "node: node name 'n1' is also used by another keeper on shared tier 'hot'" in clash.stderr
    daemon = run_cli(second, "daemon", timeout=120)  # the daemon refuses to start too
    assert daemon.returncode == 2, daemon.stdout + daemon.stderr
    assert "node: node name 'n1' is also used by another keeper" in daemon.stderr
    again = run_cli(first, "prune")  # the first keeper is itself, not a clash
    assert again.returncode == 0, again.stderr


# --------------------------------------------------------------------------------------------
# the file lease's conditional writes, and the pure rules


def test_local_fleet_objects_conditional_writes(tmp_path: Path) -> None:
    store = LocalFleetObjects(tmp_path, "hot")
    first = store.put_fleet_object("leases/x", b"one", if_none_match=True)
    assert first is not None
    assert store.put_fleet_object("leases/x", b"two", if_none_match=True) is None
    assert store.get_fleet_object("leases/x") == (b"one", first)
    assert store.put_fleet_object("leases/x", b"three", if_match="not-the-etag") is None
    assert store.get_fleet_object("leases/x") == (b"one", first)  # put back untouched
    second = store.put_fleet_object("leases/x", b"four", if_match=first)
    assert second is not None and store.get_fleet_object("leases/x") == (b"four", second)
    assert store.put_fleet_object("leases/x", b"five", if_match=first) is None  # stale etag
    assert store.put_fleet_object("leases/y", b"z", if_match=first) is None  # absent
    assert [n for n, _ in store.list_fleet_objects("leases")] == ["x"]  # no temp files left


def test_lease_rules_over_a_file() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sharedhot-") as d:
        store = LocalFleetObjects(Path(d), "hot")
        clock = [time.time()]  # the filesystem's clock (it dates the lease file), moved on by hand
        a = Lease(store, "node-a", 30.0, clock=lambda: clock[0], name="leases/hot-1")
        b = Lease(store, "node-b", 30.0, clock=lambda: clock[0], name="leases/hot-1")
        assert a.acquire() and not b.acquire()
        clock[0] += 20
        assert a.renew() and not b.acquire()  # renewed: still live for B
        clock[0] += 31
        assert b.acquire()  # expired: taken over
        assert not a.renew()  # the stalled holder finds out and stops
        info, _ = read_lease(store, "leases/hot-1")
        assert info is not None and info.node == "node-b"


def test_catalog_only_note_and_keeper_clash() -> None:
    lease = LeaseInfo("node-b", 7, 0.0, 142.0)
    assert catalog_only_note("hot", lease, 100.0) == (
        "hot is shared: node-b holds the lease (expires in 42s); this node only catalogs"
    )
    beat = NodeBeat(node="n1", last_pass=100.0, keeper="h1:/a/index.db", stored_at=100.0)
    assert name_clash(beat, "h1:/a/index.db", "hot", 110.0, 3600.0) is None
    msg = name_clash(beat, "h2:/a/index.db", "hot", 110.0, 3600.0)
    assert msg is not None and msg.startswith("node: node name 'n1' is also used by another keeper")
    assert name_clash(beat, "h2:/a/index.db", "hot", 100.0 + 3601.0, 3600.0) is None  # moved long ago


@pytest.mark.parametrize("tier", ["warm", "cold"])
def test_copies_on_a_shared_fs_belong_to_the_tier(tier: str) -> None:
    """A copy in a shared filesystem tier written by another node is the tier's (the lease holder
    acts on it); in any other tier it stays its writer's."""
    from builders import checkpoint, snapshot

    snap = snapshot(checkpoint("exp", 1, tiers={"warm", "cold"}))
    import dataclasses

    snap = dataclasses.replace(snap, foreign={("exp", 1, "warm"): "node-a", ("exp", 1, "cold"): "node-a"})
    out = owned_by_the_tier(snap, {"warm"})
    assert (("exp", 1, tier) in out.foreign) is (tier == "cold")


def test_holder_that_lost_the_lease_stops_before_its_next_action(tmp_path: Path) -> None:
    """A holder stalled past the TTL whose lease another node took over: the executor asks the
    lease before each action on the shared tier, and the pass stops there — nothing moved."""
    from ckptkeeper.actions.prune import make_plan
    from ckptkeeper.actions.sharedfs import open_shared
    from ckptkeeper.executor import Executor
    from ckptkeeper.index import Index
    from ckptkeeper.ingest.catalog import Catalog

    hot = tmp_path / "shared-hot"
    _payloads(hot)
    settings = load_settings(_node(tmp_path, "node-a", hot, lease_ttl="5s"))
    shared = open_shared(settings)
    assert shared is not None
    with Index(Path(settings.index)) as index:
        shared.acquire(dry_run=False, now=time.time())
        Catalog(settings, index).reconcile()
        plan = shared.restrict(make_plan(settings, index))
        assert plan.actions  # node-a holds the lease: it would act
        (tier,) = shared.tiers
        thief = Lease(tier.store, "node-b", 5.0, clock=lambda: time.time() + 60, name=tier.lease_name)
        assert thief.acquire()  # node-a's lease expired (as node-b's clock sees it): taken over
        before = sorted(p.relative_to(hot).as_posix() for p in hot.rglob("*") if ".ckptkeeper" not in p.parts)
        result = Executor(index, settings.tier_specs(), guard=shared.guard).apply(plan)
    assert result.stopped and not result.done and not result.failed
    after = sorted(p.relative_to(hot).as_posix() for p in hot.rglob("*") if ".ckptkeeper" not in p.parts)
    assert after == before
    assert not (tmp_path / "node-a" / "warm" / "exp").exists()
    (note,) = shared.notes
    assert note.startswith("hot is shared: this node lost its lease") and "stopped before copy" in note


def test_new_holder_applies_the_rules_to_copies_the_old_one_wrote(tmp_path: Path) -> None:
    """Hot and warm both on the shared filesystem: node-a demotes into warm (its manifests name
    node-a); once its lease expired node-b holds it, and warm's keep_last=2 applies to node-a's copy
    too — on a shared filesystem a copy is the tier's, not its writer's."""
    shared = tmp_path / "lustre"
    (shared / "warm").mkdir(parents=True)
    configs = {}
    for n in ("node-a", "node-b"):
        (tmp_path / n).mkdir()
        configs[n] = write_config(
            tmp_path / n / "config.toml",
            index=tmp_path / n / "index.db",
            node=n,
            fleet={"lease_ttl": "5s"},
            daemon={
                "settle_seconds": "1s",
                "trust_mtimes": True,
                "metrics_addr": "",
                "retention_interval": "2s",
            },
            tiers=[
                local_tier("hot", shared / "hot", keep_last=1, shared=True),
                local_tier("warm", shared / "warm", keep_last=2, shared=True),
            ],
        )
    for step in (100, 200):
        hf_checkpoint(shared / "hot" / "exp", step, os.urandom(5000 + step))
    first = run_cli(configs["node-a"], "prune", "--json")
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (shared / "warm" / "exp").iterdir() if p.is_dir()) == ["checkpoint-100"]
    manifest = next((shared / "warm" / "exp").glob(f"checkpoint-100{MANIFEST_SUFFIX}"))
    assert json.loads(manifest.read_text())["node"] == "node-a"

    hf_checkpoint(shared / "hot" / "exp", 300, os.urandom(5300), age=1800.0)
    store = LocalFleetObjects(shared / "hot", "hot")
    ((lease_file, _),) = store.list_fleet_objects("leases")
    info, _ = read_lease(store, f"leases/{lease_file}")
    assert info is not None and info.node == "node-a"
    while time.time() <= info.expires:  # the lease's own expiry
        time.sleep(0.2)
    second = run_cli(configs["node-b"], "prune", "--json")
    assert second.returncode == 0, second.stderr
    doc = json.loads(second.stdout)
    assert not [k for k in doc["keep"] if any("not ours" in r for r in k["reasons"])]
    assert sorted(p.name for p in (shared / "warm" / "exp").iterdir() if p.is_dir()) == ["checkpoint-200"]
    assert sorted(p.name for p in (shared / "hot" / "exp").iterdir() if not p.name.startswith(".")) == [
        "checkpoint-300"
    ]


def test_two_daemons_on_one_shared_hot_dir_one_acts(tmp_path: Path) -> None:
    """The daemon's passes go through the same lease: two daemons on one shared hot directory
    (polling, as on NFS), each checkpoint demoted once, by one of them, into its warm tier."""
    from builders import FAST_DAEMON

    hot = tmp_path / "shared-hot"
    payloads = _payloads(hot)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "CKPTKEEPER_"))
    }
    procs = {}
    for n in ("node-a", "node-b"):
        cfg = _node(tmp_path, n, hot, lease_ttl="30s", daemon={**FAST_DAEMON, "polling": True})
        log = (tmp_path / f"{n}.log").open("wb")
        procs[n] = subprocess.Popen(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(cfg), "daemon"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()

    def warm(n: str) -> list[str]:
        d = tmp_path / n / "warm" / "exp"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def done() -> bool:
        return _hot_steps(hot) == ["checkpoint-400"] and sorted(warm("node-a") + warm("node-b")) == [
            f"checkpoint-{s}" for s in STEPS
        ]

    try:
        deadline = time.monotonic() + 120
        while not done() and time.monotonic() < deadline and all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        logs = {n: (tmp_path / f"{n}.log").read_text(errors="replace")[-3000:] for n in procs}
        assert done(), (_hot_steps(hot), warm("node-a"), warm("node-b"), logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {n: p.wait(timeout=60) for n, p in procs.items()}
    assert codes == {"node-a": 0, "node-b": 0}
    # one acted: every checkpoint was copied into exactly one node's warm tier, that node's
    actors = [n for n in procs if warm(n)]
    assert len(actors) == 1, (warm("node-a"), warm("node-b"))
    for step in STEPS:
        got = tmp_path / actors[0] / "warm" / "exp" / f"checkpoint-{step}" / "model.bin"
        assert got.read_bytes() == payloads[step]


def test_daemon_takes_the_lease_before_it_catalogs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's pass right after a takeover: the previous holder (stalled past its lease, its
    last move still in flight) finishes that move the moment this node takes the lease. The
    daemon catalogs after taking the lease, so its plan never names the checkpoint already moved
    and its first pass as holder succeeds. (Cataloging first, the pass planned a copy of
    checkpoint-100 from a hot dir that no longer held it: its copy and delete were planned, then
    skipped by the executor's re-check, "written to since it was cataloged".)"""
    import shutil

    import structlog
    from builders import FAST_DAEMON

    from ckptkeeper.actions.index import open_index
    from ckptkeeper.actions.sharedfs import open_shared
    from ckptkeeper.daemon.service import Daemon

    hot = tmp_path / "shared-hot"
    payloads = _payloads(hot)
    settings = load_settings(
        _node(tmp_path, "node-b", hot, lease_ttl="30s", daemon={**FAST_DAEMON, "polling": True})
    )
    shared = open_shared(settings)
    assert shared is not None
    (tier,) = shared.tiers
    old = Lease(tier.store, "node-a", 30.0, clock=lambda: time.time() - 3600, name=tier.lease_name)
    assert old.acquire()  # node-a's lease, written an hour ago by the filesystem's clock: expired
    then = time.time() - 3600
    os.utime(tier.fs.base / tier.lease_name, (then, then))  # node-b takes it over this pass
    a_warm = tmp_path / "node-a" / "warm" / "exp"
    real_acquire = Lease.acquire

    def old_holders_move_lands(lease: Lease) -> bool:
        """node-a's in-flight move of checkpoint-100 (copied to its warm tier, gone from hot)
        completes right as node-b takes the lease."""
        got = real_acquire(lease)
        if got and lease.node == "node-b" and (hot / "exp" / "checkpoint-100").exists():
            a_warm.mkdir(parents=True, exist_ok=True)
            shutil.copytree(hot / "exp" / "checkpoint-100", a_warm / "checkpoint-100")
            shutil.rmtree(hot / "exp" / "checkpoint-100")
        return got

    monkeypatch.setattr(Lease, "acquire", old_holders_move_lands)
    daemon = Daemon(None, settings)
    daemon.index = open_index(settings)
    try:
        daemon.watcher = daemon._make_watcher(settings)
        daemon.watcher.start(initial_reconcile=True)  # the catalog as it was before the takeover
        try:
            with structlog.testing.capture_logs() as events:
                error = daemon._prune("retention", ("retention", "reap"))
        finally:
            daemon.watcher.stop()
    finally:
        daemon.index.close()
    assert error is None, error
    assert [e for e in events if e["event"] == "action skipped"] == []
    (done,) = [e for e in events if e["event"] == "prune done"]
    assert (done["actions"], done["failed"]) == (5, 0)  # copy 200, 300, 400; drop 200, 300 from hot
    assert _hot_steps(hot) == ["checkpoint-400"]
    b_warm = tmp_path / "node-b" / "warm" / "exp"
    assert sorted(p.name for p in b_warm.iterdir() if p.is_dir()) == [
        "checkpoint-200",
        "checkpoint-300",
        "checkpoint-400",
    ]
    for step in (200, 300, 400):
        assert (b_warm / f"checkpoint-{step}" / "model.bin").read_bytes() == payloads[step]
    assert (a_warm / "checkpoint-100" / "model.bin").read_bytes() == payloads[100]
    info, _etag = read_lease(tier.store, tier.lease_name)
    assert info is not None and info.node == "node-b"
