"""The scrub job: slower-tier copies re-hashed a little at a time.

End to end through the CLI (subprocesses, real files, moto over HTTP): a byte flipped in a warm
copy, or an S3 object overwritten with other bytes of the same size, is found by ``scrub`` (exit
1), shown damaged by ``ls``, copied again from hot by the next ``prune`` (the copy in the tier is
then byte-identical to the original), after which ``scrub`` is clean. A bad copy that is the only
copy is reported and never deleted; one another node wrote is reported and left alone. The pass's
selection (pure) and the token bucket (clock and sleep injected) are tested with values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, s3_tier, write_config
from test_survivor_recheck import tree_digest, write_checkpoint

from ckptkeeper.core.scrub import ScrubCandidate, pass_budget, select_for_scrub
from ckptkeeper.util.throttle import Stopped, TokenBucket

RUN = "r"

# -- the selection: a pure function ------------------------------------------------------------


def _cand(name: str, size: int, scrubbed_at: float | None, tier: str = "warm", **kw: Any) -> ScrubCandidate:
    step = int(name.rsplit("-", 1)[1])
    return ScrubCandidate(
        checkpoint_id=step,
        run=kw.get("run", "r"),
        name=name,
        step=step,
        bytes=size,
        tier=tier,
        location_version=kw.get("version", "v"),
        node="",
        scrubbed_at=scrubbed_at,
    )


SELECTION_TABLE = [
    # (candidates, budget, expected picks in order, deferred)
    pytest.param(
        [_cand("c-1", 10, 500.0), _cand("c-2", 10, None), _cand("c-3", 10, 100.0)],
        100,
        ["c-2", "c-3", "c-1"],
        0,
        id="never-scrubbed first, then oldest",
    ),
    pytest.param(
        [_cand("c-1", 40, 300.0), _cand("c-2", 40, 200.0), _cand("c-3", 40, 100.0)],
        90,
        ["c-3", "c-2"],
        1,
        id="whole copies within the budget",
    ),
    pytest.param(
        [_cand("c-1", 10, 300.0), _cand("c-2", 80, 200.0), _cand("c-3", 10, 100.0)],
        30,
        ["c-3"],
        2,
        id="stops at the first copy that does not fit (it leads the next pass)",
    ),
    pytest.param(
        [_cand("c-1", 500, 100.0), _cand("c-2", 10, 200.0)],
        30,
        ["c-1"],
        1,
        id="a copy larger than the budget is taken alone as a pass's first",
    ),
    pytest.param(
        [_cand("c-1", 10, None, tier="cold"), _cand("c-2", 10, None, tier="warm")],
        15,
        ["c-2"],
        1,
        id="ties: fastest tier first",
    ),
    pytest.param([], 100, [], 0, id="nothing to scrub"),
]


@pytest.mark.parametrize(("candidates", "budget", "expected", "deferred"), SELECTION_TABLE)
def test_selection_table(
    candidates: list[ScrubCandidate], budget: int, expected: list[str], deferred: int
) -> None:
    selection = select_for_scrub(candidates, budget, now=1000.0, tier_order=["hot", "warm", "cold"])
    assert [p.candidate.name for p in selection.picks] == expected
    assert selection.deferred == deferred
    assert selection.bytes == sum(p.candidate.bytes for p in selection.picks)
    if len(selection.picks) > 1:
        assert selection.bytes <= budget
    for pick in selection.picks:
        assert pick.reason.startswith(
            "never re-hashed" if pick.candidate.scrubbed_at is None else "last re-hashed"
        )


def test_selection_covers_everything_over_successive_passes() -> None:
    """Passes with a budget of two copies, each recording what it checked: every copy is checked
    once before any is checked twice (coverage by last-verified ordering)."""
    copies = {f"c-{i}": _cand(f"c-{i}", 10, None) for i in range(1, 6)}
    seen: list[list[str]] = []
    clock = 1000.0
    for _ in range(3):
        selection = select_for_scrub(list(copies.values()), 20, now=clock)
        names = [p.candidate.name for p in selection.picks]
        seen.append(names)
        for name in names:
            clock += 1
            c = copies[name]
            copies[name] = _cand(name, c.bytes, clock)
    assert seen[0] == ["c-1", "c-2"] and seen[1] == ["c-3", "c-4"] and seen[2] == ["c-5", "c-1"]


def test_pass_budget_is_rate_times_a_bounded_slice() -> None:
    assert pass_budget(100, 60.0) == 6000
    assert pass_budget(100, 6 * 3600.0) == 100 * 1800
    assert pass_budget(100, 0.0) == 100 * 1800  # off in the daemon; a manual pass gets a slice


# -- the token bucket: sleeps asked for, no timing -----------------------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_token_bucket_sleeps_to_hold_the_rate() -> None:
    t = FakeTime()
    bucket = TokenBucket(1000, clock=t.clock, sleep=t.sleep)
    bucket.consume(1000)  # the first second's worth: the bucket starts full
    assert t.sleeps == []
    for _ in range(4):
        bucket.consume(500)
    assert t.sleeps == pytest.approx([0.5, 0.5, 0.5, 0.5])
    assert bucket.slept == pytest.approx(2.0)
    t.now += 10.0  # idle: refills to one second's worth, no more
    bucket.consume(1000)
    bucket.consume(250)
    assert t.sleeps[4:] == pytest.approx([0.25])


def test_token_bucket_stops_on_the_stop_event() -> None:
    import threading

    t = FakeTime()
    stop = threading.Event()

    def sleep(seconds: float) -> None:
        t.sleep(seconds)
        stop.set()  # SIGTERM while throttled

    bucket = TokenBucket(100, clock=t.clock, sleep=sleep, stop=stop)
    with pytest.raises(Stopped):
        bucket.consume(300)
    assert t.sleeps == pytest.approx([2.0])


# -- end to end through the CLI -------------------------------------------------------------------


class Node:
    """A node with a hot tier and one slower tier, driven through the CLI."""

    def __init__(
        self, tmp: Path, slower: dict[str, Any], *, hot: dict[str, Any] | None = None, **top: Any
    ) -> None:
        self.tmp = tmp
        self.hot = tmp / "hot"
        self.hot.mkdir(exist_ok=True)
        self.run_dir = self.hot / RUN
        self.config = tmp / "config.toml"
        self.originals = tmp / "originals"
        self.slower = slower["name"]
        write_config(
            self.config,
            index=tmp / "index.db",
            daemon={"settle_seconds": "1s", "trust_mtimes": True, "metrics_addr": ""},
            tiers=[local_tier("hot", self.hot, **(hot or {})), slower],
            **top,
        )

    def write(self, *steps: int) -> None:
        now = time.time()
        self.originals.mkdir(exist_ok=True)
        for step in steps:
            write_checkpoint(self.run_dir, step, now - 3600 + step)
            dest = self.originals / f"checkpoint-{step}"
            subprocess.run(["cp", "-a", str(self.run_dir / f"checkpoint-{step}"), str(dest)], check=True)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ckptkeeper.cli", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def ok(self, *args: str) -> subprocess.CompletedProcess[str]:
        result = self.cli(*args)
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        return result

    def scrub(self, *args: str) -> tuple[int, dict[str, Any]]:
        result = self.cli("scrub", "--json", *args)
        assert result.returncode in (0, 1), result.stderr
        return result.returncode, json.loads(result.stdout)

    def ls(self) -> dict[int, dict[str, Any]]:
        (run,) = json.loads(self.ok("ls", "--json").stdout)["runs"]
        return {c["step"]: c for c in run["checkpoints"]}


def _flip_byte(path: Path) -> None:
    """One byte changed in place: same size, same mtime (bit rot a listing cannot see)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _found_repaired_clean(node: Node, damage: Any, copy_digest: Any) -> None:
    """The scenario every tier goes through: damage step 1's copy, scrub finds it, ls marks it,
    prune copies it again from hot, the copy is byte-identical, the next scrub is clean."""
    node.write(1, 2)
    node.ok("prune")
    assert node.ls()[1]["tiers"] == ["hot", node.slower]
    code, clean = node.scrub()
    assert code == 0 and clean["bad"] == [] and len(clean["checked"]) == 2, clean
    assert copy_digest(1) == tree_digest(node.originals / "checkpoint-1")

    damage()
    code, doc = node.scrub()
    assert code == 1, doc
    (bad,) = doc["bad"]
    assert (bad["run"], bad["step"], bad["tier"], bad["owner"]) == (RUN, 1, node.slower, None), bad
    assert "hash" in bad["problem"] and bad["next"] == "copied again from hot by the next prune", bad
    assert doc["exit_code"] == 1 and doc["no_good_copy"] == []

    entry = node.ls()[1]
    assert entry["tiers"] == ["hot"] and entry["damaged"][node.slower].startswith("scrub: "), entry
    status = json.loads(node.ok("status", "--json").stdout)
    assert status["damaged_copies"] == 1
    assert status["scrub"]["tiers"][node.slower]["bad"] == 1
    listing = node.ok("ls", RUN).stdout
    assert f"{node.slower}:DAMAGED" in listing, listing

    # a scan (sizes only) does not take the scrub's verdict back
    node.ok("scan")
    assert node.slower in node.ls()[1]["damaged"]

    pruned = json.loads(node.ok("prune", "--json").stdout)
    copies = [(a["action"], a["step"], a["tier"], a["to_tier"]) for a in pruned["actions"]]
    assert copies == [("copy", 1, "hot", node.slower)], pruned["actions"]
    assert pruned["result"]["failed"] == [] and pruned["result"]["skipped"] == [], pruned["result"]
    assert copy_digest(1) == tree_digest(node.originals / "checkpoint-1")
    entry = node.ls()[1]
    assert entry["tiers"] == ["hot", node.slower] and entry["damaged"] == {}, entry

    code, after = node.scrub()
    assert code == 0 and after["bad"] == [], after
    assert {(c["step"], c["ok"]) for c in after["checked"]} == {(1, True), (2, True)}


