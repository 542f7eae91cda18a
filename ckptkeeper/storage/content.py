"""Dedup in a slower tier (``dedup = true``, docs/dedup.md): each file's bytes stored once per
node, in the node's content store, and referenced by every copy that holds them.

Layout, relative to the tier's own area (the root, or ``<node>/`` of a shared bucket)::

    .ckptkeeper/content/<node>/<hash[:2]>/<hash>

named by the raw content hash the manifest already has (xxh3-128); ``<hash>.z`` holds the same
bytes in the framed format of :mod:`~ckptkeeper.storage.codec` (written when the tier compresses).
A copy's manifest marks each such file ``"location": "content"``
(:attr:`ckptkeeper.core.model.FileEntry.location`) and records which form it references and its
stored size (``encoding``/``stored``, per piece in ``parts``); its digest does not change. Either
form of a hash dedups the other: a copy references whichever is there. A local copy keeps an
empty directory at its place (the commit point of a local copy is the rename of its staging
directory); an S3 copy is its manifest alone.

Order (kill -9 at any instant loses nothing): every content object of a copy is written whole
(local: staging name + fsync + rename; S3: one PUT or a completed multipart upload, which a
reader never sees partial) and checked before the manifest that references it is committed; a
delete removes the manifest (and placeholder) only. Only the owner node's prune pass removes
content (:func:`~ckptkeeper.storage.content_gc.collect`), under the executor lock every tier write holds, and only content that
no manifest of the tier (committed or in the trash) references and that is older than the tier's
``dedup_grace`` by the store's clock: an interrupted copy's content is found by the next pass.

A reference is only ever followed into the reading node's own content store, by a hash that is
32 hex digits: a manifest naming another node, or anything else, is refused.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptkeeper.core.model import IN_CONTENT, FileEntry, Manifest
from ckptkeeper.storage.base import (
    FileCopy,
    Progress,
    StorageError,
    VerificationError,
    _describe,
    _FileWriter,
    _Reader,
    _rel_of,
    _Sink,
    _split_rel,
    largest_first,
    log,
)
from ckptkeeper.storage.content_codec import (
    ENCODED_SUFFIX,
    REUSED_ENCODING,
    Ref,
    refs,
    with_refs,
    write_encoded,
)
from ckptkeeper.storage.content_store import (
    _HEX,
    CONTENT_DIR,
    _is_s3,
    _local_size,
    content_rel,
    name_rel,
    node_dir,
    size_of,
    sizes_of,
)
from ckptkeeper.util import hashing

__all__ = [
    "CONTENT_DIR",
    "ENCODED_SUFFIX",
    "_HEX",
    "Ref",
    "_is_s3",
    "content_rel",
    "name_rel",
    "node_dir",
    "refs",
    "size_of",
]

if TYPE_CHECKING:  # the contract, without importing it (tier imports this module)
    from typing import Protocol

    class TierStorage(Protocol):
        name: str
        node: str
        hot: bool
        is_local: bool

        spec: Any

        def read_manifest(self, rel_path: str) -> Manifest | None: ...
        def _open_read(self, rel: str, file_path: str) -> _Reader: ...
        def _open_entry(self, rel: str, entry: FileEntry) -> _Reader: ...
        def _stored_form(self, manifest: Manifest) -> Manifest: ...
        def _how_stored(self, manifest: Manifest) -> tuple[Manifest | None, Manifest]: ...
        def _begin_write(self, rel: str, manifest: Manifest) -> _Sink: ...
        def delete(self, rel_path: str) -> int: ...
        def list_manifests(self) -> list[tuple[str, Manifest | None, str | None]]: ...
        def list_trash(self) -> list[tuple[str, Manifest | None, float, str | None]]: ...


def has_content(manifest: Manifest) -> bool:
    return any(e.location for e in manifest.files)


def plain(manifest: Manifest) -> Manifest:
    """``manifest`` with every file at its path: what any other tier's copy of it records."""
    if not has_content(manifest):
        return manifest
    return dataclasses.replace(
        manifest,
        files=tuple(
            dataclasses.replace(e, location="", encoding="", stored=None, forms=()) if e.location else e
            for e in manifest.files
        ),
    )


