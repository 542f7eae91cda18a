"""The one ranking of ``--step best``: index rows (local restore) and another node's manifests
(``restore --node``) go through :func:`best_by_metric`, so both pick the same checkpoint."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from ckptkeeper.actions.restore import best_by_metric

Scored = tuple[int, Mapping[str, float]]
ROWS: list[Scored] = [(100, {"loss": 0.5}), (200, {"loss": 0.3}), (300, {"loss": 0.3}), (400, {"acc": 0.9})]


@pytest.mark.parametrize(
    ("mode", "metric", "expected"),
    [
        ("min", "loss", 300),  # 200 and 300 tie on 0.3: the newer step wins
        ("max", "loss", 100),
        ("max", "acc", 400),
        ("min", "acc", 400),  # the only row reporting it
    ],
)
def test_best_by_metric(mode: str, metric: str, expected: int) -> None:
    best = best_by_metric(ROWS, lambda r: r[1], lambda r: r[0], "run", metric, mode)
    assert best[0] == expected


def test_no_row_reports_the_metric_names_what_is_reported() -> None:
    with pytest.raises(LookupError, match=r"reports 'bleu' \(metrics reported: acc, loss\)"):
        best_by_metric(ROWS, lambda r: r[1], lambda r: r[0], "run", "bleu", "min")
