"""NeMo checkpoints (files and distributed dirs) and their ``-unfinished`` markers."""

from __future__ import annotations

import os
import re
from typing import Final

from ckptkeeper.ingest.layouts.base import _Dir, _name_metrics, _Node, _strip_ext, _Verdict, parse_step

NEMO_UNFINISHED: Final = "-unfinished"


class _NeMo:
    """NeMo ``*.ckpt`` files or distributed-checkpoint dirs: partial while ``<name>-unfinished`` exists.

    NeMo creates the marker before saving and removes it after every rank finished. The marker
    name drops ``.nemo``/``.ckpt`` and ``-EMA`` and lives beside the un-injected path (the parent of
    ``mp_rank_XX/`` or ``tp_rank_XX_pp_rank_XXX/`` dirs). Claimed when such a marker exists or the
    name has NeMo's ``--`` separator (``megatron_gpt--val_loss=1.23-step=100-…``); ``key=value``
    numbers in the name (``val_loss``) become metrics. The torch/DCP recognizers add their checks.
    """

    layout = "nemo"
    _rank_dir = re.compile(r"^(?:mp_rank_\d+|tp_rank_\d+_pp_rank_\d+)$")

    def claims(self, node: _Node) -> bool:
        if node.is_file and not node.name.endswith(".ckpt"):
            return False
        return "--" in node.name or self._marker(node) is not None

    def step(self, node: _Node) -> int | None:
        return parse_step(_strip_ext(node.name, (".ckpt",)))

    def check(self, node: _Node) -> _Verdict:
        metrics = _name_metrics(_strip_ext(node.name, (".ckpt",)))
        marker = self._marker(node)
        if marker is not None:
            return _Verdict(problems=(f"{marker} present: save unfinished",), metrics=metrics)
        return _Verdict(metrics=metrics)

    @staticmethod
    def marker_name(name: str) -> str:
        for suffix in (".nemo", ".ckpt", "-EMA"):
            name = name.removesuffix(suffix)
        return name + NEMO_UNFINISHED

    def _marker(self, node: _Node) -> str | None:
        """Relative name (from the checkpoint's dir) of its unfinished marker, if present."""
        marker = self.marker_name(node.name)
        if node.parent.has_file(marker):
            return marker
        if self._rank_dir.match(os.path.basename(node.parent.path)):
            up = node.parent.grandparent()
            if up is not None and up.has_file(marker):
                return f"../{marker}"
        return None

    def orphan(self, parent: _Dir, marker: str) -> bool:
        """True when no checkpoint this marker could belong to exists (a crash between save and
        cleanup, or the checkpoint was removed without its marker)."""
        base = marker.removesuffix(NEMO_UNFINISHED)
        names = (base, base + ".ckpt", base + "-EMA.ckpt", base + ".nemo", base + "-EMA")
        if any(n in parent.entries for n in names):
            return False
        for sub_name in parent.entries:
            if self._rank_dir.match(sub_name):
                sub = parent.subdir(sub_name)
                if sub is not None and any(n in sub.entries for n in names):
                    return False
        return True
