"""Preflight decisions: "will this node sustain this job's checkpoints?" as pure functions.

The action (:mod:`ckptkeeper.actions.preflight`) measures and probes; every verdict — pass, warn
or fail, with a one-line reason and the config key (or system setting) to change — is decided
here from plain numbers, so each threshold is a table-driven unit test and not a timing test.

The scratch run's name is decided here too: the catalog, the reaper and ``prune`` recognise a
preflight's scratch by it and never treat it as a user run.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ckptkeeper.core.model import TierPolicy

Status = Literal["pass", "warn", "fail"]

SCRATCH_PREFIX = ".ckptkeeper-preflight-"
"""Scratch runs are ``.ckptkeeper-preflight-<node>-<pid>``: hidden on the hot tier (the catalog
skips dot-directories), skipped by name in slower tiers, and swept by the next preflight or prune
of the same node once the process that wrote it is gone."""

DEFAULT_EVERY = 1800.0
"""Checkpoint interval assumed when neither ``--every`` nor a run's history gives one."""
DEFAULT_SIZE = 1 << 30
"""Save size assumed when neither ``--size`` nor a cataloged checkpoint gives one."""
QUICK_SAMPLE = 64 << 20
"""``--quick`` writes at most this much per synthetic save and extrapolates rates to the full size."""
FULL_SAMPLE = 1 << 30
"""Without ``--quick``, at most this much per synthetic save."""
DROP_THRESHOLD = 0.3
"""A stage whose throughput falls by more than this fraction over ``--duration`` is flagged."""
MIN_TIMED_SECONDS = 0.25
"""A stage is watched for drops only if its fastest round took at least this long."""

RPO_WARN_FRACTION = 0.8
CAPACITY_WARN_FRACTION = 0.9
SKEW_WARN_SECONDS = 30.0
SKEW_FAIL_SECONDS = 300.0
"""S3 rejects SigV4 requests more than 15 minutes off; ages (reaper, retention) drift long before."""
QUEUED_EVENTS_WARN = 16384
INOTIFY_WATCH_HEADROOM = 1000

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    """One line: what was found, and what to change (naming the config key) when not a pass."""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


