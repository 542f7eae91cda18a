"""accelerate ``save_state`` dirs (``checkpoints/checkpoint_N/`` with ``automatic_checkpoint_naming``).

``N`` counts saves (``ProjectConfiguration.iteration``), not training steps: the tenth save of a run
at step 5000 is ``checkpoint_9``. accelerate records its own step counter (``Accelerator.step``, the
number of ``accumulate()`` calls) as ``"step"`` in ``random_states_<process>.pkl``, the file
``save_accelerator_state`` writes last. That number is read without unpickling: the pickle's opcode
stream is walked (``pickletools.genops``, which executes nothing) for the ``"step"`` key's integer.
"""

from __future__ import annotations

import os
import re
from typing import Final

from ckptkeeper.ingest.layouts.base import _Node, _to_int, _Verdict, _zip_problem, torch_pickle_values
from ckptkeeper.ingest.layouts.temps import SAFETENSORS_TMP

ACCELERATE_RNG: Final = re.compile(r"^random_states_(\d+)\.pkl$")
SAVE_METRIC: Final = "accelerate_save"
"""Metric carrying ``N`` of ``checkpoint_N`` (the save count), shown beside the real step."""
_EVIDENCE: Final = ("optimizer.bin", "scheduler.bin", "sampler.bin", "model.safetensors", "pytorch_model.bin")


def recorded_step(path: str) -> int | None:
    """accelerate's ``"step"`` in a ``random_states_N.pkl`` (a torch.save zip), or None; read
    without unpickling (:func:`torch_pickle_values`)."""
    value = next(iter(torch_pickle_values(path, "step")), None)
    return value if isinstance(value, int) and value >= 0 else None


class _Accelerate:
    """``checkpoint_N/`` holding accelerate's files: complete once ``random_states_0.pkl`` (written
    last, after the model, optimizer, scheduler and sampler states) is a whole zip and no
    safetensors temp is left. The model is not required by name: under DeepSpeed or FSDP it is a
    directory of that framework's own; a whole ``model.safetensors`` is the safetensors
    recognizer's to check.

    Claimed on the name *and* accelerate's own files (``optimizer.bin``, ``model.safetensors``, …,
    or the safetensors temp of a save killed while writing the model), so a user's ``checkpoint_3``
    of another format keeps its own recognizer. Step: accelerate's recorded step; when that is 0
    for ``N > 0`` (``accumulate()`` never used) or unreadable, ``N``. The catalog prefers the step
    the hook committed. ``accelerate_save`` = ``N`` is reported as a metric so ``ls`` shows both.
    """

    layout = "accelerate"
    _name = re.compile(r"^checkpoint_(\d+)$")

    def claims(self, node: _Node) -> bool:
        if not node.is_dir or self._name.match(node.name) is None:
            return False
        names = node.children.entries
        return any(n in _EVIDENCE or ACCELERATE_RNG.match(n) or SAFETENSORS_TMP.match(n) for n in names)

    def _save_number(self, node: _Node) -> int | None:
        m = self._name.match(node.name)
        return _to_int(m.group(1)) if m else None

    def step(self, node: _Node) -> int | None:
        number = self._save_number(node)
        kids = node.children
        rng = "random_states_0.pkl"
        if kids.has_file(rng):
            recorded = recorded_step(os.path.join(node.path, rng))
            if recorded is not None and (recorded > 0 or not number):
                return recorded
        return number

    def check(self, node: _Node) -> _Verdict:
        kids = node.children
        problems: list[str] = []
        number = self._save_number(node)
        metrics = {SAVE_METRIC: float(number)} if number is not None else {}
        temps = sorted(n for n in kids.entries if SAFETENSORS_TMP.match(n))
        if temps:
            problems.append(f"safetensors temp {temps[0]} left by an unfinished write")
        rng = kids.regular("random_states_0.pkl")
        if rng is None:
            problems.append("random_states_0.pkl missing (accelerate writes it last)")
        else:
            zip_problem = _zip_problem(os.path.join(node.path, "random_states_0.pkl"), rng.st_size)
            if zip_problem:
                problems.append(f"random_states_0.pkl: {zip_problem}")
        return _Verdict(problems=tuple(problems), metrics=metrics)
