"""Configuration: TOML file + ``CKPTKEEPER_*`` environment, validated up front.

The config decides what gets deleted, so it is strict: unknown keys are errors (a typo such as
``keep_lsat`` must not silently mean "keep everything"), every problem is reported with its key
path, and a file that group or others may write is refused.
"""

from __future__ import annotations

import math
import os
import re
import socket
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from ckptkeeper.config_cache import CONFIG_ENV as CONFIG_ENV
from ckptkeeper.config_cache import DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH
from ckptkeeper.config_cache import TIERS_ENV as TIERS_ENV
from ckptkeeper.config_cache import is_local_url, local_path_of, tier_spec
from ckptkeeper.config_cache import resolve_config_path as resolve_config_path
from ckptkeeper.config_checks import ENV_PREFIX, env_problems, env_variables, tier_problems
from ckptkeeper.core.model import ReaperPolicy, TierSpec
from ckptkeeper.util.fmt import format_duration

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)", re.IGNORECASE)
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_MAX_SECONDS = 100 * 365 * 86400.0


class ConfigError(Exception):
    """Invalid configuration; ``problems`` holds one ``key.path: message`` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def parse_duration(value: object) -> float:
    """Seconds from ``90``, ``"90s"``, ``"5m"``, ``"2h"``, ``"7d"``, ``"1w"`` or ``"1h30m"``."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '90s', '5m', '2h', '7d'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().replace(" ", "")
        if re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = float(text)
        else:
            parts = _DURATION_PART.findall(text)
            if not parts or "".join(n + u for n, u in parts).lower() != text.lower():
                raise ValueError(f"invalid duration {value!r}: use e.g. '90s', '5m', '2h', '7d'")
            seconds = sum(float(n) * _UNIT_SECONDS[u.lower()] for n, u in parts)
    else:
        raise ValueError("a duration is a number of seconds or a string like '90s', '5m', '2h', '7d'")
    if not math.isfinite(seconds) or seconds < 0 or seconds > _MAX_SECONDS:
        raise ValueError(f"duration {value!r} out of range (0 .. 100 years)")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]
JobInterval = Annotated[float, BeforeValidator(parse_duration), Field(ge=1.0)]
"""A scheduled job runs at most once a second: ``0`` made the daemon spin a whole core."""


def _optional_interval(value: object) -> float:
    """``0`` or ``"off"`` turns a job off; anything else is a :data:`JobInterval` (at least 1 s)."""
    if isinstance(value, str) and value.strip().lower() in ("off", "0"):
        return 0.0
    seconds = parse_duration(value)
    if 0 < seconds < 1.0:
        raise ValueError("a job runs at most once a second: use at least '1s', or 0 / 'off' to turn it off")
    return seconds


OptionalJobInterval = Annotated[float, BeforeValidator(_optional_interval)]
"""A job that may be turned off (``0`` / ``"off"``): off is no job at all, never a spinning one."""


def _rate(value: object) -> int:
    """Bytes per second from ``"50MiB"`` or a number of bytes (binary units, as ``preflight``)."""
    from ckptkeeper.core.preflight import parse_size

    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("expected a size per second, e.g. '50MiB' or a number of bytes")
    return parse_size(str(value))


ByteRate = Annotated[int, BeforeValidator(_rate)]
PollInterval = Annotated[float, BeforeValidator(parse_duration), Field(ge=0.1)]
Count = Annotated[int, Field(ge=0, le=10**12)]
Fraction = Annotated[float, Field(gt=0.0, le=1.0)]


