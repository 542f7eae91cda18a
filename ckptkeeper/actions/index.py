"""The index as an action: open it, and repair a corrupt, missing or replaced one from the tiers.

A corrupt index is moved aside and rebuilt from the tiers (every tier is self-describing); a missing
one (``rm index.db*``) is rebuilt the same way when the tiers hold copies, and a daemon whose index
file was deleted or replaced under it (:meth:`Index.identity_problem`, checked before every pass and
every write) reopens the path and rebuilds too (:func:`reopen_after_loss`). Pins are read back from
the pin objects in the slower tiers (``actions.pins``); what only the index knew — the journal —
is lost with it, so deletes are frozen (a :class:`DeleteFreeze`, in ``<index>.deletes-held``) until
every tier has been reconciled again. The freeze is written here; each prune pass applies it to its
plan, and advances or releases it afterwards (:mod:`ckptkeeper.actions.pruning.freeze`).
:func:`executor_lock` serialises everything that changes the tiers or rebuilds the index.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptkeeper.actions.errors import IndexUnusable, Locked
from ckptkeeper.hook.protocol import INDEX_RECORD_PREFIX
from ckptkeeper.index import Index, IndexCorrupt, salvage_history
from ckptkeeper.util.lock import ExecutorLock, LockHeld
from ckptkeeper.util.logs import get_logger

if TYPE_CHECKING:
    from ckptkeeper.config import Settings
    from ckptkeeper.ingest.catalog import Catalog
    from ckptkeeper.ingest.report import ReconcileReport

# The catalog (and its layouts) is imported where an index is rebuilt: opening a sound index, as
# every command does, needs none of it.

log = get_logger("ckptkeeper.actions.index")


def _catalog(settings: Settings, index: Index) -> Catalog:
    from ckptkeeper.ingest.catalog import Catalog

    return Catalog(settings, index)


@contextmanager
def executor_lock(settings: Settings, timeout: float) -> Iterator[None]:
    """One executor per index (flock); waits up to ``timeout`` seconds, then raises Locked."""
    lock = ExecutorLock(settings.index)
    try:
        lock.acquire(timeout)
    except LockHeld as exc:
        raise Locked(str(exc)) from None
    try:
        yield
    finally:
        lock.release()


FREEZE_SUFFIX = ".deletes-held"


@dataclass(frozen=True)
class DeleteFreeze:
    """Deletes frozen after an index loss: the first pass only copies; then, while the pins are
    unknown (not salvaged, nor read back from the tiers), no expiry or reap runs until ``--force``."""

    reason: str
    pins_salvaged: bool = False
    first_pass_done: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "pins_salvaged": self.pins_salvaged,
            "first_pass_done": self.first_pass_done,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> DeleteFreeze:
        return cls(str(doc.get("reason")), bool(doc.get("pins_salvaged")), bool(doc.get("first_pass_done")))

    def describe(self) -> str:
        """What is frozen and why (``status``)."""
        if not self.first_pass_done:
            return f"every delete and reap, for one prune pass: {self.reason}"
        return (
            f"expiries and reaps (moves go on): {self.reason}; the index was rebuilt without its "
            "pins: re-pin what must be kept, then run `ckptkeeper prune --force`"
        )


def deletes_held_path(settings: Settings) -> Path:
    index = Path(settings.index)
    return index.with_name(index.name + FREEZE_SUFFIX)


def read_freeze(settings: Settings) -> DeleteFreeze | None:
    """The freeze a rebuild left, or None."""
    try:
        text = deletes_held_path(settings).read_text()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            return DeleteFreeze.from_json(doc)
    except ValueError:
        pass
    return DeleteFreeze(text.strip() or "index rebuilt")  # unreadable: the strictest freeze


def deletes_held(settings: Settings) -> str | None:
    """What is frozen and why (``status``'s ``deletes_held``), or None."""
    freeze = read_freeze(settings)
    return None if freeze is None else freeze.describe()


def write_freeze(settings: Settings, freeze: DeleteFreeze) -> None:
    held = deletes_held_path(settings)
    tmp = held.with_name(held.name + ".tmp")
    tmp.write_text(json.dumps(freeze.to_json()) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, held)


def _corruption(exc: BaseException) -> bool:
    """A damaged database, as opposed to one that is busy, missing or on a failing disk."""
    if isinstance(exc, IndexCorrupt):
        return True
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text or not isinstance(exc, sqlite3.OperationalError)


def open_index(settings: Settings, *, check: bool = False, rebuild: bool = False) -> Index:
    """Open the index; with ``check`` run SQLite's ``quick_check`` first.

    A missing index is rebuilt from the tiers with ``rebuild`` (deletes held when the tiers hold
    copies, see :func:`_finish_loss`); without it an empty in-memory index stands in, so that a
    read-only command never creates the file.

    A corrupt index (unreadable, or failing the check) is moved aside as
    ``<index>.corrupt-<time>`` and, with ``rebuild``, rebuilt from the tiers: the hot tier is
    scanned and every slower tier listed through the manifests beside its copies. What only the
    index knew is lost with it — pins (salvaged from the damaged file when it still reads), the
    journal — so deletes are then held (``<index>.deletes-held``): the first prune after a rebuild
    copies but deletes and reaps nothing, and releases the freeze once a reconcile listed every
    tier. Without ``rebuild`` a corrupt index raises :class:`IndexUnusable`.
    """
    if not _index_exists(settings):
        if not rebuild:
            # Read-only uses (ls, status, pin, a dry run) must not create the file: an empty index
            # on disk would hide the loss from the next scan or prune, which rebuild it.
            log.debug(
                "index does not exist: `ckptkeeper scan` builds it from the tiers", index=str(settings.index)
            )
            return Index(":memory:")
        # Never created, or lost (``rm index.db*``): rebuilt from the tiers, and when they hold
        # copies the first pass deletes nothing, exactly as after corruption.
        with executor_lock(settings, timeout=60.0):
            if not _index_exists(settings):
                return _rebuild_missing(settings)
    ix: Index | None = None
    try:
        ix = Index(settings.index)
        if check:
            ix.quick_check()
        return ix
    except Exception as exc:
        if ix is not None:
            ix.close()
        if not _corruption(exc):
            raise
        problem = f"{type(exc).__name__}: {exc}"
    if not rebuild:
        raise IndexUnusable(
            f"index {settings.index} is corrupt ({problem}); `ckptkeeper scan` rebuilds it from the tiers"
        )
    with executor_lock(settings, timeout=60.0):
        return _rebuild(settings, problem)


def _rebuild(settings: Settings, problem: str) -> Index:
    path = Path(settings.index)
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
    reason = f"index rebuilt from the tiers at {time.strftime('%Y-%m-%d %H:%M:%S')} ({problem})"
    # The freeze first: a crash in the middle of a rebuild must not leave a fresh index that deletes.
    freeze = DeleteFreeze(reason)
    write_freeze(settings, freeze)
    for suffix in ("", "-wal", "-shm"):
        src = Path(str(path) + suffix)
        if src.exists():
            os.replace(src, Path(str(aside) + suffix))
    log.error(
        "index corrupt: moved aside, rebuilding from the tiers; deletes held until a full reconcile",
        index=str(path),
        moved_to=str(aside),
        problem=problem,
    )
    pins = _salvage_pins(aside)
    ix = Index(path)
    ix.add_history(salvage_history(aside), durable=True)  # `history` and `why` survive the rebuild
    report = _catalog(settings, ix).reconcile()
    wanted = sorted(set(pins or ()))
    restored = sum(ix.set_pinned(run, step, True) > 0 for run, step in wanted)
    recorded = read_index_record(settings)
    if recorded:
        ix.pin_by_name(recorded)
    # The hot root's record is a source of pins too (the only one with a hot tier alone).
    in_tiers = _pins_read_from_tiers(settings, report) or (pins is None and recorded is not None)
    # Relaxed only once every pin is back in the index — salvaged from the damaged file, or read
    # from the pin objects of every slower tier: a crash before this, or a pinned checkpoint in a
    # tier that could not be listed, keeps the strict freeze.
    if (pins is not None and restored == len(wanted)) or in_tiers:
        write_freeze(settings, dataclasses.replace(freeze, pins_salvaged=True))
    log.warning(
        "index rebuilt from the tiers",
        checkpoints=len(ix.checkpoints()),
        tiers_failed=sorted(report.tiers_failed),
        pins_salvaged=None if pins is None else len(wanted),
        pins_restored=restored,
        pins_read_from_tiers=in_tiers,
    )
    if not in_tiers and (pins is None or restored != len(wanted)):
        log.error(
            "pins could not all be restored from the damaged index: expiries and reaps stay held; re-pin "
            "what must be kept (ckptkeeper pin), then run `ckptkeeper prune --force`",
            pins_restored=restored,
            pins_salvaged=None if pins is None else len(wanted),
        )
    return ix


# --------------------------------------------------------------------------------------------
# The index record in the hot root: proof that an index existed, and its pins


def index_record_path(settings: Settings) -> Path:
    return settings.hot.local_path / f"{INDEX_RECORD_PREFIX}{settings.node}.json"


def write_index_record(settings: Settings, index: Index) -> None:
    """Record in the hot root that this node has an index, with its pins (best effort, only when
    they changed). Pin objects live in the slower tiers; a node with only a hot tier had no
    other trace of its index: ``rm index.db*`` looked like a first start and the next prune
    expired what was pinned. The record sits outside the index's directory, so the same ``rm``
    does not take it, and is per node, so nodes sharing a hot file system keep their own."""
    path = index_record_path(settings)
    doc = json.dumps(
        {
            "version": 1,
            "node": settings.node,
            "index": str(settings.index),
            "pins": sorted(index.pinned_names()),
        },
        sort_keys=True,
    )
    try:
        if path.read_text() == doc:
            return
    except (OSError, UnicodeDecodeError):
        pass
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(doc)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("cannot write the index record in the hot root", path=str(path), error=str(exc))


def read_index_record(settings: Settings) -> list[tuple[str, str]] | None:
    """The pins (run, name) the record holds; None when there is no readable record (a record
    is untrusted input like anything under a root: anything but the expected shape is ignored)."""
    try:
        doc = json.loads(index_record_path(settings).read_bytes()[: 1 << 24])
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("pins"), list):
        return None
    return [
        (p[0], p[1])
        for p in doc["pins"]
        if isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) and x and "\0" not in x for x in p)
    ]


