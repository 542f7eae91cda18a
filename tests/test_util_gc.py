"""gc_paused: the GC pause callers put around plan() (the prune action, bench/planning.py)."""

from __future__ import annotations

import gc

from ckptkeeper.util.gc import gc_paused


def test_gc_paused_leaves_the_callers_gc_state_alone() -> None:
    """Paused inside; afterwards objects the process froze itself (e.g. before forking data-loader
    workers) stay frozen, and a disabled GC stays disabled."""
    keepsake = [object() for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_paused():
            assert not gc.isenabled()
            survivors = [[i] for i in range(1000)]
        # Not exact: a frozen object whose last reference goes away meanwhile leaves the count.
        # Thawing them all would leave 0.
        assert gc.get_freeze_count() > frozen // 2
        assert gc.isenabled()
        gc.disable()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
    assert keepsake and survivors


def test_gc_paused_moves_survivors_to_the_oldest_generation() -> None:
    """With nothing frozen by the process, what the block allocated is not left young (the first
    young collection would scan it all) and nothing stays frozen."""
    gc.collect()
    assert gc.get_freeze_count() == 0
    with gc_paused():
        survivors = [[i] for i in range(10_000)]
    assert gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 1000
    assert survivors
