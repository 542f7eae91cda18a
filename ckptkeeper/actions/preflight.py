"""``preflight``: will this node sustain this job's checkpoints? The I/O shell.

Writes synthetic saves of the job's shape into a scratch run (``.ckptkeeper-preflight-<node>-<pid>``)
under the hot tier and drives them through the real pipeline — the executor uploads to the cold
tier and moves to the warm one, the storage layer restores and verifies — measuring each stage,
then removes every byte it wrote on every tier. The store's features (conditional writes,
ListMultipartUploads, permissions, clock) are probed under the same scratch prefix. Every verdict
is a pure function of :mod:`ckptkeeper.core.preflight`.

It holds the executor lock from start to cleanup, like ``prune``: nothing else changes the tiers
meanwhile, so scratch of this node found while holding the lock belongs to a dead preflight
(``kill -9``) and is swept — by the next preflight, and by every ``prune`` (:func:`sweep_scratch`).
It uses a private index inside the scratch run; the user's index and runs are only read.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptkeeper.actions.errors import EXIT_OK, EXIT_PREFLIGHT_FAILED, EXIT_PREFLIGHT_WARNINGS
from ckptkeeper.actions.index import executor_lock
from ckptkeeper.config import Settings, TierConfig
from ckptkeeper.core import preflight as pf
from ckptkeeper.core.headroom import Headroom
from ckptkeeper.core.model import Action, ActionKind, CheckpointState, FileEntry, Manifest, Plan
from ckptkeeper.index import Index
from ckptkeeper.util import hashing
from ckptkeeper.util.fmt import human_bytes as _fmt_bytes
from ckptkeeper.util.logs import get_logger

log = get_logger("ckptkeeper.actions.preflight")

STAGES = ("hot_write", "warm_move", "cold_upload", "restore")
_CHUNK = 4 << 20


@dataclass
class PreflightReport:
    checks: list[pf.Check]
    throughput: dict[str, float | None]
    """Bytes/s per stage (the median over rounds); None where the stage does not apply."""
    rpo_seconds: float | None
    size: int
    every: float
    sample_bytes: int
    scratch: str
    rounds: list[dict[str, float | None]] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)

    @property
    def status(self) -> pf.Status:
        return pf.verdict(self.checks)

    @property
    def sustainable(self) -> bool:
        return self.status != "fail"

    @property
    def exit_code(self) -> int:
        return {"pass": EXIT_OK, "warn": EXIT_PREFLIGHT_WARNINGS, "fail": EXIT_PREFLIGHT_FAILED}[self.status]

    def to_dict(self) -> dict[str, Any]:
        return {
            "checks": [c.to_dict() for c in self.checks],
            "throughput": dict(self.throughput),
            "rpo_seconds": None if self.rpo_seconds is None else round(self.rpo_seconds, 3),
            "sustainable": self.sustainable,
            "status": self.status,
            "size": self.size,
            "every": self.every,
            "sample_bytes": self.sample_bytes,
            "rounds": self.rounds,
            "scratch": self.scratch,
        }


# --------------------------------------------------------------------------------------------
# defaults from the index


def history_defaults(index: Index) -> tuple[int | None, float | None]:
    """(size of the newest save, median interval between saves) of the newest user run."""
    runs = [r for r in index.runs() if not pf.is_scratch_run(r.name)]
    for run in sorted(runs, key=lambda r: r.last_seen, reverse=True):
        done = [c for c in index.checkpoints(run.name) if c.state is CheckpointState.COMPLETE]
        if done:
            newest = max(done, key=lambda c: c.created_at)
            return newest.bytes, pf.median_interval([c.created_at for c in done])
    return None, None


# --------------------------------------------------------------------------------------------
# scratch: where it lives, and sweeping it


def _purge_local(root: Path, wanted: Callable[[str], bool]) -> list[str]:
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not wanted(entry.name):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(entry.path)
        except OSError as exc:
            log.warning("cannot remove preflight scratch", path=entry.path, error=str(exc))
    return removed


def _purge_s3(tier: TierConfig, wanted: Callable[[str], bool]) -> list[str]:
    """Every object and multipart upload of a wanted scratch run under the tier's prefix."""
    from ckptkeeper.storage import S3TierStorage, TierStorage

    storage = TierStorage(tier.to_spec())
    assert isinstance(storage, S3TierStorage)
    fs, bucket, base = storage.fs, storage.bucket, storage.prefix + pf.SCRATCH_PREFIX
    removed: list[str] = []

    def run_of(key: str) -> str:
        return key[len(storage.prefix) :].split("/", 1)[0]

    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": base}
    keys: list[str] = []
    while True:
        resp = fs.call_s3("list_objects_v2", **kw)
        keys += [o["Key"] for o in resp.get("Contents", []) if wanted(run_of(o["Key"]))]
        if not resp.get("IsTruncated"):
            break
        kw["ContinuationToken"] = resp["NextContinuationToken"]
    for i in range(0, len(keys), 1000):
        fs.call_s3(
            "delete_objects",
            Bucket=bucket,
            Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
        )
    removed += [f"{tier.name}:{k}" for k in keys]
    with contextlib.suppress(Exception):  # a store without ListMultipartUploads: the check says so
        resp = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=base)
        for up in resp.get("Uploads", []):
            if wanted(run_of(up["Key"])):
                with contextlib.suppress(FileNotFoundError):
                    fs.call_s3(
                        "abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]
                    )
                removed.append(f"{tier.name}:upload {up['Key']}")
    return removed


