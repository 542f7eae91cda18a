"""Checks of a whole config that no single key can make (docs/configuration-safety.md).

* **Tiers cannot overlap.** Two tiers that are one place, or one inside the other, see each other's
  copies: warm inside hot is cataloged as a hot run and reaped as a stale one; two object-store
  tiers on one bucket and prefix delete each other's "redundant" copies. Local paths are compared
  after resolving symlinks, ``..`` and trailing slashes, and by the identity (device, inode) of
  every existing directory on the way (a bind mount of a tier elsewhere is the same place).
  Object-store URLs are compared by store (scheme and endpoint), bucket and whole key components:
  ``s3://b/a`` holds ``s3://b/a/x`` but not ``s3://b/ab``.
* **Paths are absolute.** A relative tier path or ``index`` resolves against the working directory
  of each command: a ``prune`` run from elsewhere demotes into another directory.
* **Every ``CKPTKEEPER_*`` variable is a setting** (or one of :data:`NOT_SETTINGS`): a typo such as
  ``CKPTKEEPER_MAX_DELET=0`` is an error, not an ignored variable, and a value that is not JSON
  where a table or a list is expected names the variable.

Every problem is one ``key: message`` line, as pydantic's are. The pure parts (:class:`Place`,
:func:`overlap`, :func:`env_problems`) take values; :func:`tier_problems` reads the filesystem.
"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pydantic import BaseModel  # imported where a model is looked at: tier_problems needs none

__all__ = [
    "ENV_PREFIX",
    "NOT_SETTINGS",
    "Place",
    "env_problems",
    "env_variables",
    "overlap",
    "place_of",
    "tier_problems",
]

ENV_PREFIX = "CKPTKEEPER_"

NOT_SETTINGS = frozenset(
    {
        "CKPTKEEPER_CONFIG",  # selects the config file (resolve_config_path)
        "CKPTKEEPER_TEST_CRASH_AFTER",  # the executor's crash points, for the crash tests
        "CKPTKEEPER_TEST_STORE_CLOCK_AHEAD",  # a dedup tier's store clock moved on, for its tests
        "CKPTKEEPER_COMPRESS_THREADS",  # threads a compressing copy uses (docs/compression.md)
        "CKPTKEEPER_SPOOL_DIR",  # where a compressing copy to S3 spools its frames (docs/compression.md)
        "CKPTKEEPER_HOST",  # the machine's name in keeper identities (util/host.py; a pod's node)
        # the Slurm hooks (deploy/slurm/) and a training job's environment
        "CKPTKEEPER_DEFAULTS",
        "CKPTKEEPER_HOOK_LOG",
        "CKPTKEEPER_PRESTAGE_TIMEOUT",
        "CKPTKEEPER_PREFLIGHT",
        "CKPTKEEPER_PREFLIGHT_TIMEOUT",
        "CKPTKEEPER_RESUME",
        # knobs of the test suite, which runs commands in-process with them set
        "CKPTKEEPER_UPDATE_GOLDEN",
        "CKPTKEEPER_STRESS_TRIALS",
        "CKPTKEEPER_STRESS_SEED",
        "CKPTKEEPER_STRESS_REPORT",
        "CKPTKEEPER_FUZZ_EXAMPLES",
    }
)
"""``CKPTKEEPER_*`` variables the project reads that are not settings. Every other one must name a
setting of the model (``CKPTKEEPER_<KEY>`` or ``CKPTKEEPER_<SECTION>__<KEY>``)."""


# --------------------------------------------------------------------------------------------
# places


@dataclass(frozen=True, slots=True)
class Place:
    """Where a tier keeps its copies: a store and a path of whole components in it."""

    store: str
    """``local``, or the object store: ``s3 <endpoint>`` (endpoint "" = the provider's default)."""
    parts: tuple[str, ...]
    """Path components (local: from ``/``; object store: the bucket, then the key prefix)."""


def overlap(a: Place, b: Place) -> Literal["same", "a-inside-b", "b-inside-a"] | None:
    """How two places overlap, by whole components (``s3://b/a`` does not hold ``s3://b/ab``)."""
    if a.store != b.store:
        return None
    if a.parts == b.parts:
        return "same"
    n = min(len(a.parts), len(b.parts))
    if a.parts[:n] != b.parts[:n]:
        return None
    return "a-inside-b" if len(a.parts) > len(b.parts) else "b-inside-a"


def _endpoint(options: Mapping[str, Any]) -> str:
    client = options.get("client_kwargs")
    raw = options.get("endpoint_url") or (client.get("endpoint_url") if isinstance(client, Mapping) else "")
    return str(raw or "").strip().lower().rstrip("/")


def is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def place_of(url: str, options: Mapping[str, Any], realpath: Any = os.path.realpath) -> Place | None:
    """The place of a tier URL; None for a relative local path (its place depends on the working
    directory). ``realpath`` resolves a local path (symlinks, ``..``); pure when given a pure one."""
    if is_local_url(url):
        path = url.removeprefix("file://")
        if not path.startswith("/"):
            return None
        return Place("local", tuple(p for p in PurePosixPath(realpath(path)).parts if p != "/"))
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme in ("s3a", "s3n"):
        scheme = "s3"
    parts = tuple(p for p in rest.split("/") if p not in ("", "."))
    return Place(f"{scheme} {_endpoint(options)}", parts)


def _local_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _inside_by_identity(inner: str, outer: str) -> bool:
    """Is ``inner`` (or one of its existing ancestors) the very directory ``outer`` is, seen through
    another path (a bind mount)? Both resolved; False when ``outer`` does not exist."""
    target = _local_identity(outer)
    if target is None:
        return False
    path = inner
    while True:
        if _local_identity(path) == target:
            return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


_WHY = {
    "same": "is the same place as {other} ({other_url!r}): each tier would list, move and delete the "
    "other's copies as its own (a redundant-copy delete in one wipes the other)",
    "a-inside-b": "is inside {other} ({other_url!r}): its copies would be cataloged as that tier's "
    "runs (and reaped as stale ones)",
    "b-inside-a": "holds {other} ({other_url!r}) inside it: that tier's copies would be cataloged as "
    "this tier's runs (and reaped as stale ones)",
}


def tier_problems(tiers: Sequence[tuple[str, Mapping[str, Any]]], index: str) -> list[str]:
    """One ``key: message`` line per relative path and per pair of overlapping tiers, given each
    tier's (url, storage_options) in config order and the ``index`` path."""
    problems: list[str] = []
    if not index.startswith("/"):
        problems.append(
            f"index: relative path {index!r} resolves against each command's working directory "
            "(every command would open another index): use an absolute path"
        )
    places: list[tuple[int, str, Place]] = []
    for i, (url, options) in enumerate(tiers):
        place = place_of(url, options)
        if place is None:
            problems.append(
                f"tiers[{i}].url: relative path {url!r} resolves against each command's working "
                "directory (a prune run elsewhere would move copies there): use an absolute path"
            )
            continue
        places.append((i, url, place))
    for n, (i, url, place) in enumerate(places):
        for j, other_url, other in places[:n]:
            how = overlap(place, other)
            if how is None and place.store == other.store == "local":
                a, b = "/" + "/".join(place.parts), "/" + "/".join(other.parts)
                if _inside_by_identity(a, b):
                    how = "same" if _local_identity(a) == _local_identity(b) else "a-inside-b"
                elif _inside_by_identity(b, a):
                    how = "b-inside-a"
            if how is not None:
                why = _WHY[how].format(other=f"tiers[{j}].url", other_url=other_url)
                problems.append(
                    f"tiers[{i}].url: {url!r} {why}; give every tier a place of its own "
                    "(see docs/configuration-safety.md)"
                )
    return problems


# --------------------------------------------------------------------------------------------
# environment


def _unwrap(annotation: Any) -> Any:
    """The type inside ``Annotated[...]`` and ``X | None``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _model_of(annotation: Any) -> type[BaseModel] | None:
    from pydantic import BaseModel

    inner = _unwrap(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _is_json(annotation: Any) -> bool:
    """Is the setting given as JSON in the environment (a table or a list), as pydantic-settings
    parses it?"""
    inner = _unwrap(annotation)
    return (
        _model_of(inner) is not None
        or typing.get_origin(inner) in (list, dict, tuple, set)
        or inner
        in (
            list,
            dict,
        )
    )


def env_variables(environ: Mapping[str, str]) -> dict[str, list[str]]:
    """Top-level setting -> the ``CKPTKEEPER_*`` variables that set it (case as pydantic-settings
    reads them: any)."""
    out: dict[str, list[str]] = {}
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX) and upper not in NOT_SETTINGS:
            key = upper[len(ENV_PREFIX) :].split("__", 1)[0].lower()
            out.setdefault(key, []).append(name)
    return out


def env_problems(environ: Mapping[str, str], model: type[BaseModel]) -> list[str]:
    """One ``VARIABLE: message`` line per ``CKPTKEEPER_*`` variable that names no setting of
    ``model`` (or no key of its section), or whose table or list value is not JSON."""
    problems: list[str] = []
    fields = model.model_fields
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NOT_SETTINGS:
            continue
        path = upper[len(ENV_PREFIX) :].lower().split("__")
        field = fields.get(path[0])
        if field is None:
            problems.append(
                f"{name}: no setting {path[0]!r} (check the spelling; settings: "
                f"{', '.join(sorted(fields))}; a section's key is {ENV_PREFIX}<SECTION>__<KEY>)"
            )
            continue
        section = _model_of(field.annotation)
        if len(path) > 1:
            if section is None:
                how = "a JSON list" if _is_json(field.annotation) else "a value"
                problems.append(f"{name}: {path[0]} has no keys: set {ENV_PREFIX}{path[0].upper()} to {how}")
            elif path[1] not in section.model_fields:
                problems.append(
                    f"{name}: no key {path[1]!r} in [{path[0]}] (check the spelling; keys: "
                    f"{', '.join(sorted(section.model_fields))})"
                )
            continue
        if _is_json(field.annotation):
            try:
                json.loads(environ[name])
            except ValueError as exc:
                example = f"{name}__<KEY>=<value>" if section is not None else f"{name}='[...]'"
                problems.append(
                    f"{name}: not valid JSON ({exc}): {path[0]} is "
                    + ("a table: give a JSON object, or set one key as " if section else "a list: give ")
                    + example
                )
    return problems
