"""torch.distributed.checkpoint directories (``__R_K.distcp`` + ``.metadata``)."""

from __future__ import annotations

from typing import Final

from ckptkeeper.ingest.layouts.base import _Node, _Verdict, parse_step

DCP_METADATA: Final = ".metadata"
DCP_METADATA_TMP: Final = ".metadata.tmp"


class _Dcp:
    """torch.distributed.checkpoint dir (``__R_K.distcp``): complete once ``.metadata`` exists.

    ``FileSystemWriter`` writes the shards, then ``.metadata.tmp``, then renames it. A reused
    directory keeps the previous save's ``.metadata`` while new shards are written, so a leftover
    ``.metadata.tmp`` or a shard newer than ``.metadata`` means a re-save in progress (or crashed).
    Consequence: copies of a DCP dir must preserve mtimes (``cp -a``, rsync ``-a``, our executor),
    or ``.metadata`` copied before a shard would look stale.
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
            return _Verdict(problems=(f"{DCP_METADATA} missing ({why})",))
        if tmp:
            return _Verdict(problems=(f"{DCP_METADATA_TMP} beside {DCP_METADATA}: re-save in progress",))
        newer = sorted(
            n for n, st in kids.entries.items() if n.endswith(".distcp") and st.st_mtime_ns > meta.st_mtime_ns
        )
        if newer:
            return _Verdict(problems=(f"{newer[0]} newer than {DCP_METADATA}: re-save in progress",))
        return _Verdict()