def referencing(manifest: Manifest) -> Manifest:
    """``manifest`` with every file in the content store: what a dedup copy commits."""
    return dataclasses.replace(
        manifest, files=tuple(dataclasses.replace(e, location=IN_CONTENT) for e in manifest.files)
    )


def _check_refs(tier: TierStorage, manifest: Manifest) -> None:
    """Refuse a manifest whose references this tier must not follow."""
    if manifest.node != tier.node:
        raise StorageError(
            f"tier {tier.name!r}: {_rel_of(manifest)} references node {manifest.node or '(unnamed)'}'s "
            f"content store, not {tier.node or '(unnamed)'}'s: refused (a node reads only its own)"
        )
    if not all(e.location == IN_CONTENT for e in manifest.files):
        raise StorageError(f"tier {tier.name!r}: {_rel_of(manifest)} mixes content references and files")
    for e in manifest.files:
        for ref in refs(e):
            content_rel(tier, ref.digest)


def layout(tier: TierStorage, manifest: Manifest) -> Manifest | None:
    """Where this tier holds the bytes of ``manifest``: its committed manifest of that version
    if it references the content store (checked), else None (files at their paths).

    The committed manifest decides, not the caller's (the index may hold another tier's): a
    manifest the tier cannot read at that path (a trash entry's) falls back to the caller's,
    which then carries its own references."""
    if tier.hot:
        return None
    try:
        committed = tier.read_manifest(_rel_of(manifest))
    except StorageError:
        committed = None
    return layout_from(tier, manifest, committed)


def layout_from(tier: TierStorage, manifest: Manifest, committed: Manifest | None) -> Manifest | None:
    """:func:`layout` with the tier's committed manifest already read (None: none readable)."""
    found = committed if committed is not None and committed.digest == manifest.digest else manifest
    if not has_content(found):
        return None
    _check_refs(tier, found)
    return dataclasses.replace(found, run=manifest.run)


# -- writing -------------------------------------------------------------------------------------


def _content_sink(tier: TierStorage, rel: str, entry: FileEntry) -> tuple[_FileWriter, Any]:
    """A writer of the content object at ``rel`` and what commits it (None: nothing to commit)."""
    if _is_s3(tier):
        from ckptkeeper.storage.s3_upload import _PartPool, _S3FileWriter

        s3: Any = tier
        writer = _S3FileWriter(s3, s3._key(rel), entry, f"{tier.name}:{rel}", _PartPool())
        return writer, writer
    from ckptkeeper.storage.localfs import _LocalSink

    local: Any = tier
    sink = _LocalSink(local.root, _split_rel(rel), False, with_manifest=False)
    try:
        return sink.open_file(entry), sink
    except BaseException:
        sink.abort()
        raise


def _pump(
    reader: _Reader,
    writer: _FileWriter,
    entry: FileEntry,
    where: str,
    progress: Progress | None,
    stop: threading.Event | None = None,
) -> None:
    """Read → hash → write one file, checked against ``entry`` (size and hash); ``stop`` (another
    file of a concurrent restore failed) ends it early."""
    hasher = hashing.new_hasher()
    size = 0
    while chunk := reader.read(hashing.CHUNK_SIZE):
        if stop is not None and stop.is_set():
            raise StorageError(f"{where}: stopped, another file of the checkpoint failed")
        size += len(chunk)
        if size > entry.size:
            raise VerificationError(f"{where}: more than the {entry.size} bytes of its manifest")
        hasher.update(chunk)
        writer.write(chunk)
        if progress is not None:
            progress(len(chunk))
    if size != entry.size:
        raise VerificationError(f"{where}: {size} bytes, manifest says {entry.size}")
    digest = hasher.hexdigest()
    if digest != entry.hash:
        raise VerificationError(f"{where}: hash {digest} != {entry.hash} in manifest")
    writer.finish()


