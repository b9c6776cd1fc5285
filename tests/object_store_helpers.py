"""Test helpers (no pytest import): versions staged straight through the object store's own commit,
with payloads of random bytes, and a child process that publishes them in a loop (to be killed)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from miles_disagg.types import VersionRef
from miles_disagg.weights.format import INDEX_NAME, VersionIndex
from miles_disagg.weights.object_store import ObjectVersionStore
from miles_disagg.weights.stores import open_store

PAYLOAD_NAME = "part-00000.safetensors"


def stage_version(store: ObjectVersionStore, version: int, run_id: str, payload: bytes) -> Path:
    """A staging directory holding version ``version``'s index and one payload (not valid safetensors:
    the store never parses payloads, the engines' apply does)."""
    staging = store.new_staging_dir(version)
    (staging / PAYLOAD_NAME).write_bytes(payload)
    index = VersionIndex(version=version, base_version=version - 1, run_id=run_id, delta_encoding="xor",
                         compression_format="zstd", checksum_format="xxh3-128", filter="none", chunk_bytes=1 << 22,
                         weight_map={"w": PAYLOAD_NAME})
    (staging / INDEX_NAME).write_text(json.dumps(index.to_json()))
    return staging


def commit_next(store: ObjectVersionStore, run_id: str, payload: bytes) -> VersionRef:
    """Stage and commit the version after the store's latest."""
    latest = store.latest()
    ref = VersionRef(run_id, (latest.version if latest else 0) + 1)
    store.commit(stage_version(store, ref.version, run_id, payload), ref, latest)
    return ref


def main() -> None:
    """``python object_store_helpers.py URL CACHE RUN_ID``: commit versions of 2 MiB forever (until killed)."""
    url, cache, run_id = sys.argv[1:4]
    store = open_store(url, cache_dir=cache)
    print("ready", flush=True)
    while True:
        commit_next(store, run_id, os.urandom(2 * 1024 * 1024))


if __name__ == "__main__":
    main()
