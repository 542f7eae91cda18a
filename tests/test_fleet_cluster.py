"""Cluster reality on a shared bucket (docs/design.md, "Cluster reality"; docs/many-nodes-clocks.md):
one ``node`` name used by two keepers, and a bucket that stops honouring conditional writes.

Real node processes (their own config, hot dir and index) against one moto bucket, some through
the fault-injecting proxy; counted from the bucket's own listing, exit codes and ``prune --json``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from builders import fleet_node, hf_checkpoint, local_tier, run_cli, s3_tier, write_config
from faultproxy import FaultProxy, Request

from ckptkeeper.core.model import MANIFEST_SUFFIX


def _keys(client: Any, bucket: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


def test_one_node_name_on_two_keepers_of_a_bucket_is_a_config_error(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    """Keeper Y (``node = "gpu-7"``) keeps every copy in the shared bucket; keeper X, another
    machine (here: another index) configured with the same ``node``, keeps 2. X must refuse,
    naming ``node``, before it acts: it would take Y's copies for its own and delete three."""
    y = fleet_node(tmp_path / "y", "gpu-7", s3_bucket, s3_reset, cold_keep_last=None)
    for step in range(1, 6):
        hf_checkpoint(tmp_path / "y" / "gpu-7" / "hot" / "exp", step, f"y-{step}".encode() * 100)
    done = run_cli(y, "prune")
    assert done.returncode == 0, done.stderr
    before = _keys(s3_client, s3_bucket)
    assert len([k for k in before if k.startswith("ckpt/gpu-7/exp/") and k.endswith(MANIFEST_SUFFIX)]) == 5

    x = fleet_node(tmp_path / "x", "gpu-7", s3_bucket, s3_reset, cold_keep_last=2)
    hf_checkpoint(tmp_path / "x" / "gpu-7" / "hot" / "other", 7, b"x" * 100)
    for args in (("prune", "--dry-run"), ("prune",), ("prune", "--json")):
        refused = run_cli(x, *args)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert (
            "node: node name 'gpu-7' is also used by another keeper on shared tier 'cold'" in refused.stderr
        )
        assert "Traceback" not in refused.stderr
    assert _keys(s3_client, s3_bucket) == before  # nothing of Y's touched, nothing of X's written
    assert (tmp_path / "x" / "gpu-7" / "hot" / "other" / "checkpoint-7").is_dir()
    again = run_cli(y, "prune")  # Y itself is not refused: its own heartbeat
    assert again.returncode == 0, again.stderr


def _shared_hot_node(base: Path, name: str, hot: Path, bucket: str, endpoint: str) -> Path:
    own = base / name
    own.mkdir(parents=True, exist_ok=True)
    return write_config(
        own / "config.toml",
        index=own / "index.db",
        node=name,
        fleet={"lease_ttl": "10m"},
        daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": "", "retention_interval": "2s"},
        tiers=[
            local_tier("hot", hot, keep_last=1, shared=True),
            s3_tier("cold", bucket, endpoint, replicate=True, shared=True),
        ],
    )


def test_a_bucket_that_starts_answering_501_to_conditional_puts_moves_the_lease_to_the_filesystem(
    tmp_path: Path, s3_bucket: str, s3_reset: str
) -> None:
    """The shared hot dir's lease lives in the bucket while it honours conditional writes. Mid-run
    the bucket starts answering 501 to every conditional PUT: the lease falls back to the
    filesystem (as when the probe finds no conditional writes), and exactly one keeper acts again —
    not none, each saying the lease is unavailable."""
    refuse = {"on": False}

    def conditional_501(request: Request) -> str | None:
        conditional = any(k.lower() in ("if-none-match", "if-match") for k, _ in request.headers)
        return "not_implemented" if refuse["on"] and request.method == "PUT" and conditional else None

    hot = tmp_path / "shared-hot"
    for step in (100, 200):
        hf_checkpoint(hot / "exp", step, os.urandom(5000))
    with FaultProxy(s3_reset, rate=0.0, rules=[conditional_501]) as proxy:
        a = _shared_hot_node(tmp_path, "node-a", hot, s3_bucket, proxy.url)
        b = _shared_hot_node(tmp_path, "node-b", hot, s3_bucket, proxy.url)
        first = run_cli(a, "prune", "--json")
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["result"]["done"]  # A holds the lease, in the bucket

        refuse["on"] = True
        hf_checkpoint(hot / "exp", 300, os.urandom(5000))
        docs = {}
        for name, cfg in (("node-a", a), ("node-b", b)):
            done = run_cli(cfg, "prune", "--json")
            assert done.returncode == 0, (name, done.stderr)
            docs[name] = json.loads(done.stdout)
    actors = [n for n, d in docs.items() if d["result"]["done"]]
    assert actors == ["node-a"], {n: d["notes"] for n, d in docs.items()}
    assert "does not enforce conditional writes" in done.stderr
    assert not any("lease" in n and "unavailable" in n for d in docs.values() for n in d["notes"])
    note = next(n for n in docs["node-b"]["notes"] if n.startswith("hot is shared:"))
    assert note.startswith("hot is shared: node-a holds the lease"), note
    assert (hot / ".ckptkeeper").is_dir()
    assert sorted(p.name for p in (hot / "exp").iterdir() if not p.name.startswith(".")) == ["checkpoint-300"]