def test_warm_byte_flip_found_marked_and_copied_again(tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(tmp_path, local_tier("warm", warm, replicate=True))
    _found_repaired_clean(
        node,
        lambda: _flip_byte(warm / RUN / "checkpoint-1" / "model.safetensors"),
        lambda step: tree_digest(warm / RUN / f"checkpoint-{step}"),
    )


def test_s3_object_overwritten_same_size_found_and_copied_again(
    tmp_path: Path, s3_server: str, s3_bucket: str, s3_client: Any
) -> None:
    node = Node(tmp_path, s3_tier("cold", s3_bucket, s3_server, replicate=True))
    prefix = f"ckpt/{RUN}/checkpoint-1/"

    def objects() -> dict[str, bytes]:
        listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix=prefix)["Contents"]
        return {
            o["Key"][len(prefix) :]: s3_client.get_object(Bucket=s3_bucket, Key=o["Key"])["Body"].read()
            for o in listed
        }

    def digest(step: int) -> dict[str, str]:
        import hashlib

        return {k: hashlib.sha256(v).hexdigest() for k, v in sorted(objects().items())}

    def damage() -> None:
        key = prefix + "model.safetensors"
        body = s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        other = body[:-64] + bytes(b ^ 0x5A for b in body[-64:])
        assert len(other) == len(body) and other != body
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=other)

    _found_repaired_clean(node, damage, digest)


