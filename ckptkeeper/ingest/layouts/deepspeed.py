"""DeepSpeed checkpoints (``global_stepN/``, and Lightning's ``DeepSpeedStrategy`` dirs)."""

from __future__ import annotations

import os
import re
import stat
from typing import Final

from ckptkeeper.ingest.layouts.base import (
    _Dir,
    _Node,
    _read_small,
    _strip_ext,
    _to_int,
    _Verdict,
    contiguous_without_zero,
    parse_step,
    rank_span,
)

DS_LATEST: Final = "latest"


class _DeepSpeed:
    """DeepSpeed ``global_stepN/``: ``latest`` in the save dir names it (or a later tag), shards agree.

    ``latest`` is written by rank 0, possibly before slower ranks finish (the barrier trap), so the
    shard set must also be consistent: at least one ``*model_states.pt``; ``mp_rank_XX`` ranks
    contiguous from 0; for ZeRO files (``[bf16_]zero_pp_rank_D_mp_rank_XX_{optim,model}_states.pt``)
    the same contiguous set of data-parallel ranks 0..D-1 under every model-parallel rank, and equal
    sets for optimizer and (ZeRO-3) model states. A missing *highest* dp rank of every mp rank cannot
    be seen from names alone; ``latest`` and settling cover that. A ``latest`` naming a later
    ``global_stepM`` vouches for this one too: otherwise every older checkpoint would look partial.

    Lightning's ``DeepSpeedStrategy`` makes ``epoch=E-step=S.ckpt/`` the save dir itself: ``latest``
    inside it names the tag dir (``checkpoint/``) holding the shards; same checks, one level down.

    One node of a multi-node job holds only its data-parallel ranks' ZeRO files
    (``zero_pp_rank_8_mp_rank_00_optim_states.pt`` …) and neither ``latest`` nor the
    ``mp_rank_*_model_states.pt`` that dp rank 0 writes: ``global_stepN/`` with no ``latest``
    beside it, ZeRO files of contiguous dp ranks from above 0 (the same under every mp rank) and no
    file of dp rank 0 is reported as a node part (:attr:`Candidate.node_part`).
    """

    layout = "deepspeed"
    _name = re.compile(r"^global_step(\d+)$")
    _mp_model = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
    _zero = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")

    def claims(self, node: _Node) -> bool:
        if not node.is_dir:
            return False
        if self._name.match(node.name):
            return True
        if not node.name.endswith(".ckpt"):
            return False
        kids = node.children
        if kids.has_file(DS_LATEST):
            return True
        for name, st in kids.entries.items():  # `latest` comes last: a tag dir with shards suffices
            sub = kids.subdir(name) if stat.S_ISDIR(st.st_mode) else None
            if sub is not None and any(self._mp_model.match(n) or self._zero.match(n) for n in sub.entries):
                return True
        return False

    def step(self, node: _Node) -> int | None:
        m = self._name.match(node.name)
        return _to_int(m.group(1)) if m else parse_step(_strip_ext(node.name, (".ckpt",)))

    def check(self, node: _Node) -> _Verdict:
        if self._name.match(node.name):
            problems = self._latest_problems(node)
            shards: _Dir | None = node.children
        else:  # Lightning: the tag dir named by our own `latest`
            tag, problems = self._read_latest(node.children)
            shards = node.children.subdir(tag) if tag else None
            if tag and shards is None:
                problems.append(f"'{DS_LATEST}' names {tag[:60]!r}, which is absent")
        part = None
        if shards is not None:
            problems.extend(self._shard_problems(shards))
            if self._name.match(node.name) and not node.parent.has_file(DS_LATEST):
                part = self._part(shards)
        # A `latest` that is not a short UTF-8 tag is a broken or hostile marker, not a save in flight.
        rejected = tuple(p for p in problems if p.startswith(f"'{DS_LATEST}' unparseable"))
        return _Verdict(problems=tuple(problems), rejected=rejected, part=part)

    def _part(self, shards: _Dir) -> str | None:
        """The evidence that ``shards`` is one node's share of a multi-node save, or None."""
        by_mp: dict[int, set[int]] = {}
        for name in shards.entries:
            if self._mp_model.match(name):
                return None  # dp rank 0's file: the save is rooted here
            if (m := self._zero.match(name)) and shards.has_file(name):
                by_mp.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
        dps = {frozenset(v) for v in by_mp.values()}
        if len(dps) != 1:
            return None
        ranks = set(next(iter(dps)))
        if not contiguous_without_zero(ranks):
            return None
        return f"ZeRO dp {rank_span(ranks)} without '{DS_LATEST}' (rank 0 writes it, on another node)"

    def _shard_problems(self, shards: _Dir) -> list[str]:
        problems: list[str] = []
        mp_ranks: set[int] = set()
        zero: dict[str, set[tuple[int, int]]] = {"optim": set(), "model": set()}
        for name in shards.entries:
            if not shards.has_file(name):
                continue
            if m := self._mp_model.match(name):
                mp_ranks.add(int(m.group(1)))
            elif m := self._zero.match(name):
                zero[m.group(3)].add((int(m.group(1)), int(m.group(2))))
        if not mp_ranks and not zero["model"]:
            problems.append("no *_model_states.pt")
        if mp_ranks and mp_ranks != set(range(len(mp_ranks))):
            problems.append(f"mp_rank model states not contiguous: {sorted(mp_ranks)}")
        for kind, pairs in zero.items():
            if pairs:
                problems.extend(self._zero_problems(kind, pairs, mp_ranks))
        if zero["optim"] and zero["model"] and zero["optim"] != zero["model"]:
            problems.append("ZeRO optim and model state shards do not match")
        return problems

    @staticmethod
    def _read_latest(directory: _Dir) -> tuple[str | None, list[str]]:
        if not directory.has_file(DS_LATEST):
            return None, [f"'{DS_LATEST}' missing"]
        try:
            return _read_small(os.path.join(directory.path, DS_LATEST), 4096).decode().strip(), []
        except ValueError as exc:  # not UTF-8, or far too big for a tag
            return None, [f"'{DS_LATEST}' unparseable ({exc})"]

    def _latest_problems(self, node: _Node) -> list[str]:
        tag, problems = self._read_latest(node.parent)
        if tag is None:
            return [p + f" beside {node.name}" for p in problems]
        if tag == node.name:
            return []
        m = self._name.match(tag)
        latest, step = (_to_int(m.group(1)) if m else None), self.step(node)
        if latest is not None and step is not None and latest >= step:
            return []
        return [f"'{DS_LATEST}' names {tag[:60]!r}, not {node.name}"]

    @staticmethod
    def _zero_problems(kind: str, pairs: set[tuple[int, int]], mp_ranks: set[int]) -> list[str]:
        by_mp: dict[int, set[int]] = {}
        for dp, mp in pairs:
            by_mp.setdefault(mp, set()).add(dp)
        problems = []
        if set(by_mp) != set(range(len(by_mp))) or (mp_ranks and set(by_mp) != mp_ranks):
            problems.append(f"ZeRO {kind} shards: model-parallel ranks {sorted(by_mp)} inconsistent")
        dp_sets = {frozenset(dps) for dps in by_mp.values()}
        world = max(len(dps) for dps in by_mp.values())
        if len(dp_sets) != 1 or set(next(iter(dp_sets))) != set(range(world)):
            missing = sorted(
                f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_{kind}_states.pt"
                for mp, dps in by_mp.items()
                for dp in set(range(world)) - dps
            )
            problems.append(f"ZeRO {kind} shards missing: {', '.join(missing[:4]) or 'non-contiguous ranks'}")
        return problems
