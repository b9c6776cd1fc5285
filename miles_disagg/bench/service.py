"""``miles-disagg bench service``: publish a sequence of versions to a local rollout service under load.

Makes a random tiny Qwen3 in a temp dir, starts a local service (gateway + ``--replicas``
built-in engines), and runs ``--concurrency`` client threads against the gateway, each
request bounded by ``min_version = newest published - --staleness`` and retried, as a
rollout client does, when refused (409/503 with ``retry_after_s``). Every fourth request
is a greedy probe. Meanwhile it publishes ``--versions`` versions one after another
(each once the previous one converged), then ``--burst`` more back to back (replicas
coalesce them), and reports:

* ``convergence_s``: per version, publication to 50% / 100% of the replicas advertising it
  (the gateway's measure, from the version's index time), plus the client's view (the
  publish call returned -> the gateway lists every replica ready at it);
* ``pause_s`` / ``prepare_s``: per replica activation pause and staging time;
* ``gateway_overhead_ms``: p50/p99 of time in the gateway minus time waiting for engines;
* ``requests``: sent, served, retried (retryable refusals), lost (no answer or a
  non-retryable error: must be 0) and ``misattributed`` (must be 0): a served sample whose
  versions are missing, not published, or outside its constraint, or a greedy probe whose
  tokens differ from what every replica produced at that version.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.bench.common import print_result, progress, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag

PROMPT = [5, 6, 7, 8, 9]
PROBE_TOKENS = 12


@dataclass(kw_only=True)
class ServiceBench:
    """rollout service: convergence, pauses, gateway overhead under load"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    replicas: int = flag(2, "Replicas of the local service.")
    versions: int = flag(4, "Versions published one after another.")
    burst: int = flag(2, "Versions then published back to back.")
    concurrency: int = flag(4, "Client threads.")
    max_new_tokens: int = flag(32, "Tokens generated per request.")
    staleness: int = flag(1, "min_version = newest published - staleness.")
    hidden_size: int = flag(64, "Of the random Qwen3.")
    num_layers: int = flag(2, "Of the random Qwen3.")
    poll_interval: float = flag(0.5, "Replicas' store polling (seconds).")
    wake: bool = flag(True, "POST /wake after publishing (--no-wake: store polling only).")
    work_dir: Path | None = flag(None, "Keep the model, store and logs here (default: a temp dir).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ServiceBench)


_progress = progress("service")


def run(args: argparse.Namespace) -> int:
    command = config_from_args(ServiceBench, args)
    with work_dir("service", command.work_dir) as root:
        return print_result(_bench(root, command))


# --------------------------------------------------------------------------- the load


@dataclass
class _Record:
    constraint: dict
    status: int | None
    start: object = None
    end: object = None
    output_ids: list | None = None
    greedy: bool = False
    retry_after_s: float | None = None  # set on a retryable refusal
    error: str | None = None


@dataclass
class _Load:
    url: str
    concurrency: int
    max_new_tokens: int
    staleness: int
    newest: list  # [int]: the newest published version, updated by the publisher thread

    def __post_init__(self) -> None:
        from miles_disagg.bench.loadgen import RequestThreads

        self._threads = RequestThreads(self.concurrency, self._request, timeout_s=120.0)

    def _request(self, http, worker: int, n: int) -> _Record:
        record = self._one(http, worker * 100_000 + n, n % 4 == 0)
        if record.retry_after_s is not None:
            time.sleep(min(0.2, record.retry_after_s))
        return record

    def _one(self, http, seed: int, greedy: bool) -> _Record:
        import httpx

        constraint = {"min_version": max(0, self.newest[0] - self.staleness)}
        params = {"max_new_tokens": PROBE_TOKENS if greedy else self.max_new_tokens, "ignore_eos": True,
                  "temperature": 0.0 if greedy else 1.0, "sampling_seed": seed}
        try:
            response = http.post(f"{self.url}/generate", json={"input_ids": PROMPT, "sampling_params": params,
                                                               "weight_version": constraint})
            answer = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            return _Record(constraint, None, error=f"{type(exc).__name__}: {exc}")
        if response.status_code != 200:
            retryable = isinstance(answer, dict) and answer.get("retryable") is True
            return _Record(constraint, response.status_code,
                           retry_after_s=float(answer.get("retry_after_s", 0.0)) if retryable else None,
                           error=None if retryable else str(answer)[:300])
        meta = answer["meta_info"]
        return _Record(constraint, 200, meta.get("weight_version_start"), meta.get("weight_version_end"),
                       answer["output_ids"], greedy)

    def count(self) -> int:
        return self._threads.count()

    def stop(self) -> list[_Record]:
        return self._threads.stop(180)


# --------------------------------------------------------------------------- the run


def _bench(root: Path, command: ServiceBench) -> dict:
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3
    from miles_disagg.service.launch import ReplicaOptions
    from miles_disagg.service.local import launch_local_service

    _progress(f"writing a random Qwen3 (hidden {command.hidden_size}, {command.num_layers} layers)")
    model_dir = make_tiny_qwen3(root / "model", hidden_size=command.hidden_size, intermediate_size=2 * command.hidden_size,
                                num_hidden_layers=command.num_layers)
    source = _Source(root / "store", model_dir)
    _progress(f"starting a local service with {command.replicas} replicas")
    options = ReplicaOptions(poll_interval_s=command.poll_interval, heartbeat_interval_s=0.5)
    service = launch_local_service(root / "store", model_dir, work_dir=root / "service", num_replicas=command.replicas,
                                   replica=options, retry_after_s=0.2)
    newest = [0]
    client = service.client()
    references: dict[int, list] = {0: _reference(client, 0)}
    load = _Load(service.url, command.concurrency, command.max_new_tokens, command.staleness, newest)
    client_convergence: dict[str, float] = {}
    try:
        for burst in [1] * command.versions + ([command.burst] if command.burst else []):
            _wait_for_requests(load, 2 * command.concurrency)
            for _ in range(burst):  # a burst: back to back, replicas coalesce
                newest[0] = source.publish()
                published_at = time.monotonic()
                _progress(f"published v{newest[0]}")
                if command.wake:
                    client.wake()
            client.wait_converged(newest[0], num_replicas=command.replicas, timeout_s=300)
            client_convergence[str(newest[0])] = round(time.monotonic() - published_at, 4)
            references[newest[0]] = _reference(client, newest[0])
        _wait_for_requests(load, 2 * command.concurrency)
    finally:
        records = load.stop()
        metrics = client.metrics()
        client.close()
        service.stop()
        source.close()
    return _report(command, metrics, records, references, client_convergence, source.published)


def _wait_for_requests(load: _Load, count: int) -> None:
    target = load.count() + count
    deadline = time.monotonic() + 120
    while load.count() < target and time.monotonic() < deadline:
        time.sleep(0.02)


def _reference(client, version: int) -> list | None:
    """Greedy probe output at ``version`` from every replica's engine directly; None if they disagree."""
    import httpx

    outputs = []
    with httpx.Client(timeout=60.0, trust_env=False) as http:
        for replica in client.replicas():
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": PROBE_TOKENS, "temperature": 0.0,
                                                             "ignore_eos": True}}
            answer = http.post(f"{replica['engine_url']}/generate", json=body).json()
            if int(answer["meta_info"]["weight_version_start"]) != version:
                return None
            outputs.append(answer["output_ids"])
    return outputs[0] if outputs and all(o == outputs[0] for o in outputs) else None


