"""A checkpoint spanning nodes is one version in a shared slower tier (docs/spanning-nodes.md).

Each node copies its own part under its own prefix (``<root>/<node>/<run>/<name>``, its manifest
naming the job and part k of N). Once its copy is verified, the node writes a small **part record**
``<root>/.ckptkeeper/versions/<job>/<run>/<step>/part-<k>.json`` naming itself, the manifest's key
and the content digest. Any node reads a version with one listing of that step's records (never
every node's prefix). A version is **complete** in a tier when all N part records exist, agree on
N, and each points at a present manifest with the same digest (a manifest is committed only after
its copy was verified).

Pure: the records and manifests are read by :mod:`ckptkeeper.fleet.versions`; here is what they
mean, and what a plan may do with a part given that meaning:

* :func:`hold_parts` — a node's hot part is never let go for a slower tier's copy (a demotion, a
  "moved", a "redundant" delete) before the whole version is complete there;
* the same pass holds a count-based expiry of a part while a newer version of its run is
  incomplete in that tier, so retention counts complete versions only: every node, reading the
  same records, takes the same decision for its own part;
* **version pins** — ``pin`` of a part also writes ``<step dir>/pin-<node>.json``; every node
  treats its own part of a version pinned there as pinned (:func:`pin_parts`,
  :func:`version_pin_reasons`): the key alone says it, so a pin object is never misread.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ckptkeeper.core.model import Action, Checkpoint, Keep, Manifest
from ckptkeeper.hook import schema

__all__ = [
    "VERSIONS_DIR",
    "PartRecord",
    "VersionKey",
    "VersionStatus",
    "hold_parts",
    "job_token",
    "manifest_mismatch",
    "pin_name",
    "pin_parts",
    "pinned_by",
    "record_name",
    "step_dir",
    "version_pin_body",
    "version_pin_reasons",
    "version_status",
]

VERSIONS_DIR = "versions"
"""Under a shared tier's fleet directory (``<root>/.ckptkeeper/``)."""

RECORD_KIND = "ckptkeeper-part"
MAX_RECORD_BYTES = 4096


def job_token(job: str | None) -> str:
    """The job as one key segment: ``j-`` + its percent-encoding (a job id may hold ``/`` or start
    with a dot); ``none`` when the hook knew no job id (parts are then grouped by run alone)."""
    return "none" if job is None else "j-" + quote(job, safe="")


def step_dir(job: str | None, run: str, step: int) -> str:
    """Where one version's part records live, relative to the fleet directory."""
    return f"{VERSIONS_DIR}/{job_token(job)}/{run}/{step}"


def record_name(job: str | None, run: str, step: int, index: int) -> str:
    return f"{step_dir(job, run, step)}/part-{index}.json"


def pin_name(job: str | None, run: str, step: int, node: str) -> str:
    """A version pin: node ``node`` pinned this version (``pin RUN STEP`` of a part)."""
    return f"{step_dir(job, run, step)}/pin-{node}.json"


def pinned_by(leaf: str) -> str | None:
    """The node a version pin object's leaf name (``pin-<node>.json``) names; None if it is not one.
    The key is the pin: what the object holds is only informative (and untrusted)."""
    if not leaf.startswith("pin-") or not leaf.endswith(".json") or "/" in leaf:
        return None
    node = leaf[len("pin-") : -len(".json")]
    return node if node and not node.startswith(".") else None


def version_pin_body(job: str | None, run: str, step: int, node: str, now: float) -> bytes:
    return json.dumps(
        {
            "kind": "ckptkeeper-version-pin",
            "job": job,
            "run": run,
            "step": step,
            "node": node,
            "pinned_at": now,
        },
        sort_keys=True,
    ).encode()


