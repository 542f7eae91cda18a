"""Issue #13 item 8: a policy held back by an unavailable tier is never a silent success.

The cold tier sits behind :mod:`faultproxy`. When every request answers ``503 SlowDown`` the tier
is unknown and replication to it is held: ``prune`` exits 4 (``EXIT_POLICY_HELD``) naming the
tier and why, ``status`` and the ``ckptkeeper_policy_held`` gauge show it until a pass gets
through. A store that lacks one feature (``ListMultipartUploads`` or conditional writes answered
``501 NotImplemented``) is not unavailable: that feature is done without, with one warning, and
checkpoints still move to cold.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import s3_tier
from faultproxy import FaultProxy, Request
from test_survivor_recheck import RUN, Node

FAST_FAILURE = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}
"""Fewer botocore attempts: a store that is down answers 503 to every one of them anyway."""


@pytest.fixture
def proxy(s3_reset: str) -> Iterator[FaultProxy]:
    with FaultProxy(s3_reset, rate=0.0) as p:
        yield p


def cold_node(tmp_path: Path, proxy: FaultProxy, bucket: str, **daemon: Any) -> Node:
    options = {"key": "testing", "secret": "testing", **FAST_FAILURE}
    return Node(
        tmp_path,
        s3_tier("cold", bucket, proxy.url, replicate=True, storage_options=options),
        **daemon,
    )


def test_store_down_prune_exits_4_and_status_shows_the_held_policy(
    tmp_path: Path, proxy: FaultProxy, s3_bucket: str
) -> None:
    textfile = tmp_path / "metrics" / "ckptkeeper.prom"
    node = cold_node(tmp_path, proxy, s3_bucket, textfile=str(textfile))
    node.write(1, 2, 3)
    assert node.cli("prune").returncode == 0
    proxy.rules.append(lambda request: "slowdown")  # the store is down: 503 to everything
    node.write(4)

    pruned = node.cli("prune")
    assert pruned.returncode == 4, pruned.stdout + pruned.stderr
    held_line = re.search(
        r"^policy held: cold unavailable \((.+)\); (\d+) checkpoint\(s\) wait on it$", pruned.stderr, re.M
    )
    assert held_line, pruned.stderr[-3000:]
    assert re.search(r"SlowDown|503|reduce your request rate", held_line.group(1)), held_line.group(1)
    assert int(held_line.group(2)) >= 1
    assert (node.run_dir / "checkpoint-2").is_dir()  # nothing deleted that depends on cold
    doc = json.loads(node.cli("prune", "--json").stdout)
    assert doc["policy_held"]["cold"]["checkpoints"] >= 1

    status = node.cli("status")
    assert status.returncode == 0, status.stderr
    assert re.search(r"^policy held for .+: cold unavailable \(", status.stdout, re.M), status.stdout
    cold = json.loads(node.cli("status", "--json").stdout)["policy_held"]["cold"]
    assert cold["checkpoints"] >= 1 and cold["error"] and cold["since"] > 0
    metrics = textfile.read_text()
    assert re.search(r'^ckptkeeper_policy_held\{tier="cold"\} [1-9]', metrics, re.M), metrics
    assert re.search(r"^ckptkeeper_prune_last_exit_code 4", metrics, re.M), metrics

    # The store answers again: the held work is done, the exit code and status clear.
    proxy.rules.clear()
    again = node.cli("prune")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "policy held" not in node.cli("status").stdout
    assert json.loads(node.cli("status", "--json").stdout)["policy_held"] == {}
    assert re.search(r'^ckptkeeper_policy_held\{tier="cold"\} 0', textfile.read_text(), re.M)
    assert node.ls()[2]["tiers"] == ["cold"]
    node.restore_matches(2)


def _list_uploads(request: Request) -> str | None:
    query = request.query.split("&")
    return "not_implemented" if request.method == "GET" and "uploads" in query else None


def _conditional_put(request: Request) -> str | None:
    has_condition = any(k.lower() == "if-none-match" for k, _ in request.headers)
    return "not_implemented" if request.method == "PUT" and has_condition else None


@pytest.mark.parametrize(
    ("rule", "feature"),
    [(_list_uploads, "ListMultipartUploads"), (_conditional_put, "conditional writes")],
    ids=["list-multipart-uploads", "conditional-writes"],
)
def test_a_missing_store_feature_degrades_only_that_feature(
    rule: Any, feature: str, tmp_path: Path, proxy: FaultProxy, s3_bucket: str
) -> None:
    proxy.rules.append(rule)
    node = cold_node(tmp_path, proxy, s3_bucket)
    node.write(1, 2, 3)
    pruned = node.cli("prune")
    out = pruned.stdout + pruned.stderr
    assert pruned.returncode == 0, out[-3000:]
    assert proxy.fault_counts().get("not_implemented", 0) >= 1  # the store really refused
    warnings = re.findall(rf"cold: the store does not implement {feature}", pruned.stderr)
    assert len(warnings) == 1, pruned.stderr[-3000:]
    assert "policy held" not in out and "unknown" not in pruned.stderr
    placed = node.ls()
    assert placed[1]["tiers"] == ["cold"], placed
    assert placed[3]["tiers"] == ["hot", "cold"], placed
    status = json.loads(node.cli("status", "--json").stdout)
    assert next(t for t in status["tiers"] if t["name"] == "cold")["ok"] is True
    node.restore_matches(1)
    assert node.cli("verify", RUN).returncode == 0
