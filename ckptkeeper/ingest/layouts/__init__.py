"""Recognizers of DESIGN §5: which paths under a run directory are checkpoints, and are they complete.

Filesystem events fire on half-written files, so every framework's own completion marker is checked
here; the catalog adds the ``settle_seconds`` rule on top (``Candidate.last_write``) and the hook's
commits override both. This module only reads: ``lstat``, directory listings and small marker files
(``trainer_state.json``, ``latest``, index files, safetensors headers, zip directories). It never
writes, never follows a symlink, never crosses into another filesystem and never hashes content —
the catalog does that, once, for complete checkpoints.

Layouts and their precedence
----------------------------
A directory can satisfy several recognizers (an HF ``checkpoint-N/`` holds ``model.safetensors``;
a Megatron ``torch_dist`` ``iter_N/`` is also a torch DCP directory; a NeMo distributed checkpoint
is one too). It still yields ONE candidate: the layout is the first applicable one in
``RECOGNIZERS`` and the candidate is complete only when *every* applicable recognizer says so; its
``problem`` lists every failure. The order, most specific first::

    hf > megatron > deepspeed > nemo > orbax > dcp > safetensors > torch > file

Framework conventions (a name pattern plus a framework-level marker or tracker) come before the
container formats they are built on (DCP, safetensors, torch zip), and the generic single-file
fallback comes last.

Where checkpoints are looked for
--------------------------------
``scan_run`` walks the run directory top-down (``os.scandir``, ``lstat``) and stops descending
at the first recognized checkpoint, so ``checkpoint-100/global_step100/`` (HF + DeepSpeed) is one HF
checkpoint. Skipped entirely: symlinks (``last.ckpt`` links included), ``.ckptkeeper/`` (the
hook's control dir), Megatron ``non_persistent/`` dirs, other filesystems (mount points), and
anything that is neither a regular file nor a directory.

Temp artifacts (``RunScan.artifacts``), each reported once:

* ``ckptkeeper-staging`` — any name containing ``.ckptkeeper-tmp-`` (``protocol.STAGING_MARK``) (our interrupted copies);
* ``orbax-tmp`` — ``*.orbax-checkpoint-tmp-*``; ``tmp-checkpoint`` — ``tmp-checkpoint-*``. A temp
  name is not yet a checkpoint: the real one appears under its final name by rename, so these are
  artifacts only, never candidates (``recognize`` returns None for them);
* ``nemo-unfinished`` — an orphan ``<name>-unfinished`` marker whose checkpoint is absent. A marker
  whose checkpoint exists makes that checkpoint a partial candidate and is not listed separately
  (reaping the partial checkpoint leaves the marker orphaned; the next scan reports it);
* ``metadata-tmp`` — a ``.metadata.tmp`` that is not inside a candidate (e.g. in a DCP dir whose
  name has no step). Inside a DCP candidate it only makes that candidate partial: the whole
  directory is the thing to reap, and listing the file as well would count its bytes twice;
* ``tmp-file`` — other ``*.tmp`` / ``*.part`` files outside candidates.

Steps
-----
Steps are non-negative Python ints, compared numerically (huge values are returned as they are;
the catalog caps what SQLite can hold). Two checkpoints of one run may share a step
(``epoch=0-step=10.ckpt`` and ``epoch=0-step=10-v1.ckpt``, or NeMo ``…-last.ckpt``): both are
candidates. ``name`` is the unique key within a run; candidates are ordered by (step, name). A path
whose step cannot be parsed is not a checkpoint we can order and is ignored (never reaped either).

Names are ``str`` decoded with ``os.fsdecode`` (surrogateescape) everywhere; a non-UTF-8 byte
becomes a lone surrogate, which callers must encode back with ``os.fsencode`` / surrogateescape
(SQLite's UTF-8 codec rejects lone surrogates).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import struct
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Final, Literal, Protocol

from ckptkeeper.core import model
from ckptkeeper.hook.protocol import STAGING_MARK, STATE_DIR

__all__ = [
    "LAYOUTS",
    "RECOGNIZERS",
    "Candidate",
    "RunScan",
    "is_shared_marker",
    "parse_step",
    "recognize",
    "scan_run",
]

MAX_MARKER_BYTES: Final = 64 * 1024 * 1024
"""Marker files are small; anything bigger is not parsed (reported as a problem, not corrupt)."""
MAX_SAFETENSORS_HEADER: Final = 100 * 1024 * 1024
"""The safetensors format itself refuses headers above 100 MB."""

ORBAX_TMP: Final = ".orbax-checkpoint-tmp-"
NEMO_UNFINISHED: Final = "-unfinished"
DS_LATEST: Final = "latest"
MEGATRON_TRACKER: Final = "latest_checkpointed_iteration.txt"
TRAINER_STATE: Final = "trainer_state.json"
DCP_METADATA: Final = ".metadata"
DCP_METADATA_TMP: Final = ".metadata.tmp"
ORBAX_CHECKPOINT_METADATA: Final = "_CHECKPOINT_METADATA"
ORBAX_COMMIT_SUCCESS: Final = "commit_success.txt"
MEGATRON_DIST_CONFIG: Final = "metadata.json"

TORCH_EXTS: Final = (".ckpt", ".pt", ".pth")
FILE_EXTS: Final = (".bin", ".safetensors", ".npz", ".msgpack", ".pkl", ".h5")


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
    """Newest ``st_mtime`` of the checkpoint path and everything under it (for settle/partial age)."""
    bytes: int
    metrics: Mapping[str, float]
    problem: str | None
    """Why it is not complete; ``None`` when complete."""
    corrupt: bool = False
    """A per-checkpoint marker is present but unparseable. Like ``complete``, only a verdict once
    the checkpoint has settled: a marker being written looks malformed for a moment."""


@dataclass(frozen=True, slots=True)
class RunScan:
    candidates: tuple[Candidate, ...]
    """Ordered by (step, name)."""
    artifacts: tuple[model.Artifact, ...]
    """Temp artifacts; ``path`` is relative to the hot root (``<run>/<rel>``), ``tier="hot"``."""
    errors: tuple[str, ...] = ()
    """Subtrees that exist but could not be read (``"<rel>: <error>"``). Whatever lives there is
    unknown, not absent: the caller must not treat checkpoints it knew there as removed."""


# --------------------------------------------------------------------------------------------------
# Step and name parsing (pure)

_VERSION_SUFFIX = re.compile(r"-v\d+$")
"""Lightning appends ``-v1``, ``-v2`` … when a file name is already taken."""
_STEP_KEYWORD = re.compile(r"(?<![a-z])(?:global_)?(?:steps?|iteration|iter)(?:=|_|-)?(\d+)(?!\d|\.\d)", re.I)
_TRAILING_DIGITS = re.compile(r"(\d+)$")
_EPOCH_WORDS = frozenset({"epoch", "epochs", "ep"})
_SHARD_NAME = re.compile(r"\d+-of-\d+")
"""``model-00001-of-00002.safetensors``: a weight shard, never a checkpoint by itself."""
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


def _strip_ext(name: str, exts: Iterable[str]) -> str:
    for ext in exts:
        if name.endswith(ext) and len(name) > len(ext):
            return name[: -len(ext)]
    return name


def is_shared_marker(path: Path | str) -> bool:
    """True for marker files that decide the completeness of *sibling* checkpoints.

    ``recognize`` maps a path to the checkpoint containing it; an event on DeepSpeed's ``latest``,
    Megatron's tracker or a NeMo ``-unfinished`` marker changes the verdict of checkpoints beside
    it, so the watcher should rescan the run (``scan_run``) instead.
    """
    name = os.path.basename(os.fsdecode(path))
    return name in (DS_LATEST, MEGATRON_TRACKER) or name.endswith(NEMO_UNFINISHED)


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
    """``json.loads`` where a nesting bomb (``[[[[…``) is malformed input (ValueError, so the
    checkpoint is judged corrupt) instead of a RecursionError that aborted every scan and prune."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


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
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        return f"{name}: header unparseable ({exc})", True
    if size < 8 + header_len + end:
        return f"{name}: truncated ({size} bytes, header says {8 + header_len + end})", False
    return None, False


def _numeric(items: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """Finite numbers only: a NaN loss cannot be ranked, and bools are not metrics."""
    out: dict[str, float] = {}
    for key, value in items:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[str(key)] = float(value)
    return out


# --------------------------------------------------------------------------------------------------
# Recognizers: one small class per layout of DESIGN §5


@dataclass(frozen=True, slots=True)
class _Verdict:
    problems: tuple[str, ...] = ()
    corrupt: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)


class _Recognizer(Protocol):
    layout: str

    def claims(self, node: _Node) -> bool:
        """Cheap: does this path look like this layout at all (name pattern, telltale files)?"""
        ...

    def step(self, node: _Node) -> int | None: ...

    def check(self, node: _Node) -> _Verdict:
        """Is it complete by this layout's marker? Reads at most small marker files and headers."""
        ...


class _Hf:
    """HF Trainer ``checkpoint-N/``: complete once ``trainer_state.json`` is written (it is last)."""

    layout = "hf"
    _name = re.compile(r"^checkpoint-(\d+)$")

    def claims(self, node: _Node) -> bool:
        return node.is_dir and self._name.match(node.name) is not None

    def step(self, node: _Node) -> int | None:
        m = self._name.match(node.name)
        return _to_int(m.group(1)) if m else None

    def check(self, node: _Node) -> _Verdict:
        if not node.children.has_file(TRAINER_STATE):
            return _Verdict(problems=(f"{TRAINER_STATE} missing",))
        step = self.step(node)
        try:
            doc = _json(_read_small(os.path.join(node.path, TRAINER_STATE)))
            history = doc.get("log_history", [])
            if not isinstance(history, list):
                raise ValueError("log_history is not a list")
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return _Verdict(problems=(f"{TRAINER_STATE} unparseable ({exc})",), corrupt=True)
        except AttributeError:
            return _Verdict(problems=(f"{TRAINER_STATE} unparseable (not an object)",), corrupt=True)
        metrics: dict[str, float] = {}
        for entry in history:
            if isinstance(entry, dict) and entry.get("step") == step:
                metrics.update(_numeric((k, v) for k, v in entry.items() if k != "step"))
        return _Verdict(metrics=metrics)


class _Megatron:
    """Megatron-LM ``iter_NNNNNNN/``: complete once the save dir's tracker holds an iteration >= N.

    Megatron rank 0 writes ``latest_checkpointed_iteration.txt`` after every rank finished. A
    tracker holding ``release`` says nothing about ``iter_N`` dirs, so they are then judged by their
    own files only (never reap on ambiguity). ``torch_dist`` checkpoints (``__*.distcp``) also need
    ``metadata.json``; the DCP recognizer adds its ``.metadata`` check. Legacy checkpoints need
    ``model_optim_rng.pt`` in every ``mp_rank_*`` dir.
    """

    layout = "megatron"
    _name = re.compile(r"^iter_(\d+)$")
    _rank_dir = re.compile(r"^mp_rank_\d+(?:_\d+)*$")

    def claims(self, node: _Node) -> bool:
        return node.is_dir and self._name.match(node.name) is not None

    def step(self, node: _Node) -> int | None:
        m = self._name.match(node.name)
        return _to_int(m.group(1)) if m else None

    def check(self, node: _Node) -> _Verdict:
        problems: list[str] = []
        step = self.step(node)
        tracker = node.parent.regular(MEGATRON_TRACKER)
        if tracker is None:
            problems.append(f"{MEGATRON_TRACKER} missing")
        else:
            try:
                text = _read_small(os.path.join(node.parent.path, MEGATRON_TRACKER), 4096).decode().strip()
            except ValueError as exc:  # not UTF-8, or far too big for a tracker
                text = f"<unparseable: {exc}>"
            if text != "release":
                latest = _to_int(text) if text.isdigit() else None
                if latest is None:
                    problems.append(f"{MEGATRON_TRACKER} holds {text[:40]!r}, not an iteration")
                elif step is not None and latest < step:
                    problems.append(f"{MEGATRON_TRACKER} at {latest} < {step}: save not finished")
        entries = node.children.entries
        if any(n.endswith(".distcp") for n in entries):
            if not node.children.has_file(MEGATRON_DIST_CONFIG):
                problems.append(f"torch_dist {MEGATRON_DIST_CONFIG} missing")
        else:
            rank_dirs = [n for n in entries if self._rank_dir.match(n) and stat.S_ISDIR(entries[n].st_mode)]
            if not rank_dirs:
                problems.append("no mp_rank_*/ dirs and no torch_dist shards")
            for rank in sorted(rank_dirs):
                sub = node.children.subdir(rank)
                if sub is None or not sub.has_file("model_optim_rng.pt"):
                    problems.append(f"{rank}/model_optim_rng.pt missing")
        return _Verdict(problems=tuple(problems))


class _DeepSpeed:
    """DeepSpeed ``global_stepN/``: ``latest`` in the save dir names it (or a later tag), shards agree.

    ``latest`` is written by rank 0, possibly before slower ranks finish (the barrier trap), so the
    shard set must also be consistent: at least one ``*model_states.pt``; ``mp_rank_XX`` ranks
    contiguous from 0; for ZeRO files (``[bf16_]zero_pp_rank_D_mp_rank_XX_{optim,model}_states.pt``)
    the same contiguous set of data-parallel ranks 0..D-1 under every model-parallel rank, and equal
    sets for optimizer and (ZeRO-3) model states. A missing *highest* dp rank of every mp rank cannot
    be seen from names alone; ``latest`` and settling cover that. A ``latest`` naming a later
    ``global_stepM`` vouches for this one too: otherwise every older checkpoint would look partial.

    Lightning's ``DeepSpeedStrategy`` makes ``epoch=E-step=S.ckpt/`` the save dir itself: ``latest``
    inside it names the tag dir (``checkpoint/``) holding the shards; same checks, one level down.
    """

    layout = "deepspeed"
    _name = re.compile(r"^global_step(\d+)$")
    _mp_model = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
    _zero = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")

    def claims(self, node: _Node) -> bool:
        if not node.is_dir:
            return False
        if self._name.match(node.name):
            return True
        if not node.name.endswith(".ckpt"):
            return False
        kids = node.children
        if kids.has_file(DS_LATEST):
            return True
        for name, st in kids.entries.items():  # `latest` comes last: a tag dir with shards suffices
            sub = kids.subdir(name) if stat.S_ISDIR(st.st_mode) else None
            if sub is not None and any(self._mp_model.match(n) or self._zero.match(n) for n in sub.entries):
                return True
        return False

    def step(self, node: _Node) -> int | None:
        m = self._name.match(node.name)
        return _to_int(m.group(1)) if m else parse_step(_strip_ext(node.name, (".ckpt",)))

    def check(self, node: _Node) -> _Verdict:
        if self._name.match(node.name):
            problems = self._latest_problems(node)
            shards: _Dir | None = node.children
        else:  # Lightning: the tag dir named by our own `latest`
            tag, problems = self._read_latest(node.children)
            shards = node.children.subdir(tag) if tag else None
            if tag and shards is None:
                problems.append(f"'{DS_LATEST}' names {tag[:60]!r}, which is absent")
        if shards is not None:
            problems.extend(self._shard_problems(shards))
        return _Verdict(problems=tuple(problems))

    def _shard_problems(self, shards: _Dir) -> list[str]:
        problems: list[str] = []
        mp_ranks: set[int] = set()
        zero: dict[str, set[tuple[int, int]]] = {"optim": set(), "model": set()}
        for name in shards.entries:
            if not shards.has_file(name):
                continue
            if m := self._mp_model.match(name):
                mp_ranks.add(int(m.group(1)))
            elif m := self._zero.match(name):
                zero[m.group(3)].add((int(m.group(1)), int(m.group(2))))
        if not mp_ranks and not zero["model"]:
            problems.append("no *_model_states.pt")
        if mp_ranks and mp_ranks != set(range(len(mp_ranks))):
            problems.append(f"mp_rank model states not contiguous: {sorted(mp_ranks)}")
        for kind, pairs in zero.items():
            if pairs:
                problems.extend(self._zero_problems(kind, pairs, mp_ranks))
        if zero["optim"] and zero["model"] and zero["optim"] != zero["model"]:
            problems.append("ZeRO optim and model state shards do not match")
        return problems

    @staticmethod
    def _read_latest(directory: _Dir) -> tuple[str | None, list[str]]:
        if not directory.has_file(DS_LATEST):
            return None, [f"'{DS_LATEST}' missing"]
        try:
            return _read_small(os.path.join(directory.path, DS_LATEST), 4096).decode().strip(), []
        except ValueError as exc:  # not UTF-8, or far too big for a tag
            return None, [f"'{DS_LATEST}' unparseable ({exc})"]

    def _latest_problems(self, node: _Node) -> list[str]:
        tag, problems = self._read_latest(node.parent)
        if tag is None:
            return [p + f" beside {node.name}" for p in problems]
        if tag == node.name:
            return []
        m = self._name.match(tag)
        latest, step = (_to_int(m.group(1)) if m else None), self.step(node)
        if latest is not None and step is not None and latest >= step:
            return []
        return [f"'{DS_LATEST}' names {tag[:60]!r}, not {node.name}"]

    @staticmethod
    def _zero_problems(kind: str, pairs: set[tuple[int, int]], mp_ranks: set[int]) -> list[str]:
        by_mp: dict[int, set[int]] = {}
        for dp, mp in pairs:
            by_mp.setdefault(mp, set()).add(dp)
        problems = []
        if set(by_mp) != set(range(len(by_mp))) or (mp_ranks and set(by_mp) != mp_ranks):
            problems.append(f"ZeRO {kind} shards: model-parallel ranks {sorted(by_mp)} inconsistent")
        dp_sets = {frozenset(dps) for dps in by_mp.values()}
        world = max(len(dps) for dps in by_mp.values())
        if len(dp_sets) != 1 or set(next(iter(dp_sets))) != set(range(world)):
            missing = sorted(
                f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_{kind}_states.pt"
                for mp, dps in by_mp.items()
                for dp in set(range(world)) - dps
            )
            problems.append(f"ZeRO {kind} shards missing: {', '.join(missing[:4]) or 'non-contiguous ranks'}")
        return problems


class _NeMo:
    """NeMo ``*.ckpt`` files or distributed-checkpoint dirs: partial while ``<name>-unfinished`` exists.

    NeMo creates the marker before saving and removes it after every rank finished. The marker
    name drops ``.nemo``/``.ckpt`` and ``-EMA`` and lives beside the un-injected path (the parent of
    ``mp_rank_XX/`` or ``tp_rank_XX_pp_rank_XXX/`` dirs). Claimed when such a marker exists or the
    name has NeMo's ``--`` separator (``megatron_gpt--val_loss=1.23-step=100-…``); ``key=value``
    numbers in the name (``val_loss``) become metrics. The torch/DCP recognizers add their checks.
    """

    layout = "nemo"
    _rank_dir = re.compile(r"^(?:mp_rank_\d+|tp_rank_\d+_pp_rank_\d+)$")

    def claims(self, node: _Node) -> bool:
        if node.is_file and not node.name.endswith(".ckpt"):
            return False
        return "--" in node.name or self._marker(node) is not None

    def step(self, node: _Node) -> int | None:
        return parse_step(_strip_ext(node.name, (".ckpt",)))

    def check(self, node: _Node) -> _Verdict:
        metrics = _name_metrics(_strip_ext(node.name, (".ckpt",)))
        marker = self._marker(node)
        if marker is not None:
            return _Verdict(problems=(f"{marker} present: save unfinished",), metrics=metrics)
        return _Verdict(metrics=metrics)

    @staticmethod
    def marker_name(name: str) -> str:
        for suffix in (".nemo", ".ckpt", "-EMA"):
            name = name.removesuffix(suffix)
        return name + NEMO_UNFINISHED

    def _marker(self, node: _Node) -> str | None:
        """Relative name (from the checkpoint's dir) of its unfinished marker, if present."""
        marker = self.marker_name(node.name)
        if node.parent.has_file(marker):
            return marker
        if self._rank_dir.match(os.path.basename(node.parent.path)):
            up = node.parent.grandparent()
            if up is not None and up.has_file(marker):
                return f"../{marker}"
        return None

    def orphan(self, parent: _Dir, marker: str) -> bool:
        """True when no checkpoint this marker could belong to exists (a crash between save and
        cleanup, or the checkpoint was removed without its marker)."""
        base = marker.removesuffix(NEMO_UNFINISHED)
        names = (base, base + ".ckpt", base + "-EMA.ckpt", base + ".nemo", base + "-EMA")
        if any(n in parent.entries for n in names):
            return False
        for sub_name in parent.entries:
            if self._rank_dir.match(sub_name):
                sub = parent.subdir(sub_name)
                if sub is not None and any(n in sub.entries for n in names):
                    return False
        return True


class _Orbax:
    """Orbax ``<step>/`` (or ``<prefix>_<step>/``): complete with ``_CHECKPOINT_METADATA`` or
    ``commit_success.txt``.

    Orbax writes into ``<step>.orbax-checkpoint-tmp-<ts>`` and renames (those temp dirs are
    artifacts, not candidates); on filesystems without atomic rename it writes
    ``commit_success.txt`` last. Claimed only on Orbax evidence — its metadata files, or an item
    dir (``default/``, ``state/``: a name that is not a step) holding ``_METADATA``,
    ``manifest.ocdbt`` or ``_sharding`` — never on a numeric name alone, so a plain DCP dir named
    ``200`` is not held hostage to an Orbax marker, and the manager's root dir (whose children are
    step dirs) is not mistaken for a step. Metrics come from
    ``_CHECKPOINT_METADATA``'s ``metrics``; an explicit ``commit_timestamp_nsecs: null`` without
    ``commit_success.txt`` means the commit did not happen.
    """

    layout = "orbax"
    _item_files = (
        ORBAX_CHECKPOINT_METADATA,
        ORBAX_COMMIT_SUCCESS,
        "_METADATA",
        "manifest.ocdbt",
        "_sharding",
    )

    def claims(self, node: _Node) -> bool:
        if not node.is_dir:
            return False
        kids = node.children
        if any(kids.has_file(n) for n in self._item_files):
            return True
        for name, st in kids.entries.items():
            if stat.S_ISDIR(st.st_mode) and ORBAX_TMP not in name and parse_step(name) is None:
                sub = kids.subdir(name)
                if sub is not None and any(sub.has_file(n) for n in self._item_files[2:]):
                    return True
        return False

    def step(self, node: _Node) -> int | None:
        return parse_step(node.name)

    def check(self, node: _Node) -> _Verdict:
        kids = node.children
        problems: list[str] = []
        metrics: dict[str, float] = {}
        committed = kids.has_file(ORBAX_COMMIT_SUCCESS)
        if kids.has_file(ORBAX_CHECKPOINT_METADATA):
            try:
                doc = _json(_read_small(os.path.join(node.path, ORBAX_CHECKPOINT_METADATA)))
                if not isinstance(doc, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                return _Verdict(problems=(f"{ORBAX_CHECKPOINT_METADATA} unparseable ({exc})",), corrupt=True)
            raw_metrics = doc.get("metrics")
            if isinstance(raw_metrics, dict):
                metrics = _numeric(raw_metrics.items())
            if "commit_timestamp_nsecs" in doc and doc["commit_timestamp_nsecs"] is None and not committed:
                problems.append(f"{ORBAX_CHECKPOINT_METADATA} has no commit timestamp")
        elif not committed:
            problems.append(f"{ORBAX_CHECKPOINT_METADATA} and {ORBAX_COMMIT_SUCCESS} missing")
        tmp_items = sorted(n for n in kids.entries if ORBAX_TMP in n)
        if tmp_items:
            problems.append(f"item still in a temp dir: {tmp_items[0]}")
        return _Verdict(problems=tuple(problems), metrics=metrics)


class _Dcp:
    """torch.distributed.checkpoint dir (``__R_K.distcp``): complete once ``.metadata`` exists.

    ``FileSystemWriter`` writes the shards, then ``.metadata.tmp``, then renames it. A reused
    directory keeps the previous save's ``.metadata`` while new shards are written, so a leftover
    ``.metadata.tmp`` or a shard newer than ``.metadata`` means a re-save in progress (or crashed).
    Consequence: copies of a DCP dir must preserve mtimes (``cp -a``, rsync ``-a``, our executor),
    or ``.metadata`` copied before a shard would look stale.
    """

    layout = "dcp"

    def claims(self, node: _Node) -> bool:
        return node.is_dir and any(n.endswith(".distcp") for n in node.children.entries)

    def step(self, node: _Node) -> int | None:
        return parse_step(node.name)

    def check(self, node: _Node) -> _Verdict:
        kids = node.children
        meta = kids.regular(DCP_METADATA)
        tmp = kids.has_file(DCP_METADATA_TMP)
        if meta is None:
            why = "only .metadata.tmp: save not finished" if tmp else "save not finished"
            return _Verdict(problems=(f"{DCP_METADATA} missing ({why})",))
        if tmp:
            return _Verdict(problems=(f"{DCP_METADATA_TMP} beside {DCP_METADATA}: re-save in progress",))
        newer = sorted(
            n for n, st in kids.entries.items() if n.endswith(".distcp") and st.st_mtime_ns > meta.st_mtime_ns
        )
        if newer:
            return _Verdict(problems=(f"{newer[0]} newer than {DCP_METADATA}: re-save in progress",))
        return _Verdict()


class _Safetensors:
    """A dir with ``*.safetensors.index.json`` (every ``weight_map`` shard present and whole) or a
    single ``model.safetensors`` (header readable, data not truncated).

    Shards of a previous save that the index does not name are ignored (stale, not missing). Shard
    names must stay inside the directory: an index pointing elsewhere is corrupt.
    """

    layout = "safetensors"
    single = "model.safetensors"

    def claims(self, node: _Node) -> bool:
        if not node.is_dir:
            return False
        kids = node.children
        return kids.has_file(self.single) or any(
            n.endswith(".safetensors.index.json") and kids.has_file(n) for n in kids.entries
        )

    def step(self, node: _Node) -> int | None:
        return parse_step(node.name)

    def check(self, node: _Node) -> _Verdict:
        kids = node.children
        problems: list[str] = []
        corrupt = False
        indexes = sorted(
            n for n in kids.entries if n.endswith(".safetensors.index.json") and kids.has_file(n)
        )
        shards: set[str] = set()
        for index in indexes:
            try:
                doc = _json(_read_small(os.path.join(node.path, index)))
                weight_map = doc["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()
                ):
                    raise ValueError("weight_map is not a name -> file object")
            except (ValueError, KeyError, TypeError) as exc:
                problems.append(f"{index} unparseable ({exc})")
                corrupt = True
                continue
            for shard in sorted(set(weight_map.values())):
                if "/" in shard or shard in ("", ".", ".."):
                    problems.append(f"{index} names {shard!r} outside the checkpoint")
                    corrupt = True
                elif not kids.has_file(shard):
                    problems.append(f"shard {shard} listed in {index} but absent")
                else:
                    shards.add(shard)
        if not indexes:
            shards.add(self.single)
        for shard in sorted(shards):
            st = kids.regular(shard)
            if st is None:
                continue
            problem, bad = _safetensors_problem(os.path.join(node.path, shard), st.st_size)
            if problem:
                problems.append(problem)
                corrupt = corrupt or bad
        return _Verdict(problems=tuple(problems), corrupt=corrupt)


class _Torch:
    """Lightning / ``torch.save`` files (``*.ckpt``, ``*.pt``, ``*.pth``): complete when the zip
    end-of-central-directory is readable — torch.save writes it last.

    Step from the name (``epoch=3-step=40.ckpt``, ``model_1000.pt``); ``last.ckpt`` (no step) is
    ignored, and when it is a symlink it was never looked at.
    """

    layout = "torch"

    def claims(self, node: _Node) -> bool:
        return node.is_file and node.name.endswith(TORCH_EXTS) and not _is_shard_member(node)

    def step(self, node: _Node) -> int | None:
        return parse_step(_strip_ext(node.name, TORCH_EXTS))

    def check(self, node: _Node) -> _Verdict:
        problem = _zip_problem(node.path, node.st.st_size)
        return _Verdict(
            problems=(problem,) if problem else (), metrics=_name_metrics(_strip_ext(node.name, TORCH_EXTS))
        )


class _File:
    """Fallback: another single file with a step in its name (``.bin``, ``.safetensors``, ``.npz``…).

    Formats with a checkable structure are checked (safetensors header, zip directory for ``.npz``
    and zip-based ``.bin``); for the others only settling (``last_write``) says it is done.
    """

    layout = "file"

    def claims(self, node: _Node) -> bool:
        return node.is_file and node.name.endswith(FILE_EXTS) and not _is_shard_member(node)

    def step(self, node: _Node) -> int | None:
        return parse_step(_strip_ext(node.name, FILE_EXTS))

    def check(self, node: _Node) -> _Verdict:
        metrics = _name_metrics(_strip_ext(node.name, FILE_EXTS))
        problem: str | None = None
        corrupt = False
        if node.name.endswith(".safetensors"):
            problem, corrupt = _safetensors_problem(node.path, node.st.st_size)
        elif node.name.endswith(".npz") or (node.name.endswith(".bin") and _starts_with_zip(node.path)):
            problem = _zip_problem(node.path, node.st.st_size)
        return _Verdict(problems=(problem,) if problem else (), corrupt=corrupt, metrics=metrics)


def _starts_with_zip(path: str) -> bool:
    return _read_head(path, 4) == b"PK\x03\x04"


def _read_head(path: str, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read(n)


def _is_shard_member(node: _Node) -> bool:
    """Weight shards belong to their index (``model-00001-of-00002.safetensors``), not to us."""
    return _SHARD_NAME.search(node.name) is not None or node.name in node.parent.indexed_shards


RECOGNIZERS: Final[tuple[_Recognizer, ...]] = (
    _Hf(),
    _Megatron(),
    _DeepSpeed(),
    _NeMo(),
    _Orbax(),
    _Dcp(),
    _Safetensors(),
    _Torch(),
    _File(),
)
"""Precedence order, most specific first (see the module docstring)."""

LAYOUTS: Final = tuple(r.layout for r in RECOGNIZERS)
_NEMO = _NeMo()


# --------------------------------------------------------------------------------------------------
# Classification of one directory entry, shared by scan_run and recognize


@dataclass(frozen=True, slots=True)
class _Art:
    kind: str


_Outcome = Candidate | _Art | Literal["skip", "descend"]


def _artifact_kind(node: _Node) -> str | None:
    name = node.name
    if STAGING_MARK in name:
        return "ckptkeeper-staging"
    if ORBAX_TMP in name:
        return "orbax-tmp"
    if name.startswith("tmp-checkpoint-"):
        return "tmp-checkpoint"
    return None


def _classify(node: _Node, run: str) -> _Outcome:
    mode = node.st.st_mode
    if stat.S_ISLNK(mode):
        return "skip"  # never followed: a link may lead out of the tier (DESIGN §8.4)
    kind = _artifact_kind(node)
    if kind is not None:
        return _Art(kind)
    if stat.S_ISDIR(mode):
        if node.name in (STATE_DIR, "non_persistent") or node.st.st_dev != node.parent.dev:
            return "skip"
        return _candidate(node, run) or "descend"
    if not stat.S_ISREG(mode):
        return "skip"
    cand = _candidate(node, run)
    if cand is not None:
        return cand
    if node.name == DCP_METADATA_TMP:
        return _Art("metadata-tmp")
    if node.name.endswith(NEMO_UNFINISHED):
        return _Art("nemo-unfinished") if _NEMO.orphan(node.parent, node.name) else "skip"
    if node.name.endswith((".tmp", ".part")):
        return _Art("tmp-file")
    return "skip"


def _candidate(node: _Node, run: str) -> Candidate | None:
    claiming = [r for r in RECOGNIZERS if r.claims(node)]
    if not claiming:
        return None
    step = claiming[0].step(node)
    if step is None or step < 0:
        return None
    problems: list[str] = []
    corrupt = False
    metrics: dict[str, float] = {}
    for recognizer in reversed(claiming):  # higher precedence last: its metrics win on a clash
        verdict = _safe_check(recognizer, node)
        problems[:0] = verdict.problems
        corrupt = corrupt or verdict.corrupt
        metrics.update(verdict.metrics)
    if node.is_dir:
        try:
            files, total, newest = _tree(node.path, node.parent.dev)
        except FileNotFoundError:
            return None
    else:
        files, total, newest = ("",), node.st.st_size, node.st.st_mtime
    return Candidate(
        run=run,
        step=step,
        name=node.rel,
        layout=claiming[0].layout,
        is_dir=node.is_dir,
        complete=not problems and not corrupt,
        files=files,
        last_write=newest,
        bytes=total,
        metrics=metrics,
        problem="; ".join(problems) or None,
        corrupt=corrupt,
    )


def _safe_check(recognizer: _Recognizer, node: _Node) -> _Verdict:
    """A marker that vanishes between listing and reading is "not there yet/anymore", not a crash."""
    try:
        return recognizer.check(node)
    except FileNotFoundError as exc:
        return _Verdict(problems=(f"{os.path.basename(exc.filename or '?')} vanished while checked",))
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink where a marker should be
            return _Verdict(problems=(f"{os.path.basename(exc.filename or '?')} is a symlink",))
        raise _Unreadable(f"{node.rel}: {exc.strerror or exc}") from exc


def _tree(root: str, dev: int) -> tuple[tuple[str, ...], int, float]:
    """(regular files relative to root, their total size, newest mtime) without following links."""
    newest = os.lstat(root).st_mtime
    files: list[str] = []
    total = 0
    stack = [(root, "")]
    while stack:
        path, prefix = stack.pop()
        try:
            it = os.scandir(path)
        except FileNotFoundError:
            if path == root:
                raise
            continue
        except OSError as exc:
            raise _Unreadable(f"{path}: {exc.strerror or exc}") from exc
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                newest = max(newest, st.st_mtime)
                if stat.S_ISDIR(st.st_mode):
                    if st.st_dev == dev:
                        stack.append((entry.path, f"{prefix}{entry.name}/"))
                elif stat.S_ISREG(st.st_mode):
                    files.append(prefix + entry.name)
                    total += st.st_size
    return tuple(sorted(files)), total, newest


def _dir_bytes(path: str, st: os.stat_result) -> tuple[int, float]:
    """(bytes, newest mtime) of an artifact: a file, or a directory tree (lstat, same filesystem)."""
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size, st.st_mtime
    try:
        _, total, newest = _tree(path, st.st_dev)
    except FileNotFoundError:
        return 0, st.st_mtime
    return total, newest


# --------------------------------------------------------------------------------------------------
# Public entry points


def _root(run_dir: Path | str) -> _Dir:
    """The run dir, listed now: a run dir that cannot be listed raises, it never reads as empty."""
    path = os.path.abspath(os.fsdecode(run_dir))
    st = os.lstat(path)  # missing run dir: FileNotFoundError, for the caller to decide
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(
            errno.ENOTDIR, "run dir is not a directory (symlinks are not followed)", path
        )
    root = _Dir(path, None, dev=st.st_dev, is_root=True)
    try:
        with os.scandir(path):
            pass
        _ = root.entries
    except _Unreadable as exc:
        raise PermissionError(errno.EACCES, str(exc), path) from exc
    return root


def scan_run(run_dir: Path, run: str) -> RunScan:
    """Every checkpoint candidate and temp artifact under one run directory of the hot tier.

    Raises OSError when the run directory itself cannot be listed (an unknown run is not an empty
    one); unreadable subtrees are reported in ``RunScan.errors`` and the rest is still scanned.
    """
    root = _root(run_dir)
    candidates: list[Candidate] = []
    artifacts: list[model.Artifact] = []
    errors: list[str] = []
    stack: list[tuple[_Dir, str]] = [(root, "")]
    while stack:
        directory, prefix = stack.pop()
        try:
            entries = sorted(directory.entries.items())
        except _Unreadable as exc:
            errors.append(f"{prefix.rstrip('/') or '.'}: {exc}")
            continue
        for name, st in entries:
            node = _Node(directory, name, st, prefix + name)
            try:
                outcome = _classify(node, run)
                if isinstance(outcome, _Art):
                    size, newest = _dir_bytes(node.path, st)
            except _Unreadable as exc:
                errors.append(f"{node.rel}: {exc}")
                continue
            if isinstance(outcome, Candidate):
                candidates.append(outcome)
            elif isinstance(outcome, _Art):
                artifacts.append(
                    model.Artifact(
                        tier="hot",
                        path=f"{run}/{node.rel}",
                        kind=outcome.kind,
                        bytes=size,
                        last_write=newest,
                        run=run,
                    )
                )
            elif outcome == "descend":
                stack.append((node.children, f"{node.rel}/"))
    candidates.sort(key=lambda c: (c.step, c.name))
    artifacts.sort(key=lambda a: a.path)
    return RunScan(candidates=tuple(candidates), artifacts=tuple(artifacts), errors=tuple(errors))


def recognize(path: Path, run_dir: Path, run: str) -> Candidate | None:
    """The checkpoint that ``path`` is or lies inside, exactly as ``scan_run`` would report it.

    For a single watcher event: ``<run>/checkpoint-100/trainer_state.json`` gives the
    ``checkpoint-100`` candidate. None when the path is not (inside) a checkpoint, is or lies under
    something ``scan_run`` skips (symlink, ``.ckptkeeper/``, temp artifact), is outside ``run_dir``
    or no longer exists. Raises OSError when something on the way exists but cannot be read.
    Events on shared markers (``is_shared_marker``) concern sibling checkpoints: rescan the run.
    """
    try:
        directory = _root(run_dir)
    except FileNotFoundError:
        return None
    rel = os.path.relpath(os.path.abspath(os.fsdecode(path)), directory.path)
    if rel == "." or rel == ".." or rel.startswith(".." + os.sep) or os.path.isabs(rel):
        return None
    parts = rel.split(os.sep)
    try:
        for depth, name in enumerate(parts):
            try:
                st = os.lstat(os.path.join(directory.path, name))
            except (FileNotFoundError, NotADirectoryError):
                return None
            node = _Node(directory, name, st, "/".join(parts[: depth + 1]))
            outcome = _classify(node, run)
            if isinstance(outcome, Candidate):
                return outcome
            if outcome != "descend":
                return None
            directory = node.children
    except _Unreadable as exc:
        raise OSError(errno.EIO, str(exc)) from exc
    return None
