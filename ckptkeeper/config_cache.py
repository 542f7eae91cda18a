"""The validated config, remembered: a command that reads the same config as the last one skips pydantic.

Validating the config (:mod:`ckptkeeper.config`) imports pydantic and pydantic-settings and builds
their models: about two thirds of the instructions of a standalone ``ckptkeeper restore`` of a small
checkpoint (bench/restore_s3.py). The result only depends on what went in, so once a config has
validated, its values are written to ``$XDG_CACHE_HOME/ckptkeeper/config/`` (default
``~/.cache/ckptkeeper/config/``; one file per config path, mode 0600), keyed on:

* the config file's path and its exact bytes (SHA-256);
* every ``CKPTKEEPER_*`` environment variable (names in any case, as pydantic-settings reads them);
* the host name (the default ``node``);
* the code that validates: this module, :mod:`ckptkeeper.config` and
  :mod:`ckptkeeper.config_checks` (their size and mtime), and pydantic, pydantic-core and
  pydantic-settings as installed (the same of their ``__init__`` files).

A command that reads the config through :func:`load_view` gets a :class:`SettingsView` with the same
attributes when every one matches. The checks that read the filesystem rather than the config are
made again on every load: the file's permissions (never group- or other-writable), overlapping
tiers (:func:`ckptkeeper.config_checks.tier_problems`: a mount may have changed) and the codecs a
compressing tier needs. Whenever anything differs or fails, the view is None and the command
validates the config in full, reporting any problem exactly as before. A cache file, or its
directory, that is not this user's own and private is never read. Anything that cannot be written
(a read-only home, a value JSON cannot hold) is simply not remembered.

Standard library only (and the pure core): importing this module must not import pydantic.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from ckptkeeper.core.model import ReaperPolicy, TierPolicy, TierSpec

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_PATH",
    "TIERS_ENV",
    "SettingsView",
    "cache_path",
    "is_local_url",
    "load_view",
    "local_path_of",
    "remember",
    "resolve_config_path",
    "tier_spec",
]

DEFAULT_CONFIG_PATH = Path("/etc/ckptkeeper/config.toml")
CONFIG_ENV = "CKPTKEEPER_CONFIG"
TIERS_ENV = "CKPTKEEPER_TIERS"
"""Set (a JSON list of tiers) with no config file named and none at the default path: the
environment alone is the config (a container's way, see docs/kubernetes.md)."""

FORMAT = 1
"""Bumped when what a cache file holds changes meaning."""
_CODE = ("config.py", "config_checks.py", "config_cache.py")
_LIBRARIES = ("pydantic", "pydantic_core", "pydantic_settings")


def resolve_config_path(explicit: str | os.PathLike[str] | None) -> Path:
    if explicit:
        return Path(explicit)
    env = os.environ.get(CONFIG_ENV)
    return Path(env) if env else DEFAULT_CONFIG_PATH


# -- the views ------------------------------------------------------------------------------


class _TierFields(Protocol):
    """What :func:`tier_spec` reads of a tier: a validated ``TierConfig`` or its view."""

    name: str
    url: str
    storage_options: dict[str, Any]
    shared: bool
    compression: Literal["none", "zstd", "auto"]
    max_rate: int | None
    dedup: bool
    dedup_tensors: bool
    dedup_grace: float
    keep_last: int | None
    keep_best: int | None
    metric: str | None
    mode: Literal["min", "max"]
    keep_every: int | None
    keep_within: float | None
    keep_hourly: int | None
    keep_daily: int | None
    keep_weekly: int | None
    keep_monthly: int | None
    replicate: bool
    high_watermark: float | None
    low_watermark: float | None
    headroom: bool | None
    undo_window: float | None
    _node: str
    _marker_beat: float


def tier_spec(t: _TierFields) -> TierSpec:
    """The core's :class:`TierSpec` of a configured tier (``TierConfig.to_spec`` and the view's)."""
    return TierSpec(
        name=t.name,
        url=t.url,
        storage_options=dict(t.storage_options),
        node=t._node,
        shared=t.shared,
        compression=t.compression,
        marker_beat=t._marker_beat,
        max_rate=t.max_rate,
        dedup=t.dedup,
        dedup_tensors=t.dedup_tensors,
        dedup_grace=t.dedup_grace,
        policy=TierPolicy(
            keep_last=t.keep_last,
            keep_best=t.keep_best,
            metric=t.metric,
            mode=t.mode,
            keep_every=t.keep_every,
            keep_within=t.keep_within,
            keep_hourly=t.keep_hourly,
            keep_daily=t.keep_daily,
            keep_weekly=t.keep_weekly,
            keep_monthly=t.keep_monthly,
            replicate=t.replicate,
            high_watermark=t.high_watermark,
            low_watermark=t.low_watermark,
            headroom=t.headroom is not False,
            undo_window=t.undo_window,
        ),
    )


class _Validated(Protocol):
    """A validated ``ckptkeeper.config.Settings`` (not imported here: that is pydantic)."""

    @property
    def tiers(self) -> Sequence[_TierFields]: ...

    def model_dump(self) -> dict[str, Any]: ...


class _Section:
    """The values of one validated section, as attributes (every key the model has)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # only reached for a name the section lacks
        raise AttributeError(f"{type(self).__name__} has no {name!r}")


def is_local_url(url: str) -> bool:
    """A tier URL naming a local directory (a path, or ``file://``)."""
    return "://" not in url or url.startswith("file://")


def local_path_of(url: str) -> Path:
    """The directory a local tier URL names."""
    return Path(url.removeprefix("file://"))


class TierView(_Section):
    @property
    def is_local(self) -> bool:
        return is_local_url(self.url)

    @property
    def local_path(self) -> Path:
        return local_path_of(self.url)

    def to_spec(self) -> TierSpec:
        return tier_spec(self)


class ReaperView(_Section):
    def to_policy(self) -> ReaperPolicy:
        return ReaperPolicy(
            failed_after=self.failed_after,
            partial_after=self.partial_after,
            keep_last_of_failed=self.keep_last_of_failed,
        )


class SettingsView(_Section):
    """A validated ``Settings``' values, attributes and the methods the commands call, without pydantic."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        sections = {k: _Section(values[k]) for k in ("fleet", "daemon", "history")}
        super().__init__(
            {**values, **sections, "reaper": ReaperView(values["reaper"])}
            | {"tiers": [TierView(t) for t in values["tiers"]]}
        )

    @property
    def hot(self) -> TierView:
        tiers: list[TierView] = self.tiers
        return tiers[0]

    def tier_specs(self) -> list[TierSpec]:
        return [t.to_spec() for t in self.tiers]


# -- the cache ------------------------------------------------------------------------------


def cache_path(config_path: Path) -> Path | None:
    """Where the validated values of the config at ``config_path`` are remembered (None: no home)."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not base.startswith("/"):
        home = os.environ.get("HOME") or ""
        if not home.startswith("/"):
            return None
        base = os.path.join(home, ".cache")
    name = hashlib.sha256(os.fsencode(os.path.abspath(config_path))).hexdigest()[:32]
    return Path(base) / "ckptkeeper" / "config" / f"{name}.json"


def _stamp(path: str | None) -> list[int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _library_origin(name: str) -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _key(config_path: Path, data: bytes) -> str:
    here = Path(__file__).parent
    parts = {
        "format": FORMAT,
        "path": os.path.abspath(config_path),
        "bytes": hashlib.sha256(data).hexdigest(),
        "env": sorted((k, v) for k, v in os.environ.items() if k.upper().startswith("CKPTKEEPER_")),
        "host": socket.gethostname(),
        "code": [_stamp(str(here / name)) for name in _CODE],
        "libraries": [_stamp(_library_origin(name)) for name in _LIBRARIES],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _own(path: Path, kind: int) -> bool:
    """``path`` is this user's own file (``stat.S_IFREG``) or directory, writable by nobody else."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_IFMT(st.st_mode) == kind
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _private(path: Path) -> bool:
    """A cache file that only this user could have written (the file and its directory)."""
    return _own(path, stat.S_IFREG) and _own(path.parent, stat.S_IFDIR)


def _read_config(explicit: str | os.PathLike[str] | None) -> tuple[Path, bytes] | None:
    """The config file's path and bytes, or None where the full load must speak (a missing,
    unreadable or group-writable file: its error is the full load's)."""
    config_path = resolve_config_path(explicit)
    try:
        with open(config_path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return None
            return config_path, f.read()
    except OSError:
        return None


def load_view(explicit: str | os.PathLike[str] | None) -> SettingsView | None:
    """The remembered values of the config (``--config`` as given) when nothing it depends on
    changed and the filesystem checks still pass; else None (validate it in full)."""
    source = _read_config(explicit)
    if source is None:
        return None
    config_path, data = source
    path = cache_path(config_path)
    if path is None or not _private(path):
        return None
    try:
        doc = json.loads(path.read_bytes())
        if doc.get("key") != _key(config_path, data):
            return None
        view = SettingsView(doc["settings"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return view if _still_sound(view) else None


def _still_sound(view: SettingsView) -> bool:
    """The checks of a validated config that depend on the machine, not on the config."""
    import importlib.util

    from ckptkeeper.config_checks import tier_problems

    if tier_problems([(t.url, t.storage_options) for t in view.tiers], view.index):
        return False
    need = {"none": (), "zstd": ("zstandard",), "auto": ("zstandard", "zipnn")}
    return all(importlib.util.find_spec(m) is not None for t in view.tiers for m in need[t.compression])


def remember(config_path: Path, data: bytes, settings: _Validated) -> None:
    """Write the validated ``settings`` of the config file ``config_path`` holding ``data``
    (the bytes that were validated); best effort: a cache that cannot be written is no error."""
    path = cache_path(config_path)
    if path is None:
        return
    values = settings.model_dump()
    for tier, dumped in zip(settings.tiers, values["tiers"], strict=True):
        dumped |= {"_node": tier._node, "_marker_beat": tier._marker_beat}
    try:
        text = json.dumps({"key": _key(config_path, data), "settings": values}, allow_nan=False)
        if path.exists() and _private(path) and path.read_text() == text:
            return
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _own(path.parent, stat.S_IFDIR):
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except (OSError, TypeError, ValueError):
        return