def open_entry(tier: TierStorage, rel: str, entry: FileEntry) -> _Reader:
    """A reader of one file of a copy, at its path or in the content store."""
    if entry.location == IN_CONTENT and entry.parts:
        from ckptkeeper.storage.content_tensors import Concat

        where = f"{tier.name}:{rel}/{entry.path}" if entry.path else f"{tier.name}:{rel}"
        return Concat([lambda r=r: _open_ref(tier, r, where) for r in refs(entry)])  # type: ignore[misc]
    if entry.location == IN_CONTENT:
        where = f"{tier.name}:{rel}/{entry.path}" if entry.path else f"{tier.name}:{rel}"
        return _open_ref(tier, refs(entry)[0], where)
    return tier._open_entry(rel, entry)  # decoded when that tier stores it compressed


def _open_ref(tier: TierStorage, ref: Ref, where: str = "") -> _Reader:
    """The raw bytes of one content object (decoded from its framed form)."""
    reader = tier._open_read(name_rel(tier, ref.name), "")
    if not ref.encoding:
        return reader
    from ckptkeeper.storage import codec

    return codec.DecodingReader(reader, ref.stored, f"{where or tier.name} (content {ref.name})")


def _source(src: TierStorage, rel: str, src_entry: FileEntry, piece: tuple[int, int, str] | None) -> _Reader:
    reader = open_entry(src, rel, src_entry)
    if piece is not None:
        from ckptkeeper.storage.content_tensors import Window

        reader = Window(reader, piece[0], piece[1])
    return reader


def _write_content(
    tier: TierStorage,
    src: TierStorage,
    rel: str,
    src_entry: FileEntry,
    piece: tuple[int, int, str] | None,
    progress: Progress | None,
    mode: str = "none",
) -> Ref:
    """Write one content object from ``src``'s file (or the ``(offset, size, hash)`` piece of
    it), whole and checked, before any reference; encoded (``<hash>.z``) when ``mode`` compresses
    and that saves enough, else raw. Returns what was written."""
    size, digest = (src_entry.size, src_entry.hash) if piece is None else piece[1:]
    where = f"{src.name}:{rel}/{src_entry.path}" if src_entry.path else f"{src.name}:{rel}"
    item = FileEntry(path="", size=size, hash=digest)
    if mode != "none" and size:
        ref = _write_encoded(tier, _source(src, rel, src_entry, piece), item, mode, where, progress)
        if ref is not None:
            return ref
        progress = None  # compressing saved too little: the raw bytes, read again (counted once)
    _write_object(tier, content_rel(tier, digest), item, _source(src, rel, src_entry, piece), where, progress)
    return Ref(size, digest)


def _write_encoded(
    tier: TierStorage, reader: _Reader, item: FileEntry, mode: str, where: str, progress: Progress | None
) -> Ref | None:
    """:func:`~.content_codec.write_encoded` into ``<hash>.z``, from ``reader``."""
    target = content_rel(tier, item.hash, encoded=True)

    def opener(stored: FileEntry) -> tuple[_FileWriter, Any, Any]:
        if not _is_s3(tier) and _local_size(tier, target) is not None:
            tier.delete(target)  # damaged (a scrub found it): a correct one replaces it
        writer, committer = _content_sink(tier, target, stored)
        return (
            writer,
            lambda: _commit_object(tier, committer, target, stored),
            lambda: _abort_object(tier, committer, target),
        )

    spool = str(getattr(tier, "root", "")) if tier.is_local else ""
    try:
        return write_encoded(
            opener,
            lambda writer: _pump(reader, writer, item, where, progress),
            item,
            mode,
            f"{tier.name}:content {item.hash}",
            spool or None,
        )
    finally:
        reader.close()


