"""Names and sizes of a dedup tier's content objects (docs/dedup.md): where ``<hash>`` and
``<hash>.z`` live in the tier, and what the store holds at those names."""

from __future__ import annotations

import os
import stat
import string
from collections.abc import Iterable
from typing import Any

from ckptkeeper.storage.base import StorageError, _describe, _split_rel
from ckptkeeper.storage.content_codec import ENCODED_SUFFIX

CONTENT_DIR = ".ckptkeeper/content"
_HEX = frozenset(string.digits + "abcdef")


# -- names ----------------------------------------------------------------------------------


def node_dir(tier: Any) -> str:
    """This node's directory in the content store (``_`` for an unnamed node)."""
    node = tier.node or "_"
    if len(_split_rel(node, "node name")) != 1:
        raise StorageError(f"tier {tier.name!r}: node name {node!r} cannot name a content store")
    return f"{CONTENT_DIR}/{node}"


def content_rel(tier: Any, digest: str, encoded: bool = False) -> str:
    """Tier-relative path of the content object ``digest`` (never anything a manifest spells)."""
    if len(digest) != 32 or not set(digest) <= _HEX:
        raise StorageError(f"tier {tier.name!r}: {digest!r} cannot name a content object")
    return f"{node_dir(tier)}/{digest[:2]}/{digest}{ENCODED_SUFFIX if encoded else ''}"


# -- the backends' content primitives --------------------------------------------------------


def _is_s3(tier: Any) -> bool:
    return not tier.is_local


def size_of(tier: Any, digest: str) -> int | None:
    """Size of the content object ``digest``, None if absent (or not a regular file)."""
    return sizes_of(tier, [digest]).get(digest)


def name_rel(tier: Any, name: str) -> str:
    """Tier-relative path of the content object called ``name`` (``<hash>`` or ``<hash>.z``)."""
    encoded = name.endswith(ENCODED_SUFFIX)
    return content_rel(tier, name[: -len(ENCODED_SUFFIX)] if encoded else name, encoded)


def sizes_of(tier: Any, names: Iterable[str]) -> dict[str, int | None]:
    """Size of each content object by name (None: absent); S3 asks 16 HEADs at once."""
    wanted = sorted(set(names))
    rels = {d: name_rel(tier, d) for d in wanted}
    if _is_s3(tier):
        return _s3_sizes(tier, rels)
    return {d: _local_size(tier, rel) for d, rel in rels.items()}


def _local_size(tier: Any, rel: str) -> int | None:
    parts = _split_rel(rel)
    try:
        with tier._parent_fd(parts, dev_check=False) as dir_fd:
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise StorageError(f"tier {tier.name!r}: cannot look at {rel}: {_describe(exc)}") from exc
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _s3_sizes(tier: Any, rels: dict[str, str]) -> dict[str, int | None]:
    import asyncio

    from fsspec.asyn import sync

    async def head(key: str) -> int | None:
        try:
            resp = await tier.fs._call_s3("head_object", Bucket=tier.bucket, Key=key)
        except FileNotFoundError:
            return None
        return int(resp["ContentLength"])

    async def all_heads() -> list[int | None]:
        sem = asyncio.Semaphore(16)

        async def one(key: str) -> int | None:
            async with sem:
                return await head(key)

        return await asyncio.gather(*(one(tier._key(r)) for r in rels.values()))

    if not rels:
        return {}
    with tier._errors("looking at content objects"):
        got = sync(tier.fs.loop, all_heads)
    return dict(zip(rels, got, strict=True))
