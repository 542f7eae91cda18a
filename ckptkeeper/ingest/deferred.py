"""A new checkpoint the catalog saw but did not hash yet (``Catalog(defer_new=True)``): what a
move needs to hash it while it copies it, and the fingerprints that vouch for its bytes
(:mod:`ckptkeeper.util.fingerprint`, docs/bandwidth.md)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ckptkeeper.core.model import NodePart
from ckptkeeper.hook import protocol
from ckptkeeper.ingest import layouts
from ckptkeeper.util import fingerprint
from ckptkeeper.util.fingerprint import Fingerprint

__all__ = ["Deferred", "fingerprints"]


@dataclass(frozen=True)
class Deferred:
    """A new complete checkpoint the catalog saw but did not hash (``Catalog.defer_new``)."""

    run_dir: Path
    cand: layouts.Candidate
    commit: protocol.Commit | None
    part: NodePart | None
    now: float
    """The reconcile's clock, which judged it complete."""
    fingerprints: dict[str, Fingerprint]
    """File path in the checkpoint -> its fingerprint when the catalog saw it."""
    metrics: dict[str, float]
    created_at: float

    @property
    def path(self) -> str:
        return f"{self.cand.run}/{self.cand.name}"


def fingerprints(
    base: Path, files: Iterable[str], *, now: float | None = None
) -> dict[str, Fingerprint] | None:
    """The fingerprint of each file of the checkpoint at ``base``; None when one cannot vouch for
    its file (gone, not a regular file, or changed too recently: :func:`fingerprint.settled`).
    ``now``: the time by the clock that stamps the files (the catalog's; default this node's)."""
    taken = time.time_ns() if now is None else int(now * 1e9)
    prints: dict[str, Fingerprint] = {}
    for rel in files:
        try:
            st = os.lstat(base / rel if rel else base)
        except OSError:
            return None
        fp = fingerprint.of(st)
        if not stat.S_ISREG(st.st_mode) or not fingerprint.settled(fp, taken):
            return None
        prints[rel] = fp
    return prints