def _write_object(
    tier: TierStorage, target: str, item: FileEntry, reader: _Reader, where: str, progress: Progress | None
) -> None:
    """Pump ``reader`` (checked against ``item``) into the content object at ``target``."""
    try:
        if not _is_s3(tier) and _local_size(tier, target) is not None:
            tier.delete(target)  # damaged (another size): this node's own; a correct one replaces it
        writer, committer = _content_sink(tier, target, item)
        try:
            _pump(reader, writer, item, where, progress)
            _commit_object(tier, committer, target, item)
        except BaseException:
            _abort_object(tier, committer, target)
            raise
    finally:
        reader.close()


def _commit_object(tier: TierStorage, committer: Any, target: str, item: FileEntry) -> None:
    if _is_s3(tier):
        _s3_trust(tier, committer, target, item)
    else:
        committer.commit(None)


def _abort_object(tier: TierStorage, committer: Any, target: str) -> None:
    try:
        committer.abort()
    except Exception as exc:  # the staging name stays for list_staging / the next pass
        log.warning("%s: cleaning up content %s: %s", tier.name, target, _describe(exc))


def _s3_trust(tier: Any, writer: Any, rel: str, item: FileEntry) -> None:
    """A store that echoed no checksum: read the object back before anything references it."""
    if writer.trusted:
        return
    from ckptkeeper.storage.s3_transfer import _S3Reader

    reader = _S3Reader(tier, tier._key(rel))
    try:
        size, digest = hashing.hash_stream(reader)  # type: ignore[arg-type]
    finally:
        reader.close()
    if (size, digest) != (item.size, item.hash):
        raise VerificationError(f"{tier.name}:{rel}: read-back does not match the manifest")


