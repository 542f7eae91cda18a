"""Tensor-level dedup (``dedup_tensors = true``, docs/dedup.md): a safetensors file cut into
pieces at its tensors' boundaries — the 8-byte length and JSON header one piece, each tensor's
bytes (small neighbours merged up to :data:`MIN_PIECE`) one more — each stored as a content object
named by its own hash, and read back as their concatenation.

The cut comes from the file's own header, read from the source and checked (offsets inside the
file, in order, not overlapping); a file that does not parse is stored whole. The pieces' hashes
are computed in one pass over the source that also hashes the whole file against the manifest
(a file changed since it was cataloged is refused before anything is written); the pieces not
yet stored are then read again, each checked against its hash as it is written.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator

from ckptkeeper.core.model import FileEntry
from ckptkeeper.storage.base import VerificationError, _Reader
from ckptkeeper.util import hashing

MIN_SPLIT = 1 << 20
"""Files smaller than this are stored whole."""
MIN_PIECE = 64 * 1024
"""Consecutive tensors smaller than this are merged into one piece (fewer objects)."""
_MAX_HEADER = 100 * 2**20


def plan(head: bytes, header: bytes, size: int) -> list[tuple[int, int]] | None:
    """``(offset, length)`` of each piece of a safetensors file of ``size`` bytes, whose first
    8 bytes are ``head`` and whose JSON header is ``header``; None if it does not parse as one."""
    start = 8 + len(header)
    try:
        doc = json.loads(header)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    spans: list[tuple[int, int]] = []
    for key, value in doc.items():
        if key == "__metadata__":
            continue
        offsets = value.get("data_offsets") if isinstance(value, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            return None
        begin, end = offsets
        if not 0 <= begin <= end or start + end > size:
            return None
        spans.append((start + begin, start + end))
    spans.sort()
    cuts = [0, start]
    for begin, end in spans:
        if begin < cuts[-1]:
            return None  # overlapping tensors: not a layout to cut
        if begin > cuts[-1]:
            cuts.append(begin)  # a gap is a piece of its own
        if end > cuts[-1]:
            cuts.append(end)
    if cuts[-1] < size:
        cuts.append(size)
    pieces = [(a, b - a) for a, b in itertools.pairwise(cuts) if b > a]
    merged: list[tuple[int, int]] = []
    for offset, length in pieces:
        if merged and merged[-1][1] < MIN_PIECE and length < MIN_PIECE and offset > start:
            prev = merged.pop()
            merged.append((prev[0], prev[1] + length))
        else:
            merged.append((offset, length))
    return merged


def splittable(entry: FileEntry) -> bool:
    return entry.path.rsplit("/", 1)[-1].endswith(".safetensors") and entry.size >= MIN_SPLIT


def hash_pieces(reader: _Reader, entry: FileEntry, where: str) -> list[tuple[int, int, str]] | None:
    """Read the whole source once: ``(offset, size, hash)`` of each piece, or None if the file is
    no safetensors file (then it is stored whole). The file's size and hash must be the
    manifest's (:class:`VerificationError` otherwise)."""
    whole = hashing.new_hasher()
    head = _read_exactly(reader, 8)
    whole.update(head)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    header = b""
    if 0 <= length <= min(_MAX_HEADER, entry.size - 8):
        header = _read_exactly(reader, length)
        whole.update(header)
    pieces = plan(head, header, entry.size) if len(header) == length else None
    got = len(head) + len(header)
    out: list[tuple[int, int, str]] = []
    if pieces is not None:
        first = hashing.new_hasher()
        first.update(head + header)
        out.append((0, pieces[0][1], ""))
        current, left, index = first, pieces[0][1] - got, 0
        while True:
            while left == 0 and index + 1 < len(pieces):
                out[index] = (out[index][0], out[index][1], current.hexdigest())
                index += 1
                out.append((pieces[index][0], pieces[index][1], ""))
                current, left = hashing.new_hasher(), pieces[index][1]
            chunk = reader.read(min(hashing.CHUNK_SIZE, left) if left else hashing.CHUNK_SIZE)
            if not chunk:
                break
            whole.update(chunk)
            got += len(chunk)
            if left < len(chunk):
                raise VerificationError(f"{where}: more than the {entry.size} bytes of its manifest")
            current.update(chunk)
            left -= len(chunk)
        out[index] = (out[index][0], out[index][1], current.hexdigest())
    else:
        while chunk := reader.read(hashing.CHUNK_SIZE):
            whole.update(chunk)
            got += len(chunk)
    if got != entry.size:
        raise VerificationError(f"{where}: {got} bytes, manifest says {entry.size}")
    if whole.hexdigest() != entry.hash:
        raise VerificationError(f"{where}: hash {whole.hexdigest()} != {entry.hash} in manifest")
    return out if pieces is not None and len(out) > 1 else None


def _read_exactly(reader: _Reader, n: int) -> bytes:
    parts = []
    while n > 0:
        chunk = reader.read(n)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


class Window:
    """``size`` bytes of a seekable reader from ``offset`` (a piece of the source file)."""

    def __init__(self, reader: _Reader, offset: int, size: int) -> None:
        seek = getattr(reader, "seek", None)
        if seek is None:
            raise VerificationError("the source of a tensor piece cannot seek")
        seek(offset)
        self.reader = reader
        self.left = size

    def read(self, n: int, /) -> bytes:
        if self.left <= 0:
            return b""
        chunk = self.reader.read(min(n, self.left))
        self.left -= len(chunk)
        return chunk

    def close(self) -> None:
        self.reader.close()


class Concat:
    """The pieces' readers, opened one after another: a split file read back whole."""

    def __init__(self, opens: list[Callable[[], _Reader]]) -> None:
        self.opens: Iterator[Callable[[], _Reader]] = iter(opens)
        self.current: _Reader | None = None

    def read(self, n: int, /) -> bytes:
        while True:
            if self.current is None:
                opener = next(self.opens, None)
                if opener is None:
                    return b""
                self.current = opener()
            chunk = self.current.read(n)
            if chunk:
                return chunk
            self.current.close()
            self.current = None

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