def _price(value: object) -> object:
    """TOML ``true`` would pass as 1.0 and a string as a number: a price is a plain number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("expected a number (price per GiB-month, e.g. 0.023)")
    return value


Price = Annotated[float, BeforeValidator(_price), Field(ge=0.0, le=1e9, allow_inf_nan=False)]


def parse_addr(addr: str) -> tuple[str, int] | None:
    """``"127.0.0.1:9464"`` / ``"[::1]:9464"`` -> (host, port); ``""`` -> None (endpoint disabled).

    Raises ValueError naming the config key, because this is a config error the daemon reports
    before it starts anything.
    """
    text = addr.strip()
    if not text:
        return None
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(
            f"daemon.metrics_addr: expected host:port (e.g. 127.0.0.1:9464 or [::1]:9464; "
            f"empty disables the endpoint), got {addr!r}"
        )
    return host, int(port_text)


def _no_nul_byte(value: str) -> str:
    """A path with a NUL byte reaches no file; every os call on it raised ValueError mid-command."""
    if "\0" in value:
        raise ValueError("contains a NUL byte")
    return value


MARKER_BEAT = 60.0
"""Seconds between staging-marker rewrites of a copy in progress, unless ``fleet.heartbeat_ttl`` / 4
is shorter (:attr:`ckptkeeper.core.model.TierSpec.marker_beat`)."""


class _Strict(BaseModel):
    # Each field's description is the attribute docstring under it, read by docs/gen_reference.py:
    # pydantic's use_attribute_docstrings parsed this module's source at every start (~10 % of the
    # CPU of a `ckptkeeper restore` process).
    model_config = ConfigDict(extra="forbid", validate_default=True)


class TierConfig(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    """The tier's name in commands, output and metrics (letters, digits, ``_ . -``; unique)."""
    url: Annotated[str, Field(min_length=1)]
    """A local directory or an ``s3://bucket/prefix`` URL. The first tier is the hot tier and must be local."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Options passed to s3fs for an object-store tier (e.g. ``endpoint_url``); never logged."""
    high_watermark: Fraction | None = None
    """Filesystem usage (0..1) above which the tier demotes the checkpoints it keeps, oldest first."""
    low_watermark: Fraction | None = None
    """Usage to demote down to once above ``high_watermark`` (default: ``high_watermark`` - 0.15)."""
    keep_last: Count | None = None
    """Keep the newest N complete checkpoints of each run in this tier or a faster one."""
    keep_best: Count | None = None
    """Keep the N best checkpoints of each run by ``metric`` (needs ``metric``)."""
    metric: str | None = None
    """The metric ``keep_best`` ranks by (from the hook's commit or the framework's files)."""
    mode: Literal["min", "max"] = "min"
    """Whether a lower (``min``) or higher (``max``) ``metric`` is better."""
    keep_every: Annotated[int, Field(ge=1, le=10**15)] | None = None
    """Keep every checkpoint whose step is divisible by N."""
    keep_within: Duration | None = None
    """Keep every checkpoint younger than this duration."""
    keep_hourly: Count | None = None
    """Keep the newest complete checkpoint of each of the N most recent UTC hours that hold one."""
    keep_daily: Count | None = None
    """Keep the newest complete checkpoint of each of the N most recent UTC days that hold one."""
    keep_weekly: Count | None = None
    """Keep the newest complete checkpoint of each of the N most recent UTC weeks that hold one."""
    keep_monthly: Count | None = None
    """Keep the newest complete checkpoint of each of the N most recent UTC months that hold one."""
    replicate: bool = False
    """Every checkpoint this tier keeps also gets a copy here while it resides in a faster tier."""
    headroom: bool | None = None
    """First tier only (default on there): keep room for the next save of every active run,
    demoting early (before ``high_watermark``, or without one) when free space would not hold them
    (:mod:`ckptkeeper.core.headroom`). None: not set."""
    undo_window: Annotated[float, BeforeValidator(parse_duration), Field(gt=0.0)] | None = None
    """How long an expired or reaped checkpoint waits in this tier's trash
    (``<root>/.ckptkeeper-trash/``) where ``undelete`` can bring it back; unset = deleted at once."""
    cost_per_gib_month: Price | None = None
    """What a GiB stored in this tier costs per month (any currency); shown by status and prune."""
    shared: bool = False
    """Several nodes use this tier (docs/design.md, "Many nodes"). An ``s3://`` tier (one bucket for a cluster):
    copies go under ``<prefix>/<node>/``. A local tier (a Lustre/NFS/Weka mount seen by several
    nodes, hot or warm): exactly one keeper acts on it at a time, the holder of its lease; the
    others only catalog it (:mod:`ckptkeeper.fleet.sharedfs`)."""
    max_rate: Annotated[int, BeforeValidator(_rate), Field(ge=1)] | None = None
    """Bandwidth cap of every copy into or out of this tier, bytes per second (``"200MiB"``, binary
    units, or a number of bytes), shared by all copies of one process, like rclone's
    ``--bwlimit``; the preflight predicts with it. Unset: as fast as the storage goes
    (docs/bandwidth.md)."""
    shared_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")] | None = None
    """A shared local tier's name across nodes, naming its lease (default: the tier's name and a hash
    of its path, so every node must mount it at the same path)."""

    dedup: bool = False
    """A slower tier only: a file whose content this node already stores in the tier is referenced,
    not stored again (docs/dedup.md). Off by default: the tier's layout is unchanged."""
    dedup_tensors: bool = False
    """With ``dedup``: a safetensors file is stored tensor by tensor, so the tensors a save did not
    change (frozen layers) are not stored again; restore reassembles the file (docs/dedup.md)."""
    dedup_grace: Annotated[float, BeforeValidator(parse_duration), Field(ge=0.0)] = 86400.0
    """How long content no copy references stays before this node's prune pass removes it."""
    compression: Literal["none", "zstd", "auto"] = "none"
    """How new copies into this slower tier are stored (docs/compression.md): ``none`` as they are,
    ``zstd`` compressed, ``auto`` ZipNN for floating-point tensors and zstd for the rest, each
    file kept raw where that saves under 3 %. Needs the ``compress`` extra. Copies already there
    stay as they are."""

    _node: str = PrivateAttr(default="")
    _marker_beat: float = PrivateAttr(default=60.0)

    @field_validator("url")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        return _no_nul_byte(value)

    @model_validator(mode="after")
    def _check(self) -> TierConfig:
        if self.shared_id is not None and not self.shared:
            raise ValueError("shared_id names a shared tier's lease: it needs shared = true")
        if self.shared and not self.is_local and not self.url.lower().startswith(("s3://", "s3a://")):
            raise ValueError("only an s3:// or a local tier can be shared by several nodes")
        if self.keep_best is not None and not self.metric:
            raise ValueError("keep_best needs metric (the name of the metric to rank by)")
        if self.low_watermark is not None and self.high_watermark is None:
            raise ValueError("low_watermark needs high_watermark")
        if self.high_watermark is not None:
            if self.low_watermark is None:
                self.low_watermark = round(max(0.01, self.high_watermark - 0.15), 4)
            if self.low_watermark >= self.high_watermark:
                raise ValueError(
                    f"low_watermark ({self.low_watermark}) must be below high_watermark ({self.high_watermark})"
                )
        return self

    @property
    def is_local(self) -> bool:
        return is_local_url(self.url)

    @property
    def local_path(self) -> Path:
        return local_path_of(self.url)

    def to_spec(self) -> TierSpec:
        return tier_spec(self)


