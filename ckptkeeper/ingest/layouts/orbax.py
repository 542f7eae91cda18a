"""Orbax checkpoints (``<step>/`` with ``_CHECKPOINT_METADATA`` or ``commit_success.txt``)."""

from __future__ import annotations

import os
import re
import stat
from typing import Final

from ckptkeeper.ingest.layouts.base import (
    _json,
    _Node,
    _numeric,
    _read_small,
    _Verdict,
    contiguous_without_zero,
    parse_step,
    rank_span,
)
from ckptkeeper.ingest.layouts.temps import ORBAX_TMP

ORBAX_CHECKPOINT_METADATA: Final = "_CHECKPOINT_METADATA"
ORBAX_COMMIT_SUCCESS: Final = "commit_success.txt"
_PROCESS_DIR = re.compile(r"^ocdbt\.process_(\d+)$")


class _Orbax:
    """Orbax ``<step>/`` (or ``<prefix>_<step>/``): complete with ``_CHECKPOINT_METADATA`` or
    ``commit_success.txt``.

    Orbax writes into ``<step>.orbax-checkpoint-tmp`` (0.12; ``-<timestamp>`` appended before) and
    renames (those temp dirs are artifacts, not candidates: ``layouts.temps``); on filesystems without atomic rename it writes
    ``commit_success.txt`` last. Claimed only on Orbax evidence — its metadata files, or an item
    dir (``default/``, ``state/``: a name that is not a step) holding ``_METADATA``,
    ``manifest.ocdbt`` or ``_sharding`` — never on a numeric name alone, so a plain DCP dir named
    ``200`` is not held hostage to an Orbax marker, and the manager's root dir (whose children are
    step dirs) is not mistaken for a step. Metrics come from
    ``_CHECKPOINT_METADATA``'s ``metrics``; an explicit ``commit_timestamp_nsecs: null`` without
    ``commit_success.txt`` means the commit did not happen.

    Multi-host saves write one ``ocdbt.process_<i>/`` per process in each item dir; the primary
    host (process 0) writes the metadata. A step dir on a node-local disk that holds only other
    processes' dirs (``ocdbt.process_1/`` …, no ``ocdbt.process_0/``, no ``_METADATA``, no
    checkpoint metadata) is claimed too and reported as a node part (:attr:`Candidate.node_part`).
    """

    layout = "orbax"
    _item_files = (
        ORBAX_CHECKPOINT_METADATA,
        ORBAX_COMMIT_SUCCESS,
        "_METADATA",
        "manifest.ocdbt",
        "_sharding",
    )

    def claims(self, node: _Node) -> bool:
        if not node.is_dir:
            return False
        kids = node.children
        if any(kids.has_file(n) for n in self._item_files):
            return True
        for name, st in kids.entries.items():
            if stat.S_ISDIR(st.st_mode) and ORBAX_TMP not in name and parse_step(name) is None:
                sub = kids.subdir(name)
                if sub is not None and (
                    any(sub.has_file(n) for n in self._item_files[2:]) or self._processes(sub.entries)
                ):
                    return True
        return False

    @staticmethod
    def _processes(entries: dict[str, os.stat_result]) -> set[int]:
        """Process indices of the ``ocdbt.process_<i>/`` dirs among ``entries``."""
        return {
            int(m.group(1))
            for name, st in entries.items()
            if stat.S_ISDIR(st.st_mode) and (m := _PROCESS_DIR.match(name))
        }

    def _part(self, node: _Node) -> str | None:
        """The evidence that this step dir is one host's share of a multi-host save, or None."""
        kids = node.children
        found: set[int] = set()
        for name, st in kids.entries.items():
            if not stat.S_ISDIR(st.st_mode) or ORBAX_TMP in name:
                continue
            sub = kids.subdir(name)
            if sub is None:
                continue
            if sub.has_file("_METADATA"):
                return None  # the primary host's item metadata: the save is rooted here
            found |= self._processes(sub.entries)
        if not contiguous_without_zero(found):
            return None
        span = rank_span(found).replace("ranks", "processes").replace("rank", "process")
        return f"{span} without {ORBAX_CHECKPOINT_METADATA} (process 0 writes it, on another host)"

    def step(self, node: _Node) -> int | None:
        return parse_step(node.name)

    def check(self, node: _Node) -> _Verdict:
        kids = node.children
        problems: list[str] = []
        metrics: dict[str, float] = {}
        rejected: list[str] = []
        committed = kids.has_file(ORBAX_COMMIT_SUCCESS)
        if kids.has_file(ORBAX_CHECKPOINT_METADATA):
            try:
                doc = _json(_read_small(os.path.join(node.path, ORBAX_CHECKPOINT_METADATA)))
                if not isinstance(doc, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                problem = f"{ORBAX_CHECKPOINT_METADATA} unparseable ({exc})"
                return _Verdict(problems=(problem,), corrupt=True, rejected=(problem,))
            raw_metrics = doc.get("metrics")
            if isinstance(raw_metrics, dict):
                metrics, dropped = _numeric(raw_metrics.items())
                if dropped:
                    rejected.append(
                        f"{ORBAX_CHECKPOINT_METADATA}: metrics {sorted(dropped)} dropped: out of range"
                    )
            if "commit_timestamp_nsecs" in doc and doc["commit_timestamp_nsecs"] is None and not committed:
                problems.append(f"{ORBAX_CHECKPOINT_METADATA} has no commit timestamp")
        elif not committed:
            problems.append(f"{ORBAX_CHECKPOINT_METADATA} and {ORBAX_COMMIT_SUCCESS} missing")
        part = self._part(node) if problems and not kids.has_file(ORBAX_CHECKPOINT_METADATA) else None
        tmp_items = sorted(n for n in kids.entries if ORBAX_TMP in n)
        if tmp_items:
            problems.append(f"item still in a temp dir: {tmp_items[0]}")
            part = None
        return _Verdict(problems=tuple(problems), metrics=metrics, rejected=tuple(rejected), part=part)
