"""Hugging Face ``Trainer`` callback: commit each ``checkpoint-N`` and mark the run finished or failed.

Usage::

    from ckptkeeper.integrations.transformers import KeeperCallback
    keeper = KeeperCallback()
    trainer = Trainer(..., callbacks=[keeper])
    with keeper:                # optional: an exception in train() marks the run failed right away
        trainer.train()

Run dir: ``args.output_dir``, where ``Trainer`` writes ``checkpoint-<global_step>/`` (docs/design.md, "Contracts": the run dir
is the framework's checkpoint dir); ``KeeperCallback(run_dir=...)`` overrides it. Hyper-parameter search
trials save under ``<output_dir>/<trial>/checkpoint-N``; those stay inside the run dir and are found too.

``on_save`` fires after ``Trainer._save_checkpoint`` returned: weights, optimizer, RNG state and
``trainer_state.json`` are written and rotation is done, so the commit names a complete directory.
Metrics (from ``state.log_history``): the latest value at or before this step of each training metric
(``loss``, ``learning_rate``, …), and ``eval_*`` metrics only when evaluated *at this step* — an older
evaluation attributed to a newer checkpoint would mislead ``keep_best``.

Failure: ``transformers`` has no exception hook. A run still active when the interpreter exits is marked
failed by the hook's ``atexit`` handler, with the uncaught exception (``"<Type>: message"``) when the
script died of one — the usual script/torchrun/SLURM case. In a long-lived process (notebook) a crashed
``train()`` leaves the run active (heartbeat still beating) until one of: ``with keeper: trainer.train()``,
``keeper.fail(reason)``, or the next ``train()`` with this callback, which marks the stale attempt failed.

Writer: on one node, the process that saves checkpoints, ``args.should_save`` (world process zero). In a
job spanning nodes (``WORLD_SIZE / LOCAL_WORLD_SIZE``, Slurm's node count, or ``KeeperCallback(parts=N)``)
each node's local process zero (``args.local_process_index``) writes into its node's ``output_dir``, as
the hook does (docs/spanning-nodes.md), recording the job and the node's part: with
DeepSpeed or FSDP each node holds only its ranks' files of ``checkpoint-N``, and even plain DDP leaves
each process's ``rng_state_<rank>.pth`` there; with ``save_on_each_node`` each node holds a whole copy.
``KeeperCallback(parts=1)`` when the nodes save into one shared ``output_dir``: world process zero writes
alone again.

Lineage: when ``train()`` resumed (``global_step > 0`` at ``on_train_begin``) the parent is
``args.resume_from_checkpoint`` if that is a path, else ``<output_dir>/checkpoint-<global_step>`` if it
exists. ``Trainer.train(resume_from_checkpoint=other_dir)`` is invisible to callbacks: pass
``KeeperCallback(parent=...)`` then.
"""

from __future__ import annotations

import glob
import logging
import math
import os
from types import TracebackType
from typing import Any, Literal

from ckptkeeper.hook import TrackedRun, parent_ref
from ckptkeeper.hook.parts import JobPart
from ckptkeeper.integrations._common import CallbackBase, build_callback_class, describe_exception

__all__ = ["KeeperCallback"]  # noqa: F822 - built on first access by __getattr__

log = logging.getLogger(__name__)

_class: type | None = None
_NOT_METRICS = frozenset({"step", "epoch"})


def __getattr__(name: str) -> Any:
    global _class
    if name != "KeeperCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _class is None:
        try:
            from transformers import TrainerCallback
        except ImportError as exc:
            raise ImportError(
                "ckptkeeper.integrations.transformers.KeeperCallback needs transformers: "
                "pip install 'ckptkeeper[hf]'"
            ) from exc
        _class = build_callback_class(_KeeperCallbackMixin, (TrainerCallback,), __name__)
    return _class