def _check_compression(i: int, tier: TierConfig) -> None:
    """A tier configured with compression needs the codecs of the ``compress`` extra."""
    import importlib.util

    need = {"none": (), "zstd": ("zstandard",), "auto": ("zstandard", "zipnn")}[tier.compression]
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"tiers[{i}].compression = {tier.compression!r} needs {', '.join(missing)}: "
            "install the compress extra (pip install 'ckptkeeper[compress]')"
        )


class DaemonConfig(_Strict):
    settle_seconds: Duration = 30.0
    """A checkpoint with its framework marker is complete once nothing under it changed for this long."""
    trust_mtimes: bool = False
    """Judge when a checkpoint was last written by mtimes alone (settling, partial and run ages).
    Off (the default), ctime counts too: ``cp -a`` / ``rsync -a`` into the hot tier keep old mtimes,
    and a copy in progress would look settled (moved half-done) or abandoned (reaped). On only where
    nothing copies checkpoints into hot that way."""
    retention_interval: JobInterval = 300.0
    """How often the daemon plans and applies retention."""
    reap_interval: JobInterval = 900.0
    """How often the daemon reaps failed runs' checkpoints and temp artifacts."""
    rescan_interval: JobInterval = 3600.0
    """How often the daemon fully reconciles every tier with the index."""
    scrub_interval: OptionalJobInterval = 6 * 3600.0
    """How often the scrub job re-hashes a slice of the slower tiers' copies (0 / "off": never)."""
    scrub_rate: ByteRate = 50 * 2**20
    """Bytes per second the scrub reads at most; a pass reads up to ``scrub_rate`` x 30 min."""
    metrics_addr: str = "127.0.0.1:9464"
    """``host:port`` for Prometheus; empty string disables the endpoint."""
    polling: bool = False
    """Use a polling observer (NFS/Lustre do not deliver inotify events)."""
    polling_interval: PollInterval = 5.0
    """Seconds between polls of the hot tier when polling (``polling``, or inotify limits reached)."""
    textfile: str | None = None
    """Write Prometheus metrics to this ``.prom`` file after each one-shot ``prune``."""
    log_stream: Literal["stderr", "stdout"] = "stderr"
    """Where the daemon's log lines go: stderr (systemd's journal, a terminal) or stdout (a
    container, whose runtime keeps stdout as the pod's log). Other commands always log to stderr:
    their stdout is their output."""
    serve_restores: bool = True
    """Serve this node's ``restore`` and ``prefetch`` commands (same user, same config) in the
    daemon's process, over the socket ``<index>.daemon.sock``: no start-up cost per command."""

    @field_validator("metrics_addr")
    @classmethod
    def _check_addr(cls, value: str) -> str:
        try:
            parse_addr(value)
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("daemon.metrics_addr: ")) from None
        return value.strip()