def _purge(settings: Settings, wanted: Callable[[str], bool]) -> list[str]:
    """Remove wanted scratch runs from the slower tiers, then — only if all of them succeeded —
    from the hot tier. The hot scratch directory is made first and removed last, so while
    anything of a scratch run is left anywhere, its hot directory says so (:func:`sweep_scratch`
    looks there, and nowhere else, before it lists a store)."""
    removed: list[str] = []
    clean = True
    for tier in settings.tiers[1:]:
        try:
            removed += _purge_local(tier.local_path, wanted) if tier.is_local else _purge_s3(tier, wanted)
        except Exception as exc:  # a failing tier must not stop a prune; the next one retries
            clean = False
            log.warning("preflight scratch not swept from tier", tier=tier.name, error=str(exc))
    if clean:
        removed += _purge_local(settings.hot.local_path, wanted)
    return removed


def sweep_scratch(settings: Settings, *, own_pid: int | None = None) -> list[str]:
    """Remove this node's scratch of dead preflights from every tier. Call with the executor lock
    held (``prune`` and ``preflight`` do): then no other preflight of this node is running.

    Costs one listing of the hot root when there is nothing to sweep: a store is only listed for a
    scratch run whose hot directory is still there (see :func:`_purge`)."""
    node, pid = settings.node, os.getpid() if own_pid is None else own_pid
    try:
        stale = {e.name for e in os.scandir(settings.hot.local_path) if pf.stale_scratch(e.name, node, pid)}
    except OSError:
        return []
    if not stale:
        return []
    removed = _purge(settings, lambda run: run in stale)
    log.warning("removed the scratch of an interrupted preflight", runs=sorted(stale), paths=len(removed))
    return removed


# --------------------------------------------------------------------------------------------
# the pipeline


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    for dirpath, dirnames, filenames in os.walk(path):
        for n in (*dirnames, *filenames):
            newest = max(newest, os.lstat(os.path.join(dirpath, n)).st_mtime)
    return newest


def _write_save(run_dir: Path, name: str, sample: int, seed: int) -> tuple[list[FileEntry], float]:
    """Write a synthetic save the way a framework does (data, then fsync); (entries, seconds)."""
    block = bytearray(os.urandom(_CHUNK))
    target = run_dir / name
    target.mkdir(parents=True)
    entries: list[FileEntry] = []
    elapsed = 0.0
    counter = seed << 32
    for rel, size in pf.synthetic_shape(sample):
        hasher = hashing.new_hasher()
        t0 = time.monotonic()
        with open(target / rel, "wb", buffering=0) as f:
            left = size
            while left:
                counter += 1
                block[:8] = counter.to_bytes(8, "little")  # no two chunks alike: nothing dedups them
                n = min(left, _CHUNK)
                view = memoryview(block)[:n]
                f.write(view)
                hasher.update(view)
                left -= n
            os.fsync(f.fileno())
        elapsed += time.monotonic() - t0
        entries.append(FileEntry(path=rel, size=size, hash=hasher.hexdigest()))
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sorted(entries, key=lambda e: e.path), elapsed


