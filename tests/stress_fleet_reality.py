"""Cluster reality in the fleet stress mode (``stress_fleet.py``; docs/many-nodes-clocks.md):
skewed clocks on a third of the nodes, and a second keeper using a live node's ``node`` name.

Kept apart so ``stress_fleet.py`` stays readable; the nodes' processes get the clock offset from
``tests/clockshift`` (``stress_fleet._env``); their hot dirs' mtimes (``stress_fleet.write_checkpoint``)
and the store's clock stay real, as a shared filesystem's server and a bucket date them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any


def skew_and_twin(
    fleet: Any, make_node: Callable[..., Any], base: Path, endpoint: str, bucket: str, cfg: dict[str, str]
) -> Any:
    """Offset the clocks of a third of ``fleet.nodes`` (up to ``--skew`` either way, from the seed)
    and return the duplicate keeper (its own hot dir and index, a live node's name), or None. The
    duplicate's own ``orphan_after`` is long: the twin's heartbeat always counts as recent to it."""
    args = fleet.args
    rng = random.Random(f"{args.seed}:skew")
    for node in rng.sample(fleet.nodes, len(fleet.nodes) // 3) if args.skew > 0 else ():
        node.offset = round(rng.uniform(-args.skew, args.skew), 1)
        fleet.fig.skewed[node.name] = node.offset
    twin = next((n for n in fleet.nodes if n.orphan_round is None), None)
    if twin is None or not args.duplicate or args.rounds < 2:
        return None
    return make_node(
        base, twin.name, endpoint, bucket, {**cfg, "orphan_after": "1d"}, home_name=f"dup-{twin.name}"
    )


def check_duplicate(fleet: Any, passes: list[Any], where: str) -> None:
    """Every pass of the duplicate keeper was refused: exit 2, naming ``node``."""
    for p in passes:
        if p.fate != "duplicate":
            continue
        fleet.fig.duplicate_passes += 1
        said = p.stderr.read_text(errors="replace") if p.stderr is not None else ""
        if p.code == 2 and "node: node name" in said:
            fleet.fig.duplicate_refused += 1
        else:
            fleet.violation(f"{where}: a second keeper named {p.node.name} was not refused (exit {p.code})")
