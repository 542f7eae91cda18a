"""The daemon's restore socket: where it is, which config it serves, and its messages.

Imported by the CLI's thin client (:mod:`.client`) on every ``restore`` and ``prefetch``, and by the
daemon's server (:mod:`.restore_server`): standard library only, so that a restore served by the
daemon never pays for pydantic, fsspec or structlog in the client.

One JSON object per line, both ways. The client sends one request; the server answers ``accepted``
(or ``declined``: the client runs the command itself), then ``progress`` lines while it works and one
``result``. A request is untrusted input: :func:`parse_request` checks its schema and bounds.
"""

# No ``from __future__ import annotations``: the named tuple's field types are then objects, not
# strings that typing compiles one by one (a tenth of the thin client's own CPU).

import json
import os
from typing import TYPE_CHECKING, Any, NamedTuple

try:  # the C module ``socket`` wraps: without the enum classes it builds at import
    import _socket
except ImportError:  # pragma: no cover - an interpreter without it
    import socket as _socket  # type: ignore[no-redef]

if TYPE_CHECKING:
    from hashlib import _Hash

PROTOCOL = 1
"""Bumped when a message changes shape: a client and a daemon of other protocols never talk."""
MAX_LINE = 64 * 1024
"""Longest message line either side accepts."""
SOCKET_SUFFIX = ".daemon.sock"
"""The socket is ``<index>.daemon.sock``, beside the index and its ``.daemon.lock``."""
ENV_PREFIX = "CKPTKEEPER_"
CONFIG_ENV = "CKPTKEEPER_CONFIG"
DEFAULT_CONFIG_PATH = "/etc/ckptkeeper/config.toml"
DEFAULT_INDEX = "/var/lib/ckptkeeper/index.db"
"""The same defaults as :mod:`ckptkeeper.config` (a test keeps them equal); not imported from
there because that module imports pydantic."""
MAX_SUN_PATH = 107
OPS = ("restore", "prefetch")
MAX_RUN = 1024
MAX_PATH = 4096
MAX_NAME = 256
MAX_STEP = 2**63 - 1
MAX_PART = 2**31 - 1


class BadRequest(ValueError):
    """A request that does not follow the protocol (the message says which field)."""


# -- where, and for which config ------------------------------------------------------------


def socket_path(index: str) -> str:
    return index + SOCKET_SUFFIX


def config_file(explicit: str | os.PathLike[str] | None) -> str:
    """The config file ``load_settings`` reads: ``--config``, else ``$CKPTKEEPER_CONFIG``, else the default."""
    if explicit:
        return os.fspath(explicit)
    return os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH


def _settings_env() -> list[tuple[str, str]]:
    """Every ``CKPTKEEPER_*`` variable that sets a key (names are case-insensitive, like the config's)."""
    return sorted(
        (k.upper(), v)
        for k, v in os.environ.items()
        if k.upper().startswith(ENV_PREFIX) and k.upper() != CONFIG_ENV
    )


def config_identity(explicit: str | os.PathLike[str] | None) -> tuple[str, bytes | None] | None:
    """(identity, file bytes) of the config this process would load; None when it cannot be read.

    The identity covers the file's real path, its bytes and every ``CKPTKEEPER_*`` variable: a
    daemon serves a client only when both would build the same settings from the same file (an edit
    not yet reloaded by the daemon, or another environment, makes the client run the command itself).
    """
    path = config_file(explicit)
    try:
        with open(path, "rb") as f:
            data: bytes | None = f.read()
        real = os.path.realpath(path)
    except FileNotFoundError:
        data, real = None, ""  # environment-only config, or none: the environment decides
    except OSError:
        return None
    digest = _sha256()
    digest.update(json.dumps([PROTOCOL, real, _settings_env()]).encode())
    digest.update(b"\0" if data is None else b"\1" + data)
    return digest.hexdigest(), data


def index_of(data: bytes | None) -> str | None:
    """The index path a config names (``$CKPTKEEPER_INDEX`` over the file's ``index``); None when
    the file does not parse (the local run then reports why)."""
    for key, value in _settings_env():
        if key == ENV_PREFIX + "INDEX":
            return value
    if data is None:
        return DEFAULT_INDEX
    plain = _plain_index(data)
    if plain is not None:
        return plain or DEFAULT_INDEX
    import tomllib

    try:
        doc = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    value = doc.get("index", DEFAULT_INDEX)
    return value if isinstance(value, str) and value and "\0" not in value else None


def _sha256() -> "_Hash":
    """A SHA-256 hasher without importing :mod:`hashlib`, which loads OpenSSL (a tenth of what the
    thin client itself costs); the same digest either way."""
    try:
        from _sha256 import sha256  # Python 3.11
    except ImportError:
        try:
            from _sha2 import sha256  # 3.12 and later
        except ImportError:
            from hashlib import sha256
    hasher: _Hash = sha256()
    return hasher