class _Pipeline:
    """One scratch run driven through the executor and the storage layer."""

    def __init__(self, settings: Settings, scratch: str) -> None:
        from ckptkeeper.executor import Executor

        self.settings = settings
        self.scratch = scratch
        self.specs = settings.tier_specs()
        self.hot = self.specs[0].name
        self.cold = self.specs[-1].name if len(self.specs) > 1 else None
        self.warm = self.specs[1].name if len(self.specs) > 2 else None
        self.run_dir = settings.hot.local_path / scratch
        self.run_dir.mkdir(parents=True, exist_ok=False)
        self.index = Index(self.run_dir / ".preflight-index.db")
        self.executor = Executor(
            self.index,
            self.specs,
            partial_after=settings.reaper.partial_after,
            trust_mtimes=settings.daemon.trust_mtimes,
        )

    def close(self) -> None:
        self.index.close()

    def _apply(self, actions: list[Action]) -> float:
        t0 = time.monotonic()
        result = self.executor.apply(
            Plan(actions=tuple(actions), keep=(), reclaim_bytes={}, refused=None, notes=())
        )
        elapsed = time.monotonic() - t0
        if result.failed or result.skipped:
            problems = [f"{a.action.value} {a.tier}->{a.to_tier}: {e}" for a, e in result.failed] + [
                f"{a.action.value} {a.tier}->{a.to_tier} skipped: {why}" for a, why in result.skipped
            ]
            raise RuntimeError("; ".join(problems))
        return elapsed

    def round(self, n: int, sample: int) -> dict[str, float | None]:
        """One save: write, upload to cold (replication reads the hot copy), move hot→warm,
        restore from the slowest tier (verified while streamed, then re-checked), remove."""
        name = f"preflight-{n}"
        rel = f"{self.scratch}/{name}"
        entries, write_s = _write_save(self.run_dir, name, sample, n)
        last_write = _newest_mtime(self.run_dir / name)
        manifest = Manifest(
            run=self.scratch,
            step=n,
            name=name,
            layout="preflight",
            is_dir=True,
            files=tuple(entries),
            created_at=time.time(),
            node=self.settings.node,
        )
        cid = self.index.upsert_checkpoint(
            run=self.scratch,
            name=name,
            step=n,
            layout="preflight",
            state=CheckpointState.COMPLETE,
            created_at=manifest.created_at,
            last_write=last_write,
            bytes=manifest.total_bytes,
            metrics={},
            committed=True,
            version=manifest.digest,
            manifest_json=manifest.to_json(),
            problem=None,
        )
        self.index.set_location(cid, self.hot, manifest.digest)
        rates: dict[str, float | None] = dict.fromkeys(STAGES)
        rates["hot_write"] = sample / max(write_s, 1e-9)

        def action(kind: ActionKind, tier: str, to_tier: str | None = None) -> Action:
            return Action(kind, "preflight", self.scratch, n, tier, to_tier, rel, sample, "preflight")

        if self.cold is not None:
            rates["cold_upload"] = sample / max(
                self._apply([action(ActionKind.COPY, self.hot, self.cold)]), 1e-9
            )
        if self.warm is not None:
            moved = self._apply(
                [action(ActionKind.COPY, self.hot, self.warm), action(ActionKind.DELETE, self.hot)]
            )
            rates["warm_move"] = sample / max(moved, 1e-9)
        source = self.executor.storage(self.cold or self.hot)
        restore_dir = self.run_dir / f"restore-{n}"
        t0 = time.monotonic()
        restored = source.fetch(manifest, restore_dir)
        rates["restore"] = sample / max(time.monotonic() - t0, 1e-9)
        got = sorted(
            (p.relative_to(restored).as_posix(), p.stat().st_size) for p in restored.rglob("*") if p.is_file()
        )
        if got != [(e.path, e.size) for e in manifest.files]:
            raise RuntimeError(f"restored copy of {rel} does not match its manifest")
        for tier in (self.warm, self.cold):
            if tier is not None and (problems := self.executor.storage(tier).verify(manifest, deep=False)):
                raise RuntimeError(f"{tier}: copy of {rel} fails verification: {'; '.join(problems)}")
        shutil.rmtree(restore_dir)
        for tier in (self.warm, self.cold):
            if tier is not None:
                self.executor.storage(tier).delete(rel)
        shutil.rmtree(self.run_dir / name, ignore_errors=True)
        self.index.delete_checkpoint(cid)
        return rates


