"""Lossless per-tier compression (docs/compression.md): the stored form of one file, frame by frame.

A compressed file is a stream of frames after an 8-byte magic. Each frame holds at most
:data:`FRAME_BYTES` raw bytes and has a 13-byte header (kind, raw length, stored length, CRC32 of
the payload, little endian), then its payload: the raw bytes themselves (``RAW``), a zstd frame (``ZSTD``) or a ZipNN
buffer (``ZIPNN``: byte grouping for floating-point tensors). Frames never cross a region of the
file's plan (a safetensors tensor run of one dtype, say), so a reader decodes one frame at a time:
memory is bounded by a frame whatever the file's size, and no frame depends on another.

The codecs are the optional ``compress`` extra (``zstandard``, ``zipnn``): imported on first use.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from ckptkeeper.storage.base import VerificationError, _Reader
from ckptkeeper.util import hashing

MAGIC = b"CKPTZ\x00\x01\n"
FRAME_BYTES = 4 * 2**20
"""Raw bytes per frame: large enough for ZipNN's byte groups and zstd's window, small enough that a
restore holds a few frames only."""
_HEADER = struct.Struct("<BIII")
"""Frame header: kind, raw length, stored length, CRC32 of the payload (checked before any codec
sees the payload: damaged bytes are reported, never handed to a decoder's C code)."""
RAW, ZSTD, ZIPNN = 0, 1, 2
_ZIPNN_DTYPES = {1: "float32", 2: "bfloat16", 3: "float16"}
"""ZipNN frame's dtype byte (first payload byte) → ZipNN's ``bytearray_dtype``."""
_DTYPE_CODES = {v: k for k, v in _ZIPNN_DTYPES.items()}
ZSTD_LEVEL = 3
WORTH = 0.97
"""A file is stored compressed only when that saves at least 3 % of its bytes."""
_SAMPLE = 128 * 1024
"""Bytes of a frame tried with each codec when the layout does not say what the bytes are."""
_SAMPLE_FROM = 64 * 1024
"""Files from this size on whose layout does not say what the bytes are (torch.save archives, DCP
shards) are tried per frame; smaller ones go to zstd (a LoRA adapter's optimizer state is a few
hundred KiB of floats)."""
_SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_MAX_SAFETENSORS_HEADER = 100 * 2**20

MODES = ("none", "zstd", "auto")
ENCODING_OF_MODE = {"zstd": "zstd", "auto": "zipnn"}
"""The manifest's ``encoding`` of a file compressed under a tier's ``compression`` mode (``zipnn``:
frames may be ZipNN, zstd or raw; ``zstd``: zstd or raw)."""


# -- plans ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Region:
    """Bytes ``[start, end)`` of a file and how to compress them: ``dtype`` for ZipNN, ``"?"`` to
    let a sample of each frame decide, None for zstd alone."""

    start: int
    end: int
    dtype: str | None


def plan(mode: str, size: int, head: bytes) -> list[Region]:
    """How to cut a file of ``size`` bytes starting with ``head`` into regions.

    ``zstd``: one zstd region. ``auto``: a safetensors file is cut at its tensors (floating-point
    runs go to ZipNN with their dtype, the rest to zstd); any other file of 64 KiB or more is tried
    per frame (ZipNN as float32 and bfloat16 against zstd, on a sample): ``torch.save`` archives
    and DCP ``.distcp`` shards hold their tensors as plain little-endian bytes.
    """
    if size == 0:
        return []
    if mode == "auto":
        regions = _safetensors_regions(size, head)
        if regions is not None:
            return regions
        if size >= _SAMPLE_FROM:
            # whole elements for ZipNN: a length that is not a multiple of 4 (a torch.save zip
            # almost always) ends in a tail of 1-3 bytes of its own, or its last frame (the whole
            # file, under a frame) would go to zstd alone
            whole = size - size % 4
            return [Region(0, whole, "?")] + ([Region(whole, size, None)] if whole < size else [])
    return [Region(0, size, None)]


def _safetensors_regions(size: int, head: bytes) -> list[Region] | None:
    """Regions of a safetensors file from its header; None if ``head`` is not one (or is cut)."""
    if len(head) < 9 or head[8:9] != b"{":
        return None
    (n,) = struct.unpack("<Q", head[:8])
    if n > _MAX_SAFETENSORS_HEADER or 8 + n > len(head) or 8 + n > size:
        return None
    try:
        doc = json.loads(head[8 : 8 + n])
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    base = 8 + n
    spans: list[tuple[int, int, str | None]] = []
    for key, info in doc.items():
        if key == "__metadata__":
            continue
        try:
            lo, hi = (int(x) for x in info["data_offsets"])
            dtype = _SAFETENSORS_FLOATS.get(str(info["dtype"]))
        except (TypeError, KeyError, ValueError):
            return None
        if not 0 <= lo <= hi or base + hi > size:
            return None
        spans.append((base + lo, base + hi, dtype))
    spans.sort()
    regions: list[Region] = []
    pos = 0
    for lo, hi, dtype in spans:
        if lo < pos:
            return None  # overlapping tensors: not a file we understand
        if lo > pos:
            regions.append(Region(pos, lo, None))
        if hi > lo:
            _append(regions, Region(lo, hi, dtype))
        pos = hi
    if pos < size:
        _append(regions, Region(pos, size, None))
    return regions


def _append(regions: list[Region], region: Region) -> None:
    """Add ``region``, merging it into the last one when they are adjacent and alike."""
    if regions and regions[-1].end == region.start and regions[-1].dtype == region.dtype:
        regions[-1] = Region(regions[-1].start, region.end, region.dtype)
    else:
        regions.append(region)


_ZIP_EOCD = struct.Struct("<4s4H2IH")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQ2H2I4Q")
_ZIP_CENTRAL = struct.Struct("<4s6H3I5H2I")
_ZIP_LOCAL = struct.Struct("<4s5H3I2H")
_MAX_ZIP_DIRECTORY = 64 * 2**20


def zip_regions(size: int, read_at: Callable[[int, int], bytes]) -> list[Region] | None:
    """Regions of a zip archive stored without compression (``torch.save``): each member's bytes
    (a tensor's storage, or the pickle) tried per frame on their own, the headers and the central
    directory to zstd; None if the archive does not parse as one, or a member is compressed.

    ``read_at(offset, n)`` reads the file. A member of several tensors' worth of frames is still
    cut every :data:`FRAME_BYTES`; the point is that no frame mixes two tensors: ZipNN codes a
    frame's exponents with one table, and Adam's two moments have different exponents (a LoRA
    adapter's optimizer state, hundreds of small tensors, stores 6 points less this way).
    """
    try:
        members = _zip_members(size, read_at)
    except (struct.error, ValueError):
        return None
    if members is None:
        return None
    regions: list[Region] = []
    pos = 0
    for start, length in sorted(members):
        if start < pos or start + length > size:
            return None
        if start > pos:
            _append(regions, Region(pos, start, None))
        whole = length - length % 4
        if whole >= 4096:
            regions.append(Region(start, start + whole, "?"))
            if whole < length:
                regions.append(Region(start + whole, start + length, None))
        elif length:
            _append(regions, Region(start, start + length, None))
        pos = start + length
    if pos < size:
        _append(regions, Region(pos, size, None))
    return regions


def _zip_members(size: int, read_at: Callable[[int, int], bytes]) -> list[tuple[int, int]] | None:
    """(offset, length) of every member's stored bytes, from the central directory and each
    member's local header; None if a member is compressed or the directory is not there."""
    tail_len = min(size, 22 + 65535)
    tail = read_at(size - tail_len, tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _ZIP_EOCD.size > len(tail):
        return None
    _, _, _, _, count, dir_size, dir_offset, _ = _ZIP_EOCD.unpack_from(tail, at)
    eocd = size - tail_len + at
    if 0xFFFF in (count,) or 0xFFFFFFFF in (dir_size, dir_offset):
        loc = read_at(eocd - _ZIP64_LOCATOR.size, _ZIP64_LOCATOR.size)
        sig, _, z64_offset, _ = _ZIP64_LOCATOR.unpack(loc)
        if sig != b"PK\x06\x07":
            return None
        rec = _ZIP64_EOCD.unpack(read_at(z64_offset, _ZIP64_EOCD.size))
        if rec[0] != b"PK\x06\x06":
            return None
        count, dir_size, dir_offset = rec[7], rec[8], rec[9]
    if dir_size > _MAX_ZIP_DIRECTORY or dir_offset + dir_size > size:
        return None
    directory = read_at(dir_offset, dir_size)
    members = []
    pos = 0
    for _ in range(count):
        fields = _ZIP_CENTRAL.unpack_from(directory, pos)
        if fields[0] != b"PK\x01\x02" or fields[4] != 0:  # not an entry, or compressed
            return None
        comp, offset = fields[8], fields[16]
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        extra = directory[pos + _ZIP_CENTRAL.size + name_len : pos + _ZIP_CENTRAL.size + name_len + extra_len]
        comp, offset = _zip64_sizes(extra, fields[9], comp, offset)
        pos += _ZIP_CENTRAL.size + name_len + extra_len + comment_len
        local = _ZIP_LOCAL.unpack(read_at(offset, _ZIP_LOCAL.size))
        if local[0] != b"PK\x03\x04":
            return None
        members.append((offset + _ZIP_LOCAL.size + local[9] + local[10], comp))
    return members


def _zip64_sizes(extra: bytes, raw: int, comp: int, offset: int) -> tuple[int, int]:
    """The compressed size and local header offset of a central directory entry, from its zip64
    extra field where the 32-bit fields say so (0xFFFFFFFF)."""
    i = 0
    while i + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            values = iter(struct.unpack_from(f"<{n // 8}Q", extra, i + 4))
            if raw == 0xFFFFFFFF:
                next(values)
            if comp == 0xFFFFFFFF:
                comp = next(values)
            if offset == 0xFFFFFFFF:
                offset = next(values)
            break
        i += 4 + n
    return comp, offset


def frames_of(regions: list[Region]) -> Iterator[tuple[int, int, str | None]]:
    """(start, end, dtype) of every frame: a region cut into :data:`FRAME_BYTES` pieces."""
    for r in regions:
        for start in range(r.start, r.end, FRAME_BYTES):
            yield start, min(start + FRAME_BYTES, r.end), r.dtype


# -- codecs --------------------------------------------------------------------------------------

_local = threading.local()


def _zstd_compress(data: bytes | memoryview) -> bytes:
    c = getattr(_local, "zc", None)
    if c is None:
        import zstandard

        c = _local.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    out: bytes = c.compress(data)
    return out


def _zstd_decompress(data: bytes, raw_len: int) -> bytes:
    d = getattr(_local, "zd", None)
    if d is None:
        import zstandard

        d = _local.zd = zstandard.ZstdDecompressor()
    out: bytes = d.decompress(data, max_output_size=raw_len)
    return out


_ZIPNN_CORE_VERSION = "0.5.4"
"""The zipnn release whose C core :func:`_zipnn_core` drives directly (its ``zipnn_core`` module:
the byte grouping and Huffman/zstd coding behind ``zipnn.ZipNN``). The ``zipnn`` package imports
torch (over a CPU-second per process); its C core does not. Another release goes through
``zipnn.ZipNN``, whose output the direct path reproduces byte for byte."""
_ZIPNN_PARAMS = {"float32": (1, 220, 4, 1), "bfloat16": (1, 10, 2, 6), "float16": (0, 10, 2, 4)}
"""dtype → (bit reorder, byte reorder, byte groups, ZipNN dtype code), as ``ZipNN`` sets them for
``input_format="byte"``."""
_ZIPNN_CHUNK_LOG2 = 18
"""ZipNN's compression chunk (256 KiB), its default."""
_zipnn_core_module: list[Any] = []


def _zipnn_core() -> Any:
    """zipnn's C core when the installed zipnn is the release it is known to match, else None."""
    if not _zipnn_core_module:
        core: Any = None
        try:
            from importlib import metadata

            if metadata.version("zipnn") == _ZIPNN_CORE_VERSION:
                import zipnn_core

                if callable(getattr(zipnn_core, "zipnn_core", None)) and callable(
                    getattr(zipnn_core, "combine_dtype", None)
                ):
                    core = zipnn_core
        except Exception:  # no such distribution, another layout: the package's own class
            core = None
        _zipnn_core_module.append(core)
    return _zipnn_core_module[0]


def _zipnn(dtype: str) -> Any:
    cache: dict[str, Any] | None = getattr(_local, "zipnn", None)
    if cache is None:
        cache = _local.zipnn = {}
    z = cache.get(dtype)
    if z is None:
        import zipnn

        z = cache[dtype] = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    return z


def _zipnn_header(dtype: str, raw_len: int) -> bytearray:
    """The 32-byte header ``zipnn.ZipNN`` writes before its C core's output (version 0.5.4,
    method auto, byte input, not streaming, 256 KiB chunks, the dtype's reorders and code, the
    raw length; the core fills in the rest)."""
    bit, byte, _, code = _ZIPNN_PARAMS[dtype]
    h = bytearray(32)
    h[0:2] = b"ZN"
    h[2:5] = bytes(int(x) for x in _ZIPNN_CORE_VERSION.split("."))
    h[5], h[6], h[8] = byte, bit, 1
    h[14], h[15] = _ZIPNN_CHUNK_LOG2, code
    h[16:24] = raw_len.to_bytes(8, "little")
    return h


def _zipnn_compress(data: bytes | memoryview, dtype: str) -> bytes:
    # ZipNN rewrites its input buffer in place, even a bytes object: it gets a copy of its own
    # (a bytearray: bytes(b) of a bytes object is that very object, not a copy).
    own = bytearray(data)
    core = _zipnn_core()
    if core is None:
        packed = bytes(_zipnn(dtype).compress(own))
    else:
        bit, byte, groups, _ = _ZIPNN_PARAMS[dtype]
        header = _zipnn_header(dtype, len(own))
        packed = bytes(core.zipnn_core(header, own, groups, bit, byte, 0, 2**_ZIPNN_CHUNK_LOG2, 0.95, 10, 1))
    return bytes([_DTYPE_CODES[dtype]]) + packed


def _zipnn_fits(data: bytes | memoryview) -> bool:
    """ZipNN is given whole elements only: on a length that is not a multiple of 4 it corrupts the
    heap (zipnn 0.5.4, 100001 bytes as float32), and below 4 KiB it saves nothing."""
    return len(data) >= 4096 and len(data) % 4 == 0


def _zipnn_decompress(data: bytes, raw_len: int) -> bytes | bytearray:
    dtype = _ZIPNN_DTYPES.get(data[0]) if data else None
    if dtype is None:
        raise ValueError("unknown ZipNN dtype code")
    core = _zipnn_core()
    if core is None:
        out: bytes | bytearray = _zipnn(dtype).decompress(bytearray(data[1:]))  # a copy of its own
        return out
    bit, byte, groups, code = _ZIPNN_PARAMS[dtype]
    header = data[1:33]
    if (
        len(header) != 32
        or header[0:2] != b"ZN"
        or (header[5], header[6], header[15]) != (byte, bit, code)
        or header[14] != _ZIPNN_CHUNK_LOG2
        or int.from_bytes(header[16:24], "little") != raw_len
    ):
        raise ValueError("not a ZipNN buffer of this frame")
    # the C core only reads its input (checked: a bytes object comes back unchanged)
    decoded: bytearray = core.combine_dtype(
        memoryview(data)[33:], groups, bit, byte, 2**_ZIPNN_CHUNK_LOG2, raw_len, 1
    )
    return decoded


def encode_frame(data: bytes, dtype: str | None) -> bytes:
    """One frame (header and payload) of ``data``; raw when no codec makes it smaller."""
    best_kind, best = RAW, data
    candidates: list[tuple[int, Callable[[], bytes]]] = []
    if dtype is None or not _zipnn_fits(data):
        candidates.append((ZSTD, lambda: _zstd_compress(data)))
    elif dtype == "?":
        pick = _pick(data[:_SAMPLE])
        if pick is None:
            candidates.append((ZSTD, lambda: _zstd_compress(data)))
        else:
            candidates.append((ZIPNN, lambda: _zipnn_compress(data, pick)))
    else:
        candidates.append((ZIPNN, lambda: _zipnn_compress(data, dtype)))
    for kind, make in candidates:
        payload = make()
        if len(payload) < len(best):
            best_kind, best = kind, payload
    return _HEADER.pack(best_kind, len(data), len(best), hashing.crc32(best)) + best


def _pick(sample: bytes) -> str | None:
    """The ZipNN dtype that packs ``sample`` best, None if zstd does better than both."""
    sizes: dict[str | None, int] = {None: len(_zstd_compress(sample))}
    for dtype in ("float32", "bfloat16"):
        sizes[dtype] = len(_zipnn_compress(sample, dtype))
    return min(sizes, key=lambda k: sizes[k])


def decode_frame(kind: int, payload: bytes, raw_len: int) -> bytes | bytearray:
    if kind == RAW:
        return payload
    if kind == ZSTD:
        return _zstd_decompress(payload, raw_len)
    if kind == ZIPNN:
        return _zipnn_decompress(payload, raw_len)
    raise ValueError(f"unknown frame kind {kind}")


# -- decoding reader -----------------------------------------------------------------------------


class DecodingReader:
    """A reader of a compressed file's raw bytes, decoding one frame at a time from ``stored``.

    Checks what it reads against the manifest's stored size and every frame against its header;
    anything else is a :class:`VerificationError` naming ``where`` (the stored bytes are damaged).
    The raw bytes' hash is the caller's check, as for any file.
    """

    def __init__(self, stored: _Reader, stored_size: int, where: str) -> None:
        self.stored = stored
        self.stored_size = stored_size
        self.where = where
        self.consumed = 0
        self.buf: bytes | bytearray = b""
        self.pos = 0
        self.started = False

    def _exact(self, n: int) -> bytes:
        parts: list[bytes] = []
        want = n
        while want:
            got = self.stored.read(min(want, 2**20))
            if not got:
                break
            parts.append(got)
            want -= len(got)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.consumed += len(data)
        return data

    def _damaged(self, why: str) -> VerificationError:
        return VerificationError(
            f"{self.where}: stored bytes do not decode ({why}); the stored copy is damaged"
        )

    def _next_frame(self) -> bool:
        if not self.started:
            self.started = True
            if self._exact(len(MAGIC)) != MAGIC:
                raise self._damaged("no ckptkeeper compression header")
        if self.consumed == self.stored_size:
            if self._exact(1):
                raise self._damaged(f"more than the {self.stored_size} stored bytes of its manifest")
            return False
        header = self._exact(_HEADER.size)
        if len(header) != _HEADER.size:
            raise self._damaged("cut short")
        kind, raw_len, stored_len, crc = _HEADER.unpack(header)
        if (
            raw_len > FRAME_BYTES
            or stored_len > raw_len + 1024
            or self.consumed + stored_len > self.stored_size
        ):
            raise self._damaged("frame header out of bounds")
        payload = self._exact(stored_len)
        if len(payload) != stored_len:
            raise self._damaged("cut short")
        if hashing.crc32(payload) != crc:
            raise self._damaged("a frame's checksum does not match")
        try:
            data = decode_frame(kind, payload, raw_len)
        except Exception as exc:  # any codec's error: the bytes are not what was stored
            raise self._damaged(f"{type(exc).__name__}: {exc}") from exc
        if len(data) != raw_len:
            raise self._damaged(f"a frame gave {len(data)} bytes, its header says {raw_len}")
        self.buf, self.pos = data, 0
        return True

    def read(self, n: int, /) -> bytes:
        """Up to ``n`` raw bytes: a view into the decoded frame, valid until the next call (what
        the copy loop's writers and hashers expect of a chunk), so no byte is copied again."""
        while self.pos >= len(self.buf):
            if not self._next_frame():
                return b""
        out = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += len(out)
        return cast(bytes, out)

    def close(self) -> None:
        self.stored.close()