def _index_existed(settings: Settings, catalog: Catalog) -> bool:
    """This node had an index worth holding deletes for: its copies in a slower tier, or pins in
    its record in the hot root (a record without pins, e.g. of an index that only ever held a
    preflight's scratch, lost nothing a first start would not rebuild)."""
    return _tiers_hold_copies(catalog) or bool(read_index_record(settings))


def _index_exists(settings: Settings) -> bool:
    try:
        os.stat(settings.index)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # exists but cannot be examined: opening it reports the real problem
    return True


def _pins_read_from_tiers(settings: Settings, report: ReconcileReport) -> bool:
    """Every slower tier was listed, pin objects included: the pins are all known again."""
    slower = [t.name for t in settings.tiers[1:]]
    return bool(slower) and not any(t in report.tiers_failed for t in slower)


def _tiers_hold_copies(catalog: Catalog) -> bool:
    """Copies this node wrote into a slower tier (their manifests name it) prove it had an index
    before: a missing one was lost. Copies of other nodes only (a new node on a shared tier), or
    none, are a first start."""
    return any(catalog.own_copies.values())


def freeze_after_loss(settings: Settings, catalog: Catalog, report: ReconcileReport) -> DeleteFreeze | None:
    """The freeze a real run would write for a missing index, for a dry run that must not write it:
    ``catalog`` reconciled a stand-in (in-memory) index. None when the index exists, or when
    rebuilding it would freeze nothing (a first start, every tier listed)."""
    if _index_exists(settings) or (not report.tiers_failed and not _index_existed(settings, catalog)):
        return None
    return DeleteFreeze(
        f"index {settings.index} is missing: a real run rebuilds it from the tiers",
        pins_salvaged=_pins_read_from_tiers(settings, report) or read_index_record(settings) is not None,
    )


