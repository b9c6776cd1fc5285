"""``miles-disagg bench store``: the version store on an object store against a shared directory, and
one WAN copy per region with a relay against one per engine. Simulated, on one machine: say so.

Model and update: the ``bench publish`` model (bf16 LLM shapes, one AdamW step at ``--lr``; 1e-6
changes about 4% of the elements, delta-physics.md), published as version 1. Engines are simulated
hosts (:mod:`miles_disagg.bench.store_fleet`): each materializes the version into its own local
checkpoint exactly as an engine's ``/pull_weights`` does, started before the clock. The S3 server is
moto on loopback (``--endpoint``: another), the WAN a proxy in front of it
(:mod:`miles_disagg.bench.wan_proxy`: one token bucket of ``--wan-mb-per-s`` shared by every
connection, ``--wan-rtt-ms`` per request).

Sections, side by side in one run:

* ``loopback``: publish-to-every-engine-ready for ``2 x --engines-per-region`` hosts, from a shared
  directory and from the object store on loopback (no WAN): ``s3_vs_directory``;
* ``wan``: the far region's ``--engines-per-region`` hosts behind the emulated WAN, pulling straight
  from the store and through one relay on their side of it: time to every host ready, WAN bytes
  (what crossed the proxy) per version per region: ``wan_bytes_per_region_vs_version`` with the relay,
  and without; against a full-checkpoint transfer of the same model across the same WAN, one copy
  and one per host. The hosts share this machine's cores, so 8 hosts applying a version at once take
  8 hosts' CPU from 2 cores: ``ready_s`` is that measured time; ``ready_own_cpus_s`` the time of a
  fleet whose hosts each have CPUs of their own, measured in two parts: every host fetching the
  version's objects at once across the WAN, applying nothing (``fetch_s``: a round of its own, with
  a cold relay), plus one host applying alone (``apply_alone_s``). The ``far_region_ready_vs_*``
  ratios use it, ``..._shared_cpus_...`` the measured time;
* ``memory``: a pulling process's peak RSS fetching single-object versions of ``--memory-sizes-mb``.

``--sections`` picks some of them (the model is written either way).

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from miles_disagg.bench.common import print_result, progress, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag

say = progress("store")
BUCKET = "bench-store"
SECTIONS = ("loopback", "wan", "memory")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


@dataclass(kw_only=True)
class StoreBench:
    """object store vs shared directory: publish-to-every-engine-ready, WAN bytes per region with a relay, pull memory"""

    size_mb: float = flag(256.0, "Model size in MiB (bf16).")
    lr: float = flag(1e-6, "AdamW learning rate of the simulated step (sets the delta's density).")
    engines_per_region: int = flag(8, "Simulated engine hosts per region.")
    wan_mb_per_s: float = flag(100.0, "Bandwidth of the emulated WAN between the regions, MiB/s.")
    wan_rtt_ms: float = flag(80.0, "Round trip of the emulated WAN, per request.")
    memory_sizes_mb: str = flag("100,1000", "Sizes (MiB) of the single-object versions the memory section pulls.")
    endpoint: str | None = flag(None, "An S3-API server to use (default: moto on loopback, started here).")
    seed: int = flag(0, "Seed of the synthetic model.")
    sections: str = flag(",".join(SECTIONS), "What to measure, comma-separated: " + ", ".join(SECTIONS) + ".")
    keep: Path | None = flag(None, "Keep the work directory here.")
    json: bool = flag(False, "Print the JSON object only (always JSON on stdout).")

    def __post_init__(self) -> None:
        if self.size_mb <= 0 or self.engines_per_region < 1 or self.wan_mb_per_s <= 0 or self.wan_rtt_ms < 0:
            raise ValueError("--size-mb, --engines-per-region and --wan-mb-per-s must be > 0, --wan-rtt-ms >= 0")
        if not self.memory_sizes:
            raise ValueError(f"--memory-sizes-mb must be comma-separated sizes, got {self.memory_sizes_mb!r}")
        unknown = set(self.section_names) - set(SECTIONS)
        if unknown or not self.section_names:
            raise ValueError(f"--sections: unknown or none {sorted(unknown)}; choose from {', '.join(SECTIONS)}")

    @property
    def section_names(self) -> list[str]:
        return [part.strip() for part in self.sections.split(",") if part.strip()]

    @property
    def memory_sizes(self) -> list[float]:
        try:
            return [float(s) for s in self.memory_sizes_mb.split(",") if s.strip() and float(s) > 0]
        except ValueError:
            return []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, StoreBench)


def run(args: argparse.Namespace) -> int:
    from miles_disagg.bench.store_fleet import LocalS3

    bench = config_from_args(StoreBench, args)
    server = None if bench.endpoint else LocalS3.start()
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": bench.endpoint or server.url, "OMP_NUM_THREADS": "1"}
    os.environ.update({k: env[k] for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")})
    try:
        with work_dir("store", bench.keep) as root:
            _bucket(env["AWS_ENDPOINT_URL"])
            return print_result(measure(bench, root, env))
    finally:
        if server is not None:
            server.stop()


def _bucket(endpoint: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)


def measure(bench: StoreBench, root: Path, env: dict[str, str]) -> dict[str, Any]:
    from miles_disagg.bench.publish import write_checkpoints

    say(f"writing the {bench.size_mb:.0f} MiB model and its step (lr {bench.lr})")
    base, trained = write_checkpoints(root / "model", bench.size_mb, bench.lr, bench.seed)
    model_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    result = {"bench": "store", "simulated": "engine hosts are processes materializing versions (no model runs); the "
                                             "S3 server is moto on loopback; the WAN is a rate-limited proxy",
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(bench).items()},
              "model_bytes": model_bytes}
    if "loopback" in bench.section_names:
        result["loopback"] = loopback = _loopback(bench, root, base, trained, env)
        result["s3_vs_directory"] = loopback["s3_vs_directory"]
    if "wan" in bench.section_names:
        result["wan"] = wan = _wan(bench, root, base, trained, env, model_bytes)
        result.update(_wan_ratios(wan))
    if "memory" in bench.section_names:
        result["memory"] = memory = _memory(bench, root, base, env)
        result["peak_rss_largest_vs_smallest"] = memory["peak_rss_largest_vs_smallest"]
    return result


def _wan_ratios(wan: dict[str, Any]) -> dict[str, float]:
    relay, one_copy, per_engine = wan["relay"], wan["full_checkpoint_one_copy_s"], wan["full_checkpoint_per_engine_s"]
    return {"wan_bytes_per_region_vs_version": relay["wan_bytes_vs_version"],
            "wan_bytes_per_region_vs_version_without_relay": wan["direct"]["wan_bytes_vs_version"],
            "far_region_ready_vs_full_checkpoint_one_copy": relay["ready_own_cpus_s"] / one_copy,
            "far_region_ready_vs_full_checkpoint_per_engine": relay["ready_own_cpus_s"] / per_engine,
            "far_region_ready_shared_cpus_vs_full_checkpoint_one_copy": relay["ready_s"] / one_copy}


def _publish(store: str, base: Path, trained: Path) -> tuple[float, int]:
    """Publish ``trained`` as version 1 of ``store`` (one trainer rank, in this process): seconds from the
    first tensor to the commit, and the version's bytes as stored."""
    import torch

    from miles_disagg.weights.publisher import DeltaPublisher
    from miles_disagg.weights.safetensors_io import checkpoint_tensors, read_bytes
    from miles_disagg.weights.stores import open_store
    from miles_disagg.weights.torch_bytes import dtype_from_code

    entries = checkpoint_tensors(trained)
    tensors = [(n, torch.frombuffer(read_bytes(trained / f, e), dtype=dtype_from_code(e.dtype)).view(e.shape))
               for n, (f, e) in sorted(entries.items())]
    publisher = DeltaPublisher(store, base_dir=base, run_id="bench-store")
    try:
        publisher.capture_baseline()
        start = time.perf_counter()
        publisher.publish(tensors)
        seconds = time.perf_counter() - start
    finally:
        publisher.close()
    reader = open_store(store)
    index = reader.read_index(1)
    pointer = getattr(reader, "read_pointer", lambda: None)()
    manifest = pointer.manifests[1].nbytes if pointer is not None else 0
    return seconds, reader.payload_bytes(index) + manifest


