"""Recognizers of docs/design.md, "Completeness": which paths under a run directory are checkpoints, and are they complete.

Filesystem events fire on half-written files, so every framework's own completion marker is checked
here; the catalog adds the ``settle_seconds`` rule on top (``Candidate.last_write``) and the hook's
commits override both. This package only reads: ``lstat``, directory listings and small marker files
(``trainer_state.json``, ``latest``, index files, safetensors headers, zip directories). It never
writes, never follows a symlink, never crosses into another filesystem and never hashes content —
the catalog does that, once, for complete checkpoints.

Layouts and their precedence
----------------------------
A directory can satisfy several recognizers (an HF ``checkpoint-N/`` holds ``model.safetensors``;
a Megatron ``torch_dist`` ``iter_N/`` is also a torch DCP directory; a NeMo distributed checkpoint
is one too). It still yields ONE candidate: the layout is the first applicable one in
``RECOGNIZERS`` and the candidate is complete only when *every* applicable recognizer says so; its
``problem`` lists every failure. The order, most specific first::

    hf > accelerate > megatron > deepspeed > nemo > orbax > dcp > safetensors > torch > file

Framework conventions (a name pattern plus a framework-level marker or tracker) come before the
container formats they are built on (DCP, safetensors, torch zip), and the generic single-file
fallback comes last.

Where checkpoints are looked for
--------------------------------
``scan_run`` walks the run directory top-down (``os.scandir``, ``lstat``) and stops descending
at the first recognized checkpoint, so ``checkpoint-100/global_step100/`` (HF + DeepSpeed) is one HF
checkpoint: a checkpoint is atomic, nothing inside it is a checkpoint of its own. A directory no
layout claims with a step is walked, but a numbered file in one whose name carries a step
(``step-3/shard-0.bin``, ``step-3/rank_0.pt``, ``step-3/model-00001.bin``,
``step-3/model_step3.pt``) or that a layout claims without one (``final/`` holding
``model.safetensors``) is a part of that save, never a checkpoint at step 0
(``scan._part_of_dir``). The hook's commit of ``step-3`` makes the directory one checkpoint, and
the catalog drops whatever the scan found inside a committed path (``hookfiles.with_commits``).
Skipped entirely: symlinks (``last.ckpt`` links included), ``.ckptkeeper/`` (the
hook's control dir), Megatron ``non_persistent/`` dirs, other filesystems (mount points), and
anything that is neither a regular file nor a directory.

Temp artifacts (``RunScan.artifacts``), each reported once; the names each framework version
writes are documented in ``layouts.temps``. A temp name is not a checkpoint: the real one appears
under its final name by rename, so these are artifacts only, never candidates and never descended
into (``recognize`` returns None for them). Inside a checkpoint dir they are not part of the
checkpoint either (not in ``files``, hashed or copied) and are reported as artifacts of their own —
unless the hook committed that checkpoint: then the catalog lists every regular file under it and
drops these artifacts (``hookfiles.with_commits``, ``hookfiles.outside_commits``):

* ``ckptkeeper-staging`` — any name containing ``.ckptkeeper-tmp-`` (``protocol.STAGING_MARK``) (our interrupted copies);
* ``orbax-tmp`` — ``*.orbax-checkpoint-tmp`` (Orbax 0.12) and ``*.orbax-checkpoint-tmp-<ts>`` (older),
  step dirs and nested item dirs alike; ``tmp-checkpoint`` — ``tmp-checkpoint-*`` (transformers 4.36);
* ``safetensors-tmp`` — ``.tmpXXXXXX`` files of safetensors' atomic write (Rust ``tempfile``);
* ``nemo-unfinished`` — an orphan ``<name>-unfinished`` marker whose checkpoint is absent. A marker
  whose checkpoint exists makes that checkpoint a partial candidate and is not listed separately
  (reaping the partial checkpoint leaves the marker orphaned; the next scan reports it);
* ``metadata-tmp`` — a ``.metadata.tmp`` / ``__<rank>.metadata.tmp`` that is not inside a candidate
  (e.g. in a DCP dir whose name has no step). Inside a DCP candidate it only makes that candidate
  partial: the whole directory is the thing to reap;
* ``tmp-file`` — other ``*.tmp`` / ``*.part`` files.

Steps
-----
Steps are non-negative Python ints, compared numerically (huge values are returned as they are;
the catalog caps what SQLite can hold). Two checkpoints of one run may share a step
(``epoch=0-step=10.ckpt`` and ``epoch=0-step=10-v1.ckpt``, or NeMo ``…-last.ckpt``): both are
candidates. ``name`` is the unique key within a run; candidates are ordered by (step, name). A path
whose step cannot be parsed is not a checkpoint we can order and is ignored (never reaped either).

Names are ``str`` decoded with ``os.fsdecode`` (surrogateescape) everywhere; a non-UTF-8 byte
becomes a lone surrogate, which callers must encode back with ``os.fsencode`` / surrogateescape
(SQLite's UTF-8 codec rejects lone surrogates).
"""

from ckptkeeper.ingest.layouts.base import Candidate, RunScan, lies_inside, parse_step
from ckptkeeper.ingest.layouts.scan import LAYOUTS, RECOGNIZERS, is_shared_marker, recognize, scan_run

__all__ = [
    "LAYOUTS",
    "RECOGNIZERS",
    "Candidate",
    "RunScan",
    "is_shared_marker",
    "lies_inside",
    "parse_step",
    "recognize",
    "scan_run",
]