# --------------------------------------------------------------------------------------------
# store probes


@dataclass
class StoreProbe:
    second_status: int | None = None
    cond_error: str | None = None
    multipart_error: str | None = None
    skew: float | None = None
    denied: list[str] = field(default_factory=list)


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status behind an s3fs/botocore error, when it says."""
    for e in (exc, exc.__cause__, exc.__context__):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            code = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code:
                return int(code)
    text = str(exc)
    if "PreconditionFailed" in text or "412" in text:
        return 412
    if "AccessDenied" in text or "403" in text or isinstance(exc, PermissionError):
        return 403
    return None


def probe_store(tier: TierConfig, scratch: str) -> StoreProbe:
    """Probe an S3 tier under the scratch prefix: permissions, conditional writes,
    ListMultipartUploads and the store's clock. Leaves objects only under the scratch prefix."""
    from ckptkeeper.storage import S3TierStorage, TierStorage

    storage = TierStorage(tier.to_spec())
    assert isinstance(storage, S3TierStorage)
    fs, bucket = storage.fs, storage.bucket
    key = f"{storage.prefix}{scratch}/probe-conditional"
    out = StoreProbe()

    def describe(exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"[:200]

    t0 = time.time()
    try:
        resp = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"1", IfNoneMatch="*")
    except Exception as exc:
        out.denied.append(f"write (PutObject: {describe(exc)})")
        out.cond_error = "the first PUT failed"
        return out
    t1 = time.time()
    date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if date:
        with contextlib.suppress(TypeError, ValueError):
            out.skew = email.utils.parsedate_to_datetime(date).timestamp() - (t0 + t1) / 2
            if abs(out.skew) <= 1.0 + (t1 - t0):  # the Date header has one-second resolution
                out.skew = 0.0
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*")
        out.second_status = 200
    except Exception as exc:
        out.second_status = _status_of(exc)
        if out.second_status != 412:
            out.cond_error = describe(exc)
    try:
        fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{storage.prefix}{scratch}/")
    except Exception as exc:
        out.denied.append(f"list (ListObjectsV2: {describe(exc)})")
    upload_key = f"{storage.prefix}{scratch}/probe-upload"
    try:
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=upload_key)
    except Exception as exc:
        out.denied.append(f"write (CreateMultipartUpload: {describe(exc)})")
    else:
        try:
            fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{storage.prefix}{scratch}/")
        except Exception as exc:
            out.multipart_error = describe(exc)
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload_key, UploadId=upload["UploadId"])
        except Exception as exc:
            out.denied.append(f"abort (AbortMultipartUpload: {describe(exc)})")
    try:
        resp = fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": [{"Key": key}], "Quiet": True})
        if resp.get("Errors"):
            first = resp["Errors"][0]
            out.denied.append(f"delete (DeleteObjects: {first.get('Code')})")
    except Exception as exc:
        out.denied.append(f"delete (DeleteObjects: {describe(exc)})")
    return out


# --------------------------------------------------------------------------------------------
# host facts


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def _count_dirs(root: Path, limit: int = 1_000_000) -> int:
    count = 0
    for _dirpath, dirnames, _files in os.walk(root):
        count += 1
        dirnames[:] = [d for d in dirnames if not d.startswith(pf.SCRATCH_PREFIX)]
        if count >= limit:
            break
    return count


UNIT_PATHS = ("/etc/systemd/system/ckptkeeper.service", "/usr/lib/systemd/system/ckptkeeper.service")


def _systemd_unit() -> tuple[dict[str, float | None], bool]:
    """WatchdogSec and TimeoutStopSec of the installed unit (the last assignment wins, as in
    systemd; drop-ins are not read), else the shipped unit's values; and whether one was found."""
    for path in UNIT_PATHS:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        found: dict[str, float | None] = dict(pf.SHIPPED_UNIT)
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key.strip() in found:
                found[key.strip()] = pf.parse_timespan(value)
        return found, True
    return dict(pf.SHIPPED_UNIT), False