def _ready(stores: list[str], root: Path, label: str, base: Path, env: dict[str, str],
           pull_only: bool = False) -> tuple[float, list[dict]]:
    from miles_disagg.bench.store_fleet import EngineHost, all_ready

    hosts = [EngineHost(store, root / f"{label}-host-{i}", base, env, pull_only) for i, store in enumerate(stores)]
    try:
        return all_ready(hosts, 1)
    finally:
        for host in hosts:
            host.stop()


def _loopback(bench: StoreBench, root: Path, base: Path, trained: Path, env: dict[str, str]) -> dict[str, Any]:
    hosts = 2 * bench.engines_per_region
    figures = {}
    for label, store in (("directory", str(root / "dir-store")), ("s3", f"s3://{BUCKET}/loopback")):
        say(f"loopback: {label}: publish, then {hosts} hosts ready")
        publish_s, version_bytes = _publish(store, base, trained)
        ready_s, _ = _ready([store] * hosts, root, f"loop-{label}", base, env)
        figures[label] = {"publish_s": publish_s, "ready_s": ready_s, "publish_to_ready_s": publish_s + ready_s,
                          "version_bytes": version_bytes}
    figures["s3_vs_directory"] = figures["s3"]["publish_to_ready_s"] / figures["directory"]["publish_to_ready_s"]
    return figures