def _finish_loss(
    settings: Settings, index: Index, freeze: DeleteFreeze, catalog: Catalog, report: ReconcileReport
) -> None:
    """After a lost index was rebuilt into ``index``: keep, relax or drop the freeze written first."""
    if not report.tiers_failed and not _index_existed(settings, catalog):
        deletes_held_path(settings).unlink(missing_ok=True)  # a first start: nothing was lost
        log.info("new index built from the tiers", index=str(settings.index))
        write_index_record(settings, index)
        return
    recorded = read_index_record(settings)
    if recorded:
        restored = index.pin_by_name(recorded)
        log.warning("pins carried over from the index record in the hot root", pins=restored)
    in_tiers = _pins_read_from_tiers(settings, report)
    if in_tiers or recorded is not None:
        write_freeze(settings, dataclasses.replace(freeze, pins_salvaged=True))
    log.error(
        "index rebuilt from the tiers; deletes held until every tier is reconciled",
        index=str(settings.index),
        checkpoints=len(index.checkpoints()),
        tiers_failed=sorted(report.tiers_failed),
        pins_read_from_tiers=in_tiers,
        pinned=len(index.pinned_names()),
    )


def _loss_freeze(settings: Settings, problem: str) -> DeleteFreeze:
    freeze = DeleteFreeze(f"index rebuilt from the tiers at {time.strftime('%Y-%m-%d %H:%M:%S')} ({problem})")
    # The freeze first: a crash in the middle of a rebuild must not leave a fresh index that deletes.
    write_freeze(settings, freeze)
    return freeze