def _safe_node(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "node"


def scratch_run(node: str, pid: int) -> str:
    return f"{SCRATCH_PREFIX}{_safe_node(node)}-{pid}"


def is_scratch_run(run: str) -> bool:
    """A preflight's scratch run (any node): never cataloged, planned or shown as a user run."""
    return run.split("/", 1)[0].startswith(SCRATCH_PREFIX)


def scratch_owner(run: str) -> tuple[str, int] | None:
    """``(node, pid)`` of a scratch run name, None if it is not one."""
    first = run.split("/", 1)[0]
    if not first.startswith(SCRATCH_PREFIX):
        return None
    node, sep, pid = first[len(SCRATCH_PREFIX) :].rpartition("-")
    if not sep or not node or not pid.isdigit():
        return None
    return node, int(pid)


def stale_scratch(run: str, node: str, own_pid: int) -> bool:
    """Scratch left by a dead preflight of this node. Only called with the executor lock held: a
    preflight holds it from start to cleanup, so any other scratch of this node is a dead one's.
    Other nodes' scratch in a shared bucket is theirs to sweep."""
    owner = scratch_owner(run)
    return owner is not None and owner[0] == _safe_node(node) and owner[1] != own_pid


def parse_size(text: str) -> int:
    """Bytes from ``"4GiB"``, ``"512M"``, ``"1.5g"``, ``"1048576"`` (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r}: use e.g. '4GiB', '512MiB' or a number of bytes")
    value = float(m.group(1)) * 1024 ** _SIZE_POWERS[m.group(2).lower()]
    if not math.isfinite(value) or value < 1 or value > 2**60:
        raise ValueError(f"size {text!r} out of range (1 byte .. 1 EiB)")
    return int(value)


def synthetic_shape(size: int) -> list[tuple[str, int]]:
    """Files of a synthetic save of ``size`` bytes, shaped like a real one: a few large shards
    (tensor data) plus small files (config, metadata, RNG and scheduler state)."""
    small = [
        ("config.json", 2048),
        ("trainer_state.json", 8192),
        ("rng_state.pth", 16384),
        ("scheduler.pt", 1024),
    ]
    small_total = sum(n for _, n in small)
    if size <= small_total * 2:
        return [("model.bin", size)]
    shards = max(1, min(4, (size - small_total) // (16 << 20)))
    big = size - small_total
    files = [(f"model-{i + 1:05d}-of-{shards:05d}.bin", big // shards) for i in range(shards)]
    files[-1] = (files[-1][0], files[-1][1] + big % shards)
    return files + small


def median_interval(times: Sequence[float]) -> float | None:
    """The median gap between consecutive saves (a run's checkpoint history), None under two."""
    ordered = sorted(times)
    gaps = sorted(b - a for a, b in itertools.pairwise(ordered) if b > a)
    if not gaps:
        return None
    mid = len(gaps) // 2
    return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2


def kept_saves(policy: TierPolicy, every: float) -> int | None:
    """How many saves a tier's policy keeps at steady state; None when it keeps all of them."""
    count = (policy.keep_last or 0) + (policy.keep_best or 0)
    if policy.keep_within:
        count += math.ceil(policy.keep_within / max(every, 1.0))
    for key in ("keep_hourly", "keep_daily", "keep_weekly", "keep_monthly"):
        count += getattr(policy, key) or 0
    if count == 0 and policy.keep_every is None:
        return None
    return max(count, 1)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _fmt_s(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def capped_rates(
    measured: Mapping[str, float | None], caps: Mapping[str, Sequence[int | None]]
) -> dict[str, float | None]:
    """What each stage will move at: the rate measured, but never more than the ``max_rate`` of a
    tier it copies into or out of (``caps``: stage -> those tiers' caps). A short measurement fits
    in the throttle's one-second burst and runs unthrottled; a real save does not."""
    out: dict[str, float | None] = {}
    for stage, rate in measured.items():
        limits = [c for c in caps.get(stage, ()) if c is not None]
        out[stage] = rate if rate is None or not limits else min(rate, float(min(limits)))
    return out


def check_rpo(size: int, cold_rate: float | None, every: float, cold_key: str) -> tuple[Check, float | None]:
    """One save must reach cold storage before the next one: RPO = size / upload rate."""
    if cold_rate is None:
        return Check(
            "rpo", "warn", "no slower tier configured: a save never leaves this node (add a [[tiers]] table)"
        ), None
    rpo = size / cold_rate if cold_rate > 0 else math.inf
    found = f"one {_fmt_bytes(size)} save replicates in {_fmt_s(rpo)} at {_fmt_bytes(cold_rate)}/s"
    if rpo > every:
        return (
            Check(
                "rpo",
                "fail",
                f"{found}, longer than the {_fmt_s(every)} interval: saves queue up; save less often (--every), "
                f"shrink saves, or speed up {cold_key} (endpoint/network)",
            ),
            rpo,
        )
    if rpo > every * RPO_WARN_FRACTION:
        return (
            Check(
                "rpo",
                "warn",
                f"{found}, over {RPO_WARN_FRACTION:.0%} of the {_fmt_s(every)} interval: little slack for {cold_key}",
            ),
            rpo,
        )
    return Check("rpo", "pass", f"{found}, within the {_fmt_s(every)} interval"), rpo


def check_hot_capacity(
    size: int,
    kept: int | None,
    total: int | None,
    used_other: int,
    high_watermark: float | None,
    free: int | None = None,
) -> Check:
    """The hot tier must hold the policy's kept saves plus the one being written, under the high
    watermark (above it the daemon evicts), besides whatever else lives on that filesystem; ``free`` is what the saves may use at most
    (free space plus the checkpoints already on the tier, which retention rotates)."""
    if total is None:
        return Check(
            "hot_capacity", "fail", "hot tier usage unreadable: check tiers[0].url exists and is readable"
        )
    if kept is None:
        return Check(
            "hot_capacity",
            "warn" if high_watermark is None else "pass",
            "tiers[0] keeps every save; only "
            + (
                "tiers[0].high_watermark bounds it"
                if high_watermark
                else "free space bounds it: set tiers[0].keep_last or tiers[0].high_watermark"
            ),
        )
    need = (kept + 1) * size
    limit = total * (high_watermark if high_watermark is not None else 1.0)
    room = min(limit - used_other, free) if free is not None else limit - used_other
    where = f"tiers[0].high_watermark={high_watermark}" if high_watermark is not None else "the disk"
    found = f"needs {kept} kept + 1 next = {kept + 1} x {_fmt_bytes(size)} = {_fmt_bytes(need)}; room under {where}: {_fmt_bytes(max(room, 0))}"
    if need > room:
        return Check(
            "hot_capacity",
            "fail",
            f"{found}: lower tiers[0].keep_last (or keep_best), "
            + ("raise tiers[0].high_watermark, " if high_watermark is not None else "")
            + "or free/add hot disk",
        )
    if need > room * CAPACITY_WARN_FRACTION:
        return Check(
            "hot_capacity",
            "warn",
            f"{found}: under {1 - CAPACITY_WARN_FRACTION:.0%} margin; consider lowering tiers[0].keep_last",
        )
    return Check("hot_capacity", "pass", found)


def check_room(name: str, index: int, size: int, kept: int | None, free: int | None, is_local: bool) -> Check:
    """A slower tier must have room for its policy's kept saves (local tiers: free space now)."""
    label = f"{name}_room"
    if not is_local:
        return Check(label, "pass", f"tiers[{index}] ({name}) is an object store: no capacity limit to check")
    if free is None:
        return Check(label, "fail", f"tiers[{index}].url unreadable: free space unknown")
    want = (kept or 1) * size
    found = f"{_fmt_bytes(free)} free for {kept if kept is not None else 'all'} kept x {_fmt_bytes(size)}"
    if free < size:
        return Check(
            label, "fail", f"{found}: not even one save fits; free space or lower tiers[{index}].keep_last"
        )
    if kept is None or free < want:
        return Check(label, "warn", f"{found}: set or lower tiers[{index}].keep_last, or add space")
    return Check(label, "pass", found)


def check_inotify(
    max_user_watches: int | None,
    max_queued_events: int | None,
    dirs_needed: int,
    files_per_save: int,
    polling: bool,
) -> Check:
    """The watcher holds one inotify watch per directory under the hot root, and a save's burst of
    events must fit the kernel's queue."""
    if polling:
        return Check("inotify", "pass", "daemon.polling = true: inotify not used")
    if max_user_watches is None or max_queued_events is None:
        return Check(
            "inotify",
            "warn",
            "cannot read /proc/sys/fs/inotify/*: watch limits unknown (or set daemon.polling)",
        )
    need = dirs_needed + INOTIFY_WATCH_HEADROOM
    found = f"max_user_watches {max_user_watches} for ~{need} dirs, max_queued_events {max_queued_events}"
    if max_user_watches < need or max_queued_events < files_per_save * 4:
        return Check(
            "inotify",
            "fail",
            f"{found}: raise sysctl fs.inotify.max_user_watches / max_queued_events, or set daemon.polling",
        )
    if max_user_watches < 2 * need or max_queued_events < QUEUED_EVENTS_WARN:
        return Check(
            "inotify",
            "warn",
            f"{found}: little headroom; raise sysctl fs.inotify.max_user_watches / max_queued_events",
        )
    return Check("inotify", "pass", found)


def check_conditional_writes(tier: str, index: int, second_status: int | None, error: str | None) -> Check:
    """Create-twice with ``If-None-Match: *``: the second must get 412, or manifests and markers of
    several nodes can overwrite each other in a shared bucket."""
    name = f"{tier}_conditional_writes"
    if error is not None:
        return Check(name, "warn", f"probe failed ({error}); conditional writes unknown for tiers[{index}]")
    if second_status == 412:
        return Check(name, "pass", "second create with If-None-Match: * got 412")
    return Check(
        name,
        "warn",
        f"second create with If-None-Match: * got {second_status or 'success'}, not 412: the store ignores conditional "
        f"writes; do not share tiers[{index}].url's prefix between nodes",
    )


def check_multipart_listing(tier: str, index: int, error: str | None) -> Check:
    name = f"{tier}_list_multipart"
    if error is None:
        return Check(name, "pass", "ListMultipartUploads works: interrupted uploads can be found and aborted")
    return Check(
        name,
        "warn",
        f"ListMultipartUploads failed ({error}): interrupted uploads under tiers[{index}].url are not reaped (add a bucket lifecycle rule)",
    )


def check_clock_skew(tier: str, skew: float | None) -> Check:
    name = f"{tier}_clock_skew"
    if skew is None:
        return Check(name, "warn", "the store sent no Date header: clock skew unknown")
    found = (
        f"node clock {abs(skew):.0f}s {'behind' if skew > 0 else 'ahead of'} the store"
        if abs(skew) >= 1
        else "node clock within 1s of the store"
    )
    if abs(skew) > SKEW_FAIL_SECONDS:
        return Check(
            name, "fail", f"{found}: requests will be refused and ages misjudged; fix NTP (chrony/timesyncd)"
        )
    if abs(skew) > SKEW_WARN_SECONDS:
        return Check(name, "warn", f"{found}: fix NTP (chrony/timesyncd)")
    return Check(name, "pass", found)


def check_credentials(tier: str, index: int, denied: Sequence[str]) -> Check:
    name = f"{tier}_credentials"
    if not denied:
        return Check(name, "pass", "write, list, delete and abort-upload allowed under the prefix")
    return Check(
        name,
        "fail",
        f"{', '.join(denied)} failed under the prefix: grant them to the credentials in tiers[{index}].storage_options",
    )


def check_throughput_drop(
    series: Mapping[str, Sequence[float]], threshold: float = DROP_THRESHOLD, rounds: int | None = None
) -> Check:
    """Over ``--duration``, a stage whose later rounds run more than ``threshold`` slower than its
    first (thermal throttling, a noisy neighbour, a filling SLC cache) is flagged. ``series`` holds
    the stages worth timing; ``rounds`` is how many rounds ran (default: the longest series)."""
    timed = max((len(v) for v in series.values()), default=0)
    rounds = timed if rounds is None else rounds
    if rounds < 2:
        return Check(
            "throughput_stability",
            "pass",
            "one round measured (a --duration longer than a round watches throughput over time)",
        )
    if timed < 2:
        return Check(
            "throughput_stability",
            "pass",
            f"{rounds} rounds, but every stage took under {MIN_TIMED_SECONDS}s: too quick to watch (use a larger --size)",
        )
    worst: tuple[float, str] = (0.0, "")
    for stage, rates in series.items():
        if len(rates) < 2 or rates[0] <= 0:
            continue
        drop = 1.0 - min(rates[1:]) / rates[0]
        if drop > worst[0]:
            worst = (drop, stage)
    if worst[0] > threshold:
        return Check(
            "throughput_stability",
            "warn",
            f"{worst[1]} fell {worst[0]:.0%} below its first round over {rounds} rounds (threshold {threshold:.0%}): "
            "throttling or a noisy neighbour; plan with the lower rate",
        )
    return Check("throughput_stability", "pass", f"{rounds} rounds, no stage fell more than {threshold:.0%}")


def verdict(checks: Sequence[Check]) -> Status:
    statuses = {c.status for c in checks}
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "pass"


SHIPPED_UNIT = {"WatchdogSec": 60.0, "TimeoutStopSec": 120.0}
"""What ``deploy/ckptkeeper.service`` sets, assumed when no installed unit is found."""

_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(us|ms|sec|min|hr|s|m|h|d)?", re.IGNORECASE)
_SPAN_SECONDS = {
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "d": 86400.0,
}


def parse_timespan(text: str) -> float | None:
    """Seconds of a systemd time span (``"120"``, ``"5min"``, ``"1h 30s"``); None for
    ``infinity``, empty or unparsable values."""
    text = text.strip().lower()
    if not text or text == "infinity":
        return None
    total, pos = 0.0, 0
    for m in _SPAN.finditer(text):
        if text[pos : m.start()].strip():
            return None
        total += float(m.group(1)) * _SPAN_SECONDS[(m.group(2) or "s").lower()]
        pos = m.end()
    return total if pos and not text[pos:].strip() else None


def check_service(unit: dict[str, float | None], installed: bool, longest_step: float | None) -> Check:
    """The systemd unit against the longest blocking step measured (one save's slowest copy).

    The watchdog is fed from its own thread while the observer and the scheduler live, so no step
    starves it; but ``systemctl stop`` lets the step in flight finish and kills it after
    ``TimeoutStopSec=``: a copy longer than that is killed on every stop and starts over."""
    where = (
        "the installed unit" if installed else "the shipped unit (deploy/ckptkeeper.service; none installed)"
    )
    watchdog = unit.get("WatchdogSec")
    stop = unit.get("TimeoutStopSec")
    if longest_step is None:
        return Check(
            "systemd", "pass", f"no step measured; {where}: WatchdogSec={watchdog}, TimeoutStopSec={stop}"
        )
    found = (
        f"longest step (one save's slowest copy) {_fmt_s(longest_step)}; {where}: WatchdogSec="
        f"{'off' if watchdog is None else _fmt_s(watchdog)} (fed by its own thread, not blocked by a copy), "
        f"TimeoutStopSec={'infinity' if stop is None else _fmt_s(stop)}"
    )
    if stop is not None and longest_step > stop:
        return Check(
            "systemd",
            "warn",
            f"{found}: a stop or restart kills the copy in flight (the journal undoes it, the copy starts "
            f"over); raise TimeoutStopSec= in the unit above {_fmt_s(longest_step)}",
        )
    return Check("systemd", "pass", found)


SAMPLE_SLACK = 4 << 20
"""Bytes besides the sample's copies a round may write on the hot tier (its private index, a
manifest, directory entries)."""


def sample_room(free: int | None, headroom: int, copies: int) -> int | None:
    """The largest synthetic save a round may write: ``copies`` of it at once on the hot tier's
    filesystem must leave the active runs' next saves (``headroom`` bytes) free. None: unknown."""
    if free is None:
        return None
    return max(0, (free - headroom - SAMPLE_SLACK) // max(1, copies))


def check_sample_room(sample: int, free: int | None, headroom: int, runs: int, copies: int) -> Check:
    """May a round write a synthetic save of ``sample`` bytes? It writes up to ``copies`` of it on
    the hot tier's filesystem at once (the save and its restore, plus each slower tier it uses on
    that filesystem); what is left must hold the next save of every active run (their
    ``headroom``, :mod:`ckptkeeper.core.headroom`), or a training save could fail for lack of space
    while the preflight runs."""
    if free is None:
        return Check("sample_room", "fail", "hot tier free space unreadable: no synthetic save written")
    room = sample_room(free, headroom, copies) or 0
    need = f"{copies} x {_fmt_bytes(sample)} = {_fmt_bytes(copies * sample)}"
    keep = (
        f"{_fmt_bytes(headroom)} kept free for the next save of {runs} active run(s)"
        if runs
        else "no active run"
    )
    found = f"a synthetic save writes up to {need} on the hot tier; {_fmt_bytes(free)} free, {keep}"
    if sample <= room:
        return Check("sample_room", "pass", found)
    hint = (
        f"--quick (saves of {_fmt_bytes(QUICK_SAMPLE)}) fits"
        if sample > QUICK_SAMPLE and room >= QUICK_SAMPLE
        else f"at most {_fmt_bytes(room)} per save fits: free space on tiers[0] or wait for the runs to end"
    )
    return Check("sample_room", "fail", f"{found}: refused, no synthetic save written ({hint})")
