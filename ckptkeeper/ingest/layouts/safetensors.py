"""Safetensors directories (sharded with an index, or one ``model.safetensors``)."""

from __future__ import annotations

import os

from ckptkeeper.ingest.layouts.base import (
    _json,
    _Node,
    _read_small,
    _safetensors_problem,
    _Verdict,
    parse_step,
)
from ckptkeeper.ingest.layouts.temps import SAFETENSORS_TMP


class _Safetensors:
    """A dir with ``*.safetensors.index.json`` (every ``weight_map`` shard present and whole) or a
    single ``model.safetensors`` (header readable, data not truncated).

    Shards of a previous save that the index does not name are ignored (stale, not missing). Shard
    names must stay inside the directory: an index pointing elsewhere is corrupt.
    """

    layout = "safetensors"
    single = "model.safetensors"

    def claims(self, node: _Node) -> bool:
        if not node.is_dir:
            return False
        kids = node.children
        return (
            kids.has_file(self.single)
            or any(n.endswith(".safetensors.index.json") and kids.has_file(n) for n in kids.entries)
            or self._only_temps(node)
        )

    @staticmethod
    def _only_temps(node: _Node) -> bool:
        """A dir holding nothing but safetensors temps: a save killed while writing its first file.
        Claimed (partial) so the dir is reaped whole rather than leaving it behind empty; any other
        entry leaves the dir to whoever claims that."""
        entries = node.children.entries
        return bool(entries) and all(SAFETENSORS_TMP.match(n) and node.children.has_file(n) for n in entries)

    def step(self, node: _Node) -> int | None:
        return parse_step(node.name)

    def check(self, node: _Node) -> _Verdict:
        kids = node.children
        problems: list[str] = []
        corrupt = False
        indexes = sorted(
            n for n in kids.entries if n.endswith(".safetensors.index.json") and kids.has_file(n)
        )
        shards: set[str] = set()
        for index in indexes:
            try:
                doc = _json(_read_small(os.path.join(node.path, index)))
                weight_map = doc["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()
                ):
                    raise ValueError("weight_map is not a name -> file object")
            except (ValueError, KeyError, TypeError) as exc:
                problems.append(f"{index} unparseable ({exc})")
                corrupt = True
                continue
            for shard in sorted(set(weight_map.values())):
                if "/" in shard or shard in ("", ".", ".."):
                    problems.append(f"{index} names {shard!r} outside the checkpoint")
                    corrupt = True
                elif not kids.has_file(shard):
                    problems.append(f"shard {shard} listed in {index} but absent")
                else:
                    shards.add(shard)
        if not indexes:
            shards.add(self.single)
            if not kids.has_file(self.single):
                temps = sorted(n for n in kids.entries if SAFETENSORS_TMP.match(n))
                problems.append(
                    f"{self.single} missing (only the temp {temps[0] if temps else '?'} of a write)"
                )
        for shard in sorted(shards):
            st = kids.regular(shard)
            if st is None:
                continue
            problem, bad = _safetensors_problem(os.path.join(node.path, shard), st.st_size)
            if problem:
                problems.append(problem)
                corrupt = corrupt or bad
        return _Verdict(problems=tuple(problems), corrupt=corrupt)