def test_budget_limits_a_pass_and_the_next_pass_continues(tmp_path: Path) -> None:
    """Budget B (two copies' worth): a pass re-hashes whole copies within B, oldest verification
    first; the second pass takes the copies the first left; the third starts over."""
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(tmp_path, local_tier("warm", warm, replicate=True))
    node.write(1, 2, 3, 4)
    node.ok("prune")
    sizes = {s: c["bytes"] for s, c in node.ls().items()}
    budget = sizes[1] + sizes[2] + 100  # steps grow with the step number: two copies fit, not three
    assert budget < sum(sizes.values())

    def oldest_check() -> float | None:
        doc = json.loads(node.ok("status", "--json").stdout)["scrub"]
        assert doc["oldest_check"].keys() == {"warm"}, doc
        when: float | None = doc["oldest_check"]["warm"]
        return when

    written = oldest_check()  # the prune hashed every copy as it wrote it
    assert written is not None and written <= time.time()
    passes = []
    first_pass = 0.0
    for n in range(3):
        first_pass = first_pass or time.time()
        code, doc = node.scrub("--budget", str(budget))
        if n == 1:  # every copy re-hashed since: the tier's least recent check is pass 1's
            after = oldest_check()
            assert after is not None and after >= first_pass > written, (written, first_pass, after)
        assert code == 0, doc
        assert doc["scrubbed_bytes"] <= budget and doc["budget_bytes"] == budget
        passes.append([c["step"] for c in doc["checked"]])
    # the copies were written (and hashed) by the prune in step order: the oldest go first
    assert passes[0] == [1, 2] and passes[1] == [3, 4] and passes[2] == [1, 2], passes
    code, doc = node.scrub("--budget", "1")  # one copy, however large: a pass is never empty
    assert [c["step"] for c in doc["checked"]] == [3] and doc["deferred"]["copies"] == 3, doc


