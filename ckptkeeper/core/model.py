"""The domain model of docs/design.md, "Domain model" as plain, immutable data.

Nothing here performs I/O: the planner consumes these values and the shell (catalog, executor)
produces them. Times are POSIX seconds (float, UTC) so the planner can take ``now`` as an argument.
"""

from __future__ import annotations

import hashlib
import json
import string
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import chain
from typing import Any, NamedTuple, overload

from ckptkeeper.hook import schema

MANIFEST_VERSION = 1
MANIFEST_SUFFIX = ".ckptkeeper-manifest.json"
"""A slower tier stores ``<run>/<checkpoint><MANIFEST_SUFFIX>`` beside each copy."""

HASH_ALGORITHM = "xxh3_128"
ENCODINGS = ("zstd", "zipnn")
"""How a slower tier may store a file besides as it is (docs/compression.md)."""


class RunState(StrEnum):
    ACTIVE = "active"
    FINISHED = "finished"
    FAILED = "failed"
    STALE = "stale"


class CheckpointState(StrEnum):
    WRITING = "writing"
    COMPLETE = "complete"
    CORRUPT = "corrupt"


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint, relative to the checkpoint path ("" for a single-file checkpoint)."""

    path: str
    size: int
    hash: str
    location: str = ""
    """Where a slower tier holds the bytes: "" at the file's path in the copy, :data:`IN_CONTENT`
    in the node's content store of the tier, named by ``hash`` (docs/dedup.md). Written only when
    set (an old manifest reads as before); not in the digest: the version is the content."""
    parts: tuple[tuple[int, str], ...] = ()
    """In the content store as consecutive pieces (a safetensors file split at its tensors):
    ``(size, hash)`` of each, in file order; empty: one object named by ``hash``."""
    encoding: str = field(default="", compare=False)
    """How the tier whose manifest this is stores the file (docs/compression.md): "" as it is,
    else one of :data:`ENCODINGS`. ``size`` and ``hash`` stay the raw file's: not in the digest."""
    stored: int | None = field(default=None, compare=False)
    """Bytes the tier holds for an encoded file (None when raw)."""
    forms: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    """With ``parts``: ``(encoding, stored size)`` of each piece's content object ("" and its size:
    raw), in the order of ``parts``; empty: every piece raw. Written into ``parts`` items as
    ``[size, hash, encoding, stored]``; not in the digest."""

    @property
    def stored_size(self) -> int:
        """Bytes the tier holds for this file."""
        if self.forms:
            return sum(stored for _enc, stored in self.forms)
        return self.stored if self.encoding and self.stored is not None else self.size

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "size": self.size, "hash": self.hash}
        if self.location:
            doc["location"] = self.location
        if self.parts:
            forms = self.forms or tuple(("", size) for size, _ in self.parts)
            doc["parts"] = [
                [size, digest, enc, stored] if enc else [size, digest]
                for (size, digest), (enc, stored) in zip(self.parts, forms, strict=True)
            ]
        if self.encoding:  # written only when set: a raw copy's manifest is byte-identical to before
            doc["encoding"] = self.encoding
            doc["stored"] = self.stored
        return doc


IN_CONTENT = "content"
""":attr:`FileEntry.location` of a file whose bytes live in its node's content store."""
_CONTENT_HASH_CHARS = frozenset(string.digits + "abcdef")


def _location(entry: Mapping[str, Any], i: int, digest: str) -> str:
    """The ``location`` of a file entry read back: absent, or :data:`IN_CONTENT` with a hash that
    can name a content object (lowercase hex of the algorithm's length): never a path."""
    value = entry.get("location")
    if value is None or value == "":
        return ""
    if value != IN_CONTENT:
        raise schema.SchemaError(f"files[{i}].location", f"unknown location {schema.describe(value)}")
    if len(digest) != 32 or not set(digest) <= _CONTENT_HASH_CHARS:
        raise schema.SchemaError(f"files[{i}].hash", "a file in the content store needs a 32-digit hex hash")
    return IN_CONTENT