@dataclass
class FarRegion:
    """The far region's hosts behind the emulated WAN, each round with a cold relay (or none)."""

    bench: StoreBench
    proxy: Any
    root: Path
    base: Path
    env: dict[str, str]

    def round(self, far: str, label: str, pull_only: bool = False, solo: bool = False) -> dict[str, Any]:
        """Every host at once (pulling only, or preparing); with ``solo``, one more host alone after them."""
        from miles_disagg.bench.store_fleet import Relay

        use_relay = label.startswith("relay")
        relay = Relay(far, self.root / f"relay-{label}", self.env, "far") if use_relay else None
        store = f"{far}&relay={relay.url}" if relay else far
        self.proxy.set_link(self.bench.wan_mb_per_s * 2**20, self.bench.wan_rtt_ms / 1e3)
        self.proxy.reset_counters()
        try:
            seconds, answers = _ready([store] * self.bench.engines_per_region, self.root, f"wan-{label}", self.base,
                                      self.env, pull_only)
            figures = {"seconds": seconds, "answers": answers, "wan_bytes": self.proxy.bytes_to_client}
            if solo:
                _, (figures["solo"],) = _ready([store], self.root, f"wan-{label}-solo", self.base, self.env)
            return figures
        finally:
            self.proxy.set_link(None)
            if relay is not None:
                relay.stop()


def _wan(bench: StoreBench, root: Path, base: Path, trained: Path, env: dict[str, str], model_bytes: int) -> dict:
    from miles_disagg.bench.wan_proxy import S3Proxy

    hosts = bench.engines_per_region
    with S3Proxy(env["AWS_ENDPOINT_URL"]).start() as proxy:
        region = FarRegion(bench, proxy, root, base, env)
        figures: dict[str, Any] = {"far_region_hosts": hosts}
        for label in ("direct", "relay"):
            store = f"s3://{BUCKET}/wan-{label}"
            _, version_bytes = _publish(store, base, trained)
            far = f"{store}?endpoint={proxy.url}"
            say(f"wan ({label}): {hosts} far hosts behind {bench.wan_mb_per_s:.0f} MiB/s, {bench.wan_rtt_ms:.0f} ms")
            fetch = region.round(far, f"{label}-fetch", pull_only=True)
            ready = region.round(far, label, solo=True)
            solo = ready["solo"]
            fetch_s, apply_alone_s = fetch["seconds"], solo["seconds"] - solo["fetch_s"]
            figures[label] = {"ready_s": ready["seconds"], "fetch_s": fetch_s, "apply_alone_s": apply_alone_s,
                              "ready_own_cpus_s": fetch_s + apply_alone_s,
                              "wan_bytes": ready["wan_bytes"], "version_bytes": version_bytes,
                              "wan_bytes_vs_version": ready["wan_bytes"] / version_bytes,
                              "relay_fallbacks": sum(a["transfer"].get("relay_fallbacks", 0) for a in ready["answers"])}
        figures.update(_full_checkpoint(bench, proxy, base, hosts, model_bytes))
    return figures