class FleetConfig(_Strict):
    """Many nodes on one bucket (docs/design.md, "Many nodes"): leases and node heartbeats in the shared tiers."""

    orphan_after: JobInterval = 7 * 86400.0
    """A node whose heartbeat object is older than this is gone: its litter (staging markers,
    multipart uploads) is cleaned by the lease holder, which also applies the shared tier's rules
    to its copies (looked at again once per ``orphan_after``)."""
    lease_ttl: Annotated[float, BeforeValidator(parse_duration), Field(ge=5.0, le=86400.0)] = 300.0
    """A lease not renewed for this long may be taken over by another node."""
    heartbeat_ttl: Annotated[float, BeforeValidator(parse_duration), Field(ge=5.0, le=86400.0)] = 600.0
    """A staging marker whose heartbeat is younger than this is a live copy: nobody reaps it."""


class HistoryConfig(_Strict):
    """What happened to checkpoints (``history``, ``why``): one index row per executed action."""

    keep: Annotated[float, BeforeValidator(parse_duration), Field(gt=0.0)] = 120 * 86400.0
    """Events older than this are dropped at the end of each prune pass (default: 120 days, long
    enough to answer last quarter's question)."""
    max_rows: Annotated[int, Field(ge=100, le=100_000_000)] = 200_000
    """At most this many events are kept (the newest): the index stays bounded whatever the churn."""


