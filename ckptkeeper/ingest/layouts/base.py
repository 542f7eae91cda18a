"""What every recognizer shares: the public data (``Candidate``, ``RunScan``), step and name
parsing, the lstat-only filesystem view (``_Dir``, ``_Node``), small bounded readers and the
content checks of the container formats (zip, safetensors), and the recognizer protocol.

Family modules (``hf``, ``megatron``, …) import this module only; ``scan`` puts them in order.
"""

from __future__ import annotations

import math
import os
import pickletools
import re
import stat
import struct
import zipfile
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Final, Protocol

from ckptkeeper.core import model
from ckptkeeper.hook import schema

MAX_MARKER_BYTES: Final = 64 * 1024 * 1024
"""Marker files are small; anything bigger is not parsed (reported as a problem, not corrupt)."""
MAX_SAFETENSORS_HEADER: Final = 100 * 1024 * 1024
"""The safetensors format itself refuses headers above 100 MB."""


# --------------------------------------------------------------------------------------------------
# Public data


@dataclass(frozen=True, slots=True)
class Candidate:
    """A checkpoint found under a run directory, with the framework's verdict on completeness."""

    run: str
    step: int
    name: str
    """Path relative to the run dir, '/' separated; unique within the run (the catalog's key)."""
    layout: str
    is_dir: bool
    complete: bool
    files: tuple[str, ...]
    """Regular files relative to the checkpoint path, sorted; ``("",)`` for a single-file checkpoint.
    Symlinks inside a checkpoint are not listed (never followed, never copied)."""
    last_write: float
    """Newest ``st_mtime`` of the checkpoint path and everything under it (for partial age)."""
    bytes: int
    metrics: Mapping[str, float]
    problem: str | None
    """Why it is not complete; ``None`` when complete."""
    changed_at: float = 0.0
    """Newest ``max(st_mtime, st_ctime)`` under the checkpoint: what settling waits on. ``cp -a``
    and ``rsync -a`` back-date mtimes of what they copy; ctime cannot be set back."""
    corrupt: bool = False
    """A per-checkpoint marker is present but unparseable. Like ``complete``, only a verdict once
    the checkpoint has settled: a marker being written looks malformed for a moment."""
    temps: tuple[tuple[str, str, int, float], ...] = ()
    """Framework temp artifacts inside the checkpoint dir (``layouts.temps``): (path relative to
    the checkpoint, kind, bytes, newest mtime). Not in ``files`` and not in ``bytes``: they are not
    part of the checkpoint, ``scan_run`` reports them as artifacts to reap on their own."""
    rejected: tuple[str, ...] = ()
    """What the schema refused in this checkpoint's markers (unparseable, values out of range): the
    catalog quarantines the marker with these reasons."""
    node_part: str | None = None
    """Not complete only for lack of the marker rank 0 writes, and rank 0's shards are not here
    either (DCP ``__8_0.distcp … __15_0.distcp`` without ``.metadata``): the shape one node of a
    multi-node job leaves on its local disk. The evidence, in words; None otherwise. The catalog
    makes it a complete part when the hook says the run is a node's part, and keeps it otherwise
    (docs/spanning-nodes.md)."""


@dataclass(frozen=True, slots=True)
class RunScan:
    candidates: tuple[Candidate, ...]
    """Ordered by (step, name)."""
    artifacts: tuple[model.Artifact, ...]
    """Temp artifacts; ``path`` is relative to the hot root (``<run>/<rel>``), ``tier="hot"``."""
    errors: tuple[str, ...] = ()
    """Subtrees that exist but could not be read (``"<rel>: <error>"``). Whatever lives there is
    unknown, not absent: the caller must not treat checkpoints it knew there as removed."""
    hook_dirs: tuple[str, ...] = ()
    """Directories (relative to the run dir, ``""`` for the run dir itself) holding the hook's
    ``.ckptkeeper/``: a callback whose checkpoint dir is below the run dir (Lightning's
    ``ModelCheckpoint(dirpath=<run>/checkpoints)``) writes it there, and it still belongs to this run."""