def _full_checkpoint(bench: StoreBench, proxy, base: Path, hosts: int, model_bytes: int) -> dict[str, float]:
    """A full checkpoint across the same WAN: the time of one copy, and of one per far host (concurrent,
    sharing the link)."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    direct = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    files = sorted(base.glob("*.safetensors"))
    for path in files:
        direct.upload_file(str(path), BUCKET, f"full/{path.name}")
    far = boto3.client("s3", endpoint_url=proxy.url)

    def one_copy(_: int) -> None:
        for path in files:
            body = far.get_object(Bucket=BUCKET, Key=f"full/{path.name}")["Body"]
            while body.read(1 << 20):
                pass

    proxy.set_link(bench.wan_mb_per_s * 2**20, bench.wan_rtt_ms / 1e3)
    try:
        say("wan: a full checkpoint, one copy, then one per far host")
        start = time.perf_counter()
        one_copy(0)
        one_s = time.perf_counter() - start
        start = time.perf_counter()
        with ThreadPoolExecutor(hosts) as pool:
            list(pool.map(one_copy, range(hosts)))
        per_engine_s = time.perf_counter() - start
    finally:
        proxy.set_link(None)
    return {"full_checkpoint_bytes": model_bytes, "full_checkpoint_one_copy_s": one_s,
            "full_checkpoint_per_engine_s": per_engine_s}


def _memory(bench: StoreBench, root: Path, base: Path, env: dict[str, str]) -> dict[str, Any]:
    from miles_disagg.bench.store_fleet import EngineHost
    from miles_disagg.types import VersionRef
    from miles_disagg.weights.stores import open_store

    figures: dict[str, Any] = {"pulls": []}
    for size_mb in bench.memory_sizes:
        store = f"s3://{BUCKET}/memory-{int(size_mb)}"
        say(f"memory: a {size_mb:.0f} MiB object, pulled by one process")
        writer = open_store(store, cache_dir=root / f"memory-writer-{int(size_mb)}")
        staging = _one_object_version(writer, size_mb)
        writer.commit(staging, VersionRef("memory", 1), None)
        host = EngineHost(store, root / f"memory-host-{int(size_mb)}", base, env, pull_only=True)
        try:
            host.ask(1)
            answer = host.answer()
        finally:
            host.stop()
        figures["pulls"].append({"version_mb": size_mb, "seconds": answer["seconds"],
                                 "peak_rss_bytes": answer["peak_rss_bytes"]})
    rss = [p["peak_rss_bytes"] for p in figures["pulls"]]
    figures["peak_rss_largest_vs_smallest"] = rss[-1] / rss[0]
    return figures


def _one_object_version(store, size_mb: float) -> Path:
    """A staged version of one payload object of ``size_mb`` random MiB (written in pieces)."""
    import json

    from miles_disagg.weights.format import INDEX_NAME, VersionIndex

    staging = store.new_staging_dir(1)
    name = "part-00000.safetensors"
    with open(staging / name, "wb") as f:
        for _ in range(int(size_mb)):
            f.write(os.urandom(2**20))
    index = VersionIndex(version=1, base_version=0, run_id="memory", delta_encoding="xor", compression_format="zstd",
                         checksum_format="xxh3-128", filter="none", chunk_bytes=1 << 22, weight_map={"w": name})
    (staging / INDEX_NAME).write_text(json.dumps(index.to_json()))
    return staging
