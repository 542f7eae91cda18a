"""One prune pass for every trigger: a participant added in one place (``participants_for``) runs
every phase, in order, in ``ckptkeeper prune``, ``prune --dry-run`` and the daemon's scheduled
job; and a participant's guard stops the executor before the action it vetoes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from builders import FAST_DAEMON, hf_checkpoint, local_tier, write_config
from click.testing import CliRunner

from ckptkeeper.actions.pruning import participants
from ckptkeeper.actions.pruning.state import Participant, PassState
from ckptkeeper.cli import main
from ckptkeeper.config import load_settings
from ckptkeeper.core.model import Action, Plan

PHASES = ["before", "recover", "catalog", "plan", "restrict", "freeze", "after"]


class Recorder(Participant):
    """Records each phase it is asked into, and may veto every action."""

    def __init__(self, veto: str | None = None) -> None:
        self.phases: list[str] = []
        self.asked: list[str] = []
        self.veto = veto
        self.stopped: bool | None = None

    def before(self, state: PassState) -> list[str]:
        self.phases.append("before")
        return []

    def recover(self, state: PassState) -> None:
        self.phases.append("recover")

    def catalog(self, state: PassState) -> None:
        self.phases.append("catalog")

    def plan(self, state: PassState, plan: Plan) -> Plan:
        self.phases.append("plan")
        return plan

    def restrict(self, state: PassState, plan: Plan) -> Plan:
        self.phases.append("restrict")
        return plan

    def freeze(self, state: PassState, plan: Plan) -> Plan:
        self.phases.append("freeze")
        return plan

    def guard(self, action: Action) -> str | None:
        self.asked.append(f"{action.action.value} {action.path}")
        return self.veto

    def after(self, state: PassState) -> list[str]:
        self.phases.append("after")
        self.stopped = state.stopped
        return [f"recorder: {'dry run' if state.dry_run else 'real pass'}"]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """The one place a participant is added: every pass built afterwards has it."""
    rec = Recorder()
    chosen = participants.participants_for
    monkeypatch.setattr(participants, "participants_for", lambda settings: [*chosen(settings), rec])
    return rec


def _node(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Three settled checkpoints in hot (keep_last 1): a pass moves two of them to warm."""
    hot, warm = tmp_path / "hot", tmp_path / "warm"
    for step in (100, 200, 300):
        hf_checkpoint(hot / "exp", step, f"weights {step}".encode())
    warm.mkdir()
    config = write_config(
        tmp_path / "config.toml",
        index=tmp_path / "index.db",
        daemon=FAST_DAEMON,
        tiers=[local_tier("hot", hot, keep_last=1), local_tier("warm", warm, keep_last=10)],
    )
    return config, hot, warm


def _prune(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(
        main, ["--config", str(config), "prune", "--json", *args], catch_exceptions=False
    )
    return result.exit_code, json.loads(result.stdout)


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "exp").iterdir() if p.is_dir()) if (root / "exp").is_dir() else []


def test_cli_prune_runs_every_phase_of_an_added_participant(tmp_path: Path, recorder: Recorder) -> None:
    config, hot, warm = _node(tmp_path)
    code, doc = _prune(config)
    assert code == 0
    assert recorder.phases == PHASES
    assert "recorder: real pass" in doc["notes"]
    assert doc["result"]["done"] == len(recorder.asked) > 0  # asked before every action
    assert _steps(warm) == ["checkpoint-100", "checkpoint-200"]
    assert _steps(hot) == ["checkpoint-300"]


def test_dry_run_runs_the_same_phases(tmp_path: Path, recorder: Recorder) -> None:
    config, hot, warm = _node(tmp_path)
    code, doc = _prune(config, "--dry-run")
    assert code == 0
    assert recorder.phases == PHASES
    assert "recorder: dry run" in doc["notes"]
    assert doc["dry_run"] is True and doc["actions"] and "result" not in doc
    assert recorder.asked == []  # nothing was executed, so nothing was asked
    assert _steps(warm) == [] and len(_steps(hot)) == 3


def test_the_daemons_scheduled_job_runs_the_same_phases(tmp_path: Path, recorder: Recorder) -> None:
    from ckptkeeper.actions.index import open_index
    from ckptkeeper.daemon.service import Daemon

    config, hot, warm = _node(tmp_path)
    settings = load_settings(config)
    daemon = Daemon(None, settings)
    daemon.index = open_index(settings)
    try:
        daemon.watcher = daemon._make_watcher(settings)
        daemon.watcher.start(initial_reconcile=True)
        try:
            error = daemon._prune("retention", ("retention",))
        finally:
            daemon.watcher.stop()
    finally:
        daemon.index.close()
    assert error is None, error
    assert recorder.phases == PHASES
    assert len(recorder.asked) > 0
    assert _steps(warm) == ["checkpoint-100", "checkpoint-200"]
    assert _steps(hot) == ["checkpoint-300"]


def test_a_participants_veto_stops_the_executor(tmp_path: Path, recorder: Recorder) -> None:
    config, hot, warm = _node(tmp_path)
    recorder.veto = "vetoed by the test"
    code, doc = _prune(config)
    assert code == 0
    assert doc["actions"]  # planned...
    assert doc["result"]["done"] == 0 and doc["result"]["failed"] == []  # ...and none carried out
    assert len(recorder.asked) == 1  # stopped at the first action
    assert recorder.phases == PHASES and recorder.stopped is True
    assert _steps(warm) == [] and len(_steps(hot)) == 3
