"""Content objects of a dedup tier that compresses (docs/dedup.md, docs/compression.md).

A content object is ``<hash>`` (raw, as before) or ``<hash>.z``: the same bytes in the framed
format of :mod:`~ckptkeeper.storage.codec`, framed on the compression threads of
:class:`~ckptkeeper.storage.compressed.EncodingSink` into an unlinked spool file, then stored
whole through the writer a raw object uses (local: staging name + fsync + rename; S3: one PUT or a
completed multipart upload) and checked before anything references it. The raw bytes are checked
against the object's hash as they are framed; the stored bytes against the spool's own hash as
they are written. A manifest records per file (per piece of a split file) which form it
references and its stored size (:attr:`~ckptkeeper.core.model.FileEntry.forms`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ckptkeeper.core.model import FileEntry
from ckptkeeper.storage import codec, compressed
from ckptkeeper.storage.base import _FileWriter, _Reader

ENCODED_SUFFIX = ".z"
"""Name suffix of a content object stored in the codec's framed format."""


@dataclass(frozen=True)
class Ref:
    """One content object a file references: its raw size and hash, and how it is stored."""

    size: int
    digest: str
    encoding: str = ""
    stored: int = -1

    @property
    def encoded(self) -> bool:
        return bool(self.encoding)

    @property
    def stored_size(self) -> int:
        return self.stored if self.encoding else self.size

    @property
    def name(self) -> str:
        """The object's name in the store: ``<hash>`` or ``<hash>.z``."""
        return self.digest + (ENCODED_SUFFIX if self.encoding else "")


def refs(entry: FileEntry) -> list[Ref]:
    """The content objects holding a file (its pieces, or the file whole), in file order."""
    if entry.parts:
        forms = entry.forms or tuple(("", size) for size, _ in entry.parts)
        return [
            Ref(size, digest, enc, stored if enc else -1)
            for (size, digest), (enc, stored) in zip(entry.parts, forms, strict=True)
        ]
    if entry.encoding and entry.stored is not None:
        return [Ref(entry.size, entry.hash, entry.encoding, entry.stored)]
    return [Ref(entry.size, entry.hash)]


REUSED_ENCODING = "zipnn"
"""The ``encoding`` recorded for a reference to an encoded object a copy found already stored:
its frames may be of any kind (every reader decodes them all)."""


def with_refs(entry: FileEntry, held: list[Ref]) -> FileEntry:
    """``entry`` (in the content store) recording the objects ``held`` that hold it."""
    if entry.parts:
        forms = tuple((r.encoding, r.stored) if r.encoding else ("", r.size) for r in held)
        return dataclasses.replace(
            entry, forms=forms if any(r.encoding for r in held) else (), encoding="", stored=None
        )
    ref = held[0]
    if ref.encoding:
        return dataclasses.replace(entry, encoding=ref.encoding, stored=ref.stored)
    return dataclasses.replace(entry, encoding="", stored=None)


Opener = Callable[[FileEntry], tuple[_FileWriter, Callable[[], None], Callable[[], None]]]
"""Opens the ``.z`` object for its stored bytes (``FileEntry`` of their size and hash): its
writer, what commits it, what aborts it."""


class _Discard:
    """The writer of a spool not worth storing: compressing saved too little."""

    def write(self, data: bytes | memoryview, /) -> None:
        pass

    def finish(self) -> None:
        pass


class _Target:
    """The inner sink :class:`~.compressed.EncodingSink` hands the framed object to."""

    def __init__(self, opener: Opener, raw_size: int) -> None:
        self.opener = opener
        self.raw_size = raw_size
        self.stored: FileEntry | None = None
        self.commit_it: Callable[[], None] | None = None
        self.abort_it: Callable[[], None] | None = None

    def open_file(self, entry: FileEntry, source: _Reader | None = None) -> _FileWriter:
        if entry.size > codec.WORTH * self.raw_size:
            return _Discard()
        writer, self.commit_it, self.abort_it = self.opener(entry)
        self.stored = entry
        return writer

    def commit(self, manifest: object) -> None:
        if self.commit_it is not None:
            self.commit_it()

    def abort(self) -> None:
        if self.abort_it is not None:
            self.abort_it()


def write_encoded(
    opener: Opener,
    pump: Callable[[_FileWriter], None],
    item: FileEntry,
    mode: str,
    where: str,
    spool_dir: str | None,
) -> Ref | None:
    """Frame the raw bytes ``pump`` writes (``item``'s size and hash, checked by it) and store them
    through ``opener``; None (nothing written) when that would save under
    :data:`~.codec.WORTH` of them."""
    target = _Target(opener, item.size)
    sink = compressed.EncodingSink(target, mode, where, spool_dir)
    try:
        pump(sink.open_file(item, None))
        sink.pool.shutdown(wait=True)
        target.commit(None)
    except BaseException:
        sink.abort()
        raise
    if target.stored is None:
        return None
    return Ref(item.size, item.hash, codec.ENCODING_OF_MODE[mode], target.stored.size)
