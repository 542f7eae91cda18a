"""The baseline a user would write instead of ckptkeeper: a whole ``python`` process that imports
boto3 and moves the files with the managed transfers (default ``TransferConfig``).

``python -m bench._boto3_job upload ENDPOINT BUCKET PREFIX ROOT``: ``upload_file`` of every regular
file under ``ROOT`` (sorted) to ``PREFIX/<relative path>``.
``python -m bench._boto3_job download ENDPOINT BUCKET PREFIX DEST [SKIP]``: ``download_file`` of every
object under ``PREFIX/`` into ``DEST/<relative key>``, skipping keys whose last component is ``SKIP``
(ckptkeeper's manifest, which the restore reads but does not hand to the user).

The parent measures the whole process (wall, CPU, peak RSS): imports and client set-up included,
as for ``ckptkeeper prune``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    op, endpoint, bucket, prefix, where = argv[:5]
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    if op == "upload":
        root = Path(where)
        files = sorted(
            os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names
        )
        for rel in files:
            client.upload_file(str(root / rel), bucket, f"{prefix}/{rel}")
        return
    skip = argv[5] if len(argv) > 5 else ""
    dest = Path(where)
    keys = [
        obj["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
        for obj in page.get("Contents", [])
    ]
    for key in keys:
        rel = key[len(prefix) + 1 :]
        if skip and rel.rsplit("/", 1)[-1] == skip:
            continue
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(out))


if __name__ == "__main__":
    main(sys.argv[1:])
