"""Random sequences of copies, deletes, trash moves, purges, undeletes and collections on a dedup
tier never leave a committed copy or a trash entry referencing missing content, and a collection
leaves exactly the content something references (docs/dedup.md)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import tempfile
from pathlib import Path

from builders import manifest_of
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkeeper.core.model import Manifest, TierPolicy, TierSpec
from ckptkeeper.storage import TierStorage, content, content_gc, content_tensors, trash


def _safetensors(*tensors: bytes) -> bytes:
    header, offset = {}, 0
    for i, t in enumerate(tensors):
        header[f"t{i}"] = {"dtype": "U8", "shape": [len(t)], "data_offsets": [offset, offset + len(t)]}
        offset += len(t)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(tensors)


FROZEN, T1, T2 = b"F" * 4000, b"1" * 3000, b"2" * 3000
BLOBS = (b"A" * 3000, b"B" * 2000, b"C" * 1000, _safetensors(FROZEN, T1), _safetensors(FROZEN, T2))
SHAPES: tuple[dict[str, int], ...] = (
    {"a": 0, "b": 1, "m.safetensors": 3},
    {"a": 0, "b": 2, "m.safetensors": 4},
    {"": 0},  # a single-file checkpoint holding the same bytes as the others' "a"
    {"a": 1, "b": 1},  # one content twice in one checkpoint
)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["copy", "delete", "trash", "purge", "undelete", "collect"]), st.integers(0, 3)
    ),
    max_size=14,
)


def _hot(root: Path) -> tuple[TierStorage, list[Manifest]]:
    out = []
    for i, shape in enumerate(SHAPES):
        name = f"checkpoint-{i}"
        path = root / "run" / name
        if "" in shape:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(BLOBS[shape[""]])
        else:
            path.mkdir(parents=True)
            for file, blob in shape.items():
                (path / file).write_bytes(BLOBS[blob])
        out.append(dataclasses.replace(manifest_of(root, "run", i, name=name), node="n1"))
    return TierStorage(TierSpec("hot", str(root), TierPolicy()), hot=True), out


def _whole(warm: TierStorage) -> None:
    listed = warm.list_manifests()
    for rel, m, err in listed:
        assert m is not None and err is None, (rel, err)
        assert warm.recheck(m) == [], rel
        assert warm.verify(m) == [], rel
    for entry, m, _when, why in warm.list_trash():
        assert m is not None, (entry, why)
        assert content.content_damage(warm, m) == [], entry


@settings(max_examples=40, deadline=None)
@given(OPS, st.booleans())
def test_no_sequence_leaves_a_reference_to_missing_content(ops: list[tuple[str, int]], tensors: bool) -> None:
    base = Path(tempfile.mkdtemp(prefix="dedup-prop-"))
    split, piece = content_tensors.MIN_SPLIT, content_tensors.MIN_PIECE
    content_tensors.MIN_SPLIT, content_tensors.MIN_PIECE = 0, 0  # these small files are split too
    try:
        (base / "hot").mkdir()
        (base / "warm").mkdir()
        hot, manifests = _hot(base / "hot")
        warm = TierStorage(
            TierSpec("warm", str(base / "warm"), TierPolicy(), node="n1", dedup=True, dedup_tensors=tensors)
        )
        trashed: dict[int, str] = {}
        for n, (op, i) in enumerate(ops):
            m = manifests[i]
            rel = f"run/{m.name}"
            committed = warm.read_manifest(rel) is not None
            if op == "copy" and i not in trashed:
                warm.copy_from(hot, m)
            elif op == "delete" and committed:
                warm.delete(rel)
            elif op == "trash" and committed and i not in trashed:
                trashed[i] = trash.new_entry(1_000_000.0 + n)
                warm.move_aside(m, trashed[i])
            elif op == "purge" and i in trashed:
                warm.purge_trash(trashed.pop(i))
            elif op == "undelete" and i in trashed and not committed:
                warm.undelete(m, trashed.pop(i))
            elif op == "collect":
                content_gc.collect(warm, grace=0.0, now=float("inf"))
                refs = {content.content_rel(warm, h) for h in content_gc.live_refs(warm)}
                store = {content.content_rel(warm, o.digest) for o in content_gc.list_content(warm)}
                assert store == refs
            _whole(warm)
        for m in manifests:
            if warm.read_manifest(f"run/{m.name}") is not None:
                got = warm.fetch(m, base / f"out-{m.step}")
                want = base / "hot" / "run" / m.name
                assert (
                    (got.read_bytes() == want.read_bytes())
                    if got.is_file()
                    else all((got / e.path).read_bytes() == (want / e.path).read_bytes() for e in m.files)
                )
        if tensors and any(op == "copy" for op, _ in ops):
            listed = [m for _, m, _ in warm.list_manifests() if m is not None]
            assert all(e.parts for m in listed for e in m.files if e.path.endswith(".safetensors"))
    finally:
        content_tensors.MIN_SPLIT, content_tensors.MIN_PIECE = split, piece
        shutil.rmtree(base, ignore_errors=True)