def test_bad_only_copy_is_reported_and_never_deleted(tmp_path: Path) -> None:
    """Step 1 lives in warm only (moved out of hot); its bytes rot. Scrub exits 1 saying no good
    copy is left; prune (even --force) deletes nothing of it; status warns; it stays reported."""
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(tmp_path, local_tier("warm", warm), hot={"keep_last": 1})
    node.write(1, 2)
    node.ok("prune")
    assert node.ls()[1]["tiers"] == ["warm"]
    victim = warm / RUN / "checkpoint-1" / "nested" / "optimizer.pt"
    _flip_byte(victim)
    rotted = tree_digest(warm / RUN / "checkpoint-1")

    code, doc = node.scrub()
    assert code == 1
    (bad,) = doc["bad"]
    assert bad["step"] == 1 and bad["next"].startswith("no good copy left: kept"), bad
    assert [(x["run"], x["step"]) for x in doc["no_good_copy"]] == [(RUN, 1)], doc

    node.write(3)
    node.ok("prune", "--force")
    assert tree_digest(warm / RUN / "checkpoint-1") == rotted  # still there, untouched
    status = json.loads(node.ok("status", "--json").stdout)
    assert any("step 1 (checkpoint-1) has no good copy left" in w for w in status["warnings"]), status
    assert status["scrub"]["no_good_copy"][0]["step"] == 1
    code, again = node.scrub()
    assert code == 1 and [x["step"] for x in again["no_good_copy"]] == [1], again
    # latest still resolves to a good checkpoint; the bad one is never offered
    assert node.ls()[1]["tiers"] == [] and node.ls()[1]["damaged"]


def test_bad_copy_of_another_node_is_reported_not_replaced(tmp_path: Path) -> None:
    """A warm copy whose manifest names node-b (a tier two nodes wrote): scrub reports it with its
    owner, the next prune does not delete or rewrite it (the copy is skipped, saying whose it is)."""
    warm = tmp_path / "warm"
    warm.mkdir()
    writer = Node(tmp_path, local_tier("warm", warm, replicate=True), node="node-b")
    writer.write(1)
    writer.ok("prune")
    node = Node(tmp_path, local_tier("warm", warm, replicate=True), node="node-a")
    node.ok("scan")
    _flip_byte(warm / RUN / "checkpoint-1" / "model.safetensors")
    rotted = tree_digest(warm / RUN / "checkpoint-1")
    code, doc = node.scrub()
    assert code == 1
    (bad,) = doc["bad"]
    assert bad["owner"] == "node-b" and "not replaced or deleted" in bad["next"], bad
    pruned = json.loads(node.cli("prune", "--json").stdout)
    skipped = [
        (s["action"]["action"], s["action"]["step"], s["action"]["to_tier"], s["reason"])
        for s in pruned["result"]["skipped"]
    ]
    assert skipped == [
        ("copy", 1, "warm", "the damaged copy in warm is owned by node node-b: not ours to replace")
    ], pruned["result"]
    assert tree_digest(warm / RUN / "checkpoint-1") == rotted


def test_scrub_usage_errors(tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(tmp_path, local_tier("warm", warm))
    hot = node.cli("scrub", "--tier", "hot")
    assert hot.returncode == 2 and "hashed when it is cataloged" in hot.stderr, hot.stderr
    nope = node.cli("scrub", "--tier", "nope")
    assert nope.returncode == 2 and "no such tier" in nope.stderr
    budget = node.cli("scrub", "--budget", "lots")
    assert budget.returncode == 2 and "invalid size" in budget.stderr


# -- the daemon's job, the metrics -----------------------------------------------------------------


@pytest.fixture
def daemon_node(tmp_path: Path) -> Iterator[Any]:
    from ckptkeeper.actions.index import open_index
    from ckptkeeper.config import load_settings
    from ckptkeeper.daemon.service import Daemon

    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(tmp_path, local_tier("warm", warm, replicate=True))
    node.write(1, 2)
    node.ok("prune")
    _flip_byte(warm / RUN / "checkpoint-2" / "model.safetensors")
    settings = load_settings(str(node.config))
    daemon = Daemon(str(node.config), settings)
    daemon.index = open_index(settings)
    try:
        yield daemon
    finally:
        daemon.index.close()


def test_daemon_schedules_the_scrub_on_its_own_worker(daemon_node: Any) -> None:
    scheduler = daemon_node._make_scheduler()
    job = scheduler.get_job("scrub")
    assert job is not None and job.executor == "scrub"
    assert job.trigger.interval.total_seconds() == 6 * 3600
    assert {j.executor for j in scheduler.get_jobs() if j.id != "scrub"} == {"default"}


def test_scrub_interval_off_schedules_no_job(tmp_path: Path) -> None:
    from ckptkeeper.actions.index import open_index
    from ckptkeeper.config import load_settings
    from ckptkeeper.daemon.service import Daemon

    (tmp_path / "hot").mkdir()
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"scrub_interval": "off", "metrics_addr": ""},
        tiers=[local_tier("hot", tmp_path / "hot")],
    )
    settings = load_settings(str(config))
    assert settings.daemon.scrub_interval == 0
    daemon = Daemon(str(config), settings)
    daemon.index = open_index(settings)
    try:
        scheduler = daemon._make_scheduler()
        assert scheduler.get_job("scrub") is None and scheduler.get_job("retention") is not None
    finally:
        daemon.index.close()