class ReaperConfig(_Strict):
    failed_after: Duration = 7200.0
    """A run with no live writer and no write for this long is stale (treated like a failed run)."""
    partial_after: Duration = 3600.0
    """A partial checkpoint, temp file or multipart upload untouched this long is reaped."""
    keep_last_of_failed: Count = 1
    """Complete checkpoints kept of each failed or stale run (the newest ones)."""

    def to_policy(self) -> ReaperPolicy:
        return ReaperPolicy(
            failed_after=self.failed_after,
            partial_after=self.partial_after,
            keep_last_of_failed=self.keep_last_of_failed,
        )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    index: str = "/var/lib/ckptkeeper/index.db"
    """Path of the SQLite index: the catalog, pins and the executor's journal."""
    run_depth: Annotated[int, Field(ge=1, le=16)] = 1
    """A run is a directory this many levels under the hot tier's root."""
    max_delete: Count = 100
    """A plan deleting more checkpoints than this deletes nothing without ``prune --force``."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the JSON log lines on stderr."""
    node: str = Field(default_factory=lambda: _default_node())
    """This node's name in shared tiers (docs/design.md, "Many nodes"): recorded in every manifest and staging marker,
    and the key prefix of its copies in a ``shared`` tier."""
    request_timeout: Annotated[float, BeforeValidator(parse_duration), Field(ge=1.0, le=86400.0)] = 300.0
    """At most this long for any one request to an object store, retries included: a request never
    answered fails, naming itself, and ends the pass with exit 1 (docs/many-nodes-clocks.md)."""
    pass_timeout: Annotated[float, BeforeValidator(parse_duration), Field(ge=1.0, le=30 * 86400.0)] = 43200.0
    """At most this long for a whole prune pass: past it, the pass stops between two actions and
    exits 1; the next pass runs as usual."""
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    """Leases and node heartbeats of tiers shared by several nodes."""
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)
    """The daemon's jobs, watcher and metrics endpoint."""
    tiers: list[TierConfig] = Field(min_length=1)
    """The tiers, fastest first; the first is the watched hot tier."""
    reaper: ReaperConfig = Field(default_factory=ReaperConfig)
    """When runs count as stale and partial checkpoints are reaped."""
    history: HistoryConfig = Field(default_factory=HistoryConfig)
    """How long and how many executed actions the index keeps for `history` and `why`."""

    @field_validator("node")
    @classmethod
    def _check_node(cls, value: str) -> str:
        if not NODE_NAME.fullmatch(value):
            raise ValueError(
                f"invalid node name {value!r}: 1-253 characters of A-Z a-z 0-9 . _ -, starting with a "
                "letter or digit (it becomes an S3 key prefix in shared tiers)"
            )
        return value

    @field_validator("index")
    @classmethod
    def _index_no_nul(cls, value: str) -> str:
        return _no_nul_byte(value)

    @model_validator(mode="after")
    def _check_tiers(self) -> Settings:
        names = [t.name for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tier names must be unique (repeated: {', '.join(dupes)})")
        if not self.tiers[0].is_local:
            raise ValueError("the first tier is the watched hot tier and must be a local path")
        if self.tiers[0].compression != "none":
            raise ValueError(
                "tiers[0].compression: the hot tier is where runs write and read their checkpoints; "
                "compression applies to slower tiers only"
            )
        if self.tiers[0].dedup:
            raise ValueError(
                "tiers[0].dedup: dedup applies to slower tiers only (the hot tier holds the runs' own files)"
            )
        for i, t in enumerate(self.tiers[1:], start=1):
            if t.dedup_tensors and not t.dedup:
                raise ValueError(f"tiers[{i}].dedup_tensors needs dedup = true")
            if t.dedup and t.shared and t.is_local:
                raise ValueError(f"tiers[{i}].dedup: not available on a shared local tier (docs/dedup.md)")
            _check_compression(i, t)
            if t.headroom is not None:
                raise ValueError(
                    f"tiers[{i}].headroom: headroom applies to the first (hot) tier only, where runs write"
                )
        shared_local = any(t.shared and t.is_local for t in self.tiers)
        if shared_local and "lease_ttl" not in self.fleet.model_fields_set:
            # Unset: outlive three passes, so a holder that misses one pass keeps the tier.
            self.fleet.lease_ttl = min(max(self.fleet.lease_ttl, 3 * self.daemon.retention_interval), 86400.0)
        if shared_local and self.fleet.lease_ttl <= self.daemon.retention_interval:
            # The holder of a shared filesystem tier's lease renews it once per pass: a lease that
            # expires between two passes would pass from node to node at every pass.
            raise ValueError(
                f"fleet.lease_ttl ({format_duration(self.fleet.lease_ttl)}) must be longer than "
                f"daemon.retention_interval ({format_duration(self.daemon.retention_interval)}) when a local "
                "tier is shared: its lease holder renews it once per pass (set lease_ttl to at least twice it)"
            )
        for t in self.tiers:
            t._node = self.node
            # a copy's marker must beat several times within the TTL other nodes judge it by
            t._marker_beat = min(MARKER_BEAT, self.fleet.heartbeat_ttl / 4)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment wins over the file (passed as init kwargs); no dotenv or secrets dirs.
        return (env_settings, init_settings)

    @property
    def hot(self) -> TierConfig:
        return self.tiers[0]

    def tier_specs(self) -> list[TierSpec]:
        return [t.to_spec() for t in self.tiers]


NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,252}")
"""A node name: safe as one S3 key component and as a file name, never ``.`` or ``..``."""