def pin_parts(
    checkpoints: Sequence[Checkpoint], pins: Mapping[tuple[str, int], Sequence[str]]
) -> tuple[tuple[Checkpoint, ...], dict[tuple[str, int], str]]:
    """The checkpoints with every part of a version pinned on some node marked pinned (a part
    pinned here already stays as it is), and the keep reason of each one newly pinned:
    ``pinned on node-a (version pin)``."""
    out: list[Checkpoint] = []
    reasons: dict[tuple[str, int], str] = {}
    for c in checkpoints:
        nodes = pins.get(c.key)
        if nodes and not c.pinned and c.part is not None and (c.part.count or 0) >= 2:
            reasons[c.key] = f"pinned on {', '.join(sorted(set(nodes)))} (version pin)"
            c = dataclasses.replace(c, pinned=True)
        out.append(c)
    return tuple(out), reasons


def version_pin_reasons(keeps: Sequence[Keep], reasons: Mapping[tuple[str, int], str]) -> tuple[Keep, ...]:
    """``keeps`` with the planner's plain ``pinned`` replaced by who pinned the version."""
    out: list[Keep] = []
    for k in keeps:
        why = reasons.get((k.run, k.step))
        if why is not None:
            k = k._replace(reasons=tuple(why if r == "pinned" else r for r in k.reasons))
        out.append(k)
    return tuple(out)


VersionKey = tuple[str | None, str, int]
"""(job, run, step): one version of a checkpoint spanning nodes."""


@dataclass(frozen=True, slots=True)
class PartRecord:
    """One node's word that its part of a version is verified in this tier."""

    job: str | None
    run: str
    step: int
    index: int
    count: int
    node: str
    manifest: str
    """The copy's path relative to the tier root (``<node>/<run>/<name>``); its manifest sits beside."""
    digest: str
    written_at: float = 0.0

    @property
    def name(self) -> str:
        return record_name(self.job, self.run, self.step, self.index)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "kind": RECORD_KIND,
                "job": self.job,
                "run": self.run,
                "step": self.step,
                "part": self.index,
                "parts": self.count,
                "node": self.node,
                "manifest": self.manifest,
                "digest": self.digest,
                "written_at": self.written_at,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, name: str) -> PartRecord:
        """Validate a record read from the store (untrusted: another node, a bug, an attacker);
        raises ValueError naming what is wrong. It must sit at the key its content names."""
        if len(data) > MAX_RECORD_BYTES:
            raise schema.SchemaError("record", f"larger than {MAX_RECORD_BYTES} bytes")
        doc = schema.mapping(schema.parse_json(data, "malformed part record"), "record", max_len=16)
        if doc.get("kind") != RECORD_KIND:
            raise schema.SchemaError("kind", f"not a part record: {schema.describe(doc.get('kind'))}")
        count = schema.integer(doc.get("parts"), "parts", lo=2, hi=1_000_000)
        written = doc.get("written_at")
        rec = cls(
            job=None if doc.get("job") is None else schema.text(doc["job"], "job", max_len=255, empty=False),
            run=schema.rel_path(doc.get("run"), "run"),
            step=schema.step(doc.get("step")),
            index=schema.integer(doc.get("part"), "part", lo=0, hi=count - 1),
            count=count,
            node=schema.text(doc.get("node"), "node", max_len=253, empty=False),
            manifest=schema.rel_path(doc.get("manifest"), "manifest"),
            digest=schema.text(doc.get("digest"), "digest", max_len=128, empty=False),
            written_at=0.0 if written is None else schema.timestamp(written, "written_at"),
        )
        if "/" in rec.node or rec.node.startswith("."):
            raise schema.SchemaError("node", f"not a node name: {schema.describe(rec.node)}")
        if not rec.manifest.startswith(f"{rec.node}/{rec.run}/"):
            raise schema.SchemaError("manifest", f"{rec.manifest!r} is not under {rec.node}/{rec.run}/")
        if rec.name != name:
            raise schema.SchemaError("record", f"found at {name}, describes {rec.name}")
        return rec


