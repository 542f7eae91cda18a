"""Tier access: streamed copy with hashing, verification, atomic commit, safe delete, usage.

One interface (:class:`TierStorage`) over two backends, picked from the tier URL:

* **local** paths (``/mnt/warm/ckpt`` or ``file:///…``) use plain ``os`` calls on directory file
  descriptors rather than fsspec's LocalFileSystem, because the safety invariants of docs/design.md, "Safety invariants" need
  ``O_NOFOLLOW`` walks, ``fsync`` of files *and* directories, ``rename`` inside one directory and
  ``st_dev`` checks that fsspec does not expose;
* **S3** (``s3://bucket/prefix``) uses s3fs only for what it does well — a configured aiobotocore
  client on fsspec's IO loop with bounded retries — and drives multipart uploads itself, so that
  memory stays bounded and every part carries a checksum computed in the same pass as the content
  hash.

Layout of a slower tier (docs/design.md, "Contracts"): ``<root>/<run>/<name>`` (a directory or a single file; ``name``
may contain ``/``) plus ``<root>/<run>/<name>.ckptkeeper-manifest.json`` beside it. The hot tier
(``hot=True``) holds no manifests: the catalog hashes it itself.

Commit protocol
---------------
Every copy is *copy → verify → commit*; the source is never modified, and a failure leaves nothing
that a listing would report as a committed copy.

* **Local**: data is streamed into ``<run>/<name>.ckptkeeper-tmp-<token>`` (files ``fsync``-ed,
  then every created directory), the manifest is written atomically (temp + ``fsync`` + rename),
  and the commit point is the final ``rename`` of the staging name into place (then the parent
  directory is ``fsync``-ed). A manifest whose data is missing is an *orphan* (crash between the
  two renames, or an interrupted delete): :meth:`list_manifests` skips it and :meth:`list_staging`
  reports it.
* **S3** has no rename (a server-side copy of 20 GB would double the cost), so data objects are
  written at their final keys and the **manifest object, written last with** ``If-None-Match: *``,
  is the commit point. Before any data is written a small marker object
  ``<run>/<name>.ckptkeeper-tmp-<token>`` records the copy in progress; it is removed after the
  commit. A marker without a manifest is an interrupted copy (:meth:`list_staging`), a marker with
  one is just stale. Deletes use the same marker, then remove the manifest (de-commit), then data.

S3 verification
---------------
Each part (and each small single-request object) is sent with ``ChecksumCRC32`` computed locally
from the very bytes that were hashed for the manifest. AWS S3 (and MinIO, Ceph RGW, …) reject a body
that does not match it (``BadDigest``), and for multipart objects the server derives a COMPOSITE
checksum (CRC32 of the part CRC32s, ``…-N``) from what it stored. After the upload we ``HEAD`` the
object with ``ChecksumMode=ENABLED`` and require the size of the manifest and our own composite
checksum, so no data is downloaded again. CRC32 rather than CRC32C: botocore needs ``awscrt`` for
CRC32C and moto silently falls back to CRC32 without the ``crc32c`` package; every S3 implementation
that speaks flexible checksums supports CRC32, computed here by ISA-L (``isal``; zlib's where it is
missing). ETag/MD5
was rejected: it is not an MD5 under SSE-KMS/SSE-C, multipart ETags differ between stores, and MD5
would cost a second, slower hash per byte. When a store echoes no checksum at all (an old S3
clone) the checksum cannot be trusted and the object is read back and re-hashed before commit.

Errors: every failure surfaces as :class:`StorageError` (listing failures as
:class:`TierUnavailable`, content mismatches as :class:`VerificationError`) with the cause chained;
messages never contain ``storage_options`` secrets.

Modules, each importing only those listed before it:

* ``base``: errors, shared constants, path and manifest checks, the reader/writer/sink protocols;
* ``localfs``: durable writes into a local directory through directory fds (the local backend's
  copies and every backend's restore);
* ``content``: a dedup tier's content store (``dedup = true``): copies that reference it, reads
  that follow the references (imported by ``tier``, importing none of the backends at load);
* ``content_gc``: the collection of a content store's unreferenced objects;
* ``tier``: the contract, :class:`TierStorage`, which also picks the backend for a URL;
* ``trash``: the trash of a tier (``undo_window``): entry names, and the local backend's move
  aside, purge and undelete;
* ``local``: :class:`LocalTierStorage`;
* ``local_fleet``: fleet objects (heartbeats, a lease) in a filesystem several nodes mount, with
  conditional writes built from ``link(2)`` and ``rename(2)`` (a shared hot tier);
* ``s3_client``: the S3 requests every S3 module builds on (client, errors, secret redaction);
* ``s3_bodies``: request bodies of uploads (a part held in a buffer) and the pool of buffers;
* ``s3_upload``: single-PUT and multipart uploads (and the ``_S3Tier`` surface they drive);
* ``s3_transfer``: the S3 reader and the S3 sink (marker, files, manifest commit);
* ``s3_trash``: an S3 tier's trash (server-side copies into and out of it);
* ``s3_staging``: staging markers and multipart uploads in an S3 tier, for the reaper;
* ``s3_fleet``: the fleet's lease and heartbeat objects in a shared bucket (conditional writes)
  and read-only views of other nodes' prefixes;
* ``s3``: :class:`S3TierStorage`.

This package re-exports the public names; patch internals where they are defined.
"""

from ckptkeeper.storage.base import (
    DAMAGED_COPY,
    MULTIPART_KIND,
    STAGING_KIND,
    Progress,
    StorageError,
    TierUnavailable,
    VerificationError,
)
from ckptkeeper.storage.local import LocalTierStorage
from ckptkeeper.storage.s3 import S3TierStorage
from ckptkeeper.storage.tier import TierStorage

__all__ = [
    "DAMAGED_COPY",
    "MULTIPART_KIND",
    "STAGING_KIND",
    "LocalTierStorage",
    "Progress",
    "S3TierStorage",
    "StorageError",
    "TierStorage",
    "TierUnavailable",
    "VerificationError",
]
