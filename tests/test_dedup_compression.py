"""A dedup tier that compresses (docs/dedup.md, docs/compression.md), through the real CLI on a
local warm tier and on moto S3: content objects (whole files and tensor pieces) are stored as
``<hash>.z`` in the codec's framed format, read back decoded and checked against the raw hash;
either form of a hash dedups the other; collection never removes a form a manifest references.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, write_config
from click.testing import CliRunner
from test_dedup import (
    AHEAD,
    MODEL,
    OPTIM,
    Node,
    content_objects,
    node,
    prune_killed_at,
    referenced,
    sweep,
)

from ckptkeeper.cli import main
from ckptkeeper.core.model import Manifest
from ckptkeeper.storage import content

__all__ = ["node"]  # the fixture of tests/test_dedup.py: a local warm tier and one on moto

ZIP = {"compression": "auto", "dedup_tensors": True}


def _tensors(seed: int, frozen: int = 0) -> dict[str, Any]:
    """A model's state dict as training leaves it (small normal values): fp32 and bf16 tensors
    of 1 MiB, the first half drawn from ``frozen``'s seed (the same in every save that shares it)."""
    import torch

    out: dict[str, Any] = {}
    for i in range(6):
        g = torch.Generator().manual_seed(frozen * 1000 + i if i < 3 else seed * 1000 + i)
        t = torch.randn(512, 512, generator=g) * 0.02
        out[f"layers.{i}.weight"] = t if i % 2 == 0 else t.to(torch.bfloat16)
    out["step"] = torch.tensor([seed])
    return out


def _save(node: Node, step: int, tensors: dict[str, Any]) -> Path:
    """An HF-style checkpoint written by safetensors itself."""
    from safetensors.torch import save_file

    ckpt = node.run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    save_file(tensors, str(ckpt / "model.safetensors"))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    for p in [*ckpt.rglob("*"), ckpt]:
        os.utime(p, (node.t0 + step, node.t0 + step))
    shutil.copytree(ckpt, node.originals / f"checkpoint-{step}")
    return ckpt


def _warm_manifest(node: Node, step: int) -> Manifest:
    code, out = node.cli("ls", "run", "--json")
    assert code == 0, out
    from ckptkeeper.config import load_settings
    from ckptkeeper.storage import TierStorage

    tier = TierStorage(load_settings(node.config).tier_specs()[1])
    manifest = tier.read_manifest(f"run/checkpoint-{step}")
    assert manifest is not None
    return manifest


def _saves(node: Node) -> None:
    """100; 200 the same weights saved again; 300 half-frozen (the first three tensors as 100's,
    the rest trained further); 400 stays hot."""
    _save(node, 100, _tensors(1, frozen=1))
    _save(node, 200, _tensors(1, frozen=1))
    _save(node, 300, _tensors(3, frozen=1))
    _save(node, 400, _tensors(4, frozen=1))


