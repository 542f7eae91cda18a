"""The daemon as systemd runs it: a training loop's checkpoints are cataloged, tiered and reaped
with no human action (issue 5's "done when")."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from builders import FAST_DAEMON
from test_daemon import Node, Notifications, stop_cleanly, wait_for

import ckptkeeper


def save(run_dir: Path, step: int) -> Path:
    path = run_dir / f"step-{step:05d}.pt"
    path.write_bytes(os.urandom(4096 + step))
    return path


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_training_loop_checkpoints_are_cataloged_tiered_and_reaped_unattended(node: Node) -> None:
    node.write_config(
        daemon=FAST_DAEMON,
        hot={"keep_last": 1},
        warm={"keep_last": 2, "replicate": None},
        reaper={"partial_after": "1s", "failed_after": "1h"},
    )
    notify = Notifications()
    proc = node.start(notify)
    try:
        assert notify.wait_for("READY=1", 30), node.log_text(proc)

        # A healthy run: three checkpoints committed through the hook.
        good = node.hot / "good"
        good.mkdir()
        with ckptkeeper.track_run(good) as run:
            for step in (100, 200, 300):
                run.commit(save(good, step), step=step, metrics={"loss": 1.0 / step})
        # A run that crashes after two checkpoints, leaving a half-written third.
        bad = node.hot / "bad"
        bad.mkdir()
        with pytest.raises(RuntimeError), ckptkeeper.track_run(bad) as run:
            for step in (100, 200):
                run.commit(save(bad, step), step=step)
            (bad / "step-00300.pt.tmp").write_bytes(b"half")
            raise RuntimeError("CUDA out of memory")

        def settled() -> bool:
            ls = node.ls()
            return (
                ls.get(("good", 300), {}).get("tiers") == ["hot"]
                and ls.get(("good", 200), {}).get("tiers") == ["warm"]
                and ls.get(("good", 100)) is None
                and set(k for k in ls if k[0] == "bad") == {("bad", 200)}
                and not (bad / "step-00300.pt.tmp").exists()
            )

        assert wait_for(settled, 60, interval=0.5), (node.ls(), node.log_text(proc)[-4000:])
        assert sorted(p.name for p in good.glob("*.pt")) == ["step-00300.pt"]
        assert (node.warm / "good" / "step-00200.pt").is_file()
        assert sorted(p.name for p in bad.iterdir() if not p.name.startswith(".")) == ["step-00200.pt"]
        status = node.cli("status", "--json")
        assert '"failed-run"' in status.stdout or '"tmp-file"' in status.stdout
        time.sleep(0.5)
        stop_cleanly(node, proc, notify)
    finally:
        node.kill_all()
        notify.close()