@dataclass(frozen=True, slots=True)
class VersionStatus:
    """What a tier holds of one version: which parts are verified there, out of how many."""

    job: str | None
    run: str
    step: int
    count: int
    verified: tuple[int, ...] = ()
    """Part indexes whose record points at a present manifest of the same digest."""
    nodes: Mapping[int, str] | None = None
    """Part index -> the node whose record claims it (verified parts only)."""
    problems: tuple[str, ...] = ()
    """Records ignored, and why (unreadable, a digest that does not match, N disagreeing, …)."""

    @property
    def complete(self) -> bool:
        return len(self.verified) == self.count

    @property
    def label(self) -> str:
        return f"{len(self.verified)}/{self.count}"

    def to_doc(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "verified": list(self.verified),
            "complete": self.complete,
            "problems": list(self.problems),
        }


def manifest_mismatch(rec: PartRecord, manifest: Manifest) -> str | None:
    """Why the manifest a part record names does not back it, or None: it must be part ``index``
    of ``count`` of the record's job, run and step, written by the record's node, with its digest.
    The one check of a record against what it points at: retention (:func:`version_status`) and
    restore both rely on it (docs/design.md, "Cluster reality")."""
    part = manifest.part
    if manifest.digest != rec.digest:
        return "is another version (digest differs)"
    if (manifest.run, manifest.step) != (rec.run, rec.step):
        return f"is {manifest.run}@{manifest.step}, not {rec.run}@{rec.step}"
    if part is None or (part.index, part.count) != (rec.index, rec.count):
        said = "no part" if part is None else f"part {part.index} of {part.count}"
        return f"is {said}, not part {rec.index} of {rec.count}"
    if part.job != rec.job:
        return f"is of job {part.job!r}, not {rec.job!r}"
    if manifest.node and manifest.node != rec.node:
        return f"was written by node {manifest.node}, not {rec.node}"
    return None


def version_status(
    key: VersionKey,
    count: int,
    records: Iterable[tuple[str, PartRecord | None, str | None]],
    manifests: Mapping[str, Manifest | str | None],
) -> VersionStatus:
    """Decide completeness of version ``key`` (N = ``count``, from the asking node's own part).

    ``records``: ``(name, record or None, error)`` as listed and read; ``manifests``: a record's
    ``manifest`` key -> the manifest found there (None: absent or unreadable; a digest alone is
    checked as the digest only). A record is ignored, with its reason, when it did not parse,
    names another N, or points at no manifest that backs it (:func:`manifest_mismatch`). Same
    records, same answer, on every node.
    """
    job, run, step = key
    verified: dict[int, str] = {}
    problems: list[str] = []
    for name, rec, error in sorted(records, key=lambda r: r[0]):
        if rec is None:
            problems.append(f"{name}: {error or 'unreadable'}")
            continue
        if (rec.job, rec.run, rec.step) != key:
            problems.append(f"{name}: names another version ({rec.job}, {rec.run}, {rec.step})")
        elif rec.count != count:
            problems.append(f"{name}: says {rec.count} parts, this node's part says {count}")
        elif (found := manifests.get(rec.manifest)) is None:
            problems.append(f"{name}: no readable manifest at {rec.manifest}")
        elif (why := _backs(rec, found)) is not None:
            problems.append(f"{name}: manifest at {rec.manifest} {why}")
        elif rec.index in verified and verified[rec.index] != rec.node:
            problems.append(f"{name}: part {rec.index} claimed by nodes {verified[rec.index]} and {rec.node}")
        else:
            verified[rec.index] = rec.node
    return VersionStatus(
        job=job,
        run=run,
        step=step,
        count=count,
        verified=tuple(sorted(verified)),
        nodes=dict(sorted(verified.items())),
        problems=tuple(problems),
    )


def _backs(rec: PartRecord, found: Manifest | str) -> str | None:
    if isinstance(found, str):
        return None if found == rec.digest else "is another version (digest differs)"
    return manifest_mismatch(rec, found)


def _part_label(c: Checkpoint) -> str:
    assert c.part is not None
    return f"part {c.part.index} of {c.part.count}"


