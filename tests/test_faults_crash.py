"""``kill -9`` at random instants (docs/design.md, safety invariant 5): nothing kept is lost, nothing temporary is left.

Each trial builds a fresh :class:`faultnode.FaultNode` (local copies, same-filesystem renames,
multipart uploads to S3, deletes from hot/warm/S3, reaps of a failed run and of temp artifacts all
happen in one prune), then SIGKILLs one process:

* ``prune-point``: ``prune`` with ``CKPTKEEPER_TEST_CRASH_AFTER=K`` (journal phases, every chunk of
  a copy, removals), K drawn from the crash points a calibration run passed through;
* ``prune-time``: ``prune`` killed after a random delay inside the window where it does work;
* ``daemon-time`` / ``daemon-point``: the same for ``ckptkeeper daemon`` (scheduled retention and
  reap jobs every second).

Right after the kill every kept checkpoint must still be intact (byte-compared) in at least one
committed location. Then a restart — ``prune``, or for half the daemon trials the daemon itself —
must finish or undo the interrupted step: every checkpoint where docs/design.md, "Retention" puts it, every copy the
index names intact, no staging names, orphan manifests, uncommitted S3 data or incomplete
multipart uploads left, the file outside the roots untouched.

CI runs ``CI_TRIALS`` trials (about 1.5 minutes on 2 cores). The stress mode is one command, which
also runs the 20 % S3-fault scenario with ten seeds instead of two (``test_faults_s3.py``)::

    CKPTKEEPER_STRESS_TRIALS=200 .venv/bin/python -m pytest -s tests/test_faults_crash.py tests/test_faults_s3.py

(``CKPTKEEPER_STRESS_SEED`` picks other trials; ``CKPTKEEPER_STRESS_REPORT=path.json`` writes the
tallies.) ``-s`` shows the summary lines printed at the end.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from faultnode import GOLDEN, FaultNode, Template, kill

CI_TRIALS = 10
TRIALS = int(os.environ.get("CKPTKEEPER_STRESS_TRIALS") or CI_TRIALS)
SEED = int(os.environ.get("CKPTKEEPER_STRESS_SEED") or 7)
MIX = (("prune-point", 0.4), ("prune-time", 0.25), ("daemon-time", 0.2), ("daemon-point", 0.15))

TRACE_WRAPPER = """
import json, os, sys, time
import ckptkeeper.executor as _ex
_hit = _ex._CrashPoints.hit
_out = open(os.environ["CKPT_TRACE"], "a", buffering=1)
def hit(self, where):
    _out.write(json.dumps([where, time.time()]) + "\\n")
    _hit(self, where)
