"""Single-file checkpoints: ``torch.save`` / Lightning files, and the generic ``file`` fallback."""

from __future__ import annotations

import os
import re
from typing import Final

from ckptkeeper.ingest.layouts.base import (
    _name_metrics,
    _Node,
    _safetensors_problem,
    _strip_ext,
    _Verdict,
    _zip_problem,
    parse_step,
)

TORCH_EXTS: Final = (".ckpt", ".pt", ".pth")
FILE_EXTS: Final = (".bin", ".safetensors", ".npz", ".msgpack", ".pkl", ".h5")

_SHARD_NAME = re.compile(r"\d+-of-\d+")
"""``model-00001-of-00002.safetensors``: a weight shard, never a checkpoint by itself."""


class _Torch:
    """Lightning / ``torch.save`` files (``*.ckpt``, ``*.pt``, ``*.pth``): complete when the zip
    end-of-central-directory is readable — torch.save writes it last.

    Step from the name (``epoch=3-step=40.ckpt``, ``model_1000.pt``); ``last.ckpt`` (no step) is
    ignored, and when it is a symlink it was never looked at.
    """

    layout = "torch"

    def claims(self, node: _Node) -> bool:
        return node.is_file and node.name.endswith(TORCH_EXTS) and not _is_shard_member(node)

    def step(self, node: _Node) -> int | None:
        return parse_step(_strip_ext(node.name, TORCH_EXTS))

    def check(self, node: _Node) -> _Verdict:
        problem = _zip_problem(node.path, node.st.st_size)
        return _Verdict(
            problems=(problem,) if problem else (), metrics=_name_metrics(_strip_ext(node.name, TORCH_EXTS))
        )


class _File:
    """Fallback: another single file with a step in its name (``.bin``, ``.safetensors``, ``.npz``…).

    Formats with a checkable structure are checked (safetensors header, zip directory for ``.npz``
    and zip-based ``.bin``); for the others only settling (``last_write``) says it is done.
    """

    layout = "file"

    def claims(self, node: _Node) -> bool:
        return node.is_file and node.name.endswith(FILE_EXTS) and not _is_shard_member(node)

    def step(self, node: _Node) -> int | None:
        return parse_step(_strip_ext(node.name, FILE_EXTS))

    def check(self, node: _Node) -> _Verdict:
        metrics = _name_metrics(_strip_ext(node.name, FILE_EXTS))
        problem: str | None = None
        corrupt = False
        if node.name.endswith(".safetensors"):
            problem, corrupt = _safetensors_problem(node.path, node.st.st_size)
        elif node.name.endswith(".npz") or (node.name.endswith(".bin") and _starts_with_zip(node.path)):
            problem = _zip_problem(node.path, node.st.st_size)
        return _Verdict(problems=(problem,) if problem else (), corrupt=corrupt, metrics=metrics)


def _starts_with_zip(path: str) -> bool:
    return _read_head(path, 4) == b"PK\x03\x04"


def _read_head(path: str, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read(n)


def _is_shard_member(node: _Node) -> bool:
    """Weight shards belong to their index (``model-00001-of-00002.safetensors``), not to us."""
    return _SHARD_NAME.search(node.name) is not None or node.name in node.parent.indexed_shards
