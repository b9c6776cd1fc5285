"""``miles-disagg weights publish|apply|verify|inspect``.

Every command prints one JSON object on stdout. Refused operations and bad input raise a
``MilesDisaggError`` (the top-level CLI prints one line and exits 2); nothing is changed
in the store or the local checkpoint when a command fails.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

from miles_disagg.tracking import status
from miles_disagg.types import FormatError, InvalidInput, LayoutMismatch
from miles_disagg.weights.checksums import CHECKSUMS, DEFAULT_CHECKSUM
from miles_disagg.weights.codec import FILTERS, PUBLISH_ENCODINGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="weights_command", metavar="ACTION")
    sub.required = True

    publish = sub.add_parser("publish", help="publish --target-dir as the next version on --store")
    publish.add_argument("--base-dir", required=True, help="version 0: the base HF checkpoint")
    publish.add_argument("--target-dir", required=True, help="HF checkpoint with the new weights (same tensors)")
    publish.add_argument("--store", required=True, help="the publication directory")
    publish.add_argument("--encoding", default="xor", choices=PUBLISH_ENCODINGS, help="delta encoding (default xor)")
    publish.add_argument("--checksum", default=DEFAULT_CHECKSUM, choices=CHECKSUMS, help="final-state checksum")
    publish.add_argument("--filter", default="byteplane", choices=FILTERS, help="payload filter (none: the plain format)")
    publish.add_argument("--run-id", default=None, help="run id (default: the store's run, or a new one)")
    publish.add_argument("--anchor-interval", type=int, default=0, help="publish a full version every N versions")
    publish.add_argument("--post-write-hook", default=None, help="module:function run before LATEST moves")
    publish.add_argument("--workers", type=int, default=2)

    apply = sub.add_parser("apply", help="materialize --local-dir at a published version")
    apply.add_argument("--store", required=True)
    apply.add_argument("--base-dir", required=True, help="version 0: the base HF checkpoint")
    apply.add_argument("--local-dir", required=True, help="host-local checkpoint (a symlink to an A/B slot)")
    apply.add_argument("--to-version", type=int, default=None, help="target version (default: latest)")
    apply.add_argument("--pre-read-hook", default=None, help="module:function run before reading a version")
    apply.add_argument("--workers", type=int, default=2)

    verify = sub.add_parser("verify", help="check a version, its payloads and its lineage")
    verify.add_argument("--store", required=True)
    verify.add_argument("--version", type=int, default=None, help="default: latest")
    verify.add_argument("--base-dir", default=None, help="also replay from the base and check final checksums")
    verify.add_argument("--workers", type=int, default=2)

    inspect = sub.add_parser("inspect", help="versions, sizes, density and lineage of a store")
    inspect.add_argument("--store", required=True)


def run(args: argparse.Namespace) -> int:
    handlers = {"publish": _publish, "apply": _apply, "verify": _verify, "inspect": _inspect}
    try:
        result = handlers[args.weights_command](args)
    except OSError as exc:  # a missing or unreadable path the user gave
        raise InvalidInput(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")) from None
    print(json.dumps(result, indent=1, default=str))
    return 0


def _require_dir(path: str, flag: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise InvalidInput(f"{flag} {path} is not a directory")
    return p


def _publish(args: argparse.Namespace) -> dict[str, Any]:
    from miles_disagg.weights.publisher import DeltaPublisher

    base = _require_dir(args.base_dir, "--base-dir")
    target = _require_dir(args.target_dir, "--target-dir")
    publisher = DeltaPublisher(
        args.store, base_dir=base, run_id=args.run_id, encoding=args.encoding, checksum=args.checksum,
        filter=args.filter, post_write_hook=args.post_write_hook, full_anchor_interval=args.anchor_interval,
        num_workers=args.workers,
    )
    try:
        status(f"capturing the baseline from {base}")
        publisher.capture_baseline()
        status(f"diffing {target} against it and publishing to {args.store}")
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


def _apply(args: argparse.Namespace) -> dict[str, Any]:
    from miles_disagg.weights.materializer import Materializer

    base = _require_dir(args.base_dir, "--base-dir")
    _require_dir(args.store, "--store")
    materializer = Materializer(args.local_dir, base_dir=base, pre_read_hook=args.pre_read_hook, num_workers=args.workers)
    status(f"materializing {'the latest version' if args.to_version is None else f'version {args.to_version}'} "
           f"of {args.store} into {materializer.local_dir}")
    prepared = materializer.prepare(args.store, args.to_version)
    status(f"{materializer.local_dir} holds version {prepared.ref.version} (verified)")
    return {"run_id": prepared.ref.run_id, "version": prepared.ref.version,
            "previous": None if prepared.previous is None else prepared.previous.version,
            "num_changed_tensors": len(prepared.changed), "path": str(prepared.path),
            "local_dir": str(materializer.local_dir)}


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    from miles_disagg.weights.audit import verify_version
    from miles_disagg.weights.store import VersionStore

    _require_dir(args.store, "--store")
    if args.base_dir is not None:
        _require_dir(args.base_dir, "--base-dir")
    report = verify_version(VersionStore(args.store), args.version, args.base_dir, args.workers)
    return {"ok": True, **report}


def _inspect(args: argparse.Namespace) -> dict[str, Any]:
    from miles_disagg.weights.audit import describe_store
    from miles_disagg.weights.store import VersionStore

    _require_dir(args.store, "--store")
    return describe_store(VersionStore(args.store))
