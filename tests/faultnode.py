"""A three-tier node for the fault-injection suites (crash, S3 faults, secrets, concurrency).

One prune on a fresh :class:`FaultNode` does every kind of step the executor knows, so a fault
injected at any instant lands in one of them:

* run ``train`` (hot, HF layout, steps 100…800, best eval_loss at 200): renames hot→warm (500),
  a real local copy hot→warm plus a multipart upload hot→cold (600), a multipart upload then a
  hot delete (300), expiries from hot (100, 400). Steps 300 and 600 carry a file one MiB bigger
  than ``S3TierStorage.part_size``, so their uploads are multipart whatever that size is tuned to;
* run ``failed`` (hot; the hook says failed): reaps of 100 and 200, a partial 400 reaped, 300 kept
  and replicated to cold; an old ``tmp-checkpoint-*`` dir in ``train`` is reaped too;
* run ``old`` (seeded straight into warm, step 100 into cold as well, as this node left it):
  uploads warm→cold (300, 600), expiries from warm and from cold (100, 200);
* a precious file outside every root, reachable through a symlink inside ``train``.

:data:`GOLDEN` is where everything must end up (docs/design.md, "Retention" applied by hand, see below); every key of
it is a checkpoint the policy keeps and must never lose.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HOUR = 3600.0

Key = tuple[str, int]

# hot keep_last 2 + best 1 (eval_loss min), warm keep_last 4, cold keep_every 300 + replicate.
# train: hot {200 best, 700, 800}; warm {500, 600}; cold {300} + replica of 600; 100, 400 expire.
# old (only in warm; never promoted): warm {300..600}; cold replicas of 300, 600; 100, 200 expire.
# failed: reaper keeps newest 1 (300; hot + cold replica), reaps 100, 200 and the partial 400.
GOLDEN: dict[Key, tuple[str, ...]] = {
    ("train", 200): ("hot",),
    ("train", 300): ("cold",),
    ("train", 500): ("warm",),
    ("train", 600): ("warm", "cold"),
    ("train", 700): ("hot",),
    ("train", 800): ("hot",),
    ("old", 300): ("warm", "cold"),
    ("old", 400): ("warm",),
    ("old", 500): ("warm",),
    ("old", 600): ("warm", "cold"),
    ("failed", 300): ("hot", "cold"),
}
BIG_STEPS = {("train", 300), ("train", 600)}
TRAIN_STEPS = range(100, 900, 100)
OLD_STEPS = range(100, 700, 100)
FAILED_STEPS = (100, 200, 300)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def age(path: Path, when: float) -> None:
    paths = [*path.rglob("*"), path] if path.is_dir() and not path.is_symlink() else [path]
    for p in paths:
        os.utime(p, (when, when), follow_symlinks=False)


@dataclass
class Template:
    """Checkpoint contents written once per session; nodes copy them (cheap) instead of regenerating."""

    root: Path
    hashes: dict[Key, dict[str, str]]
    """(run, step) -> {file path inside the checkpoint: sha256}."""

    @staticmethod
    def build(root: Path, *, multipart: bool = True) -> Template:
        """``multipart=False``: every file small (for tests about listings and logs, not uploads)."""
        from ckptkeeper.storage import S3TierStorage

        big = S3TierStorage.part_size + 2**20 if multipart else 60_000
        hashes: dict[Key, dict[str, str]] = {}
        rnd = __import__("random").Random(1234)

        def hf(run: str, step: int, *, eval_loss: float | None, complete: bool = True) -> None:
            ckpt = root / run / f"checkpoint-{step}"
            (ckpt / "nested").mkdir(parents=True)
            payload = rnd.randbytes((big if (run, step) in BIG_STEPS else 40_000 + step) // 4 * 4)
            header = json.dumps(
                {"w": {"dtype": "F32", "shape": [len(payload) // 4], "data_offsets": [0, len(payload)]}}
            ).encode()
            files = {
                "model.safetensors": struct.pack("<Q", len(header)) + header + payload,
                "nested/optimizer.pt": rnd.randbytes(8_000),
            }
            if complete:
                history: list[dict[str, Any]] = [{"step": step, "loss": 2.0}]
                if eval_loss is not None:
                    history.append({"step": step, "eval_loss": eval_loss})
                files["trainer_state.json"] = json.dumps(
                    {"global_step": step, "log_history": history}
                ).encode()
            for rel, data in files.items():
                (ckpt / rel).write_bytes(data)
            hashes[(run, step)] = {rel: sha(data) for rel, data in files.items()}

        for step in TRAIN_STEPS:
            hf("train", step, eval_loss=1.0 if step == 200 else 2.0 - step / 10000)
        for step in OLD_STEPS:
            hf("old", step, eval_loss=None)
        for step in FAILED_STEPS:
            hf("failed", step, eval_loss=None)
        hf("failed", 400, eval_loss=None, complete=False)
        return Template(root, hashes)


class FaultNode:
    """hot + warm (local) + cold (S3) with the scenario above, driven through the real CLI."""

    def __init__(
        self,
        tmp: Path,
        template: Template,
        *,
        endpoint: str,
        bucket: str,
        storage_endpoint: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        log_level: str = "info",
        max_delete: int = 100,
        populate: bool = True,
    ) -> None:
        self.tmp = tmp
        self.template = template
        self.hot = tmp / "hot"
        self.warm = tmp / "warm"
        self.outside = tmp / "outside"
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = "ckpt"
        self.index = tmp / "state" / "index.db"
        self.config = tmp / "config.toml"
        opts = dict(storage_options or {"key": "testing", "secret": "testing"})
        opts["endpoint_url"] = storage_endpoint or endpoint
        self.storage_options = opts
        self.log_level = log_level
        self.max_delete = max_delete
        for d in (self.hot, self.warm, self.outside, self.index.parent):
            d.mkdir(parents=True, exist_ok=True)
        self.write_config()
        if populate:
            self.populate()

    # -- setup --------------------------------------------------------------------------------

    def write_config(self, *, warm_keep_last: int = 4, **daemon: str) -> None:
        from builders import FAST_DAEMON, local_tier, s3_tier, write_config

        write_config(
            self.config,
            index=self.index,
            max_delete=self.max_delete,
            log_level=self.log_level,
            daemon={**FAST_DAEMON, **daemon},
            tiers=[
                local_tier("hot", self.hot, keep_last=2, keep_best=1, metric="eval_loss", mode="min"),
                local_tier("warm", self.warm, keep_last=warm_keep_last),
                s3_tier(
                    "cold",
                    self.bucket,
                    self.storage_options["endpoint_url"],
                    prefix=self.prefix,
                    storage_options=self.storage_options,
                    keep_every=300,
                    replicate=True,
                ),
            ],
            reaper={"failed_after": "2h", "partial_after": "1h", "keep_last_of_failed": 1},
        )

    def populate(self) -> None:
        from builders import manifest_of, tier

        from ckptkeeper.storage import TierStorage

        src = self.template.root
        old = time.time() - HOUR
        for run in ("train", "failed"):
            shutil.copytree(src / run, self.hot / run, copy_function=shutil.copyfile)
        for step in TRAIN_STEPS:
            age(self.hot / "train" / f"checkpoint-{step}", old - 1000 + step)
        for step in (*FAILED_STEPS, 400):
            age(self.hot / "failed" / f"checkpoint-{step}", old - 2 * HOUR + step)
        control = self.hot / "failed" / ".ckptkeeper"
        control.mkdir()
        (control / "run.json").write_text(
            json.dumps(
                {
                    "version": 1,
                    "name": "failed",
                    "state": "failed",
                    "host": socket.gethostname(),
                    "pid": None,
                    "started": old - 5 * HOUR,
                    "ended": old - 2 * HOUR,
                    "reason": "RuntimeError: NCCL timeout",
                    "parent": None,
                }
            )
        )
        tmpdir = self.hot / "train" / "tmp-checkpoint-999"
        tmpdir.mkdir()
        (tmpdir / "shard.bin").write_bytes(b"x" * 10_000)
        age(tmpdir, old - 2 * HOUR)
        (self.outside / "precious.bin").write_bytes(b"never delete me" * 100)
        os.symlink(self.outside, self.hot / "train" / "link-out")
        # run `old` as this node left it after its hot dir was removed: copies with manifests in
        # warm (and step 100 in cold), written under this node's name (another node's copies are
        # read-only to this node since docs/design.md, "Many nodes": tests/test_fleet_ownership.py)
        template_tier = TierStorage(tier("template", str(src)), hot=True)
        warm = TierStorage(tier("warm", str(self.warm)))
        cold = TierStorage(
            tier("cold", f"s3://{self.bucket}/{self.prefix}", storage_options=self.direct_options())
        )
        for step in OLD_STEPS:
            manifest = manifest_of(
                src, "old", step, created_at=time.time() - 5 * HOUR + step, node=socket.gethostname()
            )
            warm.copy_from(template_tier, manifest)
            if step == 100:
                cold.copy_from(template_tier, manifest)
        # ... and this node's index, which it kept: tiers holding copies of ours while no index
        # exists mean a lost index, rebuilt with deletes held (#13), which is not this scenario
        from ckptkeeper.index import Index

        with Index(self.index):
            pass

    def direct_options(self) -> dict[str, Any]:
        """storage_options reaching moto directly (no fault proxy): for arranging state."""
        return {**self.storage_options, "endpoint_url": self.endpoint}

    # -- driving ------------------------------------------------------------------------------

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTKEEPER_", "NOTIFY_SOCKET"))}
        env.update(extra or {})
        return env

    def argv(self, *args: str, wrapper: str | None = None) -> list[str]:
        head = [sys.executable, "-c", wrapper] if wrapper else [sys.executable, "-m", "ckptkeeper.cli"]
        return [*head, "--config", str(self.config), *args]

    def cli(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float = 180,
        wrapper: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args, wrapper=wrapper),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(env),
            cwd=REPO,
        )

    def popen(
        self, *args: str, env: Mapping[str, str] | None = None, log: str = "proc", wrapper: str | None = None
    ) -> subprocess.Popen[bytes]:
        out = (self.tmp / f"{log}.log").open("ab")
        try:
            return subprocess.Popen(
                self.argv(*args, wrapper=wrapper),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(env),
                cwd=REPO,
            )
        finally:
            out.close()

    def log(self, name: str = "proc") -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def ls(self) -> dict[str, Any]:
        result = self.cli("ls", "--json")
        assert result.returncode == 0, result.stderr
        doc: dict[str, Any] = json.loads(result.stdout)
        return doc

    def placement(self) -> dict[Key, tuple[str, ...]]:
        return {
            (r["name"], c["step"]): tuple(c["tiers"])
            for r in self.ls()["runs"]
            for c in r["checkpoints"]
            if c["tiers"]
        }

    # -- what is really on the tiers (not what the index says) --------------------------------

    def s3_keys(self, s3: Any) -> list[str]:
        keys: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            keys.extend(o["Key"] for o in page.get("Contents", []))
        return keys

    def s3_uploads(self, s3: Any) -> list[str]:
        return [u["Key"] for u in s3.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])]

    def litter(self, s3: Any) -> list[str]:
        """Our temporary leftovers anywhere: staging names, orphan manifests, multipart uploads."""
        out = [
            str(p)
            for root in (self.hot, self.warm)
            for p in root.rglob("*")
            if ".ckptkeeper-tmp" in p.name
            or (
                p.name.endswith(".ckptkeeper-manifest.json")
                and not p.with_name(p.name.removesuffix(".ckptkeeper-manifest.json")).exists()
            )
        ]
        keys = self.s3_keys(s3)
        out += [f"s3:{k}" for k in keys if ".ckptkeeper-tmp" in k]
        manifests = {k.removesuffix(".ckptkeeper-manifest.json") for k in keys if k.endswith("manifest.json")}
        for k in keys:
            if ".ckptkeeper-tmp" in k or k.endswith(".ckptkeeper-manifest.json"):
                continue
            root = "/".join(k.split("/")[:3])  # <prefix>/<run>/<checkpoint>
            if root not in manifests:
                out.append(f"s3 data without manifest:{k}")
        out += [f"s3 upload:{k}" for k in self.s3_uploads(s3)]
        return out

    def intact_in(self, key: Key, tier: str, s3: Any) -> bool:
        """True when ``tier`` holds a committed copy whose every byte matches what training wrote."""
        run, step = key
        want = self.template.hashes[key]
        name = f"checkpoint-{step}"
        if tier in ("hot", "warm"):
            base = (self.hot if tier == "hot" else self.warm) / run / name
            if tier == "warm" and not base.with_name(name + ".ckptkeeper-manifest.json").is_file():
                return False
            if not base.is_dir() or base.is_symlink():
                return False
            got = {str(p.relative_to(base)): sha(p.read_bytes()) for p in base.rglob("*") if p.is_file()}
            return got == want
        prefix = f"{self.prefix}/{run}/{name}"
        try:
            s3.head_object(Bucket=self.bucket, Key=prefix + ".ckptkeeper-manifest.json")
        except Exception:
            return False
        for rel, digest in want.items():
            try:
                body = s3.get_object(Bucket=self.bucket, Key=f"{prefix}/{rel}")["Body"].read()
            except Exception:
                return False
            if sha(body) != digest:
                return False
        return True

    def lost(self, s3: Any, keys: Iterable[Key] = GOLDEN) -> list[Key]:
        """Kept checkpoints with no intact committed copy in any tier right now."""
        return [k for k in keys if not any(self.intact_in(k, t, s3) for t in ("hot", "warm", "cold"))]

    def misplaced(self, s3: Any) -> list[str]:
        """Differences from GOLDEN, checked against the index AND the bytes in every tier it names."""
        problems = []
        placement = self.placement()
        for key, tiers in GOLDEN.items():
            if placement.get(key) != tiers:
                problems.append(f"{key}: index says {placement.get(key)}, expected {tiers}")
                continue
            problems += [f"{key}: copy in {t} not intact" for t in tiers if not self.intact_in(key, t, s3)]
        problems += [f"{key}: unexpected in {t}" for key, t in placement.items() if key not in GOLDEN]
        return problems

    def outside_intact(self) -> bool:
        return (self.outside / "precious.bin").read_bytes() == b"never delete me" * 100


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=60)
