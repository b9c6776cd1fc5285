"""``miles-disagg bench publish``: sharded publication with 1, 2, 4... ranks, side by side.

Model and update: the ``bench delta`` model (bf16 LLM shapes, one AdamW step at ``--lr``), written
as a base checkpoint and a trained one. For each rank count, that many processes (torch.distributed
over gloo, as trainer ranks) each own a share of the tensors (``assign_by_size``), capture the
baseline of their share, then publish the trained weights together: every rank encodes and
writes its share, rank 0 commits the one version.

Per rank count: the largest per-rank snapshot and payload (encoded) bytes, the publish wall time
(every share written and the version committed, on rank 0) and the commit's part of it, and the
total wire, which must equal the 1-rank wire within 1% (the same tensors, encoded the same way).
On 2 cores the wall time cannot fall much; the per-rank bytes fall as 1/ranks.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from miles_disagg.bench.common import print_result, progress, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag

say = progress("publish")


@dataclass(kw_only=True)
class PublishBench:
    """sharded publication: per-rank snapshot and payload bytes, wall time, wire for 1, 2, 4 ranks"""

    ranks: str = flag("1,2,4", "Comma-separated rank counts to publish with.")
    size_mb: float = flag(128.0, "Model size in MiB (bf16).")
    lr: float = flag(1e-5, "AdamW learning rate of the simulated step.")
    workers: int = flag(1, "Encoding threads per rank.")
    seed: int = flag(0, "Seed of the synthetic model.")
    json: bool = flag(False, "Print the JSON object only (always JSON on stdout).")

    def __post_init__(self) -> None:
        try:
            counts = [int(r) for r in self.ranks.split(",") if r.strip()]
        except ValueError:
            counts = []
        if not counts or any(c < 1 or c > 64 for c in counts):
            raise ValueError(f"--ranks must be comma-separated integers in 1..64, got {self.ranks!r}")
        if self.size_mb <= 0 or self.workers < 1 or self.lr < 0:
            raise ValueError("--size-mb must be > 0, --workers >= 1 and --lr >= 0")

    @property
    def rank_counts(self) -> list[int]:
        return [int(r) for r in self.ranks.split(",") if r.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, PublishBench)


def write_checkpoints(root: Path, size_mb: float, lr: float, seed: int, files: int = 4) -> tuple[Path, Path]:
    """The ``bench delta`` model before and after its step, as two bf16 checkpoints (``files`` each)."""
    from miles_disagg.bench.delta import make_model, model_shapes
    from miles_disagg.weights.safetensors_io import write_file

    old, new = make_model(size_mb, lr, seed)
    shapes = dict(model_shapes(int(size_mb * 1024 * 1024)))
    names = list(old)
    dirs = []
    for label, arrays in (("base", old), ("trained", new)):
        directory = root / label
        directory.mkdir(parents=True, exist_ok=True)
        for i in range(files):
            part = names[i::files]
            if part:
                write_file(directory / f"model-{i:05d}-of-{files:05d}.safetensors",
                           {n: ("BF16", shapes[n], arrays[n]) for n in part}, fsync=False)
        dirs.append(directory)
    return dirs[0], dirs[1]


def publish_with_ranks(base: Path, trained: Path, store: Path, ranks: int, workers: int = 1,
                       timeout_s: float = 600.0, filter: str = "byteplane") -> dict[str, Any]:
    """Publish ``trained`` onto ``store`` (baseline ``base``) with ``ranks`` processes; rank 0's report."""
    context = multiprocessing.get_context("spawn")
    init_file = store.parent / f".dist-{store.name}-{time.time_ns()}"
    queue = context.Queue()
    procs = [context.Process(target=_rank_main, args=(rank, ranks, str(init_file), str(base), str(trained),
                                                      str(store), workers, filter, queue), daemon=True)
             for rank in range(ranks)]
    for proc in procs:
        proc.start()
    try:
        reports = [queue.get(timeout=timeout_s) for _ in range(ranks)]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    failed = [r for r in reports if "error" in r]
    if failed:
        raise RuntimeError(f"publishing with {ranks} ranks failed: {failed}")
    root = next(r for r in reports if r["rank"] == 0)
    root["rank_snapshot_bytes"] = [r["snapshot_bytes"] for r in sorted(reports, key=lambda r: r["rank"])]
    return root