# --------------------------------------------------------------------------------------------------
# Step and name parsing (pure)

_VERSION_SUFFIX = re.compile(r"-v\d+$")
"""Lightning appends ``-v1``, ``-v2`` … when a file name is already taken."""
_STEP_KEYWORD = re.compile(r"(?<![a-z])(?:global_)?(?:steps?|iteration|iter)(?:=|_|-)?(\d+)(?!\d|\.\d)", re.I)
_TRAILING_DIGITS = re.compile(r"(\d+)$")
_EPOCH_WORDS = frozenset({"epoch", "epochs", "ep"})
_NAME_METRIC = re.compile(r"(?:^|(?<=-))([A-Za-z]\w*)=(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?=-|$)")


def _to_int(digits: str) -> int | None:
    try:
        return int(digits)
    except ValueError:  # beyond sys.get_int_max_str_digits(): not a step anyone trains to
        return None


def parse_step(stem: str) -> int | None:
    """The training step encoded in a file or directory name (extension already removed).

    In order: an explicit keyword (``step=40``, ``-step40``, ``global_step40``, ``step_200``,
    ``iter_0000100``; the first one wins, so ``epoch=3-step=40`` is 40); else a trailing integer
    that stands alone (``checkpoint_1000``, ``200``, ``model-00100``). A Lightning ``-vN`` suffix
    is ignored. Not a step: the value of another ``key=`` (``epoch=3``, ``val_loss=1.23``), a
    number glued to letters (``gpt2``, ``resnet50``), an epoch (``epoch_3``), a decimal fraction,
    and anything negative. None means "not orderable": the path is not a checkpoint to us.
    """
    stem = _VERSION_SUFFIX.sub("", stem)
    m = _STEP_KEYWORD.search(stem)
    if m:
        return _to_int(m.group(1))
    m = _TRAILING_DIGITS.search(stem)
    if m is None:
        return None
    before = stem[: m.start(1)]
    if before:
        sep, head = before[-1], before[:-1]
        if sep not in "_-.":
            return None  # '=' (another key's value) or a letter (a model name like gpt2)
        if sep == "." and head[-1:].isdigit():
            return None  # the fraction of a decimal number
        if sep == "-" and head.endswith("="):
            return None  # a negative value
        if re.split(r"[^A-Za-z]", head)[-1].lower() in _EPOCH_WORDS:
            return None
    return _to_int(m.group(1))


def _name_metrics(stem: str) -> dict[str, float]:
    """Numeric ``key=value`` fields of a Lightning/NeMo file name (``val_loss=1.23``), but ``step``."""
    stem = _VERSION_SUFFIX.sub("", stem)
    out: dict[str, float] = {}
    for key, value in _NAME_METRIC.findall(stem):
        number = float(value)
        if key != "step" and math.isfinite(number):
            out[key] = number
    return out


def has_step_keyword(stem: str) -> bool:
    """The step in ``stem`` is spelled out (``step=40``, ``global_step40``, ``iter_100``), not
    just a trailing number (``shard-0``, ``rank_0``, ``model-00001``)."""
    return _STEP_KEYWORD.search(_VERSION_SUFFIX.sub("", stem)) is not None


def lies_inside(rel: str, dirs: AbstractSet[str]) -> bool:
    """``rel`` is strictly below one of ``dirs`` (paths relative to the run dir, ``/``-separated)."""
    parts = rel.split("/")
    return any("/".join(parts[:i]) in dirs for i in range(1, len(parts)))


def _strip_ext(name: str, exts: Iterable[str]) -> str:
    for ext in exts:
        if name.endswith(ext) and len(name) > len(ext):
            return name[: -len(ext)]
    return name


# --------------------------------------------------------------------------------------------------
# Filesystem views: one listing per directory, lstat only, shared by every recognizer


class _Unreadable(Exception):
    """A path exists but cannot be read: unknown, which is not the same as absent."""


