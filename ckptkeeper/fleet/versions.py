"""Part records of checkpoints spanning nodes, in a shared S3 tier: write, read, judge, remove.

The meaning (what a record says, when a version is complete) is :mod:`ckptkeeper.core.versions`;
this module only reads and writes ``<root>/.ckptkeeper/versions/…`` and the manifests the records
point at. Everything read is untrusted: a record that does not parse, or points at a manifest
that is missing or of another digest, is ignored with its reason (:attr:`VersionStatus.problems`),
never a crash.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from ckptkeeper.core.model import Manifest
from ckptkeeper.core.versions import (
    VERSIONS_DIR,
    PartRecord,
    VersionKey,
    VersionStatus,
    job_token,
    pin_name,
    pinned_by,
    step_dir,
    version_pin_body,
    version_status,
)
from ckptkeeper.storage import S3TierStorage, StorageError

__all__ = [
    "delete_record",
    "list_run_pins",
    "list_run_records",
    "read_version",
    "read_versions",
    "record_for",
    "remove_version_pin",
    "write_record",
    "write_version_pin",
]


def record_for(manifest: Manifest, node: str, *, now: float | None = None) -> PartRecord | None:
    """The record of this node's copy of ``manifest`` (None when it is not a known part of N > 1)."""
    part = manifest.part
    if part is None or part.count is None or part.index is None or part.count < 2:
        return None
    return PartRecord(
        job=part.job,
        run=manifest.run,
        step=manifest.step,
        index=part.index,
        count=part.count,
        node=node,
        manifest=f"{node}/{manifest.run}/{manifest.name}",
        digest=manifest.digest,
        written_at=time.time() if now is None else now,
    )


def write_record(tier: S3TierStorage, record: PartRecord) -> None:
    """PUT the record (after this node's copy was verified; replacing its own older record)."""
    tier.put_fleet_object(record.name, record.to_json())


def delete_record(tier: S3TierStorage, name: str) -> None:
    tier.delete_fleet_object(name)


def write_version_pin(tier: S3TierStorage, job: str | None, run: str, step: int, node: str) -> None:
    """``pin`` of a part: every node's part of this version is pinned while the object exists."""
    tier.put_fleet_object(pin_name(job, run, step, node), version_pin_body(job, run, step, node, time.time()))


def remove_version_pin(tier: S3TierStorage, job: str | None, run: str, step: int, node: str) -> None:
    """``unpin`` of a part: only this node's pin of the version (another node's pin stays)."""
    tier.delete_fleet_object(pin_name(job, run, step, node))


def list_run_pins(tier: S3TierStorage, job: str | None, run: str) -> dict[int, list[str]]:
    """step -> nodes that pinned that version of ``run`` of ``job``: one listing. The key is the
    pin (no GET): an object there whose body is garbage still pins, the safe side."""
    base = f"{VERSIONS_DIR}/{job_token(job)}/{run}"
    out: dict[int, list[str]] = {}
    for name, _mtime in tier.list_fleet_objects(base):
        head, _, leaf = name.partition("/")
        node = pinned_by(leaf)
        if head.isdigit() and node is not None:
            out.setdefault(int(head), []).append(node)
    return out


def list_run_records(tier: S3TierStorage, job: str | None, run: str) -> dict[int, list[str]]:
    """step -> record names of ``run`` of ``job`` in ``tier``: one listing."""
    base = f"{VERSIONS_DIR}/{job_token(job)}/{run}"
    out: dict[int, list[str]] = {}
    for name, _mtime in tier.list_fleet_objects(base):
        head, _, leaf = name.partition("/")
        if not head.isdigit() or "/" in leaf or not leaf.startswith("part-") or not leaf.endswith(".json"):
            continue
        out.setdefault(int(head), []).append(f"{base}/{name}")
    return out


def _read_record(tier: S3TierStorage, name: str) -> tuple[str, PartRecord | None, str | None]:
    try:
        got = tier.get_fleet_object(name)
    except StorageError as exc:
        return name, None, f"unreadable: {exc}"
    if got is None:
        return name, None, "gone while reading"
    try:
        return name, PartRecord.from_json(got[0], name), None
    except ValueError as exc:
        return name, None, f"bad record: {exc}"


def _manifest(tier: S3TierStorage, rel: str, cache: dict[str, Manifest | None]) -> Manifest | None:
    if rel not in cache:
        node, _, inner = rel.partition("/")
        try:
            cache[rel] = tier.view(node).read_manifest(inner)
        except StorageError:
            cache[rel] = None
    return cache[rel]


def read_version(
    tier: S3TierStorage,
    key: VersionKey,
    count: int,
    names: Iterable[str] | None = None,
    cache: dict[str, Manifest | None] | None = None,
) -> VersionStatus:
    """The status of one version in ``tier``: its records (listed, unless ``names`` are given),
    each read and validated, and checked against the manifest each points at (part index and
    count, job, run, step, writer, digest: :func:`ckptkeeper.core.versions.manifest_mismatch`).
    Retention and restore both take a version's parts from here."""
    job, run, step = key
    if names is None:
        base = step_dir(job, run, step)
        names = [f"{base}/{n}" for n, _ in tier.list_fleet_objects(base) if "/" not in n]
    records = [_read_record(tier, n) for n in sorted(names)]
    manifests: dict[str, Manifest | None] = {}
    cache = {} if cache is None else cache
    for _name, rec, _err in records:
        if rec is not None:
            manifests[rec.manifest] = _manifest(tier, rec.manifest, cache)
    return version_status(key, count, records, manifests)


def read_versions(
    tier: S3TierStorage, job: str | None, run: str, counts: Mapping[int, int]
) -> dict[int, VersionStatus]:
    """Statuses of the steps in ``counts`` (step -> N) of one run: one listing, then each step's
    records and manifests."""
    listed = list_run_records(tier, job, run)
    cache: dict[str, Manifest | None] = {}
    return {
        step: read_version(tier, (job, run, step), count, listed.get(step, []), cache)
        for step, count in sorted(counts.items())
    }