def test_tensor_dedup_with_zipnn_round_trips_a_real_safetensors_checkpoint(node: Node) -> None:
    node.configure(**ZIP)
    _saves(node)
    doc = node.prune()
    warm = doc["dedup"]["tiers"]["warm"]
    objs = content_objects(node)
    tensor = 512 * 512 * 4
    encoded = {k: v for k, v in objs.items() if k.endswith(".z")}
    # the six tensors of 100 once, the three trained ones of 300 once more, each compressed
    pieces = [v for v in encoded.values() if v > tensor // 4]
    assert len(pieces) == 6 + 3, objs
    # 200 stored nothing of its model again, 300 only its trained half
    model = (node.originals / "checkpoint-100" / "model.safetensors").stat().st_size
    assert warm["deduped_bytes"] >= model + 2 * tensor + tensor // 2  # two fp32 tensors, one bf16
    assert warm["stored_bytes"] < warm["uploaded_bytes"]
    for step in (100, 200, 300):
        assert node.restore(step) == node.original(step)
    code, out = node.cli("verify", "run", "--json")
    assert code == 0, out
    code, out = node.cli("scrub", "--json")
    assert code == 0, out
    # the manifest records, per piece, which form it references and its stored size
    entry = next(e for e in _warm_manifest(node, 300).files if e.path == "model.safetensors")
    assert len(entry.forms) == len(entry.parts) and any(enc == "zipnn" for enc, _ in entry.forms)
    sizes = {k.rsplit("/", 1)[-1]: v for k, v in objs.items()}
    for ref in content.refs(entry):
        assert sizes[ref.name] == ref.stored_size
        assert not ref.encoding or ref.stored < 0.97 * ref.size
    assert entry.stored_size < entry.size
    # once 100 and 200 expire, their objects go and 300's stay (referenced forms only)
    node.configure(keep_last=2, **ZIP)  # 300 in warm, 400 hot
    node.prune(env=AHEAD)
    left = content_objects(node)
    assert set(left) == referenced(node)
    assert len([v for k, v in left.items() if k.endswith(".z") and v > tensor // 4]) == 6
    assert node.restore(300) == node.original(300)


def test_either_form_of_a_hash_dedups_the_other(node: Node) -> None:
    """Raw objects stored before compression was switched on are referenced, not stored again;
    after it is switched off, encoded ones are; collection keeps both forms while referenced."""
    node.configure(hot=HOT, replicate=True, dedup_tensors=True)
    _save(node, 100, _tensors(1, frozen=1))
    node.prune()
    raw = set(content_objects(node))
    assert len(raw) >= 6
    assert not [k for k in raw if k.endswith(".z")]
    node.configure(hot=HOT, replicate=True, **ZIP)
    _save(node, 200, _tensors(2, frozen=1))
    doc = node.prune()
    after = set(content_objects(node))
    assert raw <= after
    new = after - raw
    assert len([k for k in new if k.endswith(".z")]) >= 3  # the trained half, compressed
    frozen = 3 * 512 * 512 * 4 // 2 + 512 * 512 * 4  # two fp32 tensors and one bf16 of the frozen half
    assert doc["dedup"]["tiers"]["warm"]["deduped_bytes"] >= frozen
    node.configure(hot=HOT, replicate=True, dedup_tensors=True)
    _save(node, 300, _tensors(2, frozen=1))  # 200's weights again, into a raw dedup tier
    node.prune()
    grown = {k: v for k, v in content_objects(node).items() if k not in after}
    assert sum(grown.values()) < 1024, grown  # its trainer state only: the model referenced as it is
    node.configure(hot=HOT, replicate=True, dedup_tensors=True, keep_last=2)  # 100 goes
    node.prune(env=AHEAD)
    left = set(content_objects(node))
    assert left == referenced(node)
    assert [k for k in left if k.endswith(".z")] and [k for k in left if not k.endswith(".z")]
    for step in (200, 300):
        assert node.restore(step) == node.original(step)
    code, out = node.cli("verify", "run")
    assert code == 0, out


HOT = {"keep_last": 3}
"""Every checkpoint stays hot too (``replicate``): each prune copies the new one to warm."""


def _corrupt_encoded(node: Node) -> None:
    """The last byte of the largest encoded object flips (same size: only decoding sees it)."""
    rel, _ = max(((k, v) for k, v in content_objects(node).items() if k.endswith(".z")), key=lambda kv: kv[1])
    if node.kind == "local":
        path = node.warm_dir / rel
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    import boto3

    assert node.s3 is not None
    client = boto3.client(
        "s3",
        endpoint_url=node.s3[1],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    key = f"{node.prefix}/{rel}"
    data = bytearray(client.get_object(Bucket=node.s3[0], Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=node.s3[0], Key=key, Body=bytes(data))


def test_a_damaged_encoded_object_fails_verify_scrub_and_restore(node: Node) -> None:
    node.configure(**ZIP)
    _save(node, 100, _tensors(1, frozen=1))
    _save(node, 200, _tensors(2, frozen=2))
    node.prune()
    code, out = node.cli("verify", "run")
    assert code == 0, out
    _corrupt_encoded(node)
    code, out = node.cli("verify", "run")  # decodes and hashes: the damage keeps the size
    assert code == 1 and "checkpoint-100/model.safetensors" in out, out
    dest = node.tmp / "bad"
    code, out = node.cli("restore", "run", "--step", "100", "--to", str(dest))
    assert code != 0 and "model.safetensors" in out, out
    assert not dest.exists() or list(dest.iterdir()) == []
    code, out = node.cli("scrub", "--json")
    assert code == 1, out


def test_dedup_with_compression_is_accepted(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    warm = {"dedup": True, "dedup_tensors": True, "compression": "zstd"}
    write_config(
        config,
        index=tmp_path / "index.db",
        tiers=[local_tier("hot", tmp_path / "hot"), local_tier("warm", tmp_path / "warm", **warm)],
    )
    (tmp_path / "hot").mkdir()
    (tmp_path / "warm").mkdir()
    result = CliRunner().invoke(main, ["--config", str(config), "status"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_kill9_at_every_crash_point_of_a_compressed_tensor_deduped_copy(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    s3 = None
    if kind == "s3":
        s3 = (request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_reset"))

    def make(k: int) -> Node:
        base = tmp_path / f"trial-{k}"
        base.mkdir()
        node = Node(base, kind, s3, prefix=f"trial-{k}")
        node.configure(**ZIP)
        _save(node, 100, _tensors(1, frozen=1))
        _save(node, 200, _tensors(1, frozen=1))
        _save(node, 300, _tensors(3, frozen=1))
        return node

    points = sweep(make, prune_killed_at, (100, 200, 300))
    assert points > 10


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_kill9_at_every_crash_point_of_a_compressed_collection(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    s3 = None
    if kind == "s3":
        s3 = (request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_reset"))

    def make(k: int) -> Node:
        base = tmp_path / f"trial-{k}"
        base.mkdir()
        node = Node(base, kind, s3, prefix=f"trial-{k}")
        node.configure(**ZIP)
        _save(node, 100, _tensors(1, frozen=1))
        _save(node, 200, _tensors(2, frozen=1))
        _save(node, 300, _tensors(3, frozen=1))
        node.prune()
        node.configure(keep_last=2, **ZIP)  # 100 expires: its trained half becomes unreferenced
        return node

    points = sweep(make, lambda node, k: prune_killed_at(node, k, AHEAD), (200, 300))
    assert points > 3


def _compressible(n: int) -> bytes:
    """``n`` bytes zstd stores in a fraction of the space, different every call."""
    return os.urandom(64) * (n // 64)


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("phase", ["copy", "delete"])
def test_kill9_at_every_crash_point_of_a_zstd_file_deduped_tier(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, phase: str
) -> None:
    """Whole files stored once as ``<hash>.z``: a copy (100 and 200 share their files), and a
    delete whose collection removes a compressed object (100's optimizer state, 200 keeps the
    shared weights), killed at every crash point."""
    s3 = None
    if kind == "s3":
        s3 = (request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_reset"))
    weights, optim, own = _compressible(MODEL), _compressible(OPTIM), _compressible(OPTIM)
    fresh, other = _compressible(MODEL), _compressible(OPTIM)

    def make(k: int) -> Node:
        base = tmp_path / f"trial-{k}"
        base.mkdir()
        node = Node(base, kind, s3, prefix=f"trial-{k}", compression="zstd")
        node.save(100, weights=weights, optim=own if phase == "delete" else optim)
        node.save(200, weights=weights, optim=optim)
        node.save(300, weights=fresh, optim=other)
        if phase == "delete":
            node.prune()
            node.configure(keep_last=2, compression="zstd")  # 100 expires from warm
        return node

    sample = make(0)
    before = set(content_objects(sample))
    sample.prune(env=AHEAD if phase == "delete" else None)
    after = set(content_objects(sample))
    gone = before - after  # a delete's collection removes 100's own optimizer state, compressed
    assert len([k for k in after if k.endswith(".z")]) == 2, after
    assert len([k for k in gone if k.endswith(".z")]) == (phase == "delete"), gone
    if phase == "copy":
        assert sweep(make, prune_killed_at, (100, 200, 300)) > 6
    else:
        assert sweep(make, lambda node, k: prune_killed_at(node, k, AHEAD), (200, 300)) > 2


@pytest.mark.parametrize("dedup", [False, True], ids=["compressed", "deduped-compressed"])
def test_undelete_of_a_compressed_copy_restores_byte_identical(node: Node, dedup: bool) -> None:
    """An expired copy of a compressing tier goes to the trash as stored, comes back with
    ``undelete`` still stored compressed, and restores byte-identical."""
    node.configure(compression="zstd", dedup=dedup)
    for step in (100, 200, 300):
        node.save(step, weights=_compressible(MODEL), optim=_compressible(OPTIM))
    node.prune()
    node.configure(compression="zstd", dedup=dedup, keep_last=1, undo_window="1d")
    node.prune()  # 100 and 200 into the trash
    code, out = node.cli("ls", "--deleted", "--json")
    assert code == 0 and {d["step"] for d in json.loads(out)["deleted"]} == {100, 200}, out
    code, out = node.cli("undelete", "run", "100")
    assert code == 0, out
    assert node.restore(100) == node.original(100)
    assert any(e.encoding for e in _warm_manifest(node, 100).files)  # still stored compressed
    code, out = node.cli("verify", "run")
    assert code == 0, out


# -- the manifest ---------------------------------------------------------------------------------

H1, H2 = "1" * 32, "2" * 32


def _doc(entry: dict[str, Any]) -> str:
    return json.dumps(
        {
            "version": 1,
            "run": "run",
            "step": 1,
            "name": "checkpoint-1",
            "layout": "hf",
            "is_dir": True,
            "files": [{"path": "a", "size": 3000, "hash": "0" * 32, "location": "content", **entry}],
        }
    )


def test_manifest_records_the_form_of_each_piece_and_reads_old_ones_unchanged() -> None:
    split = Manifest.from_json(_doc({"parts": [[1000, H1], [2000, H2, "zipnn", 1500]]}))
    (entry,) = split.files
    assert [r.name for r in content.refs(entry)] == [H1, H2 + ".z"]
    assert [r.stored_size for r in content.refs(entry)] == [1000, 1500]
    assert entry.stored_size == 2500
    assert Manifest.from_json(split.to_json()) == split
    assert Manifest.from_json(split.to_json()).files[0].forms == entry.forms
    whole = Manifest.from_json(_doc({"encoding": "zstd", "stored": 900}))
    assert [(r.name, r.stored_size) for r in content.refs(whole.files[0])] == [("0" * 32 + ".z", 900)]
    raw = Manifest.from_json(_doc({"parts": [[1000, H1], [2000, H2]]}))
    assert raw.files[0].forms == () and '"parts": [\n' in raw.to_json()
    assert "zipnn" not in raw.to_json() and '"stored"' not in raw.to_json()
    # how the bytes are stored is not the version: one digest for every form
    assert split.digest == whole.digest == raw.digest == Manifest.from_json(_doc({})).digest


@pytest.mark.parametrize(
    "entry",
    [
        {"parts": [[1000, H1], [2000, H2, "zipnn"]]},
        {"parts": [[1000, H1], [2000, H2, "lz4", 1500]]},
        {"parts": [[1000, H1], [2000, H2, "", 1500]]},
        {"parts": [[1000, H1], [2000, H2, "zipnn", None]]},
        {"parts": [[1000, H1], [2000, H2, "zipnn", 10**9]]},  # more stored than raw allows
        {"parts": [[1000, H1], [2000, H2, "zipnn", -1]]},
        {"parts": [[1000, H1], [2000, H2]], "encoding": "zipnn", "stored": 10},  # per piece only
    ],
)
def test_manifest_forms_are_validated(entry: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"files\[0\]"):
        Manifest.from_json(_doc(entry))


# -- every layout of the real-framework fixtures, on every store -------------------------------------


def _add_fixtures(node: Node) -> dict[tuple[str, str, int], dict[str, str]]:
    """Every framework's complete fixture twice (runs ``<framework>-a`` and ``-b``: the same bytes
    saved by two runs), an hour old (settled, not yet stale: no reaping); each complete
    checkpoint's file hashes by (run, name, step)."""
    from test_compression import FIXTURES, LAYOUTS, _tree

    for framework in LAYOUTS:
        for copy in ("a", "b"):
            run = node.hot / f"{framework}-{copy}"
            shutil.copytree(FIXTURES / framework / "complete" / "run", run, symlinks=True)
            for keep in run.rglob(".keep-empty-dir"):
                keep.unlink()
    then = node.t0 + 3600
    for p in sorted(node.hot.rglob("*"), reverse=True):
        os.utime(p, (then, then), follow_symlinks=False)
    code, out = node.cli("scan", "--json")
    assert code == 0, out
    code, out = node.cli("ls", "--json")
    assert code == 0, out
    found = {
        (r["name"], c["name"], c["step"]): _tree(node.hot / r["name"] / c["name"])
        for r in json.loads(out)["runs"]
        for c in r["checkpoints"]
        if c["state"] == "complete"
    }
    assert {run.rsplit("-", 1)[0] for run, _, _ in found} == set(LAYOUTS)
    return found


def _restored(node: Node, run: str, name: str, step: int) -> dict[str, str]:
    from test_compression import _tree

    dest = node.tmp / f"restored-{run}-{step}-{time.monotonic_ns()}"
    code, out = node.cli("restore", run, "--step", str(step), "--to", str(dest))
    assert code == 0, out
    return _tree(dest / name)


@pytest.mark.parametrize("warm", [{}, ZIP], ids=["file-dedup", "tensor-dedup-auto"])
def test_every_framework_layout_round_trips_deduped(node: Node, warm: dict[str, Any]) -> None:
    """Each layout of tests/fixtures through a dedup tier (whole files, or tensors and compressed):
    the second run's copies reference the first's content; every checkpoint restores byte-identical;
    after the older saves expire, collection leaves exactly what the kept manifests reference."""
    node.configure(hot={"keep_last": 0}, **warm)
    originals = _add_fixtures(node)
    doc = node.prune()
    assert not [k for k in originals if (node.hot / k[0] / k[1]).exists()], "all pruned into warm"
    raw = sum(f["size"] for f in _warm_files(node))
    assert doc["dedup"]["tiers"]["warm"]["deduped_bytes"] >= raw // 2 - 4096, doc["dedup"]
    assert sum(content_objects(node).values()) < raw // 2 + 4096
    encoded = [k for k in content_objects(node) if k.endswith(".z")]
    assert bool(encoded) == bool(warm), encoded  # stored compressed where the tier compresses
    code, out = node.cli("verify", "--json")
    assert code == 0 and json.loads(out)["problems"] == [], out
    for (run, name, step), want in originals.items():
        assert _restored(node, run, name, step) == want, (run, name)
    node.configure(hot={"keep_last": 0}, **{**warm, "keep_last": 1})  # the older saves expire
    node.prune(env=AHEAD)
    assert set(content_objects(node)) == referenced(node)
    code, out = node.cli("ls", "--json")
    kept = {(r["name"], c["step"]) for r in json.loads(out)["runs"] for c in r["checkpoints"]}
    assert len(kept) < len(originals)
    for (run, name, step), want in originals.items():
        if (run, step) in kept:
            assert _restored(node, run, name, step) == want, (run, name)


def _warm_files(node: Node) -> list[dict[str, Any]]:
    """Every file of every committed copy in the warm tier (its manifests' entries)."""
    from ckptkeeper.config import load_settings
    from ckptkeeper.storage import TierStorage

    tier = TierStorage(load_settings(node.config).tier_specs()[1])
    return [{"path": e.path, "size": e.size} for _rel, m, _err in tier.list_manifests() if m for e in m.files]
