"""Restoring from S3 with plain HTTP GETs on worker threads, each byte copied once by the kernel
into a reused buffer, hashed there and written at its offset (``os.pwrite``).

Why not the S3 client's event loop (:mod:`.s3_fetch`, still used behind a proxy): every byte
that passes through aiohttp is copied three times in Python (socket read, stream buffer, the
``read()`` that joins it) on one thread that also parses and signs each request; a restore spent
about twice the CPU per byte of s5cmd that way (bench/restore_s3.py). Here each request is signed
by :mod:`.s3_sign` (SigV4, ~15 µs; where the bucket lives and with which credentials as the tier's
S3 client would resolve them) and ``http.client`` fetches it with ``readinto`` straight into the
worker's buffer, every socket read, hash and write made with the GIL released. The S3 client
(s3fs, aiohttp) is never imported for a restore.

Large objects are fetched as ranges by :data:`WORKERS` threads, largest first; small objects
(one range of at most :data:`SMALL_OBJECT` bytes) whole by up to :data:`SMALL_WORKERS` more, smallest
first, so a checkpoint of many small files keeps many requests in flight (each costs the store a
round of lookups, whatever its size) without more large buffers held.

Safety is the same as :mod:`.s3_fetch`: each file is hashed in file order (a range that is done
before its turn waits, in its buffer, for the earlier ones; how many ranges may wait is bounded),
checked against its manifest entry (size, then hash) before it is finished; all ranges of one
object carry the same ETag (``If-Match`` on every range after the first answer); a broken stream
resumes from its last byte a bounded number of times; the first failure stops every worker (their
connections are shut down, so none waits out a stalled read) before the caller's abort removes the
staging directory.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from ckptkeeper.core.model import FileEntry, Manifest
from ckptkeeper.storage import deadline
from ckptkeeper.storage.base import Progress, StorageError, TierUnavailable, VerificationError, log
from ckptkeeper.storage.s3_sign import GetSigner, plain_signer
from ckptkeeper.util import hashing

if TYPE_CHECKING:
    from ckptkeeper.core.model import TierSpec
    from ckptkeeper.storage.localfs import _LocalFileWriter, _LocalSink


class S3TierStorage(Protocol):
    """What a direct restore uses of the S3 backend (:class:`~ckptkeeper.storage.s3.S3TierStorage`)."""

    name: str
    bucket: str
    spec: TierSpec

    def _redact(self, text: str) -> str: ...
    def _key(self, rel: str) -> str: ...


RANGE_SIZE = 8 * 2**20
"""Bytes per ranged GET of a large object, and per worker buffer."""
WORKERS = 8
"""GETs in flight at once for one restore (threads, each with its own connection)."""
SMALL_OBJECT = 2 * 2**20
"""Objects of at most this many bytes may also go to the small-object workers."""
SMALL_WORKERS = 24
"""More GETs in flight, each of one whole small object (taken smallest first, while the
:data:`WORKERS` go largest first): a small object's request costs the store a round of lookups
that more connections hide. Their buffers are of :data:`SMALL_OBJECT` bytes, so they add at most
``SMALL_WORKERS x SMALL_OBJECT`` to what a restore holds."""
AHEAD = 4
"""Ranges done before their turn to be hashed that may wait, at most, beyond one per worker (bounds
the bytes held: ``(WORKERS + AHEAD) x RANGE_SIZE`` at worst)."""
RETRIES = 5
"""Resumptions of one range whose stream broke or whose request failed transiently."""
URL_SECONDS = 6 * 3600
"""Lifetime of a presigned URL (a failed request signs its URL again before it is retried)."""
_PROXY_ENV = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")


_OPTIONS = frozenset(
    {"key", "secret", "token", "endpoint_url", "client_kwargs", "config_kwargs", "profile", "anon"}
    | {"requester_pays", "use_ssl"}
)
"""``storage_options`` the signing client understands as s3fs does; any other keeps the S3 client."""
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def usable(tier: S3TierStorage) -> bool:
    """Plain GETs reach the store the way the tier's S3 client would: no proxy is configured, every
    storage option is one :func:`_signer` maps, and the endpoint or the bucket's region is given."""
    options = _options(tier)
    if set(options) - _OPTIONS or any(os.environ.get(k) for k in _PROXY_ENV):
        return False
    config = options.get("config_kwargs") or {}
    client_kwargs = options.get("client_kwargs") or {}
    verify = client_kwargs.get("verify")
    if config.get("proxies") or not (verify is None or isinstance(verify, bool | str)):
        return False
    # On AWS itself only a region given in the tier's options is trusted to be the bucket's (an
    # AWS_REGION in the environment is often the compute's): botocore follows a wrong one, we cannot.
    return bool(
        options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or client_kwargs.get("region_name")
        or config.get("region_name")
        or any(os.environ.get(k) for k in _ENDPOINT_ENV)
    )


