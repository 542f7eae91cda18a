"""Byte progress of a restore, shared by :mod:`.restore` and :mod:`.restore_parts`.

Its own leaf module because ``restore`` imports ``restore_parts`` (lazily, only for shared tiers): a
helper living in either would make the other import it back, a circle.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptkeeper.storage import Progress

__all__ = ["byte_progress"]


def byte_progress(total: int, progress: Callable[[int, int], None] | None) -> Progress:
    """Turn a caller's ``progress(done, total)`` into the per-chunk callback a storage fetch calls
    with each increment. Each call starts its own count at 0: a restore that falls back to the next
    tier takes a new one, so the count restarts (as :func:`.restore.restore_to` documents), while
    the parts of one version share one, so the count runs once over all of them."""
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    return on_bytes