def _plain_index(data: bytes) -> str | None:
    """The top-level ``index`` of a config that writes it plainly (``index = "/path"``: a string
    without escapes on a line of its own, before the first table), ``""`` when such a config sets
    none, None when only a TOML parser can tell. Parsing TOML was a third of what the thin client
    itself costs; a wrong guess costs no more than a daemon not found (a daemon serves only the
    very config bytes it runs: :func:`config_identity`)."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None
    found = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            break  # a table: no top-level key follows
        if "'''" in line or '"""' in line:
            return None  # a multi-line string: the lines that follow are not keys
        key, eq, value = line.partition("=")
        if not eq or "index" not in key or line.startswith("#"):
            continue
        if key.strip() != "index" or found:
            return None  # quoted, dotted, inside a value, or twice: the parser decides
        value = value.strip()
        quote = value[:1]
        end = value.find(quote, 1) if quote in ("'", '"') else -1
        rest = value[end + 1 :].strip() if end > 1 else "?"
        if end <= 1 or "\\" in value[:end] or (rest and not rest.startswith("#")):
            return None
        found = value[1:end]
        if not found.isprintable():
            return None  # control characters: not a TOML string
    return found


def process_umask() -> int | None:
    """This process's umask, read without changing it (``os.umask`` would race other threads)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def addressable(path: str) -> tuple[str, int | None]:
    """An address ``bind``/``connect`` accept for ``path``: itself, or, past the 107 bytes a Unix
    socket address holds, the name under ``/proc/self/fd/<directory fd>`` (the fd is returned to be
    closed after the call)."""
    if len(os.fsencode(path)) <= MAX_SUN_PATH:
        return path, None
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def peer_credentials(sock: _socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (``SO_PEERCRED``)."""
    import struct

    raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


# -- messages --------------------------------------------------------------------------------


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Reads one bounded JSON line at a time from a socket."""

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    def read(self) -> dict[str, Any] | None:
        """The next message; None at end of stream. ValueError: too long or not a JSON object.
        Socket timeouts and errors propagate."""
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise ValueError(f"message longer than {MAX_LINE} bytes")
            chunk = self.sock.recv(65536)
            if not chunk:
                if self._buf:
                    raise ValueError("message cut short")
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        if len(line) > MAX_LINE:
            raise ValueError(f"message longer than {MAX_LINE} bytes")
        doc = json.loads(line)
        if not isinstance(doc, dict):
            raise ValueError("a message is a JSON object")
        return doc


class Request(NamedTuple):
    """A checked request: the command's own arguments, and who asks (a named tuple: no
    dataclasses import in the client)."""

    op: str
    version: str
    config: str
    umask: int | None
    progress: bool
    run: str
    step: str | int
    to: str | None
    """restore only: an absolute path (the client resolved it against its own working directory)."""
    metric: str | None = None
    mode: str | None = None
    node: str | None = None
    part: int | None = None


def _text(doc: dict[str, Any], key: str, limit: int, *, optional: bool = False) -> str | None:
    value = doc.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{key}: a non-empty string")
    if len(value) > limit or "\0" in value:
        raise BadRequest(f"{key}: at most {limit} characters, no NUL")
    return value


def _int(doc: dict[str, Any], key: str, limit: int) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise BadRequest(f"{key}: an integer from 0 to {limit}")
    return value


def parse_request(doc: dict[str, Any]) -> Request:
    """Check a request's schema and bounds; raise :class:`BadRequest` naming the first bad field."""
    allowed = {"v", "op", "version", "config", "umask", "progress", "args"}
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}")
    if doc.get("v") != PROTOCOL:
        raise BadRequest(f"v: protocol {PROTOCOL} expected")
    op = doc.get("op")
    if op not in OPS:
        raise BadRequest(f"op: one of {', '.join(OPS)}")
    version = _text(doc, "version", 64)
    config = _text(doc, "config", 64)
    umask = _int(doc, "umask", 0o777)
    if not isinstance(doc.get("progress", False), bool):
        raise BadRequest("progress: true or false")
    args = doc.get("args")
    if not isinstance(args, dict):
        raise BadRequest("args: an object")
    keys = {"run", "step", "part"} | ({"to", "metric", "mode", "node"} if op == "restore" else set())
    unknown = sorted(set(args) - keys)
    if unknown:
        raise BadRequest(f"args: unknown field {unknown[0]!r}")
    run = _text(args, "run", MAX_RUN)
    named = ("latest", "best") if op == "restore" else ("latest",)
    step: str | int | None = args.get("step")
    if step not in named:
        step = _int(args, "step", MAX_STEP)
    if step is None:
        raise BadRequest(f"args.step: a step number or {' or '.join(named)}")
    part = _int(args, "part", MAX_PART)
    to = metric = mode = node = None
    if op == "restore":
        to = _text(args, "to", MAX_PATH)
        if to is None or not os.path.isabs(to):
            raise BadRequest("args.to: an absolute path")
        metric = _text(args, "metric", MAX_NAME, optional=True)
        mode = args.get("mode")
        if mode not in (None, "min", "max"):
            raise BadRequest("args.mode: min or max")
        if (metric is not None or mode is not None) and step != "best":
            raise BadRequest("args.metric and args.mode only apply to step best")
        node = _text(args, "node", MAX_NAME, optional=True)
    assert version is not None and config is not None and run is not None
    return Request(
        op=str(op),
        version=version,
        config=config,
        umask=umask,
        progress=bool(doc.get("progress", False)),
        run=run,
        step=step,
        to=to,
        metric=metric,
        mode=mode,
        node=node,
        part=part,
    )