class _Dir:
    """One directory's entries (name -> lstat), read once and shared by everything that asks."""

    def __init__(self, path: str, parent: _Dir | None, *, dev: int, is_root: bool = False) -> None:
        self.path = path
        self.parent = parent
        self.dev = dev
        self.is_root = is_root
        self.mounts: frozenset[str] = frozenset()
        """On the run's root: mount points below it (relative paths), never walked."""
        self.claimed_by: str | None = None
        """The layout that claims this directory although its name gives no step (an HF
        ``output_dir`` holding ``model.safetensors`` beside its ``checkpoint-N/``): walked for the
        checkpoints below it, but its own numbered files are parts of it (``scan._part_of_dir``)."""

    @cached_property
    def entries(self) -> dict[str, os.stat_result]:
        out: dict[str, os.stat_result] = {}
        try:
            with os.scandir(self.path) as it:
                for entry in it:
                    try:
                        out[entry.name] = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while we listed: the writer or rotation got there first
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            raise _Unreadable(f"{self.path}: {exc.strerror or exc}") from exc
        return out

    def regular(self, name: str) -> os.stat_result | None:
        st = self.entries.get(name)
        return st if st is not None and stat.S_ISREG(st.st_mode) else None

    def has_file(self, name: str) -> bool:
        return self.regular(name) is not None

    def subdir(self, name: str) -> _Dir | None:
        st = self.entries.get(name)
        if st is None or not stat.S_ISDIR(st.st_mode) or st.st_dev != self.dev:
            return None
        return _Dir(os.path.join(self.path, name), self, dev=self.dev)

    def grandparent(self) -> _Dir | None:
        if self.is_root:
            return None
        if self.parent is None:
            self.parent = _Dir(os.path.dirname(self.path), None, dev=self.dev)
        return self.parent

    @cached_property
    def indexed_shards(self) -> frozenset[str]:
        """Shard names referenced by any ``*.index.json`` here (they belong to that index)."""
        names: set[str] = set()
        for name in self.entries:
            if name.endswith(".index.json") and self.has_file(name):
                try:
                    doc = _json(_read_small(os.path.join(self.path, name)))
                    names.update(str(v) for v in dict(doc.get("weight_map") or {}).values())
                except (OSError, ValueError, TypeError, AttributeError):
                    continue
        return frozenset(names)


class _Node:
    """A path under examination: its lstat, its siblings, and (for a directory) its children."""

    def __init__(self, parent: _Dir, name: str, st: os.stat_result, rel: str) -> None:
        self.parent = parent
        self.name = name
        self.st = st
        self.rel = rel

    @property
    def path(self) -> str:
        return os.path.join(self.parent.path, self.name)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.st.st_mode)

    @cached_property
    def children(self) -> _Dir:
        return _Dir(self.path, self.parent, dev=self.parent.dev)


def _json(data: bytes | str) -> Any:
    """The schema's JSON parser: a nesting bomb (``[[[[…``), bad UTF-8 or an integer literal of
    thousands of digits is malformed input (a ValueError, so the checkpoint is judged corrupt)
    instead of an exception that aborted every scan and prune."""
    return schema.parse_json(data, "JSON")


