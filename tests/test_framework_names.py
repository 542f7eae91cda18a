"""Temp names per framework version, the hook dir below the run dir, accelerate's step, and the
pickle reader that never unpickles (issue 16). Real-framework trees: test_framework_fixtures.py."""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import pytest
from builders import local_tier, write_config
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkeeper.config import load_settings
from ckptkeeper.index import Index
from ckptkeeper.ingest.catalog import Catalog
from ckptkeeper.ingest.layouts import scan_run
from ckptkeeper.ingest.layouts.base import torch_pickle_values
from ckptkeeper.ingest.layouts.temps import dir_kind, file_kind


@pytest.mark.parametrize(
    ("name", "is_dir", "kind"),
    [
        ("100.orbax-checkpoint-tmp", True, "orbax-tmp"),  # Orbax 0.12
        ("default.orbax-checkpoint-tmp", True, "orbax-tmp"),  # its nested item dir
        ("100.orbax-checkpoint-tmp-1700000000", True, "orbax-tmp"),  # Orbax < 0.12
        ("checkpoint_100.orbax-checkpoint-tmp-1700000000", True, "orbax-tmp"),
        ("tmp-checkpoint-40", True, "tmp-checkpoint"),  # transformers 4.36
        ("checkpoint-9.ckptkeeper-tmp-1a2b", True, "ckptkeeper-staging"),
        (".tmp8hXSZv", False, "safetensors-tmp"),  # safetensors >= 0.5 (Rust tempfile)
        (".metadata.tmp", False, "metadata-tmp"),  # torch DCP
        ("__3.metadata.tmp", False, "metadata-tmp"),  # torch DCP without collectives
        ("events.tmp", False, "tmp-file"),
        ("model.safetensors.part", False, "tmp-file"),
        # not temps
        ("100", True, None),
        ("ocdbt.process_0", True, None),
        (".tmp8hXSZ", False, None),  # 5 chars: not Rust tempfile's name
        (".tmp8hXSZvv", False, None),
        ("tmp.ckpt", False, None),
        ("model.safetensors", False, None),
    ],
)
def test_temp_names(name: str, is_dir: bool, kind: str | None) -> None:
    assert (dir_kind(name) if is_dir else file_kind(name, in_candidate=False)) == kind


def test_dcp_metadata_tmp_inside_its_checkpoint_is_the_checkpoints_marker() -> None:
    assert file_kind(".metadata.tmp", in_candidate=True) is None
    assert file_kind(".tmpAbC123", in_candidate=True) == "safetensors-tmp"


def _age(root: Path, seconds: float = 7200) -> None:
    then = time.time() - seconds
    for p in [*root.rglob("*"), root]:
        os.utime(p, (then, then), follow_symlinks=False)


def test_temp_inside_complete_checkpoint_is_not_part_of_it(tmp_path: Path) -> None:
    """A stray safetensors temp in a complete HF checkpoint: not hashed, not copied, its own artifact."""
    ckpt = tmp_path / "run" / "checkpoint-10"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    (ckpt / "optimizer.pt").write_bytes(b"o" * 10)
    (ckpt / ".tmpQw3rTy").write_bytes(b"t" * 1000)
    scan = scan_run(tmp_path / "run", "run")
    (cand,) = scan.candidates
    assert cand.complete and cand.files == ("optimizer.pt", "trainer_state.json") and cand.bytes < 1000
    assert [(a.path, a.kind, a.bytes) for a in scan.artifacts] == [
        ("run/checkpoint-10/.tmpQw3rTy", "safetensors-tmp", 1000)
    ]


def _catalog(tmp_path: Path, hot: Path) -> tuple[Catalog, Index]:
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon={"settle_seconds": "1h", "trust_mtimes": True},  # _age back-dates with utime
        tiers=[local_tier("hot", hot)],
    )
    settings_ = load_settings(config)
    index = Index(Path(settings_.index))
    return Catalog(settings_, index), index


def _hook(control_parent: Path, state: str, commits: list[dict[str, object]]) -> None:
    control = control_parent / ".ckptkeeper"
    control.mkdir(parents=True)
    (control / "run.json").write_text(
        json.dumps(
            {"version": 1, "name": "x", "state": state, "host": "elsewhere", "pid": None, "started": 1.0}
        )
    )
    (control / "commits.jsonl").write_text("".join(json.dumps({**c, "time": 1.0}) + "\n" for c in commits))


