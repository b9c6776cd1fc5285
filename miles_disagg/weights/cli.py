"""``miles-disagg weights publish|apply|verify|inspect|ls|fetch-base``.

A store (``--store``) is a directory or an ``s3://bucket/prefix`` URL (:mod:`miles_disagg.weights.location`).

Every command prints one JSON object on stdout. Refused operations and bad input raise a
``MilesDisaggError`` (the top-level CLI prints one line and exits 2); nothing is changed
in the store or the local checkpoint when a command fails.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from miles_disagg.config.commands import action_config, add_actions
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.tracking import status
from miles_disagg.types import FormatError, InvalidInput, LayoutMismatch
from miles_disagg.weights.checksums import CHECKSUMS, DEFAULT_CHECKSUM
from miles_disagg.weights.codec import PUBLISH_ENCODINGS
from miles_disagg.weights.format import FILTERS

BASE_DIR_HELP = "Version 0: the base HF checkpoint."
STORE_HELP = "The version store: a directory or s3://bucket/prefix."
WORKERS_HELP = "Worker threads reading and writing payloads."


@dataclass(kw_only=True)
class PublishCommand:
    """publish --target-dir as the next version on --store"""

    base_dir: str = flag(REQUIRED, BASE_DIR_HELP)
    target_dir: str = flag(REQUIRED, "HF checkpoint with the new weights (same tensors).")
    store: str = flag(REQUIRED, STORE_HELP)
    encoding: str = flag("xor", "Delta encoding.", choices=PUBLISH_ENCODINGS)
    checksum: str = flag(DEFAULT_CHECKSUM, "Final-state checksum.", choices=CHECKSUMS)
    filter: str = flag("byteplane", "Payload filter (none: the plain format).", choices=FILTERS)
    run_id: str | None = flag(None, "Run id (default: the store's run, or a new one).")
    anchor_interval: int = flag(0, "Publish a full version every N versions (0: never).")
    post_write_hook: str | None = flag(None, "Hook run before LATEST moves.", metavar="MODULE:FUNCTION")
    workers: int = flag(2, WORKERS_HELP)
    base_in_store: bool = flag(False, "Also put --base-dir into the object store once, as its version 0 (engines "
                                      "and replicas started with --base-from-store fetch it from there; a LoRA "
                                      "adapter directory becomes the adapter chain's version 0, which engines "
                                      "started with --lora-base-from-store fetch).")


@dataclass(kw_only=True)
class ApplyCommand:
    """materialize --local-dir at a published version"""

    store: str = flag(REQUIRED, STORE_HELP)
    base_dir: str = flag(REQUIRED, BASE_DIR_HELP)
    local_dir: str = flag(REQUIRED, "Host-local checkpoint (a symlink to an A/B slot).")
    to_version: int | None = flag(None, "Target version (default: the latest).")
    pre_read_hook: str | None = flag(None, "Hook run before reading a version.", metavar="MODULE:FUNCTION")
    workers: int = flag(2, WORKERS_HELP)


@dataclass(kw_only=True)
class VerifyCommand:
    """check a version, its payloads and its lineage"""

    store: str = flag(REQUIRED, STORE_HELP)
    version: int | None = flag(None, "Version to check (default: the latest).")
    base_dir: str | None = flag(None, "Also replay from the base and check final checksums.")
    workers: int = flag(2, WORKERS_HELP)


@dataclass(kw_only=True)
class InspectCommand:
    """versions, sizes, density and lineage of a store"""

    store: str = flag(REQUIRED, STORE_HELP)


@dataclass(kw_only=True)
class FetchBaseCommand:
    """the object store's base checkpoint into a local directory (a node with no copy of it)"""

    store: str = flag(REQUIRED, "The object store holding the base (s3://bucket/prefix).")
    dest: str = flag(REQUIRED, "Where the base goes (created; kept when it already holds this base).")
    lora: bool = flag(False, "Fetch the store's LoRA adapter chain's version 0 instead of the model's base "
                             "(checked whole as an adapter).")


ACTIONS = {"publish": PublishCommand, "apply": ApplyCommand, "verify": VerifyCommand, "inspect": InspectCommand,
           "ls": InspectCommand, "fetch-base": FetchBaseCommand}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_actions(parser, "weights_command", "ACTION", ACTIONS)