def hold_parts(
    deletes: Sequence[Action],
    keeps: Sequence[Keep],
    checkpoints: Mapping[tuple[str, int], Checkpoint],
    versions: Mapping[tuple[str, int, str], VersionStatus],
    shared: Sequence[str],
    pos: Mapping[str, int],
) -> tuple[list[Action], Sequence[Keep], list[str]]:
    """Turn deletes of a node's part that the shared tiers' versions do not allow into keeps.

    ``versions``: (run, step, shared tier) -> status, for the parts planned for deletion and every
    newer step of their runs (what :mod:`ckptkeeper.fleet.versions` read). Rules, per delete of a
    checkpoint that is part k of N (N > 1):

    * a delete from a tier that is not shared (the node's hot part) that is not an expiry (the
      copy in a slower tier is why it may go: ``moved``, ``redundant``, a demotion) is held unless
      the version is complete in a shared tier where this part is verified: ``part 0 of 2:
      version incomplete in cold (1/2 parts)``;
    * an expiry is held while a newer version of the run is incomplete in a shared tier
      (retention counts complete versions only): ``part 0 of 2: expiry waits: newer version
      step 300 incomplete in cold (1/2 parts)``. Every delete of that checkpoint is held then.

    Returns the deletes left, the keeps (with the held copies added, in output order) and notes.
    """
    if not shared:
        return list(deletes), keeps, []
    held: dict[tuple[str, int, str], str] = {}
    held_expiry: dict[tuple[str, int], str] = {}
    for a in deletes:
        if a.run is None or a.step is None or a.tier is None:
            continue
        c = checkpoints.get((a.run, a.step))
        if c is None or c.part is None or c.part.count is None or c.part.count < 2 or c.part.index is None:
            continue
        if a.rule == "expired":
            why = _newer_incomplete(c, versions, shared)
            if why is not None:
                held_expiry[c.key] = f"{_part_label(c)}: expiry waits: {why}"
            continue
        if a.tier in shared:
            continue  # a shared tier's own copy going (it resides faster): not a hot part let go
        statuses = [(t, versions.get((c.run, c.step, t))) for t in shared if t in c.tiers]
        if any(s is not None and s.complete for _, s in statuses):
            continue
        where = next(((t, s) for t, s in statuses if s is not None), None)
        if where is not None:
            t, s = where
            held[(a.run, a.step, a.tier)] = f"{_part_label(c)}: version incomplete in {t} ({s.label} parts)"
        else:
            tier = next((t for t in shared if t != a.tier), shared[0])
            held[(a.run, a.step, a.tier)] = (
                f"{_part_label(c)}: version incomplete in {tier} (this part not recorded there yet)"
            )
    if not held and not held_expiry:
        return list(deletes), keeps, []
    out: list[Action] = []
    extra: list[Keep] = []
    for a in deletes:
        key = (a.run or "", a.step if a.step is not None else -1, a.tier or "")
        if key in held:
            extra.append(Keep(key[0], key[1], key[2], (held[key],)))
        elif key[:2] in held_expiry:
            extra.append(Keep(key[0], key[1], key[2], (held_expiry[key[:2]],)))
        else:
            out.append(a)
    last = len(pos)
    merged = [*keeps, *extra]
    merged.sort(key=lambda k: (k.run, k.step, pos.get(k.tier, last)))
    notes = sorted({f"{k.run}@{k.step}: {k.reasons[0]}" for k in extra})
    return out, merged, notes


def _newer_incomplete(
    c: Checkpoint, versions: Mapping[tuple[str, int, str], VersionStatus], shared: Sequence[str]
) -> str | None:
    """The first newer version of ``c``'s run incomplete in a shared tier, in words; None if none."""
    newer = sorted(
        (step, tier, s)
        for (run, step, tier), s in versions.items()
        if run == c.run and step > c.step and tier in shared and not s.complete
    )
    if not newer:
        return None
    step, tier, s = newer[0]
    return f"newer version step {step} incomplete in {tier} ({s.label} parts)"
