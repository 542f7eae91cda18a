"""Storage cost: ``cost_per_gib_month`` per tier, shown by ``status``, ``status --json``, the
metrics and ``prune --dry-run`` — which must agree with each other and with bytes x price."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from hypothesis import given
from hypothesis import strategies as st
from layout_fixtures import make_hf

from ckptkeeper.core import cost
from ckptkeeper.core.model import Action, ActionKind

GIB = 1 << 30


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTKEEPER_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptkeeper.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


# --------------------------------------------------------------------------------------------
# pure


def test_monthly_is_bytes_in_gib_times_price() -> None:
    assert cost.monthly(GIB, 0.023) == 0.023
    assert cost.monthly(10 * GIB, 2.5) == 25.0
    assert cost.monthly(0, 9.0) == 0.0


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["hot", "cold", "free"]),
            st.integers(0, 1 << 44),
        ),
        max_size=30,
    )
)
def test_runs_add_up_to_their_tier(copies: list[tuple[str, str, int]]) -> None:
    prices: dict[str, float | None] = {"hot": 0.1, "cold": 0.004, "free": None}
    per_run = cost.by_run(copies, prices)
    totals: dict[str, int] = {}
    for _run, tier, n in copies:
        totals[tier] = totals.get(tier, 0) + n
    per_tier = cost.by_tier(totals, prices)
    assert "free" not in per_tier and all("free" not in t for t in per_run.values())
    for tier, value in per_tier.items():
        assert sum(t.get(tier, 0.0) for t in per_run.values()) == pytest.approx(
            value, abs=0.0001 * (len(per_run) + 1)
        )


def test_plan_change_counts_copies_in_and_deletes_out() -> None:
    actions = [
        Action(ActionKind.COPY, "demote", "r", 1, "hot", "cold", "r/c1", 2 * GIB),
        Action(ActionKind.DELETE, "demote", "r", 1, "hot", None, "r/c1", 2 * GIB),
        Action(ActionKind.DELETE, "expired", "r", 0, "cold", None, "r/c0", GIB),
        Action(ActionKind.REAP, "failed-run", "f", 3, "warm", None, "f/c3", GIB),
    ]
    change = cost.plan_change(actions, {"hot": 0.1, "cold": 0.01, "warm": None})
    assert change == {"cold": 0.01, "hot": -0.2}


def test_copies_into_a_compressing_tier_are_priced_at_what_its_past_copies_stored() -> None:
    history = {"cold": (4, 8 * GIB, 2 * GIB), "warm": (2, GIB, GIB), "new": (0, 0, 0)}
    ratios = cost.stored_ratios(history, ["cold", "new", "other"])
    assert set(ratios) == {"cold"}  # no history: raw bytes; warm does not compress
    assert ratios["cold"].ratio == 0.25 and ratios["cold"].copies == 4
    actions = [
        Action(ActionKind.COPY, "demote", "r", 1, "hot", "cold", "r/c1", 4 * GIB),
        Action(ActionKind.COPY, "demote", "r", 2, "hot", "new", "r/c2", GIB),
    ]
    prices = {"cold": 1.0, "new": 1.0}
    assert cost.plan_change(actions, prices, cost.StoredBasis(ratios)) == {"cold": 1.0, "new": 1.0}
    assert cost.plan_change(actions, prices) == {"cold": 4.0, "new": 1.0}
    assert cost.copies_estimate(actions, ratios) == {"cold": (4 * GIB, GIB)}
    # a delete of a copy stored compressed frees the bytes it takes, not its raw bytes
    deletes = [
        Action(ActionKind.DELETE, "expired", "r", 0, "cold", None, "r/c0", 2 * GIB),
        Action(ActionKind.DELETE, "expired", "r", 9, "cold", None, "r/c9", 2 * GIB),
    ]
    basis = cost.StoredBasis(copies={("cold", "r/c0"): GIB // 2})
    assert cost.plan_change(deletes, prices, basis) == {"cold": -2.5}


# --------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize("value", [-0.5, "cheap", True, "0.1"])
def test_a_bad_price_exits_2_naming_the_key(tmp_path: Path, value: Any) -> None:
    (tmp_path / "hot").mkdir()
    (tmp_path / "cold").mkdir()
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        tiers=[
            local_tier("hot", tmp_path / "hot"),
            local_tier("cold", tmp_path / "cold", cost_per_gib_month=value),
        ],
    )
    result = _cli(config, "status")
    assert result.returncode == 2
    assert "tiers[1].cost_per_gib_month" in result.stderr


# --------------------------------------------------------------------------------------------
# status, status --json, the metric, prune --dry-run


def _metric(prom: Path, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for line in prom.read_text().splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
            out[labels] = float(m.group(2))
    return out


def test_status_json_text_and_metric_agree_on_cost(tmp_path: Path) -> None:
    hot, cold = tmp_path / "hot", tmp_path / "cold"
    hot.mkdir()
    cold.mkdir()
    prom = tmp_path / "metrics" / "ckptkeeper.prom"
    # Prices high enough that a few KiB of fixtures cost more than a cent each.
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "0s", "textfile": str(prom)},
        tiers=[
            local_tier("hot", hot, keep_last=1, cost_per_gib_month=2_000_000.0),
            local_tier("cold", cold, keep_last=10, cost_per_gib_month=300_000.0),
        ],
    )
    for run in ("run-a", "run-b"):
        for step in (10, 20):
            make_hf(hot / run, step, eval_loss=1.0 / step)
    assert _cli(config, "scan").returncode == 0

    dry = _cli(config, "prune", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    dry_json = json.loads(_cli(config, "prune", "--dry-run", "--json").stdout)
    saving = dry_json["cost_saving_per_month"]
    moved = sum(a["bytes"] for a in dry_json["actions"] if a["action"] == "delete" and a["tier"] == "hot")
    assert moved > 0
    assert saving["tiers"]["hot"] == pytest.approx(round(moved / GIB * 2_000_000.0, 4))
    assert saving["tiers"]["cold"] == pytest.approx(-round(moved / GIB * 300_000.0, 4))
    assert saving["total"] > 0
    assert f"this plan saves {saving['total']:.2f} per month in storage" in dry.stdout

    pruned = _cli(config, "prune")
    assert pruned.returncode == 0, pruned.stderr
    doc = json.loads(_cli(config, "status", "--json").stdout)
    text = _cli(config, "status").stdout
    costs = doc["cost_per_month"]
    tier_rows = {t["name"]: t for t in doc["tiers"]}
    for tier, price in (("hot", 2_000_000.0), ("cold", 300_000.0)):
        assert tier_rows[tier]["bytes"] > 0
        assert costs["tiers"][tier] == pytest.approx(round(tier_rows[tier]["bytes"] / GIB * price, 4))
    assert set(costs["runs"]) == {"run-a", "run-b"}
    for tier in ("hot", "cold"):
        assert sum(r[tier] for r in costs["runs"].values()) == pytest.approx(costs["tiers"][tier], abs=0.001)

    # the metric: written by the same prune's textfile, from the same summary
    _cli(config, "prune")  # refresh the textfile after the pass (nothing left to do)
    tier_metric = _metric(prom, "ckptkeeper_tier_cost_per_month")
    run_metric = _metric(prom, "ckptkeeper_run_cost_per_month")
    assert {dict(k)["tier"]: v for k, v in tier_metric.items()} == pytest.approx(costs["tiers"])
    for labels, value in run_metric.items():
        d = dict(labels)
        assert costs["runs"][d["run"]][d["tier"]] == pytest.approx(value)
    assert len(run_metric) == sum(len(r) - 1 for r in costs["runs"].values())  # minus "total"

    # the text
    assert f"storage cost per month: {costs['total']:.2f}" in text
    assert f"hot {costs['tiers']['hot']:.2f}" in text and f"cold {costs['tiers']['cold']:.2f}" in text
    for run, tiers in costs["runs"].items():
        assert f"run {run}: {tiers['total']:.2f}" in text


def test_no_prices_no_cost_anywhere(tmp_path: Path) -> None:
    (tmp_path / "hot").mkdir()
    config = write_config(
        tmp_path / "config.toml", index=tmp_path / "index.db", tiers=[local_tier("hot", tmp_path / "hot")]
    )
    doc = json.loads(_cli(config, "status", "--json").stdout)
    assert doc["cost_per_month"] is None
    assert "storage cost" not in _cli(config, "status").stdout
