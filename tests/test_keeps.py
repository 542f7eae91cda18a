"""``Plan.keep`` from the planner is a :class:`Keeps`: built on first read from one-shot parts.
Whoever reads it first, from whichever thread, every reader sees the same keeps, and it compares
like the tuple it stands for."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ckptkeeper.core.model import Keep, Keeps


def _parts() -> list[object]:
    def plain() -> Iterator[Keep]:
        for step in range(1000):
            if step % 100 == 0:
                time.sleep(0)  # let another reader in mid-build (a real plan's build takes long)
            yield Keep("r", step, "hot", ("last 2",))

    return [[Keep("a", 1, "warm", ("pinned",))], plain(), iter([Keep("z", 9, "cold", ())])]


EXPECTED = (
    Keep("a", 1, "warm", ("pinned",)),
    *(Keep("r", s, "hot", ("last 2",)) for s in range(1000)),
    Keep("z", 9, "cold", ()),
)


def test_keeps_read_like_the_tuple_they_stand_for() -> None:
    keeps = Keeps(_parts())  # type: ignore[arg-type]
    assert len(keeps) == 1002
    assert keeps == EXPECTED and keeps == list(EXPECTED) and keeps == Keeps([EXPECTED])
    assert keeps[0] == EXPECTED[0] and keeps[-1] == EXPECTED[-1] and keeps[1:3] == EXPECTED[1:3]
    assert Keep("r", 500, "hot", ("last 2",)) in keeps
    assert list(keeps) == list(EXPECTED)  # a second read: the one-shot parts were not read twice
    assert keeps != EXPECTED[:-1] and Keeps() == ()


def test_concurrent_first_reads_all_see_every_keep() -> None:
    for _ in range(20):
        keeps = Keeps(_parts())  # type: ignore[arg-type]
        start = threading.Barrier(8)
        seen: list[tuple[Keep, ...]] = []

        def read(
            keeps: Keeps = keeps, start: threading.Barrier = start, seen: list[tuple[Keep, ...]] = seen
        ) -> None:
            start.wait()
            seen.append(tuple(keeps))

        threads = [threading.Thread(target=read) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == [EXPECTED] * 8
