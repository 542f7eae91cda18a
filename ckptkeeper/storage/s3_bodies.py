"""Request bodies of uploads to S3: a part held in a buffer (the bytes the copy read and hashed),
and the pool of part buffers."""

from __future__ import annotations

import base64
import io


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
