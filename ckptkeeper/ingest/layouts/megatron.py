"""Megatron-LM checkpoints (``iter_NNNNNNN/``, legacy and ``torch_dist``)."""

from __future__ import annotations

import os
import re
import stat
from typing import Final

from ckptkeeper.ingest.layouts.base import (
    _Node,
    _read_small,
    _to_int,
    _Verdict,
    contiguous_without_zero,
    rank_span,
)
from ckptkeeper.ingest.layouts.dcp import shard_ranks

MEGATRON_TRACKER: Final = "latest_checkpointed_iteration.txt"
MEGATRON_DIST_CONFIG: Final = "metadata.json"


class _Megatron:
    """Megatron-LM ``iter_NNNNNNN/``: complete once the save dir's tracker holds an iteration >= N.

    Megatron rank 0 writes ``latest_checkpointed_iteration.txt`` after every rank finished. A
    tracker holding ``release`` says nothing about ``iter_N`` dirs, so they are then judged by their
    own files only (never reap on ambiguity). ``torch_dist`` checkpoints (``__*.distcp``) also need
    ``metadata.json``; the DCP recognizer adds its ``.metadata`` check. Legacy checkpoints need
    ``model_optim_rng.pt`` in every ``mp_rank_*`` dir.

    One node of a multi-node job holds neither the tracker nor what rank 0 writes: with no tracker,
    ``torch_dist`` shards of contiguous ranks without rank 0's (and no ``metadata.json``), or legacy
    ``mp_rank_*`` dirs all holding ``model_optim_rng.pt`` without ``mp_rank_00[_000]``, are
    reported as a node part (:attr:`Candidate.node_part`).
    """

    layout = "megatron"
    _name = re.compile(r"^iter_(\d+)$")
    _rank_dir = re.compile(r"^mp_rank_\d+(?:_\d+)*$")

    def claims(self, node: _Node) -> bool:
        return node.is_dir and self._name.match(node.name) is not None

    def step(self, node: _Node) -> int | None:
        m = self._name.match(node.name)
        return _to_int(m.group(1)) if m else None

    def check(self, node: _Node) -> _Verdict:
        problems: list[str] = []
        rejected: list[str] = []
        step = self.step(node)
        tracker = node.parent.regular(MEGATRON_TRACKER)
        if tracker is None:
            problems.append(f"{MEGATRON_TRACKER} missing")
        else:
            try:
                text = _read_small(os.path.join(node.parent.path, MEGATRON_TRACKER), 4096).decode().strip()
            except ValueError as exc:  # not UTF-8, or far too big for a tracker
                text = f"<unparseable: {exc}>"
            if text != "release":
                latest = _to_int(text) if text.isdigit() else None
                if latest is None:
                    problems.append(f"{MEGATRON_TRACKER} holds {text[:40]!r}, not an iteration")
                    rejected.append(problems[-1])
                elif step is not None and latest < step:
                    problems.append(f"{MEGATRON_TRACKER} at {latest} < {step}: save not finished")
        entries = node.children.entries
        part = None
        if any(n.endswith(".distcp") for n in entries):
            if not node.children.has_file(MEGATRON_DIST_CONFIG):
                problems.append(f"torch_dist {MEGATRON_DIST_CONFIG} missing")
            ranks = shard_ranks(entries)
            if tracker is None and contiguous_without_zero(ranks):
                part = f"torch_dist {rank_span(ranks)} without {MEGATRON_TRACKER} (rank 0 writes it, on another node)"
        else:
            rank_dirs = [n for n in entries if self._rank_dir.match(n) and stat.S_ISDIR(entries[n].st_mode)]
            if not rank_dirs:
                problems.append("no mp_rank_*/ dirs and no torch_dist shards")
            for rank in sorted(rank_dirs):
                sub = node.children.subdir(rank)
                if sub is None or not sub.has_file("model_optim_rng.pt"):
                    problems.append(f"{rank}/model_optim_rng.pt missing")
            first = [r for r in rank_dirs if not r.removeprefix("mp_rank_").replace("_", "").strip("0")]
            if tracker is None and rank_dirs and not first and len(problems) == 1:
                part = f"{len(rank_dirs)} mp_rank dirs without mp_rank_00 or {MEGATRON_TRACKER} (rank 0's, on another node)"
        return _Verdict(problems=tuple(problems), rejected=tuple(rejected), part=part)
