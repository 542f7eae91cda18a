"""torch.distributed.checkpoint directories (``__R_K.distcp`` + ``.metadata``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from ckptkeeper.ingest.layouts.base import _Node, _Verdict, contiguous_without_zero, parse_step, rank_span

DCP_METADATA: Final = ".metadata"
DCP_METADATA_TMP: Final = ".metadata.tmp"
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


def shard_ranks(names: Iterable[str]) -> set[int]:
    """Ranks of the ``__<rank>_<k>.distcp`` shards among ``names``."""
    return {int(m.group(1)) for n in names if (m := _SHARD.match(n))}


class _Dcp:
    """torch.distributed.checkpoint dir (``__R_K.distcp``): complete once ``.metadata`` exists.

    ``FileSystemWriter`` writes the shards, then ``.metadata.tmp``, then renames it. A reused
    directory keeps the previous save's ``.metadata`` while new shards are written, so a leftover
    ``.metadata.tmp`` or a shard newer than ``.metadata`` means a re-save in progress (or crashed).
    Consequence: copies of a DCP dir must preserve mtimes (``cp -a``, rsync ``-a``, our executor),
    or ``.metadata`` copied before a shard would look stale.

    One node of a multi-node job holds only its ranks' shards (``__8_0.distcp … __15_0.distcp``)
    and never a ``.metadata``: shards of contiguous ranks, rank 0's absent, no ``.metadata.tmp``
    is reported as a node part (:attr:`Candidate.node_part`), not as a save in progress.
    """

    layout = "dcp"

    def claims(self, node: _Node) -> bool:
        return node.is_dir and any(n.endswith(".distcp") for n in node.children.entries)

    def step(self, node: _Node) -> int | None:
        return parse_step(node.name)

    def check(self, node: _Node) -> _Verdict:
        kids = node.children
        meta = kids.regular(DCP_METADATA)
        tmp = kids.has_file(DCP_METADATA_TMP)
        if meta is None:
            why = "only .metadata.tmp: save not finished" if tmp else "save not finished"
            ranks = shard_ranks(kids.entries)
            part = None
            if not tmp and contiguous_without_zero(ranks):
                # The coordinator (rank 0) writes .metadata; with its shard absent too, this is the
                # share of a node that never gets one.
                part = f"{rank_span(ranks)} without {DCP_METADATA} (rank 0 writes it, on another node)"
            return _Verdict(problems=(f"{DCP_METADATA} missing ({why})",), part=part)
        if tmp:
            return _Verdict(problems=(f"{DCP_METADATA_TMP} beside {DCP_METADATA}: re-save in progress",))
        newer = sorted(
            n for n, st in kids.entries.items() if n.endswith(".distcp") and st.st_mtime_ns > meta.st_mtime_ns
        )
        if newer:
            return _Verdict(problems=(f"{newer[0]} newer than {DCP_METADATA}: re-save in progress",))
        return _Verdict()