class _Source:
    """Publishes versions in this process (every tensor moves, so greedy outputs change)."""

    def __init__(self, store_dir: Path, base_dir: Path):
        from safetensors.torch import load_file

        from miles_disagg.weights.publisher import DeltaPublisher

        self.tensors = {}
        for file in sorted(base_dir.glob("*.safetensors")):
            self.tensors.update(load_file(str(file)))
        self.publisher = DeltaPublisher(store_dir, base_dir=base_dir)
        self.publisher.capture_baseline()
        self.published: list[int] = []

    def publish(self) -> int:
        import torch

        generator = torch.Generator().manual_seed(len(self.published))
        for name, tensor in self.tensors.items():
            self.tensors[name] = tensor + 0.05 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        self.published.append(self.publisher.publish(self.tensors.items()).ref.version)
        return self.published[-1]

    def close(self) -> None:
        self.publisher.close()


# --------------------------------------------------------------------------- the report


def _misattributed(record: _Record, published: set[int], references: dict[int, list | None]) -> bool:
    start, end = record.start, record.end
    if not isinstance(start, int) or not isinstance(end, int) or start > end:
        return True
    if start not in published or end not in published or start < record.constraint["min_version"]:
        return True
    reference = references.get(start)
    return record.greedy and start == end and reference is not None and record.output_ids != reference


def _report(command: ServiceBench, metrics: dict, records: list[_Record], references: dict, client_convergence: dict,
            published: list[int]) -> dict:
    served = [r for r in records if r.status == 200]
    known = {0, *published}
    checked = [r for r in served if r.greedy and r.start == r.end and references.get(r.start) is not None]
    replicas = {r["replica_id"]: {"pause_s": r["pause_s"], "prepare_s": r["prepare_s"],
                                  "num_restages": r["counters"].get("num_restages", 0)} for r in metrics["replicas"]}
    pauses = [a["pause_s"] for r in metrics["replicas"] for a in r["activations"]]
    prepares = [a["prepare_s"] for r in metrics["replicas"] for a in r["activations"]]
    full = [v["converged_s"]["1"] for v in metrics["convergence"]["versions"].values() if v["converged_s"]["1"] is not None]
    requests = metrics["requests"]
    return {
        "replicas": command.replicas, "concurrency": command.concurrency, "staleness": command.staleness,
        "versions_published": published, "wake": command.wake, "poll_interval_s": command.poll_interval,
        "convergence_s": {v: c["converged_s"] for v, c in metrics["convergence"]["versions"].items()},
        "convergence_s_p50": _round(statistics.median(full)) if full else None,
        "convergence_s_max": _round(max(full)) if full else None,
        "client_convergence_s": client_convergence,
        "pause_s_mean": _round(statistics.fmean(pauses)) if pauses else None,
        "pause_s_max": _round(max(pauses)) if pauses else None,
        "prepare_s_mean": _round(statistics.fmean(prepares)) if prepares else None,
        "per_replica": replicas,
        "gateway_overhead_ms": {k: _round(v) for k, v in requests["gateway_overhead_ms"].items()},
        "requests": {
            "sent": len(records), "served": len(served),
            "retried": sum(r.retry_after_s is not None for r in records),
            "lost": sum(r.status is None or (r.status != 200 and r.retry_after_s is None) for r in records),
            "misattributed": sum(_misattributed(r, known, references) for r in served),
            "mixed_version": sum(r.start != r.end for r in served),
            "greedy_probes_checked": len(checked),
        },
        "version_lag_behind_newest": requests["version_lag_behind_newest"],
        "gateway_counts": requests["counts"],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
