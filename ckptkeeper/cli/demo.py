"""``ckptkeeper demo``: a throwaway node with realistic checkpoints, to see the tool work in a minute.

It writes, under a temp dir, a hot tier with runs of several frameworks (Hugging Face Trainer,
Lightning, torch DCP, Orbax), a failed run and a crashed one with partial checkpoints and temp
files, a warm tier and a cold tier (a local moto S3 server when moto is installed, else a local
dir), then runs the real ``scan``, ``ls``, ``prune --dry-run`` and — unless ``--no-apply`` —
``prune`` and ``ls`` again, through the same command group that runs ``demo`` (passed in, not
imported: this module is one of that group's commands). The files are made without torch: torch.save writes a zip, DCP
writes ``.distcp`` shards and ``.metadata``, so a zip and a few bytes stand in faithfully.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

HOUR = 3600.0


def _age(path: Path, when: float) -> None:
    """Backdate a file or a whole tree so the demo does not wait for settle timers."""
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            os.utime(os.path.join(dirpath, f), (when, when), follow_symlinks=False)
        os.utime(dirpath, (when, when))
    if path.is_file():
        os.utime(path, (when, when))


def _safetensors(path: Path, nbytes: int) -> None:
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes // 4 * 4]}}
    ).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + os.urandom(nbytes // 4 * 4))


def _hf_checkpoint(run_dir: Path, step: int, eval_loss: float, when: float, *, complete: bool = True) -> None:
    ckpt = run_dir / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    _safetensors(ckpt / "model.safetensors", 96 * 1024)
    (ckpt / "optimizer.pt").write_bytes(os.urandom(64 * 1024))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    if complete:
        history = [
            {"step": s, "eval_loss": eval_loss + (step - s) / 10000, "epoch": s / 100}
            for s in range(100, step + 1, 100)
        ]
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    _age(ckpt, when)


def _lightning_checkpoint(
    run_dir: Path, epoch: int, step: int, when: float, *, truncated: bool = False
) -> None:
    path = run_dir / "checkpoints" / f"epoch={epoch}-step={step}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    import zipfile  # only the demo writes zips: kept out of ``ckptkeeper --help``

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", os.urandom(8 * 1024))
        zf.writestr("archive/data/0", os.urandom(120 * 1024))
    if truncated:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    _age(path, when)


def _dcp_checkpoint(run_dir: Path, step: int, when: float, *, complete: bool = True) -> None:
    ckpt = run_dir / f"step_{step}"
    ckpt.mkdir(parents=True)
    for rank in range(2):
        (ckpt / f"__{rank}_0.distcp").write_bytes(os.urandom(80 * 1024))
    (ckpt / (".metadata" if complete else ".metadata.tmp")).write_bytes(os.urandom(2 * 1024))
    _age(ckpt, when)


def _orbax_checkpoint(run_dir: Path, step: int, when: float, *, tmp: bool = False) -> None:
    # Orbax 0.12 names: the step dir and its item dir both under a ``.orbax-checkpoint-tmp`` name.
    name = f"{step}.orbax-checkpoint-tmp" if tmp else str(step)
    ckpt = run_dir / name / ("default.orbax-checkpoint-tmp" if tmp else "default")
    ckpt.mkdir(parents=True)
    (ckpt / "array_data").write_bytes(os.urandom(64 * 1024))
    if not tmp:
        (run_dir / name / "_CHECKPOINT_METADATA").write_text(
            json.dumps({"init_timestamp_nsecs": int(when * 1e9)})
        )
    _age(run_dir / name, when)


def _hook_files(
    run_dir: Path,
    state: str,
    when: float,
    reason: str | None = None,
    *,
    commits: list[tuple[str, int, dict[str, float]]] | None = None,
) -> None:
    """The hook's files in ``run_dir`` (for Lightning: its ModelCheckpoint dirpath)."""
    control = run_dir / ".ckptkeeper"
    control.mkdir(parents=True, exist_ok=True)
    doc = {
        "version": 1,
        "name": run_dir.name,
        "state": state,
        "host": "demo-node",
        "pid": None,
        "started": when - 6 * HOUR,
        "ended": when if state != "active" else None,
        "reason": reason,
        "parent": None,
    }
    (control / "run.json").write_text(json.dumps(doc))
    lines = [
        json.dumps({"path": path, "step": step, "metrics": metrics, "time": when - HOUR})
        for path, step, metrics in commits or []
    ]
    if lines:
        (control / "commits.jsonl").write_text("\n".join(lines) + "\n")