def _hot_checkpoint_bytes(index: Index, hot: str) -> int:
    return sum(c.bytes for c in index.checkpoints() if hot in c.locations)


# --------------------------------------------------------------------------------------------
# the action


def _copies_on_hot(settings: Settings) -> int:
    """How many copies of a synthetic save a round holds at once on the hot tier's filesystem: the
    save and its restore, plus the slower tiers it uses (warm, cold) on that same filesystem."""
    tiers = settings.tiers
    used = {tiers[-1].name, tiers[1].name} if len(tiers) > 2 else {t.name for t in tiers[1:]}

    def device(path: Path) -> int | None:
        for p in (path, *path.parents):  # a tier directory not made yet lives where its parent is
            with contextlib.suppress(OSError):
                return os.stat(p).st_dev
        return None

    hot = device(settings.hot.local_path)
    return 2 + sum(1 for t in tiers[1:] if t.name in used and t.is_local and device(t.local_path) == hot)


def _sample_room(settings: Settings, index: Index, sample: int) -> pf.Check:
    """Is there room on the hot tier for a round, leaving the active runs' next saves their room?"""
    hot = settings.hot
    try:
        free: int | None = shutil.disk_usage(hot.local_path).free
    except OSError:
        free = None
    runs = [r for r in index.runs() if not pf.is_scratch_run(r.name)]
    room = Headroom.of(hot.name, free or 0, runs, ((c.run, c.step, c) for c in index.checkpoints()))
    active = sum(1 for b in room.runs.values() if b)
    return pf.check_sample_room(sample, free, room.needed_bytes, active, _copies_on_hot(settings))


def _stage_caps(settings: Settings) -> dict[str, list[int | None]]:
    """Stage -> the ``max_rate`` of each tier its copies go into or out of (as :class:`_Pipeline`
    picks them: cold is the last tier, warm the second of three or more). A restore is not capped:
    the job waits for it (docs/bandwidth.md)."""
    specs = settings.tier_specs()
    hot, cold = specs[0].max_rate, specs[-1].max_rate if len(specs) > 1 else None
    warm = specs[1].max_rate if len(specs) > 2 else None
    return {"cold_upload": [hot, cold], "warm_move": [hot, warm]}


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@contextlib.contextmanager
def _scratch(settings: Settings, scratch: str) -> Iterator[None]:
    """Everything written under ``scratch`` is removed on the way out, on every tier."""
    try:
        yield
    finally:
        _purge(settings, lambda run: run == scratch)


def _rounds(
    settings: Settings,
    index: Index,
    scratch: str,
    sample: int,
    series: dict[str, list[float]],
    rounds: list[dict[str, float | None]],
    *,
    quick: bool,
    duration: float | None,
) -> list[pf.Check]:
    """Drive synthetic saves through the pipeline (one, or rounds for ``duration``), each only
    while the hot tier has room for it beside the active runs' next saves; appends to ``series``
    and ``rounds``, returns the ``sample_room`` and ``pipeline`` checks."""
    room = _sample_room(settings, index, sample)
    if room.status != "pass":
        return [room, pf.Check("pipeline", "fail", "not run: no room for a synthetic save (see sample_room)")]
    pipeline = _Pipeline(settings, scratch)
    try:
        deadline = time.monotonic() + (duration or 0.0)
        n = 0
        while True:
            n += 1
            if n > 1 and (again := _sample_room(settings, index, sample)).status != "pass":
                # the runs' saves grew meanwhile: stop here, never into their headroom
                room = pf.Check("sample_room", "warn", f"stopped after {n - 1} round(s): {again.detail}")
                break
            try:
                rates = pipeline.round(n, sample)
            except Exception as exc:
                log.error("preflight pipeline failed", round=n, error=str(exc))
                return [room, pf.Check("pipeline", "fail", f"round {n}: {exc}"[:400])]
            rounds.append(rates)
            for stage, rate in rates.items():
                if rate is not None:
                    series[stage].append(rate)
            if quick or duration is None or time.monotonic() >= deadline:
                break
    finally:
        pipeline.close()
    done = f"{len(rounds)} synthetic save(s) of {_fmt_bytes(sample)} written, moved, uploaded, restored and verified"
    return [room, pf.Check("pipeline", "pass", done)]