def run(args: argparse.Namespace) -> int:
    handlers = {"publish": _publish, "apply": _apply, "verify": _verify, "inspect": _inspect, "ls": _inspect,
                "fetch-base": _fetch_base}
    command = action_config(args, "weights_command", ACTIONS)
    try:
        result = handlers[args.weights_command](command)
    except OSError as exc:  # a missing or unreadable path the user gave
        raise InvalidInput(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")) from None
    print(json.dumps(result, indent=1, default=str))
    return 0


def _require_dir(path: str, flag: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise InvalidInput(f"{flag} {path} is not a directory")
    return p


def _require_store(text: str, *, exists: bool = True) -> str:
    """A store URL is parsed (another scheme is refused); a directory must exist when ``exists``."""
    from miles_disagg.weights.location import is_url, parse_object_url

    if is_url(text):
        return parse_object_url(text, "--store").url
    return str(_require_dir(text, "--store")) if exists else text


def _publish(command: PublishCommand) -> dict[str, Any]:
    from miles_disagg.weights.publisher import DeltaPublisher

    _require_store(command.store, exists=False)
    base = _require_dir(command.base_dir, "--base-dir")
    target = _require_dir(command.target_dir, "--target-dir")
    publisher = DeltaPublisher(
        command.store, base_dir=base, run_id=command.run_id, encoding=command.encoding, checksum=command.checksum,
        filter=command.filter, post_write_hook=command.post_write_hook, full_anchor_interval=command.anchor_interval,
        num_workers=command.workers, base_in_store=command.base_in_store,
    )
    try:
        status(f"capturing the baseline from {base}")
        publisher.capture_baseline()
        status(f"diffing {target} against it and publishing to {command.store}")
        result = publisher.publish(_stream_checkpoint(target, set(publisher.tensor_names)))
    finally:
        publisher.close()
    status(f"published version {result.ref.version} ({result.wire_bytes} bytes on the wire, density {result.density:.4f})")
    return {"run_id": result.ref.run_id, "version": result.ref.version, "base_version": result.ref.version - 1,
            "delta_encoding": result.delta_encoding, "density": result.density, "wire_bytes": result.wire_bytes,
            "changed_bytes": result.changed_bytes, "total_bytes": result.total_bytes,
            "num_changed_tensors": result.num_changed_tensors, "encode_time_s": result.encode_time_s,
            "publish_time_s": result.publish_time_s}


def _stream_checkpoint(ckpt_dir: Path, expected: set[str]) -> Iterator[tuple[str, Any]]:
    """Tensors of a checkpoint one at a time; it must hold exactly the baseline's names."""
    from safetensors import safe_open

    from miles_disagg.weights.safetensors_io import checkpoint_tensors

    found = checkpoint_tensors(ckpt_dir)
    missing, extra = sorted(expected - found.keys()), sorted(found.keys() - expected)
    if missing or extra:
        raise LayoutMismatch(f"--target-dir {ckpt_dir} does not match the base: missing {missing[:5]}, unexpected {extra[:5]}")
    by_file: dict[str, list[str]] = {}
    for name, (file_name, _) in found.items():
        by_file.setdefault(file_name, []).append(name)
    for file_name, names in sorted(by_file.items()):
        try:
            handle = safe_open(str(ckpt_dir / file_name), framework="pt")
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise FormatError(f"cannot read {ckpt_dir / file_name}: {exc}") from None
        with handle as f:
            for name in sorted(names):
                yield name, f.get_tensor(name)


def _apply(command: ApplyCommand) -> dict[str, Any]:
    from miles_disagg.weights.materializer import Materializer

    base = _require_dir(command.base_dir, "--base-dir")
    _require_store(command.store)
    materializer = Materializer(command.local_dir, base_dir=base, pre_read_hook=command.pre_read_hook, num_workers=command.workers)
    status(f"materializing {'the latest version' if command.to_version is None else f'version {command.to_version}'} "
           f"of {command.store} into {materializer.local_dir}")
    prepared = materializer.prepare(command.store, command.to_version)
    status(f"{materializer.local_dir} holds version {prepared.ref.version} (verified)")
    return {"run_id": prepared.ref.run_id, "version": prepared.ref.version,
            "previous": None if prepared.previous is None else prepared.previous.version,
            "num_changed_tensors": len(prepared.changed), "path": str(prepared.path),
            "local_dir": str(materializer.local_dir)}


def _verify(command: VerifyCommand) -> dict[str, Any]:
    from miles_disagg.weights.audit import verify_version
    from miles_disagg.weights.stores import open_store

    _require_store(command.store)
    if command.base_dir is not None:
        _require_dir(command.base_dir, "--base-dir")
    report = verify_version(open_store(command.store), command.version, command.base_dir, command.workers)
    return {"ok": True, **report}


def _inspect(command: InspectCommand) -> dict[str, Any]:
    from miles_disagg.weights.audit import describe_store
    from miles_disagg.weights.stores import open_store

    _require_store(command.store)
    return describe_store(open_store(command.store))


def _fetch_base(command: FetchBaseCommand) -> dict[str, Any]:
    from miles_disagg.weights.location import is_url
    from miles_disagg.weights.object_base import ADAPTER, MODEL, pull_base
    from miles_disagg.weights.stores import open_store

    if not is_url(command.store):
        raise InvalidInput(f"--store {command.store}: only an object store holds a base (a directory store's base "
                           "is the --base-dir its publisher was given)")
    dest = Path(command.dest)
    store = open_store(_require_store(command.store), cache_dir=dest.parent / f".{dest.name}.mirror")
    kind = ADAPTER if command.lora else MODEL
    status(f"fetching the {kind.what} of {store.display} into {dest}")
    folder = pull_base(store, dest, kind)
    files = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    return {"store": store.display, "dest": str(folder), "files": files,
            "bytes": sum((folder / f).stat().st_size for f in files)}