def _parts(
    entry: Mapping[str, Any], i: int, size: int, location: str
) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[str, int], ...]]:
    """The ``parts`` of a file entry read back (pieces of content-store objects adding up to the
    file's size, each named by a 32-digit hex hash), and how each piece is stored (all raw: ())."""
    raw = entry.get("parts")
    if raw is None:
        return (), ()
    field = f"files[{i}].parts"
    if location != IN_CONTENT:
        raise schema.SchemaError(field, "parts only for a file in the content store")
    if entry.get("encoding") not in (None, ""):
        raise schema.SchemaError(
            f"files[{i}].encoding", "a file in pieces records the encoding of each piece"
        )
    out = []
    forms = []
    for j, item in enumerate(schema.array(raw, field, max_len=1_000_000)):
        where = f"{field}[{j}]"
        if not isinstance(item, list) or len(item) not in (2, 4):
            raise schema.SchemaError(where, "want [size, hash] or [size, hash, encoding, stored]")
        digest = schema.text(item[1], where, max_len=64)
        if len(digest) != 32 or not set(digest) <= _CONTENT_HASH_CHARS:
            raise schema.SchemaError(where, "a piece needs a 32-digit hex hash")
        piece = schema.size(item[0], where)
        out.append((piece, digest))
        if len(item) == 2:
            forms.append(("", piece))
            continue
        encoding, stored = _stored_form({"encoding": item[2], "stored": item[3]}, i, piece)
        if not encoding or stored is None:
            raise schema.SchemaError(where, "an encoded piece needs its encoding and stored size")
        forms.append((encoding, stored))
    if sum(s for s, _ in out) != size:
        raise schema.SchemaError(field, "pieces do not add up to the file's size")
    return tuple(out), (tuple(forms) if any(enc for enc, _ in forms) else ())


