"""One rollout sample over HTTP: an SGLang ``/generate`` request through the router.

The request carries the version constraint (``weight_version: {"min_version": N}``); the
response's ``meta_info.weight_version_start/_end`` (what actually served it) are recorded
on the sample. Retryable refusals (409 version not ready, 502/503 worker failed or none
available) are retried after ``Retry-After`` with a fresh request: the failed attempt
produced nothing this run uses, so nothing is replayed into a sample.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from miles_disagg.samples import Sample, SampleStatus
from miles_disagg.types import FailRun, Retryable

RETRYABLE_STATUS = (409, 429, 502, 503)
MAX_ATTEMPTS = 200


class GenerationFailed(FailRun):
    """A generation request failed in a way retrying cannot fix (a 4xx, or too many retries)."""


class RequestLost(Retryable):
    """A request failed after it was dispatched and may not be replayed; its group is given up."""


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "top_k": self.top_k}
        if self.stop:
            body["stop"] = list(self.stop)
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        return body


def request_body(prompt_ids: list[int], sampling: SamplingSettings, min_version: int | None,
                 exact_version: int | None = None, num_samples: int = 1, run_id: str | None = None,
                 top_logprobs_num: int = 0, lora_path: str | None = None) -> dict[str, Any]:
    """One ``/generate`` body; ``num_samples > 1`` sends the prompt that many times in one
    batched request (SGLang's list-of-prompts form), answered by a list of results;
    ``top_logprobs_num``: also each output token's most likely tokens (top-k OPD's student side);
    ``lora_path``: the loaded LoRA adapter every sample runs with (SGLang's field; None: the base)."""
    input_ids: Any = prompt_ids if num_samples == 1 else [list(prompt_ids) for _ in range(num_samples)]
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling.to_json(), "return_logprob": True}
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    if lora_path is not None:
        body["lora_path"] = lora_path
    return constrained(body, min_version, exact_version, run_id)


def constrained(body: dict[str, Any], min_version: int | None, exact_version: int | None,
                run_id: str | None) -> dict[str, Any]:
    """``body`` with its ``weight_version`` constraint: exactly one version, or at least one; ``run_id``
    (rollout service) binds it to this run's versions."""
    constraint: dict[str, Any] = {}
    if exact_version is not None:
        constraint["exact_version"] = exact_version
    elif min_version is not None:
        constraint["min_version"] = min_version
    if run_id is not None:
        constraint["run_id"] = run_id
    if constraint:
        body["weight_version"] = constraint
    return body


def sample_from_response(prompt_ids: list[int], payload: dict) -> Sample:
    """Build a Sample from an SGLang ``/generate`` answer routed by our router."""
    meta = payload["meta_info"]
    start, end = meta.get("weight_version_start"), meta.get("weight_version_end")
    if not (_is_version(start) and _is_version(end)):
        raise GenerationFailed(f"the serving engine reported no numeric weight version ({start!r}, {end!r}); "
                               "a sample must name the policy that generated it (start engines with a numeric "
                               "--weight-version)")
    triples = meta.get("output_token_logprobs") or []
    output_ids = list(payload.get("output_ids") or [t[1] for t in triples])
    finish = meta.get("finish_reason") or {}
    reason = finish.get("type", "length") if isinstance(finish, dict) else str(finish)
    return Sample(
        prompt_ids=list(prompt_ids), response_ids=output_ids, response_logprobs=[float(t[0]) for t in triples],
        weight_version_start=int(start), weight_version_end=int(end), finish_reason=reason,
        status=STATUS_OF_FINISH.get(reason, SampleStatus.COMPLETED).value, call_versions=[[int(start), int(end)]],
    )


STATUS_OF_FINISH = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
"""miles' sample status from SGLang's ``finish_reason.type``."""


DISPATCHED_FAILURE = 502  # the router had sent it to a worker that then failed


async def generate_one(client, url: str, body: dict, counters: dict[str, int], *,
                       replay_after_dispatch: bool = True) -> dict:
    """POST ``body`` to ``url``/generate until it succeeds; retry only retryable refusals.

    A 409/429/503 was never dispatched and is always retried. A 502 (the worker failed
    after the request reached it) is retried only with ``replay_after_dispatch``; otherwise
    ``RequestLost`` is raised (the service topology: nothing is replayed). At most
    :data:`MAX_ATTEMPTS` refusals, not counting the router's 503 ``NoWorkerAvailable``: no engine
    serves now (all are down, or the last one was removed), and rollout waits until one joins or
    comes back; the run's ``--min-rollout-engines-timeout`` bounds that wait (its capacity watch
    ends the run), not this loop.
    """
    attempts, last = 0, ""
    while attempts < MAX_ATTEMPTS:
        try:
            response = await client.post(f"{url}/generate", json=body)
        except Exception as exc:  # router unreachable for a moment: treat as retryable
            counters["retried"] = counters.get("retried", 0) + 1
            attempts += 1
            await asyncio.sleep(min(2.0, 0.1 * attempts))
            last = f"{type(exc).__name__}: {exc}"
            continue
        if response.status_code == 200:
            return response.json()
        if response.status_code not in RETRYABLE_STATUS:
            raise GenerationFailed(f"/generate answered {response.status_code}: {response.text[:500]}")
        if response.status_code == DISPATCHED_FAILURE and not replay_after_dispatch:
            counters["lost"] = counters.get("lost", 0) + 1
            raise RequestLost(f"/generate failed after dispatch and is not replayed: {response.text[:300]}")
        counters["retried"] = counters.get("retried", 0) + 1
        if response.status_code == 409:
            counters["version_not_ready"] = counters.get("version_not_ready", 0) + 1
        if not _no_worker(response):
            attempts += 1
        await asyncio.sleep(_retry_after(response) * (0.5 + random.random()))
        last = response.text[:300]
    raise GenerationFailed(f"/generate failed {MAX_ATTEMPTS} times; last: {last}")


def _no_worker(response) -> bool:
    """The router's 503 ``NoWorkerAvailable``: no engine serves at all (none is ready)."""
    if response.status_code != 503:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("type") == "NoWorkerAvailable"


def _retry_after(response) -> float:
    """The router's exact ``retry_after_s`` from the JSON body, else the (whole-second) header."""
    try:
        body = response.json()
        value = body.get("retry_after_s") if isinstance(body, dict) else None
        if value is None:
            value = (body.get("error") or {}).get("retry_after_s") if isinstance(body, dict) else None
        if value is None:
            value = response.headers.get("retry-after", 0.2)
        return min(5.0, max(0.02, float(value)))
    except (ValueError, TypeError, AttributeError):
        return 0.2


def _is_version(value) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.isdigit())
