"""Which node of a multi-node job this process is on, and whether it writes the hook's files.

A job whose ranks save to node-local disks leaves on each node only its ranks' files: the marker
that makes a checkpoint complete (DCP ``.metadata``, DeepSpeed ``latest``, Megatron's tracker,
Orbax's ``_CHECKPOINT_METADATA``) lives on one node only. So one process per *node* writes the
hook's files (the node's local rank 0), and says which part of the job its node holds: the job id,
the node's part index (0-based, like ``GROUP_RANK``) and the number of parts (nodes). The daemon
of each node then knows its checkpoints are parts, complete for that node, never partial saves.

Read once when a run is tracked, from the environment launchers set (torchrun / torchelastic:
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``TORCHELASTIC_RUN_ID``; Slurm: ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
``SLURM_NNODES``, ``SLURM_JOB_ID``; ``NODE_RANK`` of Lightning / DeepSpeed launchers), from
explicit ``track_run(job=, part=, parts=)``, or from what a framework knows of the process (the
Lightning and Hugging Face callbacks pass their ranks, world size and node count). Standard library only, pure (the environment is an
argument): training processes import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_PARTS = 1_000_000
"""More nodes than any job has: a larger count in a run dir is not one a launcher wrote."""


@dataclass(frozen=True, slots=True)
class JobPart:
    """This node's share of a multi-node job (``parts`` > 1)."""

    job: str | None
    """The job's id (``TORCHELASTIC_RUN_ID``, ``SLURM_JOB_ID`` or ``track_run(job=...)``); None
    when no launcher said and the caller did not either."""
    part: int
    """0-based index of this node's part (``GROUP_RANK`` / ``NODE_RANK`` / ``SLURM_NODEID``)."""
    parts: int
    """How many parts (nodes) every checkpoint of the job has."""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.job, "part": self.part, "parts": self.parts}


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` set to a non-negative integer; launchers never write anything else,
    so a malformed value is treated as unset (the hook must never stop training)."""
    for name in names:
        raw = env.get(name, "").strip()
        if raw.isdigit():
            return int(raw)
    return None


def _checked(value: Any, what: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= MAX_PARTS:
        raise ValueError(f"{what} must be in [{lo}, {MAX_PARTS}], got {value}")
    return value


def detect(
    env: Mapping[str, str],
    *,
    job: str | None = None,
    part: int | None = None,
    parts: int | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world: int | None = None,
) -> tuple[bool, JobPart | None]:
    """(does this process write the hook's files, this node's part or None for a one-node job).

    Explicit arguments win over the environment. ``rank``, ``local_rank`` and ``world`` (the
    number of processes) are what a framework knows of this process (Lightning's
    ``trainer.global_rank``, Hugging Face's ``args.process_index``, …); they stand for ``RANK``,
    ``LOCAL_RANK`` and ``WORLD_SIZE``, so a framework callback decides exactly as the hook would. The number of parts is ``parts``, else
    ``WORLD_SIZE / LOCAL_WORLD_SIZE`` (torchrun), else ``SLURM_NNODES``; the part index is
    ``part``, else ``GROUP_RANK`` / ``NODE_RANK`` / ``SLURM_NODEID``, else ``RANK //
    LOCAL_WORLD_SIZE``. With more than one part the writer is the node's local rank 0
    (``LOCAL_RANK`` / ``SLURM_LOCALID`` unset or 0); otherwise, as before, the process with ``RANK``
    (``SLURM_PROCID``) unset or 0. A count of parts without a known index of this node is no part
    at all: a wrong index would be worse than none.
    """
    if job is not None and (not isinstance(job, str) or not job or "\0" in job or len(job) > 255):
        raise ValueError(f"job must be a non-empty str of at most 255 characters, got {job!r}")
    if part is not None:
        part = _checked(part, "part", 0)
    if parts is not None:
        parts = _checked(parts, "parts", 1)
    if part is not None and parts is not None and part >= parts:
        raise ValueError(f"part must be below parts ({parts}), got {part}")
    for value, what in ((rank, "rank"), (local_rank, "local_rank"), (world, "world")):
        if value is not None:
            _checked(value, what, 0)
    if rank is None:
        rank = _env_int(env, "RANK", "SLURM_PROCID")
    if local_rank is None:
        local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID")
    local_world = _env_int(env, "LOCAL_WORLD_SIZE")
    if parts is None:
        if world is None:
            world = _env_int(env, "WORLD_SIZE")
        if world and local_world and world % local_world == 0:
            parts = world // local_world
        else:
            parts = _env_int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if part is None:
        part = _env_int(env, "GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
        if part is None and rank is not None and local_world:
            part = rank // local_world
    if job is None:
        found = env.get("TORCHELASTIC_RUN_ID", "").strip() or env.get("SLURM_JOB_ID", "").strip()
        # torchrun's default rendezvous id is the literal "none": no id at all.
        job = found[:255] if found and found != "none" and "\0" not in found else None
    if parts is None or parts < 2 or part is None or part >= parts:
        return rank in (None, 0), None
    return local_rank in (None, 0), JobPart(job=job, part=part, parts=parts)


def scheduler_job(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The scheduler job of this process, as ``run.json`` records it (``scheduler_job``):
    ``{"scheduler": "slurm", "id": SLURM_JOB_ID, "restarts": SLURM_RESTART_COUNT}``; None outside
    a job. ``ckptkeeper job end`` finds a job's runs by it, and tells a requeue (the job's restart
    count grew since the run started) from a failure."""
    job = env.get("SLURM_JOB_ID", "").strip()
    if not job or len(job) > 64 or not job.replace("_", "").isdigit():
        return None
    restarts = _env_int(env, "SLURM_RESTART_COUNT")
    doc: dict[str, Any] = {"scheduler": "slurm", "id": job, "restarts": restarts or 0}
    node = env.get("SLURMD_NODENAME", "").strip()
    if node and len(node) <= 255 and "\0" not in node:
        doc["node"] = node
    return doc
