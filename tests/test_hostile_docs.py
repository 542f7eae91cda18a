"""Hostile documents, fuzzed through the real ``scan`` and ``prune``.

One test per document type ckptkeeper reads — a manifest beside a copy in a slower tier, a manifest
someone left in hot, ``run.json``, ``commits.jsonl``, the heartbeat, a framework marker — each
drawing hostile content with hypothesis (out-of-range and non-finite numbers written as raw JSON
text, wrong types, NUL and unpaired surrogates, ``..`` and absolute paths, nesting bombs, random
bytes) and running the CLI's ``scan`` and ``prune`` in process after every draw. After each example:

* no exception escapes and both commands exit 0;
* every checkpoint that existed is still in place (the good ones and the hostile one's own data);
* the hostile document is quarantined with a reason (``ls --json`` and ``status --json``).

Each test builds one tree and rewrites only the hostile document per example, so an example costs
two in-process commands. ``CKPTKEEPER_FUZZ_EXAMPLES`` (default 500) sets the examples per document
type; the hypothesis profile ``hostile`` is registered here.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import local_tier, manifest_of, write_config
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ckptkeeper.actions.prune import run_prune
from ckptkeeper.cli.app import main
from ckptkeeper.config import load_settings
from ckptkeeper.core.model import MANIFEST_SUFFIX
from ckptkeeper.index import Index

EXAMPLES = int(os.environ.get("CKPTKEEPER_FUZZ_EXAMPLES", "500"))
settings.register_profile(
    "hostile",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
HOSTILE = settings.get_profile("hostile")
AGE = 600.0

# -- hostile values, as raw JSON text -------------------------------------------------------------

BIG_INTS = [str(10**30), str(2**63), str(2**64), str(2**70), str(-(2**63) - 1), "9" * 400]
NON_FINITE = ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"]
WRONG_TYPES = ["true", "false", '"12"', "[]", "{}", "[1]", '{"a": 1}']
BOMB = "[" * 50_000 + "]" * 50_000
TOO_MANY_DIGITS = "9" * 5000  # beyond Python's int-from-string limit: json.loads raises ValueError

HOSTILE_INTEGERS = [*BIG_INTS, *NON_FINITE, *WRONG_TYPES, "-1", "0.5", "1.0", "1e3", TOO_MANY_DIGITS, BOMB]
"""Never a valid step, size or pid."""
HOSTILE_TIMES = [*BIG_INTS, *NON_FINITE, *WRONG_TYPES, "-1", "-0.5", "1e12", "1e308", TOO_MANY_DIGITS, BOMB]
"""Never a valid POSIX time between 1970 and 3000."""
HOSTILE_STRINGS = [
    '"a\\u0000b"',
    '"\\ud800"',
    json.dumps("x" * 10_000),
    "5",
    "1e400",
    "NaN",
    "true",
    "[]",
    "{}",
    BOMB,
]
"""Never a valid name, host, layout or hash."""
HOSTILE_PATHS = [*HOSTILE_STRINGS, '"../../outside"', '"/etc/passwd"', '"a//b"', '"."', '"a/../b"', '""']


def raw_json_values() -> st.SearchStrategy[str]:
    """Arbitrary JSON values as text (plus a few the generator would not make)."""
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    values = st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )
    return values.map(lambda v: json.dumps(v)) | st.sampled_from([*NON_FINITE, *BIG_INTS, BOMB])


def render(template: dict[str, Any], field: str, raw: str) -> str:
    """``template`` as JSON with ``field`` (dotted: ``files.0.size``) replaced by the raw text."""
    doc = json.loads(json.dumps(template))
    holder: Any = doc
    *parents, last = field.split(".")
    for part in parents:
        holder = holder[int(part)] if isinstance(holder, list) else holder[part]
    holder[int(last) if isinstance(holder, list) else last] = "\x00HOSTILE\x00"
    return json.dumps(doc).replace('"\\u0000HOSTILE\\u0000"', raw)


def mutations(template: dict[str, Any], fields: dict[str, list[str]]) -> st.SearchStrategy[bytes]:
    """Hostile documents: one field replaced by a value that is never valid there, or a document
    that is not an object at all, or random bytes that do not parse as a JSON object."""
    one_field = st.sampled_from(sorted(fields)).flatmap(
        lambda f: st.sampled_from(fields[f]).map(lambda raw: render(template, f, raw).encode())
    )
    not_object = raw_json_values().filter(lambda t: not t.startswith("{")).map(str.encode)
    junk = st.binary(max_size=200).filter(_not_a_json_object)
    return st.one_of(one_field, one_field, one_field, not_object, junk)  # mostly one precise field


def _not_a_json_object(data: bytes) -> bool:
    try:
        return not isinstance(json.loads(data), dict)
    except (ValueError, RecursionError):
        return True


# -- one tree per test, reused by every example ---------------------------------------------------


def hf(run: Path, step: int, *, state: str | None = None) -> Path:
    ckpt = run / f"checkpoint-{step}"
    (ckpt / "nested").mkdir(parents=True)
    payload = os.urandom(800)
    header = json.dumps({"w": {"dtype": "F32", "shape": [200], "data_offsets": [0, 800]}}).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + payload)
    (ckpt / "nested" / "optimizer.pt").write_bytes(os.urandom(300))
    (ckpt / "trainer_state.json").write_text(
        state
        if state is not None
        else json.dumps({"global_step": step, "log_history": [{"step": step, "loss": 0.5}]})
    )
    return ckpt


def age(root: Path, seconds: float = AGE) -> None:
    when = time.time() - seconds
    for dirpath, dirnames, filenames in os.walk(root):
        for n in (*dirnames, *filenames):
            os.utime(os.path.join(dirpath, n), (when, when), follow_symlinks=False)


def files_under(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and ".ckptkeeper" not in p.parts
    }


class Tree:
    """hot (keep_last 10, keep_daily 10: the date-bucketing rules see every created_at) and warm.

    ``good`` has checkpoints 1 and 2 in hot and 0 in warm (a real copy with a valid manifest);
    ``victim`` has checkpoint 1 in hot, whose hook files or marker a test makes hostile; warm holds
    ``victim2/checkpoint-9``'s data, whose manifest a test makes hostile.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.hot = root / "hot"
        self.warm = root / "warm"
        self.config = root / "config.toml"
        write_config(
            self.config,
            index=root / "index.db",
            daemon={"settle_seconds": "1s", "metrics_addr": ""},
            tiers=[
                local_tier("hot", self.hot, keep_last=10, keep_daily=10),
                local_tier("warm", self.warm, keep_last=10),
            ],
        )
        hf(self.hot / "good", 1)
        hf(self.hot / "good", 2)
        hf(self.hot / "victim", 1)
        (self.hot / "victim" / ".ckptkeeper").mkdir()
        zero = hf(self.warm / "good", 0)
        (self.warm / "good" / f"checkpoint-0{MANIFEST_SUFFIX}").write_text(
            manifest_of(self.warm, "good", 0, created_at=time.time() - AGE).to_json()
        )
        hf(self.warm / "victim2", 9)
        self.victim2_manifest = json.loads(manifest_of(self.warm, "victim2", 9, created_at=1.7e9).to_json())
        del self.victim2_manifest["digest"]  # so a hostile field is judged by its own bounds
        assert zero.is_dir()
        age(self.hot)
        age(self.warm)
        self.runner = CliRunner()
        self.examples = 0
        self.before = {"hot": files_under(self.hot), "warm": files_under(self.warm)}
        first = self.cli("scan")
        assert first.exit_code == 0, first.output
        self.settings = load_settings(self.config)
        self.index = Index(root / "index.db")

    def close(self) -> None:
        self.index.close()

    def cli(self, *args: str) -> Any:
        result = self.runner.invoke(main, ["--config", str(self.config), *args], catch_exceptions=True)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise AssertionError(f"{args}: exception escaped: {result.exception!r}\n{result.output[-3000:]}")
        return result

    def check(
        self, kind: str, path: str, *, must_quarantine: bool = True, full: bool = False
    ) -> dict[str, Any]:
        """``prune --force`` exits 0 (it reconciles every tier first: the scan path), nothing is lost,
        and (by default) ``path`` is quarantined as ``kind`` with a reason. Every tenth example (and
        with ``full``) also runs ``scan`` and checks what ``ls --json`` and ``status --json`` show."""
        self.examples += 1
        full = full or self.examples % 10 == 1
        if full:
            for args in (("scan",), ("prune", "--force")):
                result = self.cli(*args)
                assert result.exit_code == 0, (args, result.output[-3000:])
        else:  # the same pass without the CLI's config load and index open
            outcome = run_prune(self.settings, self.index, force=True)
            assert outcome.exit_code == 0, (outcome.failed, outcome.plan.refused)
        after = {"hot": files_under(self.hot), "warm": files_under(self.warm)}
        for tier in ("hot", "warm"):
            missing = set(self.before[tier]) - set(after[tier])
            assert not missing, (tier, sorted(missing))
        steps = {(c.run, c.step) for c in self.index.checkpoints()}
        quarantined = [q.to_dict() for q in self.index.quarantined()]
        assert {("good", 0), ("good", 1), ("good", 2), ("victim", 1)} <= steps, steps
        found = [q for q in quarantined if q["kind"] == kind and q["path"] == path]
        if must_quarantine:
            assert found and found[0]["reason"], (kind, path, quarantined)
        if not full:
            return {"quarantined": quarantined}
        listing = json.loads(self.cli("ls", "--json").stdout)
        status = json.loads(self.cli("status", "--json").stdout)
        assert status["quarantined"] == quarantined
        assert sorted(map(str, listing["quarantined"])) == sorted(map(str, quarantined))
        return status


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    """One tree per test, on tmpfs when there is one: the index commits with synchronous=FULL, and
    an fsync per transaction would make 500 examples per document type take minutes."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        root = Path(tempfile.mkdtemp(prefix="ckptkeeper-fuzz-", dir=shm))
        try:
            made = Tree(root)
            yield made
            made.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        made = Tree(tmp_path)
        yield made
        made.close()


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp-fuzz")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -- manifests ------------------------------------------------------------------------------------

MANIFEST_FIELDS: dict[str, list[str]] = {
    "step": HOSTILE_INTEGERS,
    "files.0.size": HOSTILE_INTEGERS,
    "files.1.size": HOSTILE_INTEGERS,
    "created_at": HOSTILE_TIMES,
    "run": HOSTILE_PATHS,
    "name": HOSTILE_PATHS,
    "files.0.path": [p for p in HOSTILE_PATHS if p != '""'],
    "files.0.hash": HOSTILE_STRINGS,
    "layout": HOSTILE_STRINGS,
    "node": [s for s in HOSTILE_STRINGS if s not in ("[]", "{}")],
    "is_dir": ["1", "0", '"yes"', "null", "[]", *NON_FINITE],
    "version": ["2", "0", "1.0", "true", '"1"', "null", *BIG_INTS],
    "files": ['"x"', "5", "{}", "null", *NON_FINITE, BOMB],
    "files.0": ['"x"', "5", "[]", "null", "{}"],
    "metrics": ['"x"', "5", "[]", '{"loss": NaN}', '{"loss": 1e400}', '{"loss": ' + "9" * 400 + "}", BOMB],
}


@HOSTILE
@given(doc=st.data())
def test_hostile_manifest_in_a_slower_tier_is_quarantined_and_nothing_is_lost(
    tree: Tree, doc: st.DataObject
) -> None:
    data = doc.draw(mutations(tree.victim2_manifest, MANIFEST_FIELDS))
    path = tree.warm / "victim2" / f"checkpoint-9{MANIFEST_SUFFIX}"
    _write(path, data)
    tree.check("manifest", f"victim2/checkpoint-9{MANIFEST_SUFFIX}")
    assert (tree.warm / "victim2" / "checkpoint-9" / "model.safetensors").is_file()


@HOSTILE
@given(doc=st.data())
def test_hostile_manifest_left_in_hot_is_never_trusted(tree: Tree, doc: st.DataObject) -> None:
    """Hot copies are hashed from their bytes: a manifest file someone left in hot is not read at all
    (so there is nothing to quarantine), and it changes nothing the catalog says about the copy."""
    template = json.loads(manifest_of(tree.hot, "good", 2).to_json())
    data = doc.draw(mutations(template, MANIFEST_FIELDS))
    _write(tree.hot / "good" / f"checkpoint-2{MANIFEST_SUFFIX}", data)
    status = tree.check("manifest", f"good/checkpoint-2{MANIFEST_SUFFIX}", must_quarantine=False)
    assert not [q for q in status["quarantined"] if q["run"] == "good"], status["quarantined"]


# -- hook files -----------------------------------------------------------------------------------

RUN_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "name": "victim",
    "state": "active",
    "host": "node-a",
    "pid": 4242,
    "started": 1.7e9,
    "ended": None,
    "reason": None,
    "parent": {"run": "good", "step": 1},
    "heartbeat_interval": 10.0,
}
RUN_FIELDS: dict[str, list[str]] = {
    "pid": [p for p in HOSTILE_INTEGERS if p not in ("-1",)] + ["0", "-1", str(2**22 + 1)],
    "parent.step": HOSTILE_INTEGERS,
    "parent.run": [*HOSTILE_STRINGS, '""'],
    "parent": ['"x"', "5", "[]", "true", *NON_FINITE],
    "started": HOSTILE_TIMES,
    "ended": HOSTILE_TIMES,
    "heartbeat_interval": [*NON_FINITE, *BIG_INTS, *WRONG_TYPES, "-1", "1e12"],
    "version": ["2", "0", "1.5", "true", '"1"', *BIG_INTS, *NON_FINITE],
    "state": ['"zombie"', *HOSTILE_STRINGS],
    "host": HOSTILE_STRINGS,
    "name": HOSTILE_STRINGS,
    "reason": HOSTILE_STRINGS,
}


@HOSTILE
@given(doc=st.data())
def test_hostile_run_json_is_quarantined_and_nothing_is_lost(tree: Tree, doc: st.DataObject) -> None:
    data = doc.draw(mutations(RUN_TEMPLATE, RUN_FIELDS))
    assume(data.strip())  # an empty run.json is "being created", reported too but not hostile
    _write(tree.hot / "victim" / ".ckptkeeper" / "run.json", data)
    tree.check("run.json", "victim/.ckptkeeper/run.json")


COMMIT_TEMPLATE: dict[str, Any] = {"path": "checkpoint-1", "step": 1, "metrics": {"loss": 0.5}, "time": 1.7e9}
COMMIT_FIELDS: dict[str, list[str]] = {
    "step": HOSTILE_INTEGERS,
    "time": HOSTILE_TIMES,
    "path": [*HOSTILE_PATHS, '".ckptkeeper/x"'],
    "metrics": ['"x"', "5", "[]", *NON_FINITE, BOMB],
    "metrics.loss": [*NON_FINITE, "9" * 400, *WRONG_TYPES],
}


@HOSTILE
@given(doc=st.data())
def test_hostile_commit_lines_are_quarantined_and_nothing_is_lost(tree: Tree, doc: st.DataObject) -> None:
    line = doc.draw(mutations(COMMIT_TEMPLATE, COMMIT_FIELDS))
    assume(line.strip() and b"\n" not in line)
    good = json.dumps(COMMIT_TEMPLATE).encode()
    where = doc.draw(st.sampled_from(["first", "last", "torn"]))
    body = {
        "first": line + b"\n" + good + b"\n",
        "last": good + b"\n" + line + b"\n",
        "torn": good + b"\n" + line,
    }
    _write(tree.hot / "victim" / ".ckptkeeper" / "commits.jsonl", body[where])
    tree.check("commits.jsonl", "victim/.ckptkeeper/commits.jsonl")
    (victim,) = tree.index.checkpoints("victim")
    assert victim.committed and victim.state.value == "complete"  # the good line still counts


@HOSTILE
@given(
    kind=st.sampled_from(["mtime", "dir", "symlink", "fifo"]),
    mtime=st.floats(min_value=-2e9, max_value=-1e-3, allow_nan=False),
    content=st.binary(max_size=64),
)
def test_hostile_heartbeat_is_quarantined_and_nothing_is_lost(
    tree: Tree, kind: str, mtime: float, content: bytes
) -> None:
    beat = tree.hot / "victim" / ".ckptkeeper" / "heartbeat"
    if beat.is_dir() and not beat.is_symlink():
        beat.rmdir()
    elif beat.exists() or beat.is_symlink():
        beat.unlink()
    if kind == "mtime":
        beat.write_bytes(content)
        os.utime(beat, (mtime, mtime))
    elif kind == "dir":
        beat.mkdir()
    elif kind == "symlink":
        beat.symlink_to(tree.hot / "good" / "checkpoint-1" / "trainer_state.json")
    else:
        os.mkfifo(beat)
    tree.check("heartbeat", "victim/.ckptkeeper/heartbeat")


# -- framework markers ----------------------------------------------------------------------------

TRAINER_STATE: dict[str, Any] = {"global_step": 1, "log_history": [{"step": 1, "loss": 0.5}]}


def hostile_markers() -> st.SearchStrategy[bytes]:
    """``trainer_state.json`` that is not an object, not JSON, has a ``log_history`` that is not a
    list, or a metric no float holds."""
    huge = st.sampled_from(["9" * 400, "-" + "9" * 400, str(2**1100)])
    return st.one_of(
        mutations(TRAINER_STATE, {"log_history": ['"x"', "5", "{}", "true", *NON_FINITE, *BIG_INTS]}),
        huge.map(lambda raw: render(TRAINER_STATE, "log_history.0.loss", raw).encode()),
        st.just(BOMB.encode()),
    )


@HOSTILE
@given(data=hostile_markers())
def test_hostile_marker_is_quarantined_and_nothing_is_lost(tree: Tree, data: bytes) -> None:
    marker = tree.hot / "victim" / "checkpoint-1" / "trainer_state.json"
    _write(marker, data)
    age(tree.hot / "victim")
    tree.check("marker", "victim/checkpoint-1")


# -- exact repros of the issue, and the helpers staying honest ------------------------------------


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("step", "1e400"),
        ("step", str(10**30)),
        ("files.0.size", str(2**70)),
        ("files.0.size", "1e400"),
        ("created_at", "NaN"),
    ],
)
def test_issue_13_manifests_are_quarantined(tree: Tree, field: str, raw: str) -> None:
    _write(
        tree.warm / "victim2" / f"checkpoint-9{MANIFEST_SUFFIX}",
        render(tree.victim2_manifest, field, raw).encode(),
    )
    status = tree.check("manifest", f"victim2/checkpoint-9{MANIFEST_SUFFIX}", full=True)
    reason = next(q["reason"] for q in status["quarantined"] if q["kind"] == "manifest")
    assert field.split(".")[-1] in reason, reason


def test_render_replaces_exactly_one_field() -> None:
    text = render({"a": 1, "b": [{"c": 2}]}, "b.0.c", "1e400")
    assert text == '{"a": 1, "b": [{"c": 1e400}]}'


def test_quarantined_documents_are_a_metric(tree: Tree) -> None:
    from ckptkeeper.actions.status import summarize
    from ckptkeeper.daemon.metrics import _summary_metrics

    _write(tree.warm / "victim2" / f"checkpoint-9{MANIFEST_SUFFIX}", b'{"version": 1, "step": 1e400}')
    _write(tree.hot / "victim" / ".ckptkeeper" / "run.json", f'{{"version": 1, "pid": {2**70}}}'.encode())
    tree.check("manifest", f"victim2/checkpoint-9{MANIFEST_SUFFIX}", full=True)
    families = {f.name: f for f in _summary_metrics(summarize(tree.settings, tree.index))}
    samples = {
        (s.labels["tier"], s.labels["kind"]): s.value for s in families["ckptkeeper_quarantined"].samples
    }
    assert samples == {("warm", "manifest"): 1, ("hot", "run.json"): 1}
    _write(tree.warm / "victim2" / f"checkpoint-9{MANIFEST_SUFFIX}", b"{}")
    (tree.hot / "victim" / ".ckptkeeper" / "run.json").unlink()
    (tree.warm / "victim2" / f"checkpoint-9{MANIFEST_SUFFIX}").unlink()
    tree.check("manifest", "-", must_quarantine=False)
    assert tree.index.quarantined() == []  # fixed or removed: no longer listed
