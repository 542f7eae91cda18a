"""Request bodies of uploads to S3: a part held in a buffer, a part read from the local file while
it is sent (checked against the hash of the bytes the copy read), and the pool of part buffers."""

from __future__ import annotations

import base64
import io
import os
import stat

from ckptkeeper.storage.base import VerificationError, _Reader
from ckptkeeper.util import hashing


def _crc32_b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class _PartStream(io.BytesIO):
    """A read-only stream over ``buf[:size]`` that never copies the whole part.

    A ``BytesIO`` subclass because aiohttp streams those inline in 256 KiB reads (other file-likes
    cost an executor hop per read; a ``bytes``/``bytearray`` body is copied whole into the socket
    transport's buffer); each ``read`` copies out just that chunk.
    """

    def __init__(self, buf: bytearray, size: int) -> None:
        super().__init__()
        self._view = memoryview(buf)[:size]
        self._pos = 0

    def read(self, size: int | None = -1, /) -> bytes:
        start = self._pos
        end = len(self._view) if size is None or size < 0 else min(len(self._view), start + size)
        self._pos = end
        return self._view[start:end].tobytes()

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getbuffer(self) -> memoryview:
        return self._view[self._pos :]

    def getvalue(self) -> bytes:
        return self._view.tobytes()


class _Extent:
    """What :meth:`_FilePart.getbuffer` hands aiohttp, which only takes its ``len`` in a ``with``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __enter__(self) -> _Extent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _FilePart(io.BytesIO):
    """One part of a local source file, read from the file while it is sent: no part buffer.

    The copy loop already hashed these bytes (content hash, CRC32, and a hash of the part alone);
    the re-read is hashed too and checked before its last byte is handed out, so a file changed in
    between fails the part (``failure``) instead of storing other bytes under the CRC32 we send (a
    store that does not check checksums would keep them). A ``BytesIO`` for the same reason as
    :class:`_PartStream`; every attempt of a request reads from offset 0 again.
    """

    def __init__(self, source: io.FileIO, offset: int, size: int, digest: str, where: str) -> None:
        super().__init__()
        self._source = source
        self._offset = offset
        self._size = size
        self._digest = digest
        self._where = where
        self._pos = 0
        self._hasher = hashing.new_hasher()
        self._hashed = 0
        self.failure: VerificationError | None = None
        """Set when the bytes read were not the bytes hashed (the HTTP stack wraps what we raise)."""

    def _fail(self, what: str) -> VerificationError:
        self.failure = VerificationError(
            f"{self._where}: part at bytes {self._offset}-{self._offset + self._size}: {what}"
        )
        return self.failure

    def read(self, size: int | None = -1, /) -> bytes:
        if self.failure is not None:  # sticky: a retry cannot make the bytes right
            raise self.failure
        start = self._pos
        left = self._size - start
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        if start != self._hashed:
            if start:  # neither aiohttp nor botocore skips into a body
                raise self._fail("read out of order")
            self._hasher, self._hashed = hashing.new_hasher(), 0
        data = os.pread(self._source.fileno(), n, self._offset + start)
        if len(data) != n:
            raise self._fail(f"file ends at byte {self._offset + start + len(data)} after it was hashed")
        self._hasher.update(data)
        self._pos = self._hashed = start + n
        if self._pos == self._size and self._hasher.hexdigest() != self._digest:
            raise self._fail("changed after it was hashed")
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getbuffer(self) -> memoryview:
        return _Extent(self._size)  # type: ignore[return-value]  # aiohttp takes only its len()

    def getvalue(self) -> bytes:
        self.seek(0)
        return self.read()


def _rereadable(source: _Reader | None) -> io.FileIO | None:
    """A private handle on ``source``'s file if it is a regular local file, else None.

    With it, parts are read from the file while they are sent instead of being held in buffers;
    a handle of our own, so that it stays valid until every part in flight is over.
    """
    fileno = getattr(source, "fileno", None)
    if fileno is None:
        return None
    try:
        fd = fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return io.FileIO(os.dup(fd), "rb", closefd=True)
    except (OSError, ValueError):
        return None


class _PartPool:
    """Part buffers reused across the parts and files of one copy: at most ``max_inflight + 1``
    of a size exist, and no part pays page faults on fresh memory."""

    def __init__(self) -> None:
        self.free: dict[int, list[bytearray]] = {}

    def get(self, size: int) -> bytearray:
        free = self.free.get(size)
        return free.pop() if free else bytearray(size)

    def put(self, buf: bytearray) -> None:
        self.free.setdefault(len(buf), []).append(buf)
