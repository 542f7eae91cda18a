"""Lightning callback: commit every checkpoint ``ModelCheckpoint`` writes, once it is on disk.

Usage::

    from ckptkeeper.integrations.lightning import KeeperCallback
    trainer = Trainer(callbacks=[ModelCheckpoint(dirpath=..., save_top_k=-1), KeeperCallback()])

Run dir: each ``ModelCheckpoint``'s resolved ``dirpath`` — the directory the ``.ckpt`` files land in
(docs/design.md, "Contracts": the run dir is the framework's checkpoint dir). For Lightning's default that is
``<default_root_dir>/lightning_logs/version_N/checkpoints``. Several ``ModelCheckpoint`` callbacks with
different ``dirpath``s give one tracked run each. ``KeeperCallback(run_dir=...)`` overrides it.

When to commit: ``on_save_checkpoint`` fires *before* the file is written, so it cannot be used. Instead
the callback observes ``ModelCheckpoint._save_checkpoint`` of each instance (installed at ``on_fit_start``,
removed at the end): it returns after ``trainer.save_checkpoint`` has written the file and passed the
strategy's barrier, which gives the exact path and ``trainer.global_step``. A file not yet on disk at that
moment (``AsyncCheckpointIO``) is kept pending and committed by a later hook, at the latest ``on_fit_end``
(after the strategy's teardown drained the async writer). Should a future Lightning drop that private
method, the callback falls back to polling what ``ModelCheckpoint`` reports (``best_k_models``,
``best_model_path``) at epoch/validation/train end.

``last.ckpt`` is never committed: it is rewritten in place (or is a symlink), so a commit would pin a
step the file no longer holds. Metrics: ``trainer.callback_metrics`` at save time (floats), plus the
monitored score ``ModelCheckpoint`` recorded for the file.

Run state: ``finished`` at ``on_fit_end``, ``failed`` at ``on_exception`` (``"<Type>: message"``, also for
KeyboardInterrupt). Bookkeeping errors are logged, never raised into training.

Writer: global rank zero on one node. In a job spanning nodes (``Trainer(num_nodes=N)``: DDP, FSDP,
DeepSpeed) each node's local rank zero writes into its node's run dir, as the hook does (docs/spanning-nodes.md), recording the job and the node's part (``trainer.node_rank`` of
``trainer.num_nodes``): a strategy that shards its checkpoints (FSDP ``state_dict_type="sharded"``,
DeepSpeed) leaves on each node only its ranks' files. ``KeeperCallback(parts=1)`` when the nodes save
into one shared directory: global rank zero writes alone again.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from ckptkeeper.hook import DEFAULT_HEARTBEAT_INTERVAL, ParentSpec, TrackedRun, parent_ref
from ckptkeeper.integrations._common import CallbackBase, build_callback_class, describe_exception

__all__ = ["KeeperCallback"]  # noqa: F822 - built on first access by __getattr__

log = logging.getLogger(__name__)

_FRAMEWORKS = ("lightning.pytorch", "pytorch_lightning")
_STEP_IN_NAME = re.compile(r"(?:^|[-_])step=(\d+)")
_class: type | None = None


def _framework_modules() -> list[Any]:
    """The Lightning flavours to build against: those the user already imported (a class deriving from
    both when both are, so either Trainer accepts it), else the first importable one."""
    loaded = [sys.modules[name] for name in _FRAMEWORKS if name in sys.modules]
    if loaded:
        return loaded
    for name in _FRAMEWORKS:
        try:
            return [importlib.import_module(name)]
        except ImportError:
            continue
    raise ImportError(
        "ckptkeeper.integrations.lightning.KeeperCallback needs Lightning: "
        "pip install 'ckptkeeper[lightning]'"
    )


def __getattr__(name: str) -> Any:
    global _class
    if name != "KeeperCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _class is None:
        bases = tuple(module.Callback for module in _framework_modules())
        _class = build_callback_class(_KeeperCallbackMixin, bases, __name__)
    return _class


def _floats(metrics: Any) -> dict[str, float]:
    """Scalar metrics as floats; tensors of several elements and non-numbers are skipped."""
    out: dict[str, float] = {}
    if not metrics:
        return out
    for key, value in dict(metrics).items():
        if not isinstance(key, str) or isinstance(value, str | bytes | bool):
            continue
        try:
            if hasattr(value, "numel") and value.numel() != 1:
                continue
            out[key] = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
    return out


class _KeeperCallbackMixin(CallbackBase):
    """Commit Lightning checkpoints to ckptkeeper after they are on disk; mark the run finished/failed.

    ``run_dir`` overrides the run dir (default: each ModelCheckpoint's ``dirpath``); ``name`` and
    ``parent`` are passed to :func:`ckptkeeper.track_run` (``parent`` defaults to the checkpoint
    ``fit(ckpt_path=...)`` resumed from).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        name: str | None = None,
        parent: ParentSpec = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        job: str | None = None,
        parts: int | None = None,
    ) -> None:
        super().__init__(
            run_dir, name=name, parent=parent, heartbeat_interval=heartbeat_interval, job=job, parts=parts
        )
        self._runs: dict[str, TrackedRun] = {}
        self._observed: list[tuple[Any, Callable[..., Any]]] = []
        self._polled: list[Any] = []
        self._committed: set[str] = set()
        self._pending: list[tuple[Any, str, int, dict[str, float]]] = []

    # -- Lightning hooks ----------------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._guard(self._start, trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Restored state (global_step) is only known now; trainer.ckpt_path is the resolved checkpoint.
        if self._runs and self.parent is None and trainer.ckpt_path:
            self._guard(self._set_parent_from, trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard(self._sweep, trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard(self._sweep, trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard(self._sweep, trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard(self._end, trainer, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._guard(self._end, trainer, describe_exception(exception))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Paths that skip on_fit_end (a tuner's early exit) still end the run and unhook.
        if any(run.state == "active" for run in self._runs.values()):
            self._guard(self._end, trainer, None)

    # -- internals ----------------------------------------------------------------------------------

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # bookkeeping must never take training down
            log.warning("ckptkeeper: %s failed: %s: %s", fn.__name__, type(exc).__name__, exc, exc_info=True)

    def _checkpoint_callbacks(self, trainer: Any) -> list[Any]:
        return [cb for cb in getattr(trainer, "checkpoint_callbacks", []) if getattr(cb, "dirpath", None)]

    def _start(self, trainer: Any) -> None:
        writes, job_part = self._node_part(
            rank=trainer.global_rank,
            local_rank=trainer.local_rank,
            world=trainer.world_size,
            node=trainer.node_rank,
            nodes=trainer.num_nodes,
        )
        if not writes:
            return
        # A second fit() on this callback starts afresh (ending is a no-op when the last fit ended).
        self._end(trainer, "a new fit() started before the previous one ended")
        self._unobserve()
        self._runs, self._pending = {}, []
        self._committed.clear()
        callbacks = self._checkpoint_callbacks(trainer)
        if not callbacks:
            self._warn_once(
                "no-checkpoint",
                "ckptkeeper: no ModelCheckpoint with a dirpath in this Trainer; "
                "KeeperCallback has nothing to track",
            )
            return
        for cb in callbacks:
            dirpath = os.fspath(cb.dirpath)
            if "://" in dirpath:
                self._warn_once(
                    f"remote:{dirpath}", f"ckptkeeper: {dirpath} is not a local path; not tracked"
                )
                continue
            top_k = getattr(cb, "save_top_k", -1)
            if top_k != -1:
                self._warn_once(
                    "top-k",
                    f"ckptkeeper: ModelCheckpoint(save_top_k={top_k}) rotates checkpoints itself, "
                    "deleting files behind ckptkeeper's back (its retention policy can no longer keep "
                    "them); use save_top_k=-1 and let the ckptkeeper policy decide what to keep.",
                )
            run_dir = self.run_dir or dirpath
            key = os.path.realpath(run_dir)
            if key not in self._runs:
                self._runs[key] = self._track(run_dir, job_part)
            self._observe(cb, trainer)

    def _observe(self, cb: Any, trainer: Any) -> None:
        original = getattr(cb, "_save_checkpoint", None)
        if not callable(original):
            self._polled.append(cb)
            return

        def save_and_commit(trainer_: Any, filepath: str, *args: Any, **kwargs: Any) -> Any:
            result = original(trainer_, filepath, *args, **kwargs)
            # Installed only in a writer (global rank zero, or a node's local rank zero).
            self._guard(self._saved, trainer_, cb, os.fspath(filepath), trainer_.global_step)
            return result

        cb._save_checkpoint = save_and_commit
        self._observed.append((cb, save_and_commit))

    def _unobserve(self) -> None:
        for cb, wrapper in self._observed:
            if vars(cb).get("_save_checkpoint") is wrapper:
                del cb._save_checkpoint
        self._observed.clear()
        self._polled.clear()

    def _saved(self, trainer: Any, cb: Any, filepath: str, step: int) -> None:
        if filepath == getattr(cb, "last_model_path", None) or filepath in self._committed:
            return
        metrics = _floats(trainer.callback_metrics)
        monitor = getattr(cb, "monitor", None)
        score = getattr(cb, "best_k_models", {}).get(filepath)
        if monitor and score is not None:
            metrics.update(_floats({monitor: score}))
        self._pending.append((cb, filepath, step, metrics))
        self._flush()

    def _flush(self, *, final: bool = False, elsewhere: bool = False) -> None:
        """Commit the pending files now on disk. ``final``: give up on the others, with a warning
        unless ``elsewhere`` (this node is not global rank zero's, and a strategy that saves whole
        checkpoints writes them there only)."""
        still: list[tuple[Any, str, int, dict[str, float]]] = []
        for cb, filepath, step, metrics in self._pending:
            if filepath in self._committed:
                continue
            if not os.path.exists(filepath):
                if final:
                    log.log(
                        logging.INFO if elsewhere else logging.WARNING,
                        "ckptkeeper: %s was reported saved but never appeared on disk%s",
                        filepath,
                        " (written by global rank 0, on another node)" if elsewhere else "",
                    )
                else:
                    still.append((cb, filepath, step, metrics))
                continue
            run = self._run_for(filepath)
            if run is None:
                log.warning("ckptkeeper: %s is outside every tracked run dir; not committed", filepath)
                continue
            run.commit(filepath, step, metrics)
            self._committed.add(filepath)
        self._pending = still

    def _run_for(self, filepath: str) -> TrackedRun | None:
        real = os.path.realpath(filepath)
        for root, run in self._runs.items():
            if real.startswith(root.rstrip(os.sep) + os.sep):
                return run
        return None

    def _sweep(self, trainer: Any) -> None:
        """Commit pending files now on disk; poll ModelCheckpoints we could not observe."""
        if not self._runs:
            return
        for cb in self._polled:
            candidates = [*getattr(cb, "best_k_models", {}), getattr(cb, "best_model_path", "")]
            for filepath in filter(None, candidates):
                filepath = os.fspath(filepath)
                if filepath in self._committed or any(p[1] == filepath for p in self._pending):
                    continue
                match = _STEP_IN_NAME.search(os.path.basename(filepath))
                if match:
                    step = int(match.group(1))
                elif filepath == getattr(cb, "_last_checkpoint_saved", None):
                    step = int(cb._last_global_step_saved)
                else:
                    step = trainer.global_step
                self._saved(trainer, cb, filepath, step)
        self._flush()

    def _set_parent_from(self, trainer: Any) -> None:
        ckpt = os.fspath(trainer.ckpt_path)
        if "://" in ckpt or not os.path.exists(ckpt):
            return
        ref = parent_ref(ckpt, step=trainer.global_step, relative_to=next(iter(self._runs)))
        for run in self._runs.values():
            run.set_parent(ref)

    def _end(self, trainer: Any, failure: str | None) -> None:
        try:
            if self._runs:
                self._sweep(trainer)
                self._flush(final=True, elsewhere=not trainer.is_global_zero)
        finally:
            for run in self._runs.values():
                if failure is None:
                    run.finish()
                else:
                    run.fail(failure)
            late = failure is not None and any(
                getattr(cb, "save_on_exception", False) for cb, _ in self._observed
            )
            if not late:
                self._unobserve()
                self._runs = {}
                self._pending = []
            # else: ModelCheckpoint(save_on_exception=True) saves from its own on_exception, which runs after
            # ours (Lightning orders checkpoint callbacks last). Stay hooked so that checkpoint is committed
            # to the now failed run; the next fit() on this callback unhooks.