@dataclass(frozen=True, slots=True)
class NodePart:
    """This node's share of a checkpoint spanning nodes (docs/spanning-nodes.md).

    ``count`` is None when no hook said the run is a node's part: the files only look like one
    (the marker rank 0 writes, and rank 0's shards, are missing); such a checkpoint is kept, never
    reaped as partial, until the fleet knows what it is.
    """

    note: str
    """Why it is a part, in words (the layout's evidence, or the hook's word)."""
    job: str | None = None
    index: int | None = None
    """0-based part index (the node's ``GROUP_RANK``), as the hook recorded it."""
    count: int | None = None
    """Number of parts (nodes) of the job, as the hook recorded it."""
    marker_elsewhere: bool = False
    """Its files lack only the completion marker rank 0 writes on another node (and rank 0's
    shards): not a partial save. The reaper never reaps such a checkpoint as partial or stale."""

    @property
    def known(self) -> bool:
        """The hook said so (a part of a known job), rather than the files' shape alone."""
        return self.count is not None

    def to_doc(self) -> dict[str, Any]:
        return {
            "note": self.note,
            "job": self.job,
            "index": self.index,
            "count": self.count,
            "marker_elsewhere": self.marker_elsewhere,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_doc(), sort_keys=True)

    @classmethod
    def from_doc(cls, value: Any, field: str = "part") -> NodePart:
        """Validate a part read back (a manifest in a tier is untrusted); SchemaError names the field."""
        doc = schema.mapping(value, field, max_len=16)

        def opt(key: str, check: Any, **bounds: Any) -> Any:
            return None if doc.get(key) is None else check(doc[key], f"{field}.{key}", **bounds)

        count = opt("count", schema.integer, lo=1, hi=1_000_000)
        return cls(
            note=schema.text(doc.get("note") or "", f"{field}.note"),
            job=opt("job", schema.text, max_len=255),
            index=opt("index", schema.integer, lo=0, hi=(count or 1_000_000) - 1),
            count=count,
            marker_elsewhere=schema.boolean(doc.get("marker_elsewhere", False), f"{field}.marker_elsewhere"),
        )

    @classmethod
    def from_json(cls, text: str | None) -> NodePart | None:
        """The index's column, tolerantly: a value that does not parse is no part, not a crash."""
        if not text:
            return None
        try:
            return cls.from_doc(schema.parse_json(text, "part"))
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class Manifest:
    """Content manifest: what a verified copy must contain. Its digest is the version id."""

    run: str
    step: int
    name: str
    """Checkpoint path relative to the run directory (e.g. ``checkpoint-100`` or ``epoch=1.ckpt``)."""
    layout: str
    is_dir: bool
    files: tuple[FileEntry, ...]
    metrics: Mapping[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    node: str = ""
    algorithm: str = HASH_ALGORITHM
    part: NodePart | None = None
    """The node's share of a checkpoint spanning nodes this copy holds (the job, part k of N);
    written only when set, so a whole checkpoint's manifest is byte-identical to before. Not in
    the digest: the version is the content."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def stored_bytes(self) -> int:
        """Bytes the tier of this manifest holds for the files (compressed ones: less)."""
        return sum(f.stored_size for f in self.files)

    @property
    def digest(self) -> str:
        """Version id: depends only on the content (file names, sizes, hashes), not on metadata."""
        h = hashlib.sha256()
        h.update(self.algorithm.encode())
        for f in sorted(self.files, key=lambda e: e.path):
            h.update(f"\0{f.path}\0{f.size}\0{f.hash}".encode("utf-8", "surrogateescape"))
        return h.hexdigest()[:32]

    def to_json(self) -> str:
        doc: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "run": self.run,
            "step": self.step,
            "name": self.name,
            "layout": self.layout,
            "is_dir": self.is_dir,
            "algorithm": self.algorithm,
            "digest": self.digest,
            "created_at": self.created_at,
            "node": self.node,
            "metrics": dict(self.metrics),
            "files": [f.to_doc() for f in self.files],
        }
        if self.part is not None:
            doc["part"] = self.part.to_doc()
        return json.dumps(doc, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate a manifest (a tier is untrusted input: another node, a bug, an attacker).

        Every field goes through the one schema (:mod:`ckptkeeper.hook.schema`): steps and sizes are
        integers that fit SQLite INTEGER, times finite and between 1970 and 3000, strings bounded and
        without NUL, paths relative. Raises ValueError (a ``SchemaError`` naming the field) on anything
        else; callers quarantine the copy with that reason.
        """
        doc = schema.mapping(schema.parse_json(text, "malformed manifest"), "malformed manifest", max_len=64)
        version = doc.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version != MANIFEST_VERSION:
            raise schema.SchemaError("version", f"unsupported manifest version {schema.describe(version)}")
        raw_files = schema.array(doc.get("files"), "files", max_len=schema.MAX_FILES)
        files = []
        total = 0
        for i, raw in enumerate(raw_files):
            entry = schema.mapping(raw, f"files[{i}]", max_len=16)
            size = schema.size(entry.get("size"), f"files[{i}].size")
            total += size
            digest = schema.text(entry.get("hash"), f"files[{i}].hash", max_len=256)
            location = _location(entry, i, digest)
            encoding, stored = _stored_form(entry, i, size)
            parts, forms = _parts(entry, i, size, location)
            files.append(
                FileEntry(
                    path=schema.rel_path(entry.get("path"), f"files[{i}].path", empty=True),
                    size=size,
                    hash=digest,
                    location=location,
                    parts=parts,
                    encoding=encoding,
                    stored=stored,
                    forms=forms,
                )
            )
        if total > schema.MAX_BYTES:
            raise schema.SchemaError("files", f"sizes add up to more than {schema.MAX_BYTES} bytes")
        metrics, dropped = schema.metrics(doc.get("metrics"))
        if dropped:
            raise schema.SchemaError("metrics", f"not finite numbers: {', '.join(sorted(dropped)[:5])}")
        created_at = doc.get("created_at")
        manifest = cls(
            run=schema.rel_path(doc.get("run"), "run"),
            step=schema.step(doc.get("step")),
            name=schema.rel_path(doc.get("name"), "name"),
            layout=schema.text(doc.get("layout"), "layout", max_len=64),
            is_dir=schema.boolean(doc.get("is_dir"), "is_dir"),
            files=tuple(files),
            metrics=metrics,
            created_at=0.0 if created_at is None else schema.timestamp(created_at, "created_at"),
            node=schema.text(doc.get("node") or "", "node", max_len=255),
            algorithm=schema.text(doc.get("algorithm") or HASH_ALGORITHM, "algorithm", max_len=64),
            part=None if doc.get("part") is None else NodePart.from_doc(doc["part"]),
        )
        if "digest" in doc and doc["digest"] != manifest.digest:
            raise ValueError("manifest digest does not match its file list")
        return manifest


def _stored_form(entry: Mapping[str, Any], i: int, size: int) -> tuple[str, int | None]:
    """(encoding, stored size) of ``files[i]``: absent = raw; an encoding this version does not
    know is refused (the copy is quarantined, never read as raw bytes)."""
    raw = entry.get("encoding")
    if raw is None or raw == "":
        if entry.get("stored") is not None:
            raise schema.SchemaError(f"files[{i}].stored", "given for a file stored raw")
        return "", None
    encoding = schema.text(raw, f"files[{i}].encoding", max_len=32)
    if encoding not in ENCODINGS:
        raise schema.SchemaError(
            f"files[{i}].encoding",
            f"unknown encoding {encoding!r} (this ckptkeeper reads {', '.join(ENCODINGS)}; "
            "a newer version wrote it?)",
        )
    stored = schema.size(entry.get("stored"), f"files[{i}].stored")
    if stored > size + size // 256 + 64 * 1024:
        raise schema.SchemaError(f"files[{i}].stored", f"{stored} stored bytes for a file of {size}")
    return encoding, stored


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    state: RunState
    last_seen: float
    parent: tuple[str, int] | None = None
    """(run, step) this run was resumed or forked from."""
    host: str = ""
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One cataloged checkpoint and where verified copies of it live."""

    run: str
    step: int
    name: str
    """Path relative to the run directory."""
    layout: str
    state: CheckpointState
    created_at: float
    bytes: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    pinned: bool = False
    version: str | None = None
    """Manifest digest; None while the checkpoint is still being written."""
    tiers: frozenset[str] = frozenset()
    """Names of tiers holding a verified copy of this version."""
    last_write: float = 0.0
    """Newest mtime seen under the checkpoint (for settle / partial age)."""
    committed: bool = False
    """Committed by the training-loop hook (stronger than a framework marker)."""
    part: NodePart | None = None
    """This node's share of a checkpoint spanning nodes; None for a whole checkpoint."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.run, self.step)

    @property
    def rel_path(self) -> str:
        """Path relative to a tier root: ``<run>/<name>``."""
        return f"{self.run}/{self.name}"


@dataclass(frozen=True, slots=True)
class Artifact:
    """Something under a tier root that is not a checkpoint but may be waste (temp files, markers)."""

    tier: str
    path: str
    """Relative to the tier root."""
    kind: str
    """e.g. ``orbax-tmp``, ``tmp-checkpoint``, ``metadata-tmp``, ``nemo-unfinished``, ``tmp-file``,
    ``ckptkeeper-staging``, ``multipart-upload``."""
    bytes: int
    last_write: float
    run: str | None = None
    upload_id: str | None = None
    """For multipart uploads: the id to abort."""
    node: str = ""
    """The node that wrote it when known (a staging marker names it; an upload is matched to its
    marker by upload id); "" = this node or unknown (docs/design.md, "Many nodes")."""


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """Retention rules of one tier; no rule set means keep everything."""

    keep_last: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"
    keep_every: int | None = None
    keep_within: float | None = None
    """Seconds."""
    keep_hourly: int | None = None
    keep_daily: int | None = None
    keep_weekly: int | None = None
    keep_monthly: int | None = None
    replicate: bool = False
    high_watermark: float | None = None
    low_watermark: float | None = None
    headroom: bool = False
    """Keep room in this tier for the next save of every active run (:mod:`ckptkeeper.core.headroom`);
    only the first (hot) tier, where runs write, uses it. Off here so a policy built in code plans
    as before; the config turns it on for the hot tier unless ``headroom = false``."""
    undo_window: float | None = None
    """Seconds an expired or reaped copy waits in the tier's trash before it is purged; None = off."""

    @property
    def has_rules(self) -> bool:
        return any(
            v is not None
            for v in (
                self.keep_last,
                self.keep_best,
                self.keep_every,
                self.keep_within,
                self.keep_hourly,
                self.keep_daily,
                self.keep_weekly,
                self.keep_monthly,
            )
        )


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    url: str
    policy: TierPolicy
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    node: str = ""
    """This node's name (docs/design.md, "Many nodes"): written into manifests and staging markers; "" = unnamed."""
    shared: bool = False
    """Several nodes write this tier: this node's copies live under ``<node>/`` in it."""
    compression: str = "none"
    """How new copies into this tier are stored: ``none``, ``zstd`` or ``auto`` (docs/compression.md)."""
    marker_beat: float = 60.0
    """Seconds between rewrites of a copy's staging marker (its heartbeat) while it runs: at most a
    quarter of ``fleet.heartbeat_ttl``, so a lease holder that waits that long for a silent marker
    never takes a live copy for an abandoned one."""
    max_rate: int | None = None
    """Bytes per second every copy into or out of this tier may move (``max_rate``); None: no cap."""
    dedup: bool = False
    """A slower tier: store each file once per node, in the node's content store, referenced by
    every copy holding it (docs/dedup.md)."""
    dedup_tensors: bool = False
    """With ``dedup``: a safetensors file is stored as one content object per tensor (its header
    one more), so the tensors a save did not change are not stored again."""
    dedup_grace: float = 86400.0
    """Seconds an unreferenced content object stays before this node's prune pass collects it."""


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Filesystem usage of a tier; object stores have none (watermarks do not apply)."""

    total_bytes: int
    used_bytes: int
    free_bytes: int | None = None
    """What a writer that is not root can still write (``statvfs`` ``f_bavail``: ext4 reserves ~5 %
    for root, so it is less than total - used); None: total - used."""

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0

    @property
    def free(self) -> int:
        """Bytes a save can still write (never negative)."""
        free = self.total_bytes - self.used_bytes if self.free_bytes is None else self.free_bytes
        return max(0, free)


@dataclass(frozen=True, slots=True)
class ReaperPolicy:
    failed_after: float = 2 * 3600.0
    partial_after: float = 3600.0
    keep_last_of_failed: int = 1


@dataclass(frozen=True, slots=True)
class TrashEntry:
    """One copy moved aside into a tier's trash (``undo_window``), waiting to be undeleted or purged."""

    tier: str
    path: str
    """The entry, relative to the tier root (``.ckptkeeper-trash/<stamp>``): what a purge removes."""
    run: str
    step: int
    name: str
    bytes: int
    deleted_at: float
    node: str = ""
    """The node that wrote the copy (its manifest's ``node``); "" = this node or unknown."""

    @classmethod
    def of(cls, tier: str, path: str, manifest: Manifest, deleted_at: float) -> TrashEntry:
        """The entry at ``path`` in ``tier``'s trash holding the copy ``manifest`` describes: what
        it is a copy of comes from the manifest alone, whether the entry was just moved aside or
        found by a listing of the trash."""
        return cls(
            tier=tier,
            path=path,
            run=manifest.run,
            step=manifest.step,
            name=manifest.name,
            bytes=manifest.total_bytes,
            deleted_at=deleted_at,
            node=manifest.node,
        )

    @property
    def rel_path(self) -> str:
        """Where the copy lived (and comes back to), relative to the tier root."""
        return f"{self.run}/{self.name}"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the planner sees: the index at one instant plus tier health."""

    runs: tuple[Run, ...]
    checkpoints: tuple[Checkpoint, ...]
    artifacts: tuple[Artifact, ...] = ()
    unknown_tiers: frozenset[str] = frozenset()
    """Tiers whose listing failed: never read as empty, no delete may depend on them."""
    foreign: Mapping[tuple[str, int, str], str] = field(default_factory=dict)
    """(run, step, tier) -> node, for copies another node wrote (its manifest names that node):
    read-only to this node's rules (docs/design.md, "Many nodes", :mod:`ckptkeeper.core.ownership`)."""
    node: str = ""
    """This node's name: an artifact another node wrote (``Artifact.node``) is not ours to reap."""
    trash: tuple[TrashEntry, ...] = ()
    """Copies waiting in a tier's trash: the planner purges them when their undo window ends or
    their tier is above its high watermark."""


class ActionKind(StrEnum):
    COPY = "copy"
    DELETE = "delete"
    REAP = "reap"
    PURGE = "purge"
    """Free a trash entry for good (its undo window ended, or its tier is above high watermark)."""


class Action(NamedTuple):
    """One step of a plan. A named tuple rather than a frozen dataclass, still immutable: a plan of
    a million checkpoints holds tens of thousands, and a frozen dataclass spends most of its
    construction in ``object.__setattr__`` (68k actions: 0.18 s vs 0.05 s)."""

    action: ActionKind
    reason: str
    run: str | None = None
    step: int | None = None
    tier: str | None = None
    """Source tier for copy; the tier deleted from for delete/reap."""
    to_tier: str | None = None
    path: str | None = None
    """Relative to the tier root."""
    bytes: int = 0
    rule: str = ""
    """Machine-readable rule id (e.g. ``expired``, ``demote``, ``replicate``, ``failed-run``)."""
    upload_id: str | None = None
    trash: bool = False
    """A delete or reap that moves the copy into its tier's trash (``undo_window``) instead of
    freeing it: nothing is reclaimed until the PURGE of that entry."""

    def to_dict(self) -> dict[str, Any]:
        doc = {
            "action": self.action.value,
            "run": self.run,
            "step": self.step,
            "tier": self.tier,
            "to_tier": self.to_tier,
            "path": self.path,
            "bytes": self.bytes,
            "reason": self.reason,
            "rule": self.rule,
        }
        if self.upload_id is not None:
            doc["upload_id"] = self.upload_id
        if self.trash:
            doc["to_trash"] = True
        return doc


class Keep(NamedTuple):
    """One kept copy: checkpoint ``run@step`` stays in ``tier``, for ``reasons``.

    A named tuple rather than a frozen dataclass, still immutable: a plan of a million checkpoints
    holds well over a million of these, and a frozen dataclass spends most of its construction in
    ``object.__setattr__`` (1M: 1.2 s vs 0.3 s). Being a tuple, it also unpacks and compares as
    ``(run, step, tier, reasons)``.
    """

    run: str
    step: int
    tier: str
    reasons: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "tier": self.tier, "reasons": list(self.reasons)}