@dataclass
class CopyStats:
    tier: str
    path: str
    uploaded_bytes: int = 0
    deduped_bytes: int = 0
    uploaded_files: int = 0
    deduped_files: int = 0
    stored_bytes: int = 0
    """Bytes the objects written hold in the store (less than ``uploaded_bytes`` when encoded)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def copy_deduped(
    tier: TierStorage,
    src: TierStorage,
    manifest: Manifest,
    progress: Progress | None,
    *,
    rehash: bool = False,
) -> CopyStats:
    """:meth:`TierStorage.copy_from` into a dedup tier: each file not yet in this node's content
    store is written there (whole, checked), then the manifest referencing all of them commits.
    Returns what was uploaded and what was referenced instead (the prune pass reports it).

    ``rehash``: the copy replaces one a scrub found damaged, whose bytes a size check cannot
    see: every object already there is hashed, and one that does not match is written again."""
    rel = _rel_of(manifest)
    in_content, stored_form = src._how_stored(manifest)
    source = in_content or stored_form  # a compressed source decodes
    src_entries = {e.path: e for e in source.files}
    pieces = _split(tier, src, rel, manifest, src_entries)
    stored = dataclasses.replace(
        referencing(manifest),
        files=tuple(
            dataclasses.replace(
                e, location=IN_CONTENT, parts=tuple((size, h) for _, size, h in pieces.get(e.path, ()))
            )
            for e in manifest.files
        ),
    )
    _check_refs(tier, stored)
    files: list[FileEntry] = []
    stats = CopyStats(tier=tier.name, path=rel)
    mode = getattr(tier.spec, "compression", "none") or "none"
    found = _present(tier, stored, rehash=rehash)
    for entry in stored.files:
        cut: list[tuple[int, int, str] | None] = list(pieces.get(entry.path, [])) or [None]
        held: list[Ref] = []
        for piece in cut:
            size, digest = (entry.size, entry.hash) if piece is None else piece[1:]
            ref = found.get(digest)
            if ref is not None:
                stats.deduped_bytes += size
                stats.deduped_files += 1
                if progress is not None and size:
                    progress(size)
            else:
                ref = _write_content(tier, src, rel, src_entries[entry.path], piece, progress, mode)
                if progress is not None:
                    progress(0)  # a content object committed, its manifest not yet: a crash point of its own
                found[digest] = ref
                stats.uploaded_bytes += size
                stats.uploaded_files += 1
                stats.stored_bytes += ref.stored_size
            held.append(ref)
        files.append(with_refs(entry, held))
    stored = dataclasses.replace(stored, files=tuple(files))
    # Everything referenced is there, at its size, now: then (and only then) the commit.
    damage = content_damage(tier, stored)
    if damage:
        raise VerificationError(f"copy of {rel} to {tier.name!r}: " + "; ".join(damage[:3]))
    sink = _placeholder_sink(tier, rel, stored)
    try:
        sink.commit(stored)
    except BaseException as exc:
        sink.abort()
        if isinstance(exc, StorageError) or not isinstance(exc, Exception):
            raise
        raise StorageError(f"commit of {rel} in {tier.name!r} failed: {_describe(exc)}") from exc
    return stats


def _present(tier: TierStorage, stored: Manifest, *, rehash: bool) -> dict[str, Ref]:
    """Hash -> the object of that hash already in the store, raw (at its size) or encoded; with
    ``rehash`` only one that reads back to its hash."""
    wanted = {r.digest: r.size for e in stored.files for r in refs(e)}
    sizes = sizes_of(tier, [d + sfx for d in wanted for sfx in ("", ENCODED_SUFFIX)])
    mode = getattr(tier.spec, "compression", "none") or "none"
    out: dict[str, Ref] = {}
    for digest, size in wanted.items():
        options = []
        if sizes.get(digest) == size:
            options.append(Ref(size, digest))
        z = sizes.get(digest + ENCODED_SUFFIX)
        if z is not None and (z > 0 or size == 0):
            options.append(Ref(size, digest, REUSED_ENCODING, z))
        if mode != "none":
            options.reverse()  # a compressing tier prefers the encoded form
        for ref in options:
            if not rehash or _intact(tier, ref):
                out[digest] = ref
                break
    return out


def _split(
    tier: TierStorage, src: TierStorage, rel: str, manifest: Manifest, src_entries: dict[str, FileEntry]
) -> dict[str, list[tuple[int, int, str]]]:
    """Path -> ``(offset, size, hash)`` of each piece, for the files stored tensor by tensor
    (``dedup_tensors``; safetensors files read from a local file)."""
    from ckptkeeper.storage import content_tensors

    out: dict[str, list[tuple[int, int, str]]] = {}
    if not getattr(tier.spec, "dedup_tensors", False) or not src.is_local:
        return out
    for entry in manifest.files:
        src_entry = src_entries[entry.path]
        if src_entry.location or not content_tensors.splittable(entry):
            continue
        where = f"{src.name}:{rel}/{entry.path}" if entry.path else f"{src.name}:{rel}"
        reader = open_entry(src, rel, src_entry)
        try:
            found = content_tensors.hash_pieces(reader, entry, where)
        finally:
            reader.close()
        if found:
            out[entry.path] = found
    return out


def _intact(tier: TierStorage, ref: Ref) -> bool:
    """The content object ``ref`` (decoded) hashes to its name (read whole)."""
    try:
        reader = _open_ref(tier, ref)
        try:
            got, found = hashing.hash_stream(reader)  # type: ignore[arg-type]
        finally:
            reader.close()
    except VerificationError:
        got, found = -1, ""
    if (got, found) != (ref.size, ref.digest):
        log.warning("%s: content %s does not hash to its name; writing it again", tier.name, ref.name)
        return False
    return True


def _placeholder_sink(tier: TierStorage, rel: str, stored: Manifest) -> _Sink:
    """The sink that commits a dedup copy: locally an empty directory renamed into place with the
    manifest beside it (a local copy's commit point); in S3 the manifest alone."""
    if _is_s3(tier):
        return tier._begin_write(rel, stored)
    from ckptkeeper.storage.localfs import _LocalSink

    local: Any = tier
    with local._root_fd():
        pass  # a missing tier root is an error, not something to create silently
    return _LocalSink(local.root, _split_rel(rel), True, with_manifest=True)


# -- reading and checking ----------------------------------------------------------------------


def content_damage(tier: TierStorage, stored: Manifest) -> list[str]:
    """Referenced content objects missing or of another stored size ([] = all there)."""
    rel = _rel_of(stored)
    sizes = sizes_of(tier, [r.name for e in stored.files for r in refs(e)])
    problems = []
    for e in stored.files:
        where = f"{rel}/{e.path}" if e.path else rel
        for ref in refs(e):
            got = sizes.get(ref.name)
            if got is None:
                problems.append(f"{where}: content {ref.name} missing")
            elif got != ref.stored_size:
                problems.append(
                    f"{where}: content {ref.name} is {got} bytes, manifest says {ref.stored_size}"
                )
    return problems


def recheck(tier: TierStorage, committed: Manifest) -> list[str]:
    """The survivor check of a dedup copy whose manifest is committed: every referenced content
    object present at its size."""
    _check_refs(tier, committed)
    return content_damage(tier, committed)


def verify(tier: TierStorage, stored: Manifest, *, deep: bool, on_bytes: Progress | None) -> list[str]:
    """:meth:`TierStorage.verify` of a dedup copy: each referenced object's size, and with
    ``deep`` its bytes hashed against the manifest."""
    problems = content_damage(tier, stored)
    if problems or not deep:
        return problems
    rel = _rel_of(stored)
    for e in stored.files:
        where = f"{rel}/{e.path}" if e.path else rel
        reader = open_entry(tier, rel, e)
        hasher = hashing.new_hasher()
        got_size = 0
        try:
            while chunk := reader.read(hashing.CHUNK_SIZE):
                hasher.update(chunk)
                got_size += len(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
        except VerificationError as exc:  # an encoded object that does not decode
            problems.append(str(exc))
            continue
        finally:
            reader.close()
        digest = hasher.hexdigest()
        if got_size != e.size:
            problems.append(f"{where}: read {got_size} bytes, manifest says {e.size}")
        elif digest != e.hash:
            problems.append(f"{where}: hash {digest} != {e.hash} in manifest")
    return problems


def stream_into(
    src: TierStorage, rel: str, stored: Manifest, sink: _Sink, progress: Progress | None, *, workers: int = 1
) -> None:
    """Write every file of ``stored`` (a dedup copy in ``src``) into ``sink`` at its path, each
    checked (size, hash) as it is written: a restore, or a copy to another tier.

    ``workers`` > 1 (a restore into a local directory, whose sink takes files from several
    threads): that many objects stream at once, largest first; the first failure stops the others
    at their next chunk and is raised once all have returned, so the caller's abort never races
    a writer."""
    workers = min(workers, len(stored.files))
    if workers <= 1:
        for e in stored.files:
            _copy_one(src, rel, e, sink, progress, None)
        return

    def make_worker() -> FileCopy:
        return lambda entry, report, stop: _copy_one(src, rel, entry, sink, report, stop)

    largest_first(stored.files, workers, make_worker, progress, "ckptkeeper-content")


def _copy_one(
    src: TierStorage,
    rel: str,
    e: FileEntry,
    sink: _Sink,
    progress: Progress | None,
    stop: threading.Event | None,
) -> None:
    reader = open_entry(src, rel, e)
    try:
        writer = sink.open_file(dataclasses.replace(e, location=""), None)
        where = f"{src.name}:{rel}/{e.path}" if e.path else f"{src.name}:{rel}"
        _pump(reader, writer, e, where, progress, stop)
    finally:
        reader.close()
