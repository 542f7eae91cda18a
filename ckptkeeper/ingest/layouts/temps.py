"""Temp names the frameworks write while a save is in flight, version by version.

Every rule here was read from the framework's own source (or observed from a kill -9 of a real
save, ``tests/fixtures/generate.py``), never guessed:

* Orbax (``orbax/checkpoint/_src/path/atomicity.py`` / ``step.py``): the step dir and each item dir
  are written under ``<final name>`` + ``TMP_DIR_SUFFIX`` and renamed when committed. Up to 0.11 the
  suffix was ``.orbax-checkpoint-tmp-<timestamp>``; 0.12 (``atomicity_types.TMP_DIR_SUFFIX``) writes
  ``<step>.orbax-checkpoint-tmp`` with nested ``default.orbax-checkpoint-tmp`` item dirs (holding
  ``ocdbt.process_N/`` and ``_sharding``). Orbax's own test ``TMP_DIR_SUFFIX in name`` covers both,
  and so does ours.
* safetensors >= 0.5 (Rust ``serialize_file``): a ``tempfile::NamedTempFile`` in the target's
  directory, named ``.tmp`` + 6 alphanumerics (``.tmp8hXSZv``), renamed over the target at the end.
  transformers ``save_pretrained`` and accelerate ``save_state`` go through it, so a kill leaves it
  inside ``checkpoint-N/`` or ``checkpoint_N/``.
* torch DCP ``FileSystemWriter.finish``: ``.metadata.tmp`` (or ``__<rank>.metadata.tmp`` without
  collectives) renamed to ``.metadata``. Inside a DCP dir it is that checkpoint's own marker (a
  save in progress), so it is only an artifact where no candidate owns it.
* transformers 4.36-4.37 staged HF checkpoints as ``tmp-checkpoint-N/`` (renamed when done).
* NeMo ``<name>-unfinished`` markers (handled by the NeMo recognizer: orphan ones are artifacts).
* DeepSpeed, Megatron (legacy ``torch`` format) and Lightning write their final names directly
  (Lightning's ``_atomic_save`` stages through fsspec in the system temp dir, not in the run), so
  they leave no temp name in the run: a killed save is a partial checkpoint, judged by markers.
* Generic ``*.tmp`` / ``*.part`` files; our own staging names (``protocol.STAGING_MARK``).

A temp artifact is never a candidate and never descended into (so nothing under it is mistaken for
a checkpoint at step 0, as Orbax's ``ocdbt.process_0/`` once was), it is reaped whole.
"""

from __future__ import annotations

import re
from typing import Final

from ckptkeeper.hook.protocol import STAGING_MARK

ORBAX_TMP: Final = ".orbax-checkpoint-tmp"
"""Infix of every Orbax temp dir: ``<name>.orbax-checkpoint-tmp`` (0.12) and
``<name>.orbax-checkpoint-tmp-<timestamp>`` (older)."""
HF_TMP_CHECKPOINT: Final = "tmp-checkpoint-"
SAFETENSORS_TMP: Final = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")
"""Rust ``tempfile`` default: prefix ``.tmp``, 6 random alphanumerics, no suffix."""
DCP_METADATA_TMP_NAME: Final = re.compile(r"^(?:__\d+)?\.metadata\.tmp$")
"""``.metadata.tmp`` and the per-rank ``__<rank>.metadata.tmp`` of ``FileSystemWriter.finish``."""


def dir_kind(name: str) -> str | None:
    """The artifact kind of a directory with this name, or None when it is no temp dir."""
    if STAGING_MARK in name:
        return "ckptkeeper-staging"
    if ORBAX_TMP in name:
        return "orbax-tmp"
    if name.startswith(HF_TMP_CHECKPOINT):
        return "tmp-checkpoint"
    return None


def file_kind(name: str, *, in_candidate: bool) -> str | None:
    """The artifact kind of a regular file with this name, or None.

    ``in_candidate``: the file lies inside a recognized checkpoint. There the DCP metadata temp is
    the checkpoint's own in-progress marker (it makes the checkpoint partial; the whole dir is then
    what gets reaped), so it is not reported separately.
    """
    if STAGING_MARK in name:
        return "ckptkeeper-staging"
    if ORBAX_TMP in name:
        return "orbax-tmp"
    if SAFETENSORS_TMP.match(name):
        return "safetensors-tmp"
    if DCP_METADATA_TMP_NAME.match(name):
        return None if in_candidate else "metadata-tmp"
    if name.endswith((".tmp", ".part")):
        return "tmp-file"
    return None