def _default_node() -> str:
    """The hostname, as manifests recorded it before ``node`` existed (so a single node's copies stay
    its own after an upgrade); one that is not a valid node name is a config error naming ``node``."""
    return socket.gethostname()


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(config)"


def _format_errors(exc: ValidationError, env: Mapping[str, list[str]] | None = None) -> list[str]:
    """One line per error; ``env``: top-level key -> the variables that set it (named too)."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if p not in ("function-after[_check(), TierConfig]",))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see config.example.toml)"
        if env and loc and isinstance(loc[0], str) and loc[0] in env:
            msg += f" (set by {', '.join(env[loc[0]])})"
        lines.append(f"{_format_loc(loc)}: {msg}")
    return lines


def check_permissions(path: Path) -> None:
    """Refuse a config that others could edit: it decides what gets deleted."""
    st = path.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            [
                f"{path}: refusing a config file writable by group or others "
                f"(mode {stat.filemode(st.st_mode)}); it decides what gets deleted — run: chmod go-w {path}"
            ]
        )


def load_settings(
    path: str | os.PathLike[str] | None = None, *, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Load and validate; raises ConfigError with one line per problem."""
    return load_settings_and_source(path, overrides=overrides)[0]


def load_settings_and_source(
    path: str | os.PathLike[str] | None = None, *, overrides: Mapping[str, Any] | None = None
) -> tuple[Settings, tuple[Path, bytes] | None]:
    """:func:`load_settings`, and the config file's path and the bytes that were validated (None
    for a config from the environment alone): what :func:`ckptkeeper.config_cache.remember` keys on."""
    config_path = resolve_config_path(path)
    if _environment_only(path, config_path):
        return settings_from_mapping(dict(overrides or {})), None
    try:
        check_permissions(config_path)
        with config_path.open("rb") as f:
            raw = f.read()
        data = tomllib.loads(raw.decode())
    except FileNotFoundError:
        raise ConfigError([f"{config_path}: config file not found (use --config or ${CONFIG_ENV})"]) from None
    except PermissionError as exc:
        raise ConfigError([f"{config_path}: cannot read config: {exc.strerror}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{config_path}: invalid TOML: {exc}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{config_path}: config is not UTF-8: {exc}"]) from None
    if overrides:
        data.update(overrides)
        return settings_from_mapping(data), None
    return settings_from_mapping(data), (config_path, raw)


def _environment_only(explicit: str | os.PathLike[str] | None, config_path: Path) -> bool:
    """No file named (``--config``, ``$CKPTKEEPER_CONFIG``), none at the default path, and the tiers
    given in ``$CKPTKEEPER_TIERS``: the ``CKPTKEEPER_*`` environment is the whole config. A file
    named but missing stays an error, and so does no file and no tiers."""
    if explicit or os.environ.get(CONFIG_ENV) or not os.environ.get(TIERS_ENV):
        return False
    return not config_path.exists()


def settings_from_mapping(data: Mapping[str, Any]) -> Settings:
    """Validate the file's ``data`` with the environment over it; then the checks no single key
    can make (:mod:`ckptkeeper.config_checks`: overlapping tiers, relative paths)."""
    problems = env_problems(os.environ, Settings)
    if problems:
        raise ConfigError(problems)
    # Our own CKPTKEEPER_CONFIG env var selects the file; it is not a setting.
    saved = os.environ.pop(CONFIG_ENV, None)
    try:
        settings = Settings(**dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, env_variables(os.environ))) from None
    except SettingsError as exc:  # a value the environment source could not parse (env_problems misses it)
        names = ", ".join(n for names in env_variables(os.environ).values() for n in names)
        raise ConfigError([f"environment ({names}): {exc}"]) from None
    finally:
        if saved is not None:
            os.environ[CONFIG_ENV] = saved
    problems = tier_problems([(t.url, t.storage_options) for t in settings.tiers], settings.index)
    if problems:
        raise ConfigError(problems)
    return settings