def _options(tier: S3TierStorage) -> dict[str, Any]:
    return dict(tier.spec.storage_options or {})


@dataclass(eq=False)
class _File:
    entry: FileEntry
    key: str
    where: str
    ranges: int
    url: str = ""
    writer: _LocalFileWriter | None = None
    """Opened when its first range is handed out (a checkpoint of thousands of files never holds
    a descriptor for each at once)."""
    hasher: hashing.Hasher = field(default_factory=hashing.new_hasher)
    handed: int = 0
    """Ranges given to a worker so far (they are handed out in order)."""
    frontier: int = 0
    """Ranges hashed so far: the next one to hash."""
    held: dict[int, bytearray] = field(default_factory=dict)
    """Ranges done before their turn: their bytes, written already, waiting to be hashed."""
    etag: str | None = None
    hashing: bool = False
    """A worker is hashing this file's frontier range (the others hold theirs)."""

    def span(self, r: int) -> tuple[int, int]:
        start = r * RANGE_SIZE
        return start, min(start + RANGE_SIZE, self.entry.size)


class _Plan:
    """Which range a worker fetches next, what waits to be hashed, and the first failure."""

    def __init__(self, files: list[_File], sink: _LocalSink, signer: GetSigner | None) -> None:
        self.files = files
        self.sink = sink
        self.first = 0
        """Files before this one have every range handed out."""
        self.last = len(files)
        """Files from this one on have every range handed out (taken by the small-object workers)."""
        self.signer = signer
        """Signs each request (None: every URL is presigned)."""
        self.cond = threading.Condition()
        self.waiting = 0
        """Ranges done but not hashed (their buffers held)."""
        self.failed: list[BaseException] = []
        self.spare: list[bytearray] = []
        self.conns: set[http.client.HTTPConnection] = set()
        self.gate = threading.Event()
        """Set once every worker is started (or none more can be): workers begin then."""

    def take(self) -> tuple[_File, int] | None:
        """The next range to fetch (a file's next range, within its window), None when none is left."""
        with self.cond:
            while not self.failed:
                files = self.files
                while self.first < len(files) and files[self.first].handed >= files[self.first].ranges:
                    self.first += 1
                if self.first == len(files):
                    return None
                for i in range(self.first, len(files)):
                    f = files[i]
                    # the range at a file's frontier is always given (it is hashed as soon as it is
                    # done, never held), so the restore can always progress
                    if f.handed < f.ranges and (f.handed == f.frontier or self.waiting < AHEAD):
                        if f.writer is None:
                            f.writer = self.sink.open_file(f.entry)  # type: ignore[assignment]
                        f.handed += 1
                        return f, f.handed - 1
                self.cond.wait()
            return None

    def take_small(self) -> _File | None:
        """The smallest object not handed out yet, if it is a small one (whole: one range)."""
        with self.cond:
            files = self.files
            while self.last > self.first and files[self.last - 1].handed >= files[self.last - 1].ranges:
                self.last -= 1
            if self.failed or self.last <= self.first:
                return None
            f = files[self.last - 1]
            if not _small(f):
                return None
            f.writer = self.sink.open_file(f.entry)  # type: ignore[assignment]
            f.handed = 1
            return f

    def done(self, f: _File, r: int, buf: bytearray) -> tuple[bytearray, bool]:
        """Range ``r`` of ``f`` is in ``buf`` (and written): hash it now, or hold it until its turn.
        Returns the buffer the worker goes on with and whether the whole file is hashed.

        Hashing (the GIL released) happens outside the lock, by one worker at a time per file: the
        one whose range is at the frontier, which then hashes the held ranges that follow it."""
        with self.cond:
            if r != f.frontier or f.hashing:
                f.held[r] = buf
                self.waiting += 1
                return (self.spare.pop() if self.spare else _buffer(RANGE_SIZE)), False
            f.hashing = True
        mine, chunk = buf, buf
        while True:
            start, end = f.span(r)
            f.hasher.update(memoryview(chunk)[: end - start])
            with self.cond:
                if chunk is not mine:
                    self.spare.append(chunk)
                    self.waiting -= 1
                r = f.frontier = r + 1
                if r not in f.held:
                    f.hashing = False
                    self.cond.notify_all()
                    return mine, f.frontier >= f.ranges
                chunk = f.held.pop(r)

    def fail(self, exc: BaseException) -> None:
        """Stop every worker: no new range is given, and reads in progress end now."""
        with self.cond:
            self.failed.append(exc)
            conns = list(self.conns)
            self.cond.notify_all()
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def fetch_direct(
    tier: S3TierStorage, rel: str, manifest: Manifest, sink: _LocalSink, progress: Progress | None
) -> None:
    """Write and verify every file of ``manifest`` from ``tier`` into ``sink`` (not committed).

    Returns when all files are written, each checked against the manifest; raises the first
    failure once every worker has stopped (the caller's abort never races a write)."""
    files: list[_File] = []
    try:
        for entry in sorted(manifest.files, key=lambda e: (-e.size, e.path)):
            key = tier._key(f"{rel}/{entry.path}" if entry.path else rel)
            where = f"{tier.name}:{rel}/{entry.path}" if entry.path else f"{tier.name}:{rel}"
            files.append(_File(entry, key, where, max(1, -(-entry.size // RANGE_SIZE))))
        signer, urls = _urls(tier, [f.key for f in files])
        for f, url in zip(files, urls, strict=True):
            f.url = url
        plan = _Plan(files, sink, signer)
        report = _locked(progress, plan.cond) if progress is not None else None
        context = _tls_context(tier) if files and files[0].url.startswith("https:") else None
        small = sum(1 for f in files if _small(f))
        threads = [
            threading.Thread(
                target=_worker, args=(tier, plan, report, context), name=f"ckptkeeper-get-{i}", daemon=True
            )
            for i in range(min(WORKERS, sum(f.ranges for f in files)))
        ] + [
            threading.Thread(
                target=_worker,
                args=(tier, plan, report, context, True),
                name=f"ckptkeeper-get-small-{i}",
                daemon=True,
            )
            for i in range(min(SMALL_WORKERS, max(0, small - WORKERS)))
        ]
        started: list[threading.Thread] = []
        try:
            # Every worker waits at the gate until all are started: a thread's start() waits for
            # it to take the GIL once, and workers already fetching would make each of them wait
            # for its turn (about 5 ms each, 150+ ms for the 32 threads of many small files).
            try:
                for t in threads:
                    t.start()
                    started.append(t)
            finally:
                plan.gate.set()
            for t in started:
                t.join()
        except BaseException as exc:  # Ctrl-C, or no more threads: stop the workers, then the staging goes
            plan.fail(exc)
            for t in started:
                t.join()
            raise
        if plan.failed:
            raise plan.failed[0]
        for spare in plan.spare:
            _give_back(spare)
    finally:
        for f in files:
            if f.writer is not None and f.writer.fd is not None:
                f.writer.close()


def _locked(progress: Progress, lock: threading.Condition) -> Progress:
    def report(n: int) -> None:
        with lock:
            progress(n)

    return report


def _urls(tier: S3TierStorage, keys: list[str]) -> tuple[GetSigner | None, list[str]]:
    """Each key's URL, and the signer of each request to it (:mod:`.s3_sign`): built from the options
    alone when they say everything (endpoint, credentials, region), else from what botocore's
    presigned URL of the first key shows; failing both, URLs presigned by botocore (no signer)."""
    if not keys:
        return None, []
    plain = plain_signer(_options(tier), os.environ, tier.bucket)
    if plain is not None:
        return plain, [plain.url(k) for k in keys]
    client, params = _signer(tier)
    probe = _presign(tier, keys[:1])[0]
    signer = None
    if not params:  # a RequestPayer parameter goes in the query, which GetSigner does not sign
        with contextlib.suppress(Exception):  # private attribute of botocore: else presign each
            signer = GetSigner.from_probe(probe, keys[0], client._request_signer._credentials)
    if signer is None:
        return None, [probe, *_presign(tier, keys[1:])]
    return signer, [signer.url(k) for k in keys]


def _presign(tier: S3TierStorage, keys: list[str]) -> list[str]:
    """A GET URL per key, signed (SigV4) by a botocore client built from the tier's options."""
    client, params = _signer(tier)
    try:
        return [
            client.generate_presigned_url(
                "get_object", Params={"Bucket": tier.bucket, "Key": k, **params}, ExpiresIn=URL_SECONDS
            )
            for k in keys
        ]
    except Exception as exc:
        raise StorageError(tier._redact(f"tier {tier.name!r}: cannot sign GET requests: {exc}")) from exc


_SIGNERS: dict[tuple[int, str, str, str], tuple[Any, dict[str, str]]] = {}
_SIGNERS_LOCK = threading.Lock()


def _signer(tier: S3TierStorage) -> tuple[Any, dict[str, str]]:
    """The process's signing client for ``tier`` (botocore alone: it resolves credentials, region,
    endpoint and addressing as the tier's s3fs client does, at half the start-up of s3fs) and the
    extra GET parameters. Kept per tier, options and ``AWS_*`` environment, as s3fs clients are."""
    options = dict(_options(tier))
    environment = json.dumps(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    cache_key = (os.getpid(), tier.name, json.dumps(options, sort_keys=True, default=repr), environment)
    with _SIGNERS_LOCK:
        found = _SIGNERS.get(cache_key)
        if found is not None:
            return found
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        client_kwargs = dict(options.get("client_kwargs") or {})
        client_kwargs.pop("verify", None)  # no request is sent by this client
        init = {
            "aws_access_key_id": options.get("key"),
            "aws_secret_access_key": options.get("secret"),
            "aws_session_token": options.get("token"),
            "endpoint_url": options.get("endpoint_url"),
        }
        init = {k: v for k, v in init.items() if v is not None}
        if "use_ssl" in options:
            init["use_ssl"] = options["use_ssl"]
        config = {"signature_version": "s3v4", **dict(options.get("config_kwargs") or {})}
        if options.get("anon"):
            config["signature_version"] = UNSIGNED
        session = botocore.session.Session(profile=options.get("profile"))
        client = session.create_client("s3", config=Config(**config), **{**init, **client_kwargs})
        params = {"RequestPayer": "requester"} if options.get("requester_pays") else {}
        with contextlib.suppress(Exception):  # credentials from a profile or instance metadata
            creds = client._request_signer._credentials
            add = getattr(tier, "_add_secrets", None)
            if creds is not None and add is not None:
                add(str(getattr(creds, f"_{n}", None) or "") for n in ("access_key", "secret_key", "token"))
        _SIGNERS[cache_key] = (client, params)
        return client, params


def _tls_context(tier: S3TierStorage) -> ssl.SSLContext:
    """Certificates checked as the S3 client checks them (``verify``, ``AWS_CA_BUNDLE``, botocore's bundle)."""
    verify = (_options(tier).get("client_kwargs") or {}).get("verify")
    if verify is False:
        return ssl._create_unverified_context()
    cafile = verify if isinstance(verify, str) else os.environ.get("AWS_CA_BUNDLE")
    if cafile is None:
        with contextlib.suppress(Exception):
            from botocore.httpsession import get_cert_path

            cafile = get_cert_path(True)
    return ssl.create_default_context(cafile=cafile if isinstance(cafile, str) else None)


def _worker(
    tier: S3TierStorage,
    plan: _Plan,
    progress: Progress | None,
    context: ssl.SSLContext | None,
    small: bool = False,
) -> None:
    """Fetch ranges until none is left (``small``: whole small objects, smallest first)."""
    plan.gate.wait()
    buf = _buffer(SMALL_OBJECT if small else RANGE_SIZE)
    conn: http.client.HTTPConnection | None = None
    try:
        while (job := _next(plan, small)) is not None:
            f, r = job
            conn = _get_range(tier, plan, f, r, memoryview(buf), conn, context)
            start, end = f.span(r)
            if progress is not None and end > start:
                progress(end - start)
            buf, whole = plan.done(f, r, buf)
            if whole:
                _check(f)
    except BaseException as exc:  # the first one is raised by the caller
        plan.fail(exc)
    finally:
        if conn is not None:
            with plan.cond:
                plan.conns.discard(conn)
            conn.close()
        _give_back(buf)


class _Buffers:
    """Range buffers a long-lived process (the daemon, :func:`keep_buffers`) keeps between
    restores. A fresh buffer costs its pages' first touch: ~20 ms of CPU per 64 MiB here, ~30 ms
    of a served 512 MiB restore (bench/restore_s3.py), paid again by every restore; kept, the next
    restore writes into pages already mapped. What a buffer still holds of an earlier restore is
    never read: each range is checked whole (length, then the file's hash) before it counts.
    Bounded by what one restore holds at most, and given back to the OS once idle
    (:func:`release_idle_buffers`)."""

    def __init__(self) -> None:
        self.keeping = False
        self.free: dict[int, list[bytearray]] = {}
        self.last_used = 0.0
        self.lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self.lock:
            free = self.free.get(size)
            if free:
                return free.pop()
        return bytearray(size)

    def give_back(self, buf: bytearray) -> None:
        if not self.keeping:
            return
        cap = SMALL_WORKERS if len(buf) == SMALL_OBJECT else WORKERS + AHEAD
        with self.lock:
            free = self.free.setdefault(len(buf), [])
            if len(free) < cap:
                free.append(buf)
            self.last_used = time.monotonic()


_BUFFERS = _Buffers()
_buffer = _BUFFERS.take
_give_back = _BUFFERS.give_back


def keep_buffers() -> None:
    """This process serves restore after restore (the daemon): keep range buffers between them."""
    _BUFFERS.keeping = True


def release_idle_buffers(idle_seconds: float) -> int:
    """Give back the kept buffers when no restore used them for ``idle_seconds``; the bytes
    released (a daemon idles at its start-up size between restores)."""
    with _BUFFERS.lock:
        if time.monotonic() - _BUFFERS.last_used < idle_seconds:
            return 0
        released = sum(len(b) for free in _BUFFERS.free.values() for b in free)
        _BUFFERS.free.clear()
    return released


def kept_buffer_bytes() -> int:
    """Bytes of range buffers kept for the next restore."""
    with _BUFFERS.lock:
        return sum(len(b) for free in _BUFFERS.free.values() for b in free)


def _small(f: _File) -> bool:
    return f.ranges == 1 and f.entry.size <= SMALL_OBJECT


def _next(plan: _Plan, small: bool) -> tuple[_File, int] | None:
    if not small:
        return plan.take()
    f = plan.take_small()
    return None if f is None else (f, 0)


def _check(f: _File) -> None:
    """The whole file is written and hashed: the hash against the manifest, then finished (size)."""
    digest = f.hasher.hexdigest()
    if digest != f.entry.hash:
        raise VerificationError(
            f"{f.where}: hash {digest} != {f.entry.hash} in manifest (changed since cataloged)"
        )
    assert f.writer is not None
    f.writer.written = f.entry.size
    f.writer.finish()


class _Broken(Exception):
    """A transient failure of one request: the range is resumed from where it got to."""


def _get_range(
    tier: S3TierStorage,
    plan: _Plan,
    f: _File,
    r: int,
    view: memoryview,
    conn: http.client.HTTPConnection | None,
    context: ssl.SSLContext | None,
) -> http.client.HTTPConnection | None:
    """GET range ``r`` of ``f`` into ``view`` and write it at its offset, resuming a broken stream.
    Returns the connection to reuse (None once one was dropped)."""
    start, end = f.span(r)
    at = [start]  # the next byte to receive (a broken stream is resumed there)
    attempt = 0
    what = f"GET {f.key}"
    assert f.writer is not None
    fd = f.writer.fd
    assert fd is not None
    while True:
        if plan.failed:
            raise StorageError(f"{f.where}: stopped, another file of the checkpoint failed")
        try:
            timeout = deadline.remaining(what, tier.name)
        except TimeoutError as exc:
            raise TierUnavailable(tier._redact(str(exc))) from None
        try:
            if conn is None:
                conn = _connect(f.url, timeout, context)
                with plan.cond:
                    plan.conns.add(conn)
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            _request(tier, conn, plan.signer, f, at, end, view[: end - start], start)
            _pwrite_all(fd, view[: end - start], start)
            return conn
        except (StorageError, KeyboardInterrupt):
            raise
        except BaseException as exc:
            if conn is not None:
                with plan.cond:
                    plan.conns.discard(conn)
                conn.close()
                conn = None
            if plan.failed:
                raise StorageError(f"{f.where}: stopped, another file of the checkpoint failed") from None
            if isinstance(exc, TimeoutError | socket.timeout):
                raise TierUnavailable(tier._redact(deadline.hung(tier.name, what, timeout))) from None
            if not isinstance(exc, _Broken | OSError | http.client.HTTPException):
                raise
            attempt += 1
            if attempt > RETRIES:
                raise StorageError(
                    f"{f.where}: read broke at byte {at[0]}: {tier._redact(_describe(exc))}"
                ) from exc
            log.warning(
                "%s: read of s3://%s/%s broke at byte %d (%s); resuming, attempt %d of %d",
                tier.name,
                tier.bucket,
                f.key,
                at[0],
                tier._redact(_describe(exc)),
                attempt,
                RETRIES,
            )
            with plan.cond:  # a pause that a failure elsewhere (or Ctrl-C) ends at once
                plan.cond.wait_for(lambda: bool(plan.failed), timeout=min(0.2 * 2**attempt, 5.0))
            if isinstance(exc, _Broken) and exc.args and exc.args[0] == "resign" and plan.signer is None:
                f.url = _presign(tier, [f.key])[0]  # expired (a signer signs every request afresh)


def _connect(url: str, timeout: float, context: ssl.SSLContext | None) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme == "https":
        return http.client.HTTPSConnection(host, parts.port, timeout=timeout, context=context)
    return http.client.HTTPConnection(host, parts.port, timeout=timeout)


def _request(
    tier: S3TierStorage,
    conn: http.client.HTTPConnection,
    signer: GetSigner | None,
    f: _File,
    at: list[int],
    end: int,
    view: memoryview,
    start: int,
) -> None:
    """One GET of ``[at[0], end)`` into ``view`` (which holds ``[start, end)``), ``at[0]`` moved
    past every byte received (also when the stream breaks)."""
    pos = at[0]
    whole = f.ranges == 1 and pos == 0
    parts = urlsplit(f.url)
    path = f"{parts.path}?{parts.query}" if parts.query else parts.path
    headers = signer.headers(path) if signer is not None else {}
    if not whole:
        headers["Range"] = f"bytes={pos}-{end - 1}"
    if f.etag:
        headers["If-Match"] = f.etag  # every range, and a resumed one, of the same object
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    if resp.status not in (200, 206):
        body = resp.read(4096)
        region = resp.getheader("x-amz-bucket-region")
        _fail_status(tier, f, resp.status, body, presigned=signer is None, region=region)
    etag = resp.getheader("ETag")
    if f.etag is None:
        f.etag = etag
    elif etag and etag != f.etag:
        raise VerificationError(f"{f.where}: the object changed during the restore (ETag)")
    if not whole:
        total = (resp.getheader("Content-Range") or "").rpartition("/")[2]
        if total != str(f.entry.size):
            raise VerificationError(
                f"{f.where}: object holds {total or '?'} bytes, manifest says {f.entry.size} "
                "(changed since cataloged)"
            )
    length = resp.getheader("Content-Length")
    if length is not None and int(length) != end - pos:
        raise VerificationError(
            f"{f.where}: object holds {length} bytes, manifest says {f.entry.size} (changed since cataloged)"
        )
    while at[0] < end:
        n = resp.readinto(view[at[0] - start :])
        if not n:
            raise _Broken(f"connection closed at byte {at[0]} of {end}")
        at[0] += n


def _fail_status(
    tier: S3TierStorage, f: _File, status: int, body: bytes, *, presigned: bool, region: str | None
) -> None:
    """The error a store's answer means: transient ones (5xx, 429; a presigned URL refused, which
    may have expired) are retried, the others end the restore naming the object and the code."""
    code = error_code(body, status)
    if status == 412:
        raise VerificationError(f"{f.where}: the object changed during the restore (ETag)")
    if status in (301, 307) and region:
        raise StorageError(tier._redact(f"tier {tier.name!r}: GET {f.key}: {code}{region_hint(region)}"))
    if status in (404, 416):
        raise StorageError(tier._redact(f"tier {tier.name!r}: GET {f.key}: {code} (HTTP {status})"))
    if status >= 500 or status == 429:
        raise _Broken(f"{code} (HTTP {status})")
    if status == 403 and presigned:
        raise _Broken("resign")
    raise StorageError(tier._redact(f"tier {tier.name!r}: GET {f.key}: {code} (HTTP {status})"))


def error_code(body: bytes, status: int) -> str:
    """The S3 error code in an error answer's XML body (``NoSuchKey``), else ``HTTP <status>``."""
    return body.decode(errors="replace").partition("<Code>")[2].partition("</Code>")[0] or f"HTTP {status}"


def region_hint(region: str) -> str:
    """What to do about a redirect to the bucket's own region (``x-amz-bucket-region``)."""
    return f": the bucket is in region {region}; set client_kwargs.region_name to it in the tier's storage_options"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n