class Keeps(Sequence[Keep]):
    """A plan's keeps, in output order, built on first read.

    Why lazy: most keeps of a big catalog say only "this plain checkpoint stays where its rule puts
    it" (1M checkpoints: ~1.4M keeps), and the one caller that plans at that scale every few
    minutes, the daemon's pass, executes the actions and never reads a keep. The planner hands
    over the parts it already decided (lists of keeps and unevaluated C-level iterators over its
    columns, see :meth:`ckptkeeper.core.placement.Placer._ready_plain`); ``prune --dry-run``,
    ``--json`` and the tests read them, which builds the tuple once (under a lock: the parts are
    one-shot iterators). Compares equal to any sequence of the same keeps, a tuple included.
    """

    __slots__ = ("_built", "_lock", "_parts")

    def __init__(self, parts: Iterable[Iterable[Keep]] = ()) -> None:
        self._parts: Iterable[Iterable[Keep]] | None = parts
        self._built: tuple[Keep, ...] | None = None
        self._lock = threading.Lock()

    def _all(self) -> tuple[Keep, ...]:
        built = self._built
        if built is None:
            with self._lock:
                built = self._built
                if built is None:
                    built = self._built = tuple(chain.from_iterable(self._parts or ()))
                    self._parts = None
        return built

    def __len__(self) -> int:
        return len(self._all())

    @overload
    def __getitem__(self, i: int) -> Keep: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Keep, ...]: ...
    def __getitem__(self, i: int | slice) -> Keep | tuple[Keep, ...]:
        return self._all()[i]

    def __iter__(self) -> Iterator[Keep]:
        return iter(self._all())

    def __contains__(self, keep: object) -> bool:
        return keep in self._all()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Keeps):
            return self._all() == other._all()
        if isinstance(other, tuple | list):
            return self._all() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Keeps({self._all()!r})"


@dataclass(frozen=True, slots=True)
class Plan:
    actions: tuple[Action, ...]
    keep: Sequence[Keep]
    """A tuple, or :class:`Keeps` (built on first read) from the planner."""
    reclaim_bytes: Mapping[str, int]
    refused: str | None = None
    """Set when a guard (max_delete, …) refused the destructive part; actions then hold no deletes."""
    notes: tuple[str, ...] = ()
    """Things the operator should know that are not actions (e.g. the last tier is above its high
    watermark and has nowhere to demote to; a reap the planner blocked)."""

    @property
    def is_empty(self) -> bool:
        return not self.actions

    def to_dict(self) -> dict[str, Any]:
        return {
            "actions": [a.to_dict() for a in self.actions],
            "keep": [k.to_dict() for k in self.keep],
            "reclaim_bytes": dict(self.reclaim_bytes),
            "refused": self.refused,
            "notes": list(self.notes),
        }