def checkpoint_metrics(log_history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """Metrics to attach to the checkpoint saved at ``step`` (see the module docstring for the rule)."""
    metrics: dict[str, float] = {}
    for entry in log_history:
        at = entry.get("step")
        if not isinstance(at, int) or at > step:
            continue
        for key, value in entry.items():
            if key in _NOT_METRICS or (key.startswith("eval_") and at != step):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            metrics[key] = float(value)
    return metrics


class _KeeperCallbackMixin(CallbackBase):
    """Commit Hugging Face ``Trainer`` checkpoints to ckptkeeper; mark the run finished or failed.

    ``run_dir`` overrides the run dir (default ``args.output_dir``); ``name`` and ``parent`` go to
    :func:`ckptkeeper.track_run`. Also a context manager around ``trainer.train()`` that marks the run
    failed on an exception.
    """

    run: TrackedRun | None = None
    """The run of the current ``train()``; set per instance at ``on_train_begin``."""

    # -- public -------------------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """Mark the current run failed (``transformers`` cannot tell callbacks about exceptions)."""
        if self.run is not None:
            self.run.fail(reason)

    def __enter__(self) -> _KeeperCallbackMixin:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if exc is not None and self.run is not None:
            try:
                self.run.fail(describe_exception(exc))
            except Exception as err:  # never mask the training exception
                log.warning("ckptkeeper: could not mark run failed: %s", err)
        return False

    # -- TrainerCallback events -----------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            writes, job_part = self._node_part(
                rank=args.process_index, local_rank=args.local_process_index, world=args.world_size
            )
            if job_part is None:  # one node: the process that saves, as always
                writes = getattr(args, "should_save", state.is_world_process_zero)
            if writes:
                self._begin(args, state, job_part)
        except Exception as exc:  # bookkeeping must never take training down
            log.warning(
                "ckptkeeper: could not start tracking: %s: %s", type(exc).__name__, exc, exc_info=True
            )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        try:
            self._commit(args, state)
        except Exception as exc:
            log.warning(
                "ckptkeeper: could not commit checkpoint: %s: %s", type(exc).__name__, exc, exc_info=True
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        try:
            self.run.finish()
        except Exception as exc:
            log.warning("ckptkeeper: could not mark run finished: %s: %s", type(exc).__name__, exc)

    # -- internals ----------------------------------------------------------------------------------

    def _begin(self, args: Any, state: Any, job_part: JobPart | None) -> None:
        if self.run is not None and self.run.state == "active":
            # The last train() never reached on_train_end: it raised (notebooks keep the process alive).
            self.run.fail("train() was started again before the previous attempt ended (it probably raised)")
        if args.save_total_limit is not None:
            self._warn_once(
                "save_total_limit",
                f"ckptkeeper: save_total_limit={args.save_total_limit} makes Trainer delete checkpoints "
                "behind ckptkeeper's back (its retention policy can no longer keep them); leave it unset "
                "and let the ckptkeeper policy decide what to keep.",
            )
        self.run = self._track(self.run_dir or args.output_dir, job_part)
        if self.parent is None and state.global_step > 0:
            self._record_resume(args, state)

    def _record_resume(self, args: Any, state: Any) -> None:
        assert self.run is not None
        candidates = []
        if isinstance(args.resume_from_checkpoint, str):
            candidates.append(args.resume_from_checkpoint)
        candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        for path in candidates:
            if os.path.isdir(path):
                self.run.set_parent(parent_ref(path, step=state.global_step, relative_to=self.run.run_dir))
                return
        log.info("ckptkeeper: resumed at step %d from a checkpoint callbacks cannot see", state.global_step)

    def _commit(self, args: Any, state: Any) -> None:
        assert self.run is not None
        folder = f"checkpoint-{state.global_step}"
        path = os.path.join(args.output_dir, folder)
        if not os.path.isdir(path):
            # Hyper-parameter search: <output_dir>/<trial name>/checkpoint-N; newest wins.
            found = sorted(
                glob.glob(os.path.join(glob.escape(args.output_dir), "*", folder)), key=os.path.getmtime
            )
            if not found:
                # A node that does not save (not args.should_save) holds only what its ranks wrote.
                log.log(
                    logging.WARNING if getattr(args, "should_save", True) else logging.INFO,
                    "ckptkeeper: on_save at step %d but no %s under %s",
                    state.global_step,
                    folder,
                    path,
                )
                return
            path = found[-1]
        self.run.commit(path, state.global_step, checkpoint_metrics(state.log_history, state.global_step))