def test_daemon_scrub_job_records_its_run_and_metrics(daemon_node: Any) -> None:
    """The job body the scheduler runs: the bad copy is marked, the job's run is recorded for
    ``status`` (an error naming the bad copy), and the counters say what it read and found."""
    from prometheus_client import CollectorRegistry, generate_latest

    from ckptkeeper.actions.status import summarize
    from ckptkeeper.daemon.metrics import IndexCollector

    daemon_node._job_function("scrub")()
    ix = daemon_node.index
    job = ix.job_runs()["scrub"]
    assert job.last_start is not None and job.last_error is not None
    assert "1 bad copies" in job.last_error and "warm:r@2" in job.last_error, job.last_error
    (row,) = [r for r in ix.checkpoints(RUN) if r.step == 2]
    assert set(row.damaged) == {"warm"}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(IndexCollector(lambda: nullcontext(ix), daemon_node.settings))
    text = generate_latest(registry).decode()
    total = sum(r.bytes for r in ix.checkpoints(RUN))
    assert f'ckptkeeper_scrub_bytes_total{{tier="warm"}} {float(total)}' in text, text
    assert 'ckptkeeper_scrub_bad_copies_total{tier="warm"} 1.0' in text
    assert 'ckptkeeper_scrub_oldest_check_timestamp_seconds{tier="warm"}' in text
    assert 'ckptkeeper_job_last_success_timestamp_seconds{job="scrub"}' not in text
    assert summarize(daemon_node.settings, ix).scrub["warm"] == (total, 2, 1)


def test_config_reload_turns_the_scrub_job_off_on_and_reschedules_it(tmp_path: Path) -> None:
    from ckptkeeper.config import settings_from_mapping
    from ckptkeeper.daemon.schedule import make_scheduler, reschedule

    def settings(**daemon: Any) -> Any:
        return settings_from_mapping(
            {
                "index": str(tmp_path / "i.db"),
                "tiers": [{"name": "hot", "url": str(tmp_path)}],
                "daemon": daemon,
            }
        )

    def job_function(job_id: str) -> Any:
        return lambda: None

    on = settings(scrub_interval="2h")
    scheduler = make_scheduler(on, 0, job_function)
    assert scheduler.get_job("scrub").trigger.interval.total_seconds() == 7200
    off = settings(scrub_interval="off")
    reschedule(scheduler, on, off, job_function)
    assert scheduler.get_job("scrub") is None
    reschedule(scheduler, off, on, job_function)
    assert scheduler.get_job("scrub").executor == "scrub"
    faster = settings(scrub_interval="30m")
    reschedule(scheduler, on, faster, job_function)
    assert scheduler.get_job("scrub").trigger.interval.total_seconds() == 1800


def test_move_onto_a_bad_copy_replaces_it_and_keeps_the_good_one_until_then(tmp_path: Path) -> None:
    """The good hot copy leaves hot (``keep_last``) while the warm copy is bad: the move (a rename,
    hot and warm share a filesystem here) replaces the bad warm copy with the good bytes; the hot
    copy is gone only because it now is the warm one."""
    warm = tmp_path / "warm"
    warm.mkdir()
    node = Node(tmp_path, local_tier("warm", warm, replicate=True), hot={"keep_last": 2})
    node.write(1, 2)
    node.ok("prune")
    _flip_byte(warm / RUN / "checkpoint-1" / "model.safetensors")
    code, doc = node.scrub()
    assert code == 1 and [b["step"] for b in doc["bad"]] == [1]
    node.write(3)
    pruned = json.loads(node.ok("prune", "--json").stdout)
    step1 = [(a["action"], a["tier"], a["to_tier"]) for a in pruned["actions"] if a["step"] == 1]
    assert step1 == [("copy", "hot", "warm"), ("delete", "hot", None)], pruned["actions"]
    assert pruned["result"]["failed"] == [], pruned["result"]
    assert not (node.run_dir / "checkpoint-1").exists()
    assert tree_digest(warm / RUN / "checkpoint-1") == tree_digest(node.originals / "checkpoint-1")
    assert node.ls()[1]["tiers"] == ["warm"] and node.ls()[1]["damaged"] == {}
    code, after = node.scrub()
    assert code == 0, after