def populate(hot: Path, now: float) -> None:
    """A realistic node after a few days of experiments."""
    # A finished HF run: 12 checkpoints, best eval_loss at step 300, plus a stray tmp dir.
    gpt = hot / "gpt2-sweep-lr3e-4"
    for i, step in enumerate(range(100, 1300, 100)):
        loss = 1.2 if step == 300 else 2.0 - step / 2000
        _hf_checkpoint(gpt, step, loss, now - (12 - i) * HOUR)
    stray = gpt / "tmp-checkpoint-1300"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(os.urandom(96 * 1024))
    _age(stray, now - 5 * HOUR)
    _hook_files(gpt, "finished", now - HOUR)

    # A Lightning run that failed (marked by the hook) after writing a truncated checkpoint. Lightning's
    # usual ModelCheckpoint(dirpath=<run>/checkpoints): the hook's files sit in checkpoints/.
    lit = hot / "resnet-lightning"
    for epoch in range(4):
        _lightning_checkpoint(lit, epoch, (epoch + 1) * 250, now - (8 - epoch) * HOUR)
    _lightning_checkpoint(lit, 4, 1250, now - 3.5 * HOUR, truncated=True)
    _hook_files(
        lit / "checkpoints",
        "failed",
        now - 3 * HOUR,
        reason="RuntimeError: CUDA error: an illegal memory access",
        commits=[
            (f"epoch={e}-step={(e + 1) * 250}.ckpt", (e + 1) * 250, {"val_loss": round(1.5 - 0.2 * e, 2)})
            for e in range(4)
        ],
    )

    # A crashed DCP run with no hook at all: a partial save and an Orbax-style tmp dir.
    dcp = hot / "llama-dcp-crashed"
    for i, step in enumerate((200, 400, 600)):
        _dcp_checkpoint(dcp, step, now - (20 - i) * HOUR)
    _dcp_checkpoint(dcp, 800, now - 16 * HOUR, complete=False)

    # An Orbax/JAX run still training: never touched.
    jax = hot / "t5x-live"
    for i, step in enumerate((1000, 2000, 3000)):
        _orbax_checkpoint(jax, step, now - (3 - i) * 0.5 * HOUR)
    _orbax_checkpoint(jax, 4000, now, tmp=True)
    _hook_files(jax, "active", now)
    (jax / ".ckptkeeper" / "heartbeat").touch()


@contextmanager
def _cold_tier(base: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A moto S3 bucket over HTTP when moto is installed (pip install -e '.[test]'), else a dir."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        path = base / "cold"
        path.mkdir()
        yield str(path), {}
        return
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    # moto's server is werkzeug: its request log ("127.0.0.1 - - [...] GET /bucket ...") goes to the
    # `werkzeug` logger, which adds its own stderr handler unless a level is set. Not our output.
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="demo-checkpoints")
        yield "s3://demo-checkpoints/ckpt", {"endpoint_url": endpoint}
    finally:
        server.stop()


def write_config(base: Path, cold_url: str, cold_options: dict[str, str]) -> Path:
    options = ", ".join(f'{k} = "{v}"' for k, v in cold_options.items())
    text = f"""\
index = "{base}/index.db"
max_delete = 100
# What the commands print is the demo; info logs (e.g. a first start's "new index built from the
# tiers", a JSON line in a pipe) are for the journal. Warnings and errors still show.
log_level = "warning"

[daemon]
settle_seconds = "0s"
metrics_addr = ""

[[tiers]]
name = "hot"
url = "{base}/hot"
keep_last = 2
keep_best = 1
metric = "eval_loss"
mode = "min"

[[tiers]]
name = "warm"
url = "{base}/warm"
keep_last = 5

[[tiers]]
name = "cold"
url = "{cold_url}"
storage_options = {{ {options} }}
replicate = true
keep_every = 400

[reaper]
failed_after = "2h"
partial_after = "1h"
keep_last_of_failed = 1
"""
    path = base / "config.toml"
    path.write_text(text)
    path.chmod(0o600)
    return path


def run_demo(cli: click.Command, *, keep: bool = False, apply: bool = True) -> int:
    """Build the demo node and drive ``cli`` (the ``ckptkeeper`` group) on it; the worst exit code."""
    import shutil
    import tempfile  # with shutil: only the demo needs them, kept out of ``ckptkeeper --help``

    base = Path(tempfile.mkdtemp(prefix="ckptkeeper-demo-"))
    (base / "hot").mkdir()
    (base / "warm").mkdir()
    populate(base / "hot", time.time())
    with _cold_tier(base) as (cold_url, cold_options):
        config = write_config(base, cold_url, cold_options)

        def step(title: str, *args: str) -> int:
            print(f"\n$ ckptkeeper {' '.join(args)}    # {title}", flush=True)
            try:
                cli.main(["--config", str(config), *args], standalone_mode=False)
            except SystemExit as exc:
                return int(exc.code or 0)
            return 0

        print(f"demo node in {base}:")
        print(f"  hot  {base}/hot\n  warm {base}/warm\n  cold {cold_url}")
        codes = [step("catalog every tier", "scan"), step("what is there", "ls")]
        codes.append(step("what retention and the reaper would do", "prune", "--dry-run"))
        if apply:
            codes.append(step("do it: copy, verify, commit, then delete", "prune"))
            codes.append(step("after", "ls"))
            codes.append(step("tiers and bytes reclaimed", "status"))
    if keep:
        print(f"\nkept {base} (config: {config})")
    else:
        shutil.rmtree(base, ignore_errors=True)
    return max(codes)


@click.command()
@click.option("--keep", is_flag=True, help="Keep the demo directory afterwards.")
@click.option("--no-apply", is_flag=True, help="Stop after prune --dry-run.")
def demo(keep: bool, no_apply: bool) -> None:
    """Make a throwaway node with realistic checkpoints and run scan, ls, prune on it."""
    group = click.get_current_context().find_root().command
    sys.exit(run_demo(group, keep=keep, apply=not no_apply))


COMMANDS = (demo,)