def test_a_keeper_that_probed_before_the_bucket_lost_conditional_writes_falls_back_at_once(
    tmp_path: Path, s3_bucket: str, s3_reset: str
) -> None:
    """The daemon probes a bucket once per process: conditional writes worked then, and the shared
    hot dir's lease lives there. When the bucket starts answering 501 to them, the next pass's
    lease PUT says so: the lease moves to the filesystem in that pass, and the keeper acts."""
    from ckptkeeper.actions.sharedfs import take_shared
    from ckptkeeper.config import load_settings

    refuse = {"on": False}

    def conditional_501(request: Request) -> str | None:
        conditional = any(k.lower() in ("if-none-match", "if-match") for k, _ in request.headers)
        return "not_implemented" if refuse["on"] and request.method == "PUT" and conditional else None

    hot = tmp_path / "shared-hot"
    hf_checkpoint(hot / "exp", 100, os.urandom(5000))
    with FaultProxy(s3_reset, rate=0.0, rules=[conditional_501]) as proxy:
        settings = load_settings(_shared_hot_node(tmp_path, "node-a", hot, s3_bucket, proxy.url))
        first = take_shared(settings)
        assert first is not None
        (tier,) = first.tiers
        assert tier.acting and tier.where == "bucket tier 'cold'", (tier.where, tier.note)
        refuse["on"] = True
        second = take_shared(settings)  # the probe's answer is cached: the lease PUT meets the 501
        assert second is not None
        (tier,) = second.tiers
        assert tier.acting and tier.where.startswith("file "), (tier.where, tier.note)
        assert (hot / ".ckptkeeper" / tier.lease_name).is_file()


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ('request_timeout = "3s"\n', "no answer within request_timeout (3s); the request hung"),
        ('pass_timeout = "2s"\n', "the pass reached pass_timeout; stopped"),
    ],
    ids=["request_timeout", "pass_timeout"],
)
def test_a_black_holed_request_ends_the_pass_with_exit_1_naming_it_and_the_next_pass_runs(
    settings: str, said: str, tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    """The store never answers the GET of this node's heartbeat. The pass does not wait forever:
    past ``request_timeout`` (or the pass's own ``pass_timeout``) the request is cancelled, the
    pass stops cleanly and exits 1 naming it; with the store answering again, the next pass does
    the work."""
    hold = {"on": True}

    def black_hole(request: Request) -> str | None:
        beat = request.method == "GET" and request.path.endswith("/.ckptkeeper/nodes/node-a.json")
        return "hold" if hold["on"] and beat else None

    with FaultProxy(s3_reset, rate=0.0, rules=[black_hole], timeout=120.0) as proxy:
        cfg = fleet_node(tmp_path, "node-a", s3_bucket, proxy.url, cold_keep_last=None)
        cfg.write_text(settings + cfg.read_text())
        for step in (1, 2):
            hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", step, f"a-{step}".encode() * 100)
        stuck = run_cli(cfg, "prune", "--json", timeout=120)
        assert stuck.returncode == 1, (stuck.stdout, stuck.stderr)
        assert stuck.stdout.strip(), stuck.stderr[-3000:]
        doc = json.loads(stuck.stdout)
        (first,) = doc["result"]["failed"][:1]
        assert "get_object ckpt/.ckptkeeper/nodes/node-a.json" in first, doc["result"]
        assert said in first
        assert "Traceback" not in stuck.stderr
        hold["on"] = False
        again = run_cli(cfg, "prune", "--json")
        assert again.returncode == 0, again.stderr
    keys = _keys(s3_client, s3_bucket)
    assert sorted(k for k in keys if k.startswith("ckpt/node-a/exp/") and k.endswith(MANIFEST_SUFFIX)) == [
        f"ckpt/node-a/exp/checkpoint-{s}{MANIFEST_SUFFIX}" for s in (1, 2)
    ]


def test_an_s3_delete_leaves_no_object_behind_when_the_listing_lags(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    """Cold keeps 1: step 1's copy expires. The store's listing of that copy lags (it omits the
    weights, as an eventually consistent listing may): the delete still removes every object the
    copy's manifest names, and checks that nothing is left."""

    def lagging(request: Request) -> Any:
        if not (request.is_listing and "checkpoint-1%2F" in request.query):
            return None

        def omit_weights(body: bytes) -> bytes:
            return re.sub(
                rb"<Contents><Key>[^<]*checkpoint-1/model\.bin</Key>.*?</Contents>", b"", body, flags=re.S
            )

        return omit_weights

    cfg = fleet_node(tmp_path, "node-a", s3_bucket, s3_reset, cold_keep_last=None, shared=False)
    for step in (1, 2):
        hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", step, f"a-{step}".encode() * 100)
    first = run_cli(cfg, "prune")
    assert first.returncode == 0, first.stderr
    assert "ckpt/exp/checkpoint-1/model.bin" in _keys(s3_client, s3_bucket)
    with FaultProxy(s3_reset, rate=0.0, rules=[lagging]) as proxy:
        text = cfg.read_text().replace(s3_reset, proxy.url)
        cfg.write_text(text.replace('name = "cold"', 'name = "cold"\nkeep_last = 1', 1))
        done = run_cli(cfg, "prune", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [(a["action"], a["step"], a["tier"]) for a in doc["actions"]] == [("delete", 1, "cold")], doc
    left = [k for k in _keys(s3_client, s3_bucket) if "checkpoint-1" in k]
    assert left == [], left


def test_an_s3_delete_that_cannot_see_its_prefix_empty_says_so_and_leaves_its_marker(
    tmp_path: Path, s3_bucket: str, s3_client: Any, s3_reset: str
) -> None:
    """A listing that keeps showing an object of the deleted copy (a phantom the store will not
    let go): after its bounded re-listings the delete fails naming it (exit 1), and its staging
    marker stays in the bucket for the reaper, never a silent leak."""
    phantom = (
        b"<Contents><Key>ckpt/exp/checkpoint-1/ghost.bin</Key>"
        b'<LastModified>2026-01-01T00:00:00.000Z</LastModified><ETag>"x"</ETag><Size>1</Size></Contents>'
    )

    def haunted(request: Request) -> Any:
        if not (request.is_listing and "checkpoint-1%2F" in request.query):
            return None
        return lambda body: body.replace(b"</ListBucketResult>", phantom + b"</ListBucketResult>")

    cfg = fleet_node(tmp_path, "node-a", s3_bucket, s3_reset, cold_keep_last=None, shared=False)
    for step in (1, 2):
        hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", step, f"a-{step}".encode() * 100)
    assert run_cli(cfg, "prune").returncode == 0
    with FaultProxy(s3_reset, rate=0.0, rules=[haunted]) as proxy:
        text = cfg.read_text().replace(s3_reset, proxy.url)
        cfg.write_text(text.replace('name = "cold"', 'name = "cold"\nkeep_last = 1', 1))
        done = run_cli(cfg, "prune", "--json")
    assert done.returncode == 1, done.stderr
    (failed,) = json.loads(done.stdout)["result"]["failed"]
    assert "objects still listed after 3 re-listings (e.g. ckpt/exp/checkpoint-1/ghost.bin)" in failed
    assert "its delete marker stays for the reaper" in failed
    left = [k for k in _keys(s3_client, s3_bucket) if "checkpoint-1" in k]
    assert len(left) == 1 and ".ckptkeeper-tmp-" in left[0], left  # the marker; the copy's data is gone


def test_request_timeout_bounds_a_restore_too(tmp_path: Path, s3_bucket: str, s3_reset: str) -> None:
    """``request_timeout`` is the deadline of every command's requests, not only a prune's: a
    restore whose data GET is never answered ends non-zero within the setting, naming the hung
    request, and leaves no checkpoint behind."""
    hold = {"on": False}

    def black_hole(request: Request) -> str | None:
        data = request.method == "GET" and request.path.endswith("/checkpoint-1/model.bin")
        return "hold" if hold["on"] and data else None

    with FaultProxy(s3_reset, rate=0.0, rules=[black_hole], timeout=120.0) as proxy:
        cfg = fleet_node(tmp_path, "node-a", s3_bucket, proxy.url, cold_keep_last=None)
        cfg.write_text('request_timeout = "3s"\n' + cfg.read_text())
        for step in (1, 2):
            hf_checkpoint(tmp_path / "node-a" / "hot" / "exp", step, f"a-{step}".encode() * 100)
        done = run_cli(cfg, "prune")
        assert done.returncode == 0, done.stderr
        assert not (tmp_path / "node-a" / "hot" / "exp" / "checkpoint-1").exists()  # only in cold now
        hold["on"] = True
        out = tmp_path / "restored"
        stuck = run_cli(cfg, "restore", "exp", "--step", "1", "--to", str(out), timeout=100)
    assert stuck.returncode != 0, stuck.stdout
    assert "no answer within request_timeout (3s)" in stuck.stderr, stuck.stderr[-3000:]
    assert "Traceback" not in stuck.stderr
    assert not (out / "checkpoint-1" / "model.bin").exists()
