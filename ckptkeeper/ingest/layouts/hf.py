"""Hugging Face Trainer checkpoints (``checkpoint-N/``)."""

from __future__ import annotations

import os
import re
from typing import Final

from ckptkeeper.ingest.layouts.base import _json, _Node, _numeric, _read_small, _to_int, _Verdict

TRAINER_STATE: Final = "trainer_state.json"


class _Hf:
    """HF Trainer ``checkpoint-N/``: complete once ``trainer_state.json`` is written (it is last)."""

    layout = "hf"
    _name = re.compile(r"^checkpoint-(\d+)$")

    def claims(self, node: _Node) -> bool:
        return node.is_dir and self._name.match(node.name) is not None

    def step(self, node: _Node) -> int | None:
        m = self._name.match(node.name)
        return _to_int(m.group(1)) if m else None

    def check(self, node: _Node) -> _Verdict:
        if not node.children.has_file(TRAINER_STATE):
            return _Verdict(problems=(f"{TRAINER_STATE} missing",))
        step = self.step(node)
        try:
            doc = _json(_read_small(os.path.join(node.path, TRAINER_STATE)))
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            history = doc.get("log_history", [])
            if not isinstance(history, list):
                raise ValueError("log_history is not a list")
        except ValueError as exc:  # SchemaError, JSONDecodeError and UnicodeDecodeError are ValueErrors
            problem = f"{TRAINER_STATE} unparseable ({exc})"
            return _Verdict(problems=(problem,), corrupt=True, rejected=(problem,))
        metrics: dict[str, float] = {}
        dropped: list[str] = []
        for entry in history:
            if isinstance(entry, dict) and entry.get("step") == step:
                kept, bad = _numeric((k, v) for k, v in entry.items() if k != "step")
                metrics.update(kept)
                dropped.extend(bad)
        rejected = (
            (f"{TRAINER_STATE}: metrics {sorted(set(dropped))} dropped: out of range",) if dropped else ()
        )
        return _Verdict(metrics=metrics, rejected=rejected)