_ex._CrashPoints.hit = hit
from ckptkeeper.cli import main
sys.exit(main())
"""


def trial_kinds(n: int) -> list[str]:
    """Kinds in proportion to MIX, interleaved so any prefix of the list is a fair sample."""
    counts = {kind: max(1, round(n * share)) for kind, share in MIX}
    while sum(counts.values()) > n:
        counts[max(counts, key=lambda k: counts[k])] -= 1
    while sum(counts.values()) < n:
        counts["prune-point"] += 1
    kinds = [k for k, c in counts.items() for _ in range(c)]
    random.Random(SEED).shuffle(kinds)
    return kinds


KINDS = trial_kinds(TRIALS)


@dataclass
class Calibration:
    prune_points: list[str]
    """Label of every crash point an uninterrupted prune passes, in order (K = position + 1)."""
    prune_times: list[float]
    """Seconds after Popen at which each of those points was reached."""
    daemon_points: list[str]
    daemon_times: list[float]


@dataclass
class Tally:
    trials: Counter[str] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    killed_before_exit: int = 0
    lost: int = 0
    litter: int = 0

    def report(self) -> str:
        return (
            f"crash trials: {sum(self.trials.values())} ({dict(self.trials)}); "
            f"killed mid-run {self.killed_before_exit}; phases hit {dict(self.phases)}; "
            f"checkpoints lost {self.lost}; litter left {self.litter}"
        )


TALLY = Tally()


def new_bucket(endpoint: str) -> str:
    import boto3

    name = f"crash-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def read_trace(path: Path, start: float) -> tuple[list[str], list[float]]:
    labels, times = [], []
    for line in path.read_text().splitlines():
        where, when = json.loads(line)
        labels.append(where)
        times.append(when - start)
    return labels, times


def wait_for(predicate: Any, timeout: float, interval: float = 0.3) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    return Template.build(tmp_path_factory.mktemp("template"))


@pytest.fixture(scope="module")
def calibration(
    template: Template, s3_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Calibration]:
    """One uninterrupted prune and one daemon, traced: where the crash points are and when."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    node = FaultNode(
        tmp_path_factory.mktemp("cal-prune"), template, endpoint=s3_server, bucket=new_bucket(s3_server)
    )
    trace = node.tmp / "trace.jsonl"
    start = time.time()
    result = node.cli("prune", env={"CKPT_TRACE": str(trace)}, wrapper=TRACE_WRAPPER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert node.misplaced(s3) == [] and node.litter(s3) == []
    prune_points, prune_times = read_trace(trace, start)

    node = FaultNode(
        tmp_path_factory.mktemp("cal-daemon"), template, endpoint=s3_server, bucket=new_bucket(s3_server)
    )
    trace = node.tmp / "trace.jsonl"
    trace.touch()
    start = time.time()
    proc = node.popen("daemon", env={"CKPT_TRACE": str(trace)}, wrapper=TRACE_WRAPPER, log="daemon")
    try:
        settled = wait_for(
            lambda: node.misplaced(s3) == [] and node.litter(s3) == [], timeout=60, interval=0.5
        )
        assert settled, node.log("daemon")[-3000:]
    finally:
        kill(proc, signal.SIGTERM)
    daemon_points, daemon_times = read_trace(trace, start)
    assert prune_points and daemon_points
    yield Calibration(prune_points, prune_times, daemon_points, daemon_times)
    line = TALLY.report()
    print("\n" + line)
    if os.environ.get("CKPTKEEPER_STRESS_REPORT"):
        Path(os.environ["CKPTKEEPER_STRESS_REPORT"]).write_text(
            json.dumps(
                {
                    "trials": dict(TALLY.trials),
                    "phases": dict(TALLY.phases),
                    "killed_before_exit": TALLY.killed_before_exit,
                    "lost": TALLY.lost,
                    "litter": TALLY.litter,
                    "prune_crash_points": len(prune_points),
                },
                indent=1,
            )
        )


def interesting(points: list[str]) -> list[int]:
    """Crash-point numbers K worth a trial: every journal/removal phase, and the first, middle and
    last chunk of every copy (a run of ``copy-progress`` points)."""
    ks: set[int] = set()
    i = 0
    while i < len(points):
        if points[i] != "copy-progress":
            ks.add(i + 1)
            i += 1
            continue
        j = i
        while j + 1 < len(points) and points[j + 1] == "copy-progress":
            j += 1
        ks.update({i + 1, (i + j) // 2 + 1, j + 1})
        i = j + 1
    return sorted(ks)


def phase_at(points: list[str], times: list[float], offset: float) -> str:
    """What the calibration run was doing ``offset`` seconds after start (for the tallies)."""
    if not times or offset < times[0]:
        return "startup/reconcile"
    last = max(i for i, t in enumerate(times) if t <= offset)
    return points[last] if last + 1 < len(points) else "after last step"


@pytest.mark.parametrize("trial", range(TRIALS), ids=[f"{i:03d}-{k}" for i, k in enumerate(KINDS)])
def test_sigkill_at_random_instant_loses_nothing_and_leaves_nothing(
    trial: int,
    calibration: Calibration,
    template: Template,
    tmp_path: Path,
    s3_server: str,
    s3_bucket: str,
    s3_client: Any,
) -> None:
    kind = KINDS[trial]
    rng = random.Random(f"{SEED}:{trial}")
    node = FaultNode(tmp_path, template, endpoint=s3_server, bucket=s3_bucket)
    what, how = kind.split("-")
    points, times = (
        (calibration.prune_points, calibration.prune_times)
        if what == "prune"
        else (calibration.daemon_points, calibration.daemon_times)
    )
    args = ("prune",) if what == "prune" else ("daemon",)
    env: dict[str, str] = {}
    if how == "point":
        # Half the trials at a phase boundary or copy edge, half at any point at all.
        pool = interesting(points) if rng.random() < 0.5 else list(range(1, len(points) + 1))
        k = rng.choice(pool)
        env["CKPTKEEPER_TEST_CRASH_AFTER"] = str(k)
        phase = points[k - 1]
        proc = node.popen(*args, env=env, log="crashed")
        try:
            # The daemon's jobs interleave differently from run to run, so its K-th point may
            # never come; a prune's always does (same plan, same order).
            code = proc.wait(timeout=90 if what == "prune" else times[-1] + 20)
        except subprocess.TimeoutExpired:
            code = kill(proc)
            phase = f"point {k} not reached; killed on a timer"
        finally:
            kill(proc)
        assert code == -signal.SIGKILL, (
            f"crash point {k} ({phase}) not reached:\n{node.log('crashed')[-3000:]}"
        )
    else:
        # A random instant between shortly before the first executor step and the last one.
        lo, hi = max(0.2, times[0] - 0.5), times[-1] + 0.2
        delay = rng.uniform(lo, hi)
        phase = phase_at(points, times, delay)
        proc = node.popen(*args, log="crashed")
        try:
            time.sleep(delay)
        finally:
            code = kill(proc)
        if code != -signal.SIGKILL:
            phase = "exited before the kill"
    TALLY.trials[kind] += 1
    TALLY.phases[phase] += 1
    TALLY.killed_before_exit += code == -signal.SIGKILL

    lost_now = node.lost(s3_client)
    TALLY.lost += len(lost_now)
    assert lost_now == [], f"kept checkpoints without an intact copy right after the kill at {phase}"
    assert node.outside_intact()

    if what == "daemon" and trial % 2:
        restarted = node.popen("daemon", log="restarted")
        try:
            settled = wait_for(
                lambda: node.misplaced(s3_client) == [] and node.litter(s3_client) == [],
                timeout=60,
                interval=0.5,
            )
        finally:
            assert kill(restarted, signal.SIGTERM) == 0, node.log("restarted")[-3000:]
        assert settled, node.log("restarted")[-3000:]
    else:
        again = node.cli("prune")
        assert again.returncode == 0, (
            f"after a kill at {phase}:\n{again.stdout[-3000:]}\n{again.stderr[-3000:]}"
        )

    litter = node.litter(s3_client)
    TALLY.litter += len(litter)
    lost_after = node.lost(s3_client)
    TALLY.lost += len(lost_after)
    assert lost_after == []
    assert litter == [], f"after a kill at {phase}"
    assert node.misplaced(s3_client) == [], f"after a kill at {phase}"
    assert node.outside_intact()
    assert sorted(GOLDEN) == sorted(node.placement())


def test_trial_mix_covers_every_kind() -> None:
    """The CI sample and the stress mode both exercise prune and daemon, crash points and timers."""
    assert {k for k, _ in MIX} <= set(trial_kinds(CI_TRIALS))
    stress = Counter(trial_kinds(200))
    assert sum(stress.values()) == 200 and min(stress.values()) >= 25


KILL_AFTER_S3_COMMIT = """
import os, signal, sys
import ckptkeeper.storage.s3 as _s3
_commit = _s3.S3TierStorage._commit_manifest
def commit(self, key, body):
    _commit(self, key, body)
    os.kill(os.getpid(), signal.SIGKILL)  # the copy is committed; its staging marker is not gone yet
_s3.S3TierStorage._commit_manifest = commit
from ckptkeeper.cli import main
sys.exit(main())
"""


def test_kill_between_s3_commit_and_marker_cleanup_leaves_no_marker(
    template: Template, tmp_path: Path, s3_server: str, s3_bucket: str, s3_client: Any
) -> None:
    """Regression: recovery recorded a copy that had committed but left its staging marker in S3
    (found by a ``daemon-time`` stress trial); only the reaper removed it, an hour later."""
    node = FaultNode(tmp_path, template, endpoint=s3_server, bucket=s3_bucket)
    crashed = node.cli("prune", wrapper=KILL_AFTER_S3_COMMIT)
    assert crashed.returncode == -signal.SIGKILL
    assert [k for k in node.s3_keys(s3_client) if ".ckptkeeper-tmp-" in k]  # the marker is there
    assert node.lost(s3_client) == []
    again = node.cli("prune")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "had committed; recorded" in again.stdout
    assert node.litter(s3_client) == []
    assert node.misplaced(s3_client) == []
