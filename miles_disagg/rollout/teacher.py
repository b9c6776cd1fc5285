"""The on-policy distillation teacher (``--use-opd --opd-type sglang``): another engine that scores
each sample's tokens through SGLang's ``/generate``, as miles' ``on_policy_distillation.reward_func`` asks.

One request per sample, miles' body::

    {"input_ids": prompt + response, "return_logprob": true, "logprob_start_len": 0,
     "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": false}}

Its answer (SGLang's tokenizer manager) carries ``meta_info["input_token_logprobs"]``: one
``[logprob, token_id, text]`` per input token, the first logprob null; the response's are the last
``len(response)`` of them (miles: ``values[1:][-response_length:]``), the teacher's logprob of each
response token given everything before it. They go to ``Sample.teacher_logprobs``, and the
teacher's ``meta_info["weight_version"]`` to ``Sample.teacher_version`` (which teacher weights scored
the sample). A teacher must share the student's vocabulary (it reads the student's token ids).

The teacher is an engine the user started (miles' ``--rm-url``, its ``/generate`` URL; no key is
sent to it) or one the job serves (``--opd-teacher-hf-checkpoint``: :func:`start_teacher`, a
built-in engine holding the run's keys). Refusals a server may retry (409, 429, 502, 503) are
retried as generation requests are (:func:`miles_disagg.rollout.generate.generate_one`); any other
failure, or an answer without one logprob per token, fails the run with one line.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from miles_disagg.rollout.generate import GenerationFailed, generate_one
from miles_disagg.types import ConfigError, Sample

GENERATE_PATH = "/generate"
SCORING_SAMPLING = {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False}


def scoring_body(tokens: list[int]) -> dict[str, Any]:
    """miles' teacher request: score every token of ``tokens``, generate nothing."""
    return {"input_ids": list(tokens), "sampling_params": dict(SCORING_SAMPLING), "return_logprob": True,
            "logprob_start_len": 0}


def base_url(generate_url: str) -> str:
    """The server address of a ``/generate`` URL (miles' ``--rm-url`` names the endpoint itself)."""
    url = generate_url.rstrip("/")
    return url[: -len(GENERATE_PATH)] if url.endswith(GENERATE_PATH) else url


def read_scores(answer: Any, tokens: list[int], response_length: int) -> tuple[list[float], str | None]:
    """``(teacher logprobs of the last response_length tokens, the teacher's weight_version)`` from a
    scoring answer; ``GenerationFailed`` unless it scored every token of ``tokens`` with a finite logprob."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) != len(tokens):
        got = len(entries) if isinstance(entries, list) else "no"
        raise GenerationFailed(f"the OPD teacher answered {got} input_token_logprobs for {len(tokens)} tokens; it must "
                               "score every input token (SGLang's logprob_start_len 0 with return_logprob)")
    values = []
    for position, entry in enumerate(entries[len(tokens) - response_length:], len(tokens) - response_length):
        value = entry[0] if isinstance(entry, (list, tuple)) and entry else None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise GenerationFailed(f"the OPD teacher's logprob of token {position} is {value!r}, not a finite number")
        values.append(float(value))
    version = meta.get("weight_version")
    return values, None if version is None else str(version)


class Teacher:
    """Scores samples with the teacher engine at ``generate_url`` (the ``/generate`` endpoint)."""

    def __init__(self, client, generate_url: str, counters: dict[str, int] | None = None):
        """``client``: the async HTTP client to reach it with (it carries the headers to send)."""
        self._client, self.url, self.base = client, generate_url, base_url(generate_url)
        self.counters: dict[str, int] = counters if counters is not None else {}

    async def score(self, samples: list[Sample]) -> None:
        """Set every sample's ``teacher_logprobs`` and ``teacher_version`` (one request each, concurrently)."""
        await asyncio.gather(*(self._one(sample) for sample in samples))

    async def _one(self, sample: Sample) -> None:
        tokens = sample.tokens
        self.counters["requests"] = self.counters.get("requests", 0) + 1
        try:
            answer = await generate_one(self._client, self.base, scoring_body(tokens), self.counters)
        except GenerationFailed as exc:
            raise GenerationFailed(f"the OPD teacher at {self.url}: {exc}") from None
        sample.teacher_logprobs, sample.teacher_version = read_scores(answer, tokens, len(sample.response_ids))

    async def aclose(self) -> None:
        await self._client.aclose()


def start_teacher(checkpoint: str | Path, log_dir: str | Path):
    """Serve ``checkpoint`` as the teacher (``--opd-teacher-hf-checkpoint``): a built-in engine on
    this host, at version 0, holding the run's keys (from this process's environment); returns the
    :class:`~miles_disagg.engines.launch.LaunchedEngine` (``stop()`` it with the run)."""
    from miles_disagg.engines.launch import launch_engine

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch_engine(Path(checkpoint), log_path=log_dir / "opd-teacher.log")


def probe_teacher(generate_url: str, flag: str, headers: dict[str, str] | None = None,
                  timeout_s: float = 60.0) -> str | None:
    """One scoring call of two tokens before the run starts; the teacher's ``weight_version``.
    ``ConfigError`` naming ``flag`` when it does not answer one as SGLang does."""
    import httpx

    tokens = [0, 1]
    try:
        response = httpx.post(f"{base_url(generate_url)}{GENERATE_PATH}", json=scoring_body(tokens), timeout=timeout_s,
                              headers=headers or {}, trust_env=False)
        if response.status_code != 200:
            raise GenerationFailed(f"it refused a scoring call ({response.status_code}: {response.text[:300]})")
        return read_scores(response.json(), tokens, 1)[1]
    except (httpx.HTTPError, ValueError, GenerationFailed) as exc:
        raise ConfigError(f"{flag}: the OPD teacher at {generate_url} does not score tokens as SGLang does "
                          f"(logprob_start_len 0, max_new_tokens 0): {exc}", (flag,)) from None


def job_teacher(config):
    """What a job does for the ``--use-opd`` teacher of a ``RunConfig``, before its rollout starts: serve
    ``--opd-teacher-hf-checkpoint`` (:func:`start_teacher`), then probe whichever teacher the run uses
    with one scoring call. Returns ``(the engine it started or None, its /generate URL or None)``."""
    from miles_disagg.net.auth import ApiKeys
    from miles_disagg.tracking import status

    if not config.train.use_opd:
        return None, None
    rollout = config.rollout
    if not rollout.opd_teacher_hf_checkpoint:
        version = probe_teacher(rollout.rm_url, "--rm-url")
        status(f"OPD teacher: {rollout.rm_url} (weight_version {version})")
        return None, None
    status(f"starting the OPD teacher: a built-in engine serving {rollout.opd_teacher_hf_checkpoint}")
    engine = start_teacher(rollout.opd_teacher_hf_checkpoint, Path(config.tracking.run_dir) / "logs")
    try:
        url = f"{engine.url}{GENERATE_PATH}"
        version = probe_teacher(url, "--opd-teacher-hf-checkpoint", ApiKeys.from_env().headers_for(GENERATE_PATH))
    except BaseException:
        engine.stop()
        raise
    status(f"OPD teacher: {url} (weight_version {version})")
    return engine, url