def _rebuild_missing(settings: Settings) -> Index:
    problem = f"index {settings.index} was missing"
    freeze = _loss_freeze(settings, problem)
    ix = Index(settings.index)
    catalog = _catalog(settings, ix)
    report = catalog.reconcile()
    _finish_loss(settings, ix, freeze, catalog, report)
    return ix


def reopen_after_loss(settings: Settings, index: Index, problem: str) -> bool:
    """The file ``index`` was opened from is deleted or replaced (the daemon keeps one connection
    for its life): reopen the path in place and rebuild it from the tiers, deletes held, pins
    kept — those still readable through the old connection, and those in the tiers. Returns
    False if, under the executor lock, the index turned out to be fine after all."""
    with executor_lock(settings, timeout=60.0):
        problem = index.identity_problem() or ""
        if not problem:
            return False
        freeze = _loss_freeze(settings, problem)
        try:
            # the old file is deleted but still open: its pins are one more source
            salvaged = index.pinned_names()
        except Exception:
            salvaged = set()
        try:
            events = index.history()  # and its history, for `history` and `why`
        except Exception:
            events = []
        log.error(
            "index deleted or replaced while open: reopening it and rebuilding from the tiers, deletes held",
            index=str(settings.index),
            problem=problem,
        )
        index.reopen()
        index.add_history(events, durable=True)
        catalog = _catalog(settings, index)
        report = catalog.reconcile()
        restored = index.pin_by_name(sorted(salvaged))
        if restored:
            log.warning("pins carried over from the lost index", pins=restored)
        _finish_loss(settings, index, freeze, catalog, report)
        return True


def _salvage_pins(aside: Path) -> list[tuple[str, int]] | None:
    """Pins live only in the index: read them from the damaged file (None: it does not read)."""
    try:
        con = sqlite3.connect(f"file:{aside}?mode=ro", uri=True, timeout=1)
        try:
            rows = con.execute("SELECT run, step FROM checkpoints WHERE pinned = 1").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return None
    return [(str(r), int(s)) for r, s in rows]