def _rank_main(rank: int, ranks: int, init_file: str, base: str, trained: str, store: str, workers: int,
               filter: str, queue: Any) -> None:
    try:
        queue.put(_publish_share(rank, ranks, init_file, base, trained, store, workers, filter))
    except BaseException as exc:  # reported to the parent, which raises
        queue.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def _publish_share(rank: int, ranks: int, init_file: str, base: str, trained: str, store: str,
                   workers: int, filter: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from miles_disagg.weights.commit import TorchCollective
    from miles_disagg.weights.publisher import DeltaPublisher
    from miles_disagg.weights.safetensors_io import checkpoint_tensors, read_bytes
    from miles_disagg.weights.shares import assign_by_size
    from miles_disagg.weights.torch_bytes import dtype_from_code

    torch.set_num_threads(1)
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
    entries = checkpoint_tensors(trained)
    share = assign_by_size({n: e.nbytes for n, (_, e) in entries.items()}, ranks)[rank]
    publisher = DeltaPublisher(store, base_dir=base, num_workers=workers, share=share, filter=filter,
                               collective=TorchCollective() if ranks > 1 else None)
    publisher.capture_baseline()
    tensors = [(n, torch.frombuffer(read_bytes(Path(trained) / f, e), dtype=dtype_from_code(e.dtype)).view(e.shape))
               for n, (f, e) in sorted(entries.items()) if n in share]
    if ranks > 1:
        dist.barrier()
    start = time.perf_counter()
    result = publisher.publish(tensors)
    wall = time.perf_counter() - start
    report: dict[str, Any] = {"rank": rank, "snapshot_bytes": publisher.snapshot_bytes}
    if result is not None:
        report.update({"version": result.ref.version, "publish_wall_s": wall, "commit_wall_s": result.commit_time_s,
                       "encode_s": result.encode_time_s, "wire_bytes": result.wire_bytes,
                       "max_snapshot_bytes": result.snapshot_bytes, "max_rank_wire_bytes": result.max_rank_wire_bytes,
                       "changed_bytes": result.changed_bytes, "total_bytes": result.total_bytes})
    publisher.close()
    if ranks > 1:
        dist.destroy_process_group()
    return report


def run(args: argparse.Namespace) -> int:
    command = config_from_args(PublishBench, args)
    with work_dir("publish", None) as root:
        say(f"writing a {command.size_mb:g} MiB bf16 model and its AdamW step (lr {command.lr:g})")
        base, trained = write_checkpoints(root, command.size_mb, command.lr, command.seed)
        rows = []
        for ranks in command.rank_counts:
            say(f"publishing with {ranks} rank(s)")
            report = publish_with_ranks(base, trained, root / f"store-{ranks}", ranks, command.workers)
            rows.append({"ranks": ranks, **{k: report[k] for k in (
                "max_snapshot_bytes", "max_rank_wire_bytes", "publish_wall_s", "commit_wall_s", "encode_s",
                "wire_bytes", "rank_snapshot_bytes")}})
    model = rows[0] and sum(rows[0]["rank_snapshot_bytes"])
    one = next((r for r in rows if r["ranks"] == 1), rows[0])
    for row in rows:
        row["wire_vs_1rank"] = row["wire_bytes"] / max(one["wire_bytes"], 1)
        row["snapshot_vs_model_over_ranks"] = row["max_snapshot_bytes"] / (model / row["ranks"])
    return print_result({"bench": "publish", "config": asdict(command), "model_bytes": model, "results": rows,
                         "wire_equal_within_1pct": all(abs(r["wire_vs_1rank"] - 1) <= 0.01 for r in rows)})