def test_two_nested_hook_dirs_liveliest_state_wins_and_commits_bind(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    run = hot / "run"
    for sub in ("a", "b"):
        (run / sub).mkdir(parents=True)
        (run / sub / "model-7.pt").write_bytes(b"not a zip, but committed")
    _hook(run / "a", "finished", [{"path": "model-7.pt", "step": 7, "metrics": {"val_loss": 0.5}}])
    _hook(run / "b", "failed", [{"path": "model-7.pt", "step": 7, "metrics": {"val_loss": 0.7}}])
    _age(run)
    catalog, index = _catalog(tmp_path, hot)
    try:
        catalog.reconcile_hot()
        (row,) = index.runs()
        assert (row.name, row.state.value) == ("run", "failed")
        got = {(c.name, c.step, c.state.value, c.metrics.get("val_loss")) for c in index.checkpoints("run")}
        assert got == {("a/model-7.pt", 7, "complete", 0.5), ("b/model-7.pt", 7, "complete", 0.7)}
    finally:
        index.close()


def test_bad_hook_files_in_a_nested_hook_dir_are_quarantined_under_their_own_path(tmp_path: Path) -> None:
    """Main's quarantine of hook files that fail the schema covers every hook dir of the run: each
    file is held under its own path, the good dir still decides the state and commits still bind."""
    hot = tmp_path / "hot"
    run = hot / "run"
    for sub in ("a", "b"):
        (run / sub).mkdir(parents=True)
        (run / sub / "model-7.pt").write_bytes(b"not a zip, but committed")
    _hook(run / "a", "finished", [{"path": "model-7.pt", "step": 7, "metrics": {}}])
    _hook(run / "b", "finished", [{"path": "model-7.pt", "step": 7, "metrics": {}}])
    with (run / "b" / ".ckptkeeper" / "commits.jsonl").open("a") as f:
        f.write('{"path": "model-8.pt", "step": -3}\n')
    (run / "b" / ".ckptkeeper" / "run.json").write_text('{"version": 1, "state": "exploded"}')
    _age(run)
    catalog, index = _catalog(tmp_path, hot)
    try:
        report = catalog.reconcile_hot()
        held = {(q.path, q.kind): q.reason for q in index.quarantined()}
        assert set(held) == {
            ("run/b/.ckptkeeper/commits.jsonl", "commits.jsonl"),
            ("run/b/.ckptkeeper/run.json", "run.json"),
        }, held
        assert "1 line(s) ignored" in held[("run/b/.ckptkeeper/commits.jsonl", "commits.jsonl")]
        assert "exploded" in held[("run/b/.ckptkeeper/run.json", "run.json")]
        assert report.quarantined == 2
        (row,) = index.runs()
        assert (row.name, row.state.value) == ("run", "finished")
        got = {(c.name, c.step, c.state.value) for c in index.checkpoints("run")}
        assert got == {("a/model-7.pt", 7, "complete"), ("b/model-7.pt", 7, "complete")}
    finally:
        index.close()


def test_accelerate_step_from_the_hook_wins(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    ckpt = hot / "run" / "checkpoints" / "checkpoint_0"
    ckpt.mkdir(parents=True)
    (ckpt / "optimizer.bin").write_bytes(b"o")
    with zipfile.ZipFile(ckpt / "random_states_0.pkl", "w") as zf:
        # protocol 2 pickle of {"step": 6}
        zf.writestr("random_states_0/data.pkl", b"\x80\x02}q\x00X\x04\x00\x00\x00stepq\x01K\x06s.")
    _hook(hot / "run", "finished", [{"path": "checkpoints/checkpoint_0", "step": 500, "metrics": {}}])
    _age(hot / "run")
    (cand,) = scan_run(hot / "run", "run").candidates
    assert (cand.layout, cand.step, cand.complete, dict(cand.metrics)) == (
        "accelerate",
        6,
        True,
        {"accelerate_save": 0.0},
    )
    catalog, index = _catalog(tmp_path, hot)
    try:
        catalog.reconcile_hot()
        assert [(c.step, c.state.value) for c in index.checkpoints("run")] == [(500, "complete")]
    finally:
        index.close()


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=300), member=st.sampled_from(["a/data.pkl", "data.pkl", "x/other"]))
def test_pickle_reader_never_raises_and_never_unpickles(
    tmp_path_factory: pytest.TempPathFactory, payload: bytes, member: str
) -> None:
    path = tmp_path_factory.mktemp("pk") / "f.pkl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    values = torch_pickle_values(str(path), "step")
    assert all(isinstance(v, int | str) for v in values)
    path.write_bytes(payload)  # not even a zip
    assert torch_pickle_values(str(path), "step") == []


def test_pickle_reader_does_not_execute_reduce(tmp_path: Path) -> None:
    """A GLOBAL+REDUCE payload (os.system) is decoded as opcodes, never run."""
    marker = tmp_path / "pwned"
    evil = (
        b"\x80\x02}q\x00X\x04\x00\x00\x00stepq\x01cos\nsystem\nq\x02X"
        + len(f"touch {marker}").to_bytes(4, "little")
        + f"touch {marker}".encode()
        + b"\x85R\x8a\x01\x05s."
    )
    path = tmp_path / "rs.pkl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("rs/data.pkl", evil)
    torch_pickle_values(str(path), "step")
    assert not marker.exists()


def test_parent_named_by_its_run_when_hook_dirs_are_nested(tmp_path: Path) -> None:
    """``ModelCheckpoint(dirpath=<run>/checkpoints)`` resumed from another run's checkpoint: the hook
    can only name the parent's checkpoint dir; the catalog names the parent run from its path."""
    import ckptkeeper

    hot = tmp_path / "hot"
    parent_ckpt = hot / "base" / "checkpoints" / "epoch=0-step=100.ckpt"
    parent_ckpt.parent.mkdir(parents=True)
    parent_ckpt.write_bytes(b"x")
    child = ckptkeeper.track_run(
        hot / "finetune" / "checkpoints", parent=str(parent_ckpt), heartbeat_interval=60
    )
    child.finish()
    catalog, index = _catalog(tmp_path, hot)
    try:
        catalog.reconcile_hot()
        row = next(r for r in index.runs() if r.name == "finetune")
        assert row.parent == ("base", 100)
    finally:
        index.close()