def _read_small(path: str, limit: int = MAX_MARKER_BYTES) -> bytes:
    """Read a small file without following a final symlink; ValueError when over ``limit``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


# --------------------------------------------------------------------------------------------------
# Content checks shared by recognizers


def _zip_problem(path: str, size: int) -> str | None:
    """None when the zip end-of-central-directory and central directory parse (torch.save, npz).

    OSError propagates: a file we may not read is unknown, not partial (partial gets reaped).
    """
    if size == 0:
        return "empty file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            magic = f.read(4)
            if magic != b"PK\x03\x04":
                return "not a zip archive (legacy non-zip torch.save files are not recognized as complete)"
            f.seek(0)
            with zipfile.ZipFile(f) as zf:
                zf.infolist()
    except (zipfile.BadZipFile, EOFError, ValueError, struct.error) as exc:
        return f"zip end-of-central-directory unreadable ({exc})"
    return None


def _safetensors_problem(path: str, size: int) -> tuple[str | None, bool]:
    """(problem, corrupt) for one safetensors file: 8-byte length, JSON header, data not truncated.

    A short file is still being written (partial); a header of full length that is not valid JSON
    is corrupt. The data must reach the largest ``data_offsets`` end — truncation is what a crash
    mid-write leaves behind.
    """
    name = os.path.basename(path)
    if size < 8:
        return f"{name}: shorter than the 8-byte header length", False
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_SAFETENSORS_HEADER:
            return f"{name}: header length {header_len} exceeds the format's limit", True
        if size < 8 + header_len:
            return f"{name}: truncated inside its header", False
        raw = f.read(header_len)
    try:
        header = _json(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        end = 0
        for key, info in header.items():
            if key != "__metadata__":
                end = max(end, int(info["data_offsets"][1]))
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
        return f"{name}: header unparseable ({exc})", True
    if size < 8 + header_len + end:
        return f"{name}: truncated ({size} bytes, header says {8 + header_len + end})", False
    return None, False


_MEMO_OPS: Final = frozenset({"BINPUT", "LONG_BINPUT", "MEMOIZE", "PUT"})
_STRING_OPS: Final = frozenset({"BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8"})


def torch_pickle_values(path: str, key: str) -> list[Any]:
    """Every plain value (int or str) stored under dict key ``key`` in a ``torch.save`` zip's pickle.

    Reads without unpickling — a checkpoint is untrusted input and unpickling runs code: the opcode
    stream of ``<archive>/data.pkl`` is decoded with ``pickletools.genops`` (which executes nothing)
    and the value pushed right after each ``key`` string is taken when it is an int or a string.
    Bounded by :data:`MAX_MARKER_BYTES`; any unreadable input gives ``[]``.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            member = next((i for i in zf.infolist() if i.filename.endswith("data.pkl")), None)
            if member is None or member.file_size > MAX_MARKER_BYTES:
                return []
            data = zf.read(member)
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, struct.error):
        return []
    values: list[Any] = []
    want_value = False
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in _MEMO_OPS:
                continue  # memo bookkeeping between a dict key and its value
            if want_value and (isinstance(arg, str) or (isinstance(arg, int) and not isinstance(arg, bool))):
                values.append(arg)
            want_value = op.name in _STRING_OPS and arg == key
    except (ValueError, IndexError, TypeError, UnicodeDecodeError):
        return values
    return values


def contiguous_without_zero(ranks: set[int]) -> bool:
    """Ranks ``k..m`` with ``k > 0`` and none missing: one node's share of a job's ranks (rank 0,
    which writes the completion markers, is on another node)."""
    return bool(ranks) and 0 not in ranks and max(ranks) - min(ranks) + 1 == len(ranks)


def rank_span(ranks: set[int]) -> str:
    return f"rank {min(ranks)}" if len(ranks) == 1 else f"ranks {min(ranks)}-{max(ranks)}"


def _numeric(items: Iterable[tuple[Any, Any]]) -> tuple[dict[str, float], list[str]]:
    """Finite numbers only (a NaN loss cannot be ranked, and bools are not metrics), and the names
    of numbers the schema refused (integers beyond the float range)."""
    return schema.numeric_items(items)


# --------------------------------------------------------------------------------------------------
# Recognizers: one small class per layout of docs/design.md, "Completeness"


@dataclass(frozen=True, slots=True)
class _Verdict:
    problems: tuple[str, ...] = ()
    corrupt: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)
    rejected: tuple[str, ...] = ()
    """Reasons the schema refused (part of) a marker; see :attr:`Candidate.rejected`."""
    part: str | None = None
    """Set when every problem is a marker that rank 0 writes and rank 0's files are not here: the
    evidence that this is one node's part of a checkpoint spanning nodes (see
    :attr:`Candidate.node_part`)."""


class _Recognizer(Protocol):
    layout: str

    def claims(self, node: _Node) -> bool:
        """Cheap: does this path look like this layout at all (name pattern, telltale files)?"""
        ...

    def step(self, node: _Node) -> int | None: ...

    def check(self, node: _Node) -> _Verdict:
        """Is it complete by this layout's marker? Reads at most small marker files and headers."""
        ...
