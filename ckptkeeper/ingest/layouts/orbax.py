"""Orbax checkpoints (``<step>/`` with ``_CHECKPOINT_METADATA`` or ``commit_success.txt``)."""

from __future__ import annotations

import os
import stat
from typing import Final

from ckptkeeper.ingest.layouts.base import _json, _Node, _numeric, _read_small, _Verdict, parse_step

ORBAX_TMP: Final = ".orbax-checkpoint-tmp-"
ORBAX_CHECKPOINT_METADATA: Final = "_CHECKPOINT_METADATA"
ORBAX_COMMIT_SUCCESS: Final = "commit_success.txt"


class _Orbax:
    """Orbax ``<step>/`` (or ``<prefix>_<step>/``): complete with ``_CHECKPOINT_METADATA`` or
    ``commit_success.txt``.

    Orbax writes into ``<step>.orbax-checkpoint-tmp-<ts>`` and renames (those temp dirs are
    artifacts, not candidates); on filesystems without atomic rename it writes
    ``commit_success.txt`` last. Claimed only on Orbax evidence — its metadata files, or an item
    dir (``default/``, ``state/``: a name that is not a step) holding ``_METADATA``,
    ``manifest.ocdbt`` or ``_sharding`` — never on a numeric name alone, so a plain DCP dir named
    ``200`` is not held hostage to an Orbax marker, and the manager's root dir (whose children are
    step dirs) is not mistaken for a step. Metrics come from
    ``_CHECKPOINT_METADATA``'s ``metrics``; an explicit ``commit_timestamp_nsecs: null`` without
    ``commit_success.txt`` means the commit did not happen.
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
                if sub is not None and any(sub.has_file(n) for n in self._item_files[2:]):
                    return True
        return False

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
        tmp_items = sorted(n for n in kids.entries if ORBAX_TMP in n)
        if tmp_items:
            problems.append(f"item still in a temp dir: {tmp_items[0]}")
        return _Verdict(problems=tuple(problems), metrics=metrics, rejected=tuple(rejected))
