"""The index's connection: opening, migrating, identity checks and transactions.

Every query module of the index (``db``, ``artifacts``, ``journal``) builds on :class:`Connection`,
so there is one place that knows how a statement is run on the shared connection: under the lock,
fetched whole, and never written into a file that was deleted or replaced while open.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from ckptkeeper.index.schema import BUSY_TIMEOUT_MS, MIGRATIONS, SCHEMA_VERSION, IndexCorrupt


class IndexReplaced(Exception):
    """The index file at the configured path is gone or is another file than the one this
    connection opened (``rm index.db*``, a restore from backup): its writes would land in a
    deleted file that nobody reads, and its reads miss what others wrote (pins). The caller
    reopens the path and rebuilds with deletes held (``actions.index.reopen_after_loss``)."""


_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


class _Result:
    """A finished statement: its rows, fetched while the index lock was held."""

    __slots__ = ("_rows", "lastrowid", "rowcount")

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        try:
            self._rows: list[Any] = cursor.fetchall()
            self.rowcount = cursor.rowcount
            self.lastrowid = cursor.lastrowid
        finally:
            cursor.close()

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Any]:
        return self._rows

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)


class Connection:
    """A connection to the catalog. Thread-safe by serialising access (one writer anyway).

    The base of :class:`~ckptkeeper.index.db.Index`; the query mixins inherit it for ``_exec`` and
    the transactions, and add no state of their own.
    """

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self.reconcile_lock = threading.RLock()
        """Serialises catalog reconciles that share this connection (watcher vs scheduled jobs)."""
        self._identity: tuple[int, int] | None = None
        self._wal = False
        """In WAL mode: a commit may skip its flush (``transaction(durable=False)``) and
        :meth:`sync_wal` flush it later, exactly what ``synchronous = FULL`` does at the commit."""
        self._deferring = threading.local()
        """Per thread: inside :meth:`deferred_flush` (its depth)."""
        if not readonly:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        uri = f"file:{self.path}?mode=ro" if readonly else f"file:{self.path}"
        self._db = sqlite3.connect(
            uri, uri=True, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000
        )
        self._db.row_factory = sqlite3.Row
        try:
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._db.execute("PRAGMA foreign_keys = ON")
            if not readonly:
                mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()
                self._wal = bool(mode) and str(mode[0]).lower() == "wal"
                self._db.execute("PRAGMA synchronous = FULL")
                self._migrate()
        except UnicodeDecodeError as exc:
            # A corrupt file can hand sqlite3 a schema or pragma text that is not UTF-8: that is
            # corruption (rebuilt from the tiers), not a crash.
            self._db.close()
            raise IndexCorrupt(f"index {self.path}: unreadable text in the database: {exc}") from exc
        self._identity = self._file_identity()
        """(st_dev, st_ino) of the file this connection opened; None: not a file (``:memory:``),
        or not known yet (migrations run before it is taken)."""

    # -- identity --------------------------------------------------------------------------

    def _file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def identity_problem(self) -> str | None:
        """Why the file at ``path`` is not the one this connection uses (None: it is).

        One ``stat``: cheap enough before every pass and every write.
        """
        if self._identity is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return f"index {self.path} was deleted while open"
        except OSError as exc:
            return f"index {self.path} cannot be checked: {exc.strerror or exc}"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"index {self.path} was replaced by another file while open"
        return None

    def check_identity(self) -> None:
        """Raise :class:`IndexReplaced` unless the path still names this connection's file."""
        problem = self.identity_problem()
        if problem is not None:
            raise IndexReplaced(problem)

    def reopen(self) -> None:
        """Close this connection and open the file now at ``path`` (created if missing), in place:
        the watcher, the catalog and the jobs keep their reference to this object."""
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            fresh = Connection(self.path)
            self._db = fresh._db
            self._identity = fresh._identity

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def quick_check(self) -> None:
        """Raise IndexCorrupt unless SQLite's quick_check passes."""
        try:
            rows = self._db.execute("PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError as exc:
            raise IndexCorrupt(str(exc)) from exc
        result = [r[0] for r in rows]
        if result != ["ok"]:
            raise IndexCorrupt("; ".join(result[:5]))

    def _migrate(self) -> None:
        if self._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
            # Up to date (every open but the first): no write transaction, so `ls`, `status` and
            # `pin` never queue behind the daemon's writer (busy_timeout) just to open the index.
            return
        with self.transaction():
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"index {self.path} has schema version {version}, newer than this ckptkeeper ({SCHEMA_VERSION})"
                )
            for i in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[i].split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {i + 1}")

    @contextmanager
    def in_memory_copy(self) -> Iterator[Self]:
        """A private in-memory clone: dry runs reconcile and plan in it, leaving this index untouched."""
        mem = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        with self._lock:
            self._db.backup(mem)
        clone = type(self).__new__(type(self))
        clone.path = self.path
        clone._lock = threading.RLock()
        clone.reconcile_lock = threading.RLock()
        clone._db = mem
        clone._identity = None
        clone._wal = False
        clone._deferring = threading.local()
        mem.row_factory = sqlite3.Row
        mem.execute("PRAGMA foreign_keys = ON")
        try:
            yield clone
        finally:
            mem.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def transaction(self, *, durable: bool = True) -> Iterator[None]:
        """One atomic unit; nested use joins the outer transaction.

        ``durable=False`` (WAL mode only; otherwise ignored): the COMMIT skips its flush. The
        transaction is committed at once for every reader and survives ``kill -9`` of this process
        (the WAL is in the OS's page cache); a power cut may lose it until the next durable commit
        or :meth:`sync_wal` — both flush every earlier commit too (the WAL is sequential), so later
        writes never survive without it. For steps whose flush can run beside another (the journal
        intent of a rename, overlapped with the manifest's) or that recovery re-derives from the
        tiers (the result of a rename)."""
        with self._lock:
            if self._db.in_transaction:
                yield
                return
            self.check_identity()
            lazy = (not durable or self._deferred()) and self._wal
            if lazy:
                self._db.execute("PRAGMA synchronous = NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                try:
                    self._db.execute("COMMIT")
                except BaseException:
                    # A COMMIT that failed leaves the transaction open on this shared connection: every
                    # later write of every thread would silently join it and never be committed.
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
            finally:
                if lazy:
                    self._db.execute("PRAGMA synchronous = FULL")

    @contextmanager
    def deferred_flush(self) -> Iterator[None]:
        """Within this block every commit of this thread skips its flush, as
        ``transaction(durable=False)`` does (autocommitted writes included); other threads' commits
        are untouched. For writes that recovery re-derives from the tiers (a catalog reconcile): a
        power cut may lose them, ``kill -9`` does not, and the next durable commit (an executor's
        journal entry, before anything irreversible) or the close of the index flushes them too."""
        depth = getattr(self._deferring, "depth", 0)
        self._deferring.depth = depth + 1
        try:
            yield
        finally:
            self._deferring.depth = depth

    def _deferred(self) -> bool:
        return getattr(self._deferring, "depth", 0) > 0

    def sync_wal(self) -> None:
        """Make every commit so far durable: fsync the write-ahead log, the very flush
        ``synchronous = FULL`` does after each commit (the WAL header and checkpoints are synced by
        SQLite itself in both modes). Safe from another thread than the one committing: it only
        flushes a file. Without WAL mode every commit was already durable."""
        if not self._wal:
            return
        try:
            fd = os.open(f"{self.path}-wal", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return  # checkpointed and removed: the database file itself was synced by SQLite
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        """A nested atomic unit inside a transaction: on an exception only its own writes are undone
        (one bad document must not leave half its rows behind, nor roll back everyone else's)."""
        with self._lock:
            if not self._db.in_transaction:
                with self.transaction():
                    yield
                return
            self._db.execute("SAVEPOINT one_document")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK TO one_document")
                self._db.execute("RELEASE one_document")
                raise
            self._db.execute("RELEASE one_document")

    def _exec(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> _Result:
        """Run one statement and fetch all it returns while holding the lock.

        The daemon's threads share this connection: a cursor still being read outside the lock is
        a statement in progress, and another thread's COMMIT then fails ("cannot commit transaction
        - SQL statements in progress").
        """
        with self._lock:
            if not self._db.in_transaction and sql.lstrip()[:7].upper().startswith(_WRITES):
                if self._deferred():  # its own commit, without the flush (deferred_flush)
                    with self.transaction(durable=False):
                        return _Result(self._db.execute(sql, params))
                self.check_identity()  # a write into a deleted or replaced file is lost
            return _Result(self._db.execute(sql, params))