def run_preflight(
    settings: Settings,
    index: Index,
    *,
    size: int | None = None,
    every: float | None = None,
    duration: float | None = None,
    quick: bool = False,
    drop_threshold: float = pf.DROP_THRESHOLD,
    lock_timeout: float = 5.0,
) -> PreflightReport:
    """Run the whole preflight; raises Locked if another executor runs."""
    hist_size, hist_every = history_defaults(index)
    size = size or hist_size or pf.DEFAULT_SIZE
    every = every or hist_every or pf.DEFAULT_EVERY
    sample = max(1, min(size, pf.QUICK_SAMPLE if quick else pf.FULL_SAMPLE))
    scratch = pf.scratch_run(settings.node, os.getpid())
    checks: list[pf.Check] = []
    series: dict[str, list[float]] = {s: [] for s in STAGES}
    rounds: list[dict[str, float | None]] = []
    with executor_lock(settings, lock_timeout):
        swept = sweep_scratch(settings)
        with _scratch(settings, scratch):
            checks += _rounds(
                settings, index, scratch, sample, series, rounds, quick=quick, duration=duration
            )
            for i, tier in enumerate(settings.tiers):
                if not tier.is_local:
                    probe = probe_store(tier, scratch)
                    checks += [
                        pf.check_credentials(tier.name, i, probe.denied),
                        pf.check_conditional_writes(tier.name, i, probe.second_status, probe.cond_error),
                        pf.check_multipart_listing(tier.name, i, probe.multipart_error),
                        pf.check_clock_skew(tier.name, probe.skew),
                    ]
    measured: dict[str, float | None] = {s: (round(_median(v), 1) if v else None) for s, v in series.items()}
    throughput = pf.capped_rates(measured, _stage_caps(settings))
    cold_key = f"tiers[{len(settings.tiers) - 1}].url"
    rpo_check, rpo = pf.check_rpo(size, throughput["cold_upload"], every, cold_key)
    if throughput["cold_upload"] is None and len(settings.tiers) > 1:
        rpo_check = pf.Check("rpo", "fail", "no upload was measured (see the pipeline check)")
    checks.append(rpo_check)
    specs = settings.tier_specs()
    hot = settings.hot
    try:
        du = shutil.disk_usage(hot.local_path)
        total: int | None = du.total
        ours = _hot_checkpoint_bytes(index, hot.name)
        used_other, free = max(0, du.used - ours), du.free + ours
    except OSError:
        total, used_other, free = None, 0, None
    checks.append(
        pf.check_hot_capacity(
            size, pf.kept_saves(specs[0].policy, every), total, used_other, hot.high_watermark, free
        )
    )
    for i, tier in enumerate(settings.tiers[1:], start=1):
        tier_free: int | None = None
        if tier.is_local:
            with contextlib.suppress(OSError):
                tier_free = shutil.disk_usage(tier.local_path).free
        checks.append(
            pf.check_room(tier.name, i, size, pf.kept_saves(specs[i].policy, every), tier_free, tier.is_local)
        )
    checks.append(
        pf.check_inotify(
            _read_int("/proc/sys/fs/inotify/max_user_watches"),
            _read_int("/proc/sys/fs/inotify/max_queued_events"),
            _count_dirs(hot.local_path),
            len(pf.synthetic_shape(size)),
            settings.daemon.polling,
        )
    )
    # A stage done in a fraction of a second (a same-filesystem rename) is all timer noise.
    timed = {k: v for k, v in series.items() if v and sample / max(v) >= pf.MIN_TIMED_SECONDS}
    checks.append(pf.check_throughput_drop(timed, drop_threshold, len(rounds)))
    stage_rates = [r for k in ("warm_move", "cold_upload") if (r := throughput[k])]  # the daemon's steps
    checks.append(pf.check_service(*_systemd_unit(), size / min(stage_rates) if stage_rates else None))
    return PreflightReport(
        checks=checks,
        throughput=throughput,
        rpo_seconds=rpo,
        size=size,
        every=every,
        sample_bytes=sample,
        scratch=scratch,
        rounds=[{k: (None if v is None else round(v, 1)) for k, v in r.items()} for r in rounds],
        swept=swept,
    )
