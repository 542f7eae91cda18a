"""The fleet stress mode's checks of adoption (``tests/stress_fleet.py``; README "Many nodes, one
bucket"): once an orphan is gone, the lease holder applies the shared tier's rules
(``keep_last=KEEP_COLD``) to the copies it left.

An orphan's own cold policy keeps more than the fleet's (``KEEP_COLD + EXTRA``), and in its last
round it writes ``EXTRA`` steps of ``exp`` below the big one and copies them (committed) before it
is killed while the big one uploads. So at death it holds more committed copies than the shared
tier's rules (every other node's config) keep. The checker:

* kept: the newest ``KEEP_COLD`` committed copies of each of its runs at death (the newest good
  one included) stay whole (``check_cold``) — never adopted;
* expired: every other committed copy is gone at the end, every key under it, and the adoption
  log lines of every process (killed ones included) name it exactly once;
* no adoption log line names a copy twice, anywhere in the fleet (live nodes that looked gone
  between passes included).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING

from ckptkeeper.core.model import MANIFEST_SUFFIX
from ckptkeeper.fleet.adopt import ADOPTED_EVENT

if TYPE_CHECKING:
    from stress_fleet import Fleet, Node


def committed_at_death(fleet: Fleet, node: Node) -> dict[str, list[tuple[int, str]]]:
    """run -> [(step, key base)] of the orphan's committed copies when it died, by step."""
    prefix = f"{fleet.prefix}/{node.name}/"
    out: dict[str, list[tuple[int, str]]] = {}
    for key in fleet.orphan_committed(node):
        base = key[: -len(MANIFEST_SUFFIX)]
        run, name = base[len(prefix) :].rsplit("/", 1)
        if name.startswith("checkpoint-") and name[len("checkpoint-") :].isdigit():
            out.setdefault(run, []).append((int(name[len("checkpoint-") :]), base))
    return {run: sorted(steps) for run, steps in out.items()}


def kept_at_death(fleet: Fleet, node: Node, keep: int) -> list[tuple[str, int]]:
    """(run, step) of the orphan's copies the shared policy keeps: the newest ``keep`` per run."""
    at_death = committed_at_death(fleet, node).items()
    return [(run, step) for run, steps in at_death for step, _ in steps[max(0, len(steps) - keep) :]]


def adoption_split(fleet: Fleet, node: Node, keep: int) -> tuple[set[str], set[str]]:
    """(key bases the shared policy keeps, key bases it expires) among the orphan's copies at death."""
    kept: set[str] = set()
    expired: set[str] = set()
    for steps in committed_at_death(fleet, node).values():
        cut = max(0, len(steps) - keep)  # (not steps[-keep:]: keep 0 would keep them all)
        kept |= {base for _, base in steps[cut:]}
        expired |= {base for _, base in steps[:cut]}
    return kept, expired


def adoption_log(fleet: Fleet) -> tuple[Counter[str], Counter[str]]:
    """From every pass's stderr: (copies adopted: key base -> count, of those logged ``late``)."""
    seen: Counter[str] = Counter()
    late: Counter[str] = Counter()
    for node in fleet.nodes:
        for err in (node.home / "logs").glob("*.err"):
            for line in err.read_text(errors="replace").splitlines():
                if ADOPTED_EVENT not in line:
                    continue
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if isinstance(doc, dict) and doc.get("event") == ADOPTED_EVENT:
                    base = f"{fleet.prefix}/{doc.get('gone')}/{doc.get('path')}"
                    seen[base] += 1
                    late[base] += bool(doc.get("late"))
    return seen, late


def check_adoption(fleet: Fleet, keep: int) -> None:
    seen, late = adoption_log(fleet)
    fleet.fig.adopted_events = sum(seen.values())
    for base, n in sorted(seen.items()):
        if n > 1:
            why = f" ({late[base]} by a holder whose lease expired during the delete)" if late[base] else ""
            fleet.violation(f"{base} deleted {n} times by fleet adoption (want at most once){why}")
    objects = fleet.store.objects()
    for node in fleet.nodes:
        if not node.dead:
            continue
        kept, expired = adoption_split(fleet, node, keep)
        fleet.fig.adopt_expected += len(expired)
        for base in sorted(kept):
            if seen[base]:
                fleet.violation(f"orphan {node.name}: {base} adopted, but the policy keeps it")
        for base in sorted(expired):
            left = [k for k in objects if k == base + MANIFEST_SUFFIX or k.startswith(base + "/")]
            if left:
                fleet.violation(
                    f"orphan {node.name}: {base} expired by the policy, still there ({len(left)} keys)"
                )
            if seen[base] != 1:
                fleet.violation(f"orphan {node.name}: {base} adopted {seen[base]} times (want exactly once)")
