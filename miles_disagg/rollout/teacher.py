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

Top-k OPD (``--opd-log-prob-top-k K``, :mod:`miles_disagg.rollout.opd_topk`): the same call also
asks for the teacher's top-K per position (``top_logprobs_num``) and/or its logprobs of the
student's top-K ids (``token_ids_logprob``, or ``token_ids_logprob_positions`` per position); where
the strategy needs the student's logprobs of the teacher's ids, the student's engines score them
through the run's router (the run's keys, the training requests' version constraint). The sample then
carries ``opd_reverse_kl``, one term per response token, besides the teacher's sampled-token logprobs.
With ``--opd-teacher-urls`` each sample goes to the teacher its metadata names (:class:`TeacherRoutes`).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from miles_disagg.config.opd_rules import parse_teacher_urls
from miles_disagg.rollout import opd_topk
from miles_disagg.rollout.generate import GenerationFailed, constrained, generate_one
from miles_disagg.rollout.opd_topk import TopKError, TopKSettings
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

GENERATE_PATH = "/generate"


def scoring_body(tokens: list[int]) -> dict[str, Any]:
    """miles' teacher request: score every token of ``tokens``, generate nothing."""
    return opd_topk.score_body(tokens)


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


class TeacherRoutes:
    """Which teacher scores a sample: one ``/generate`` URL (``--rm-url`` or the job's teacher), or by
    name (``--opd-teacher-urls NAME=URL ...`` with ``--opd-teacher-key``; :func:`opd_topk.teacher_name`)."""

    def __init__(self, url: str | None = None, named: dict[str, str] | None = None, key: str = "opd_teacher"):
        if (url is None) == (not named):
            raise ValueError("a teacher is one URL or a map of named URLs")
        self.url, self.named, self.key = url, dict(named or {}), key

    @property
    def urls(self) -> list[str]:
        return [self.url] if self.url is not None else list(self.named.values())

    def url_for(self, sample: Sample) -> str:
        if self.url is not None:
            return self.url
        try:
            return self.named[opd_topk.teacher_name(sample.metadata, self.key, self.named)]
        except TopKError as exc:
            raise GenerationFailed(f"--opd-teacher-urls: {exc}") from None


class StudentScorer:
    """The student's engines scoring given token ids (top-k OPD's ``student_on_teacher``) through the
    run's router, under the version constraint of a training request sent now."""

    def __init__(self, client, router_url: str, counters: dict[str, int], version_bound, run_id: str | None = None):
        self._client, self._url, self._counters = client, router_url, counters
        self._bound, self._run_id = version_bound, run_id

    async def score(self, body: dict[str, Any]) -> dict:
        min_version, exact_version = self._bound()
        self._counters["opd_student_scores"] = self._counters.get("opd_student_scores", 0) + 1
        answer = await generate_one(self._client, self._url, constrained(body, min_version, exact_version,
                                                                          self._run_id), self._counters)
        if not isinstance(answer, dict):
            raise GenerationFailed(f"the student's scoring call answered {type(answer).__name__}, not one object")
        return answer


class Teacher:
    """Scores samples with the teacher engine(s): ``routes`` (or one ``/generate`` URL); with ``topk``
    also each token's top-k reverse KL, the student's side scored by ``student`` where needed."""

    def __init__(self, client, routes: TeacherRoutes | str, counters: dict[str, int] | None = None, *,
                 topk: TopKSettings | None = None, student: StudentScorer | None = None):
        """``client``: the async HTTP client to reach it with (it carries the headers to send)."""
        self.routes = routes if isinstance(routes, TeacherRoutes) else TeacherRoutes(routes)
        self._client, self.topk, self._student = client, topk, student
        if topk is not None and topk.student_on_teacher and student is None:
            raise ValueError(f"--opd-top-k-strategy {topk.strategy} needs the student's engines to score the "
                             "teacher's top-k ids")
        self.counters: dict[str, int] = counters if counters is not None else {}

    async def score(self, samples: list[Sample]) -> None:
        """Set every sample's ``teacher_logprobs`` and ``teacher_version`` (one request each, concurrently),
        and with top-k its ``opd_reverse_kl``."""
        await asyncio.gather(*(self._one(sample) for sample in samples))

    async def _one(self, sample: Sample) -> None:
        tokens, n, url = sample.tokens, len(sample.response_ids), self.routes.url_for(sample)
        rows = self._student_rows(sample) if self.topk is not None else None
        body = scoring_body(tokens) if self.topk is None else self._teacher_body(tokens, rows, n)
        answer = await self._ask(url, body)
        sample.teacher_logprobs, sample.teacher_version = read_scores(answer, tokens, n)
        if self.topk is not None:
            try:
                sample.opd_reverse_kl = await self._topk_term(tokens, n, rows, answer["meta_info"])
            except TopKError as exc:
                raise GenerationFailed(f"top-k OPD with the teacher at {url}: {exc}") from None

    async def _topk_term(self, tokens: list[int], n: int, rows: list | None, meta: dict) -> list[float]:
        """Each response token's term; the student's engines first score the teacher's top ids if needed."""
        student_meta = None
        if self.topk.student_on_teacher:
            top = opd_topk.response_rows(meta, "input_top_logprobs", n, "the teacher's answer")
            student_meta = (await self._student.score(opd_topk.ids_body(tokens, top, n, self.topk))).get("meta_info")
        return opd_topk.reverse_kl(self.topk, n, rows, meta, student_meta)

    def _student_rows(self, sample: Sample) -> list | None:
        if not self.topk.student_top:
            return None
        try:
            return opd_topk.student_rows(sample.metadata, len(sample.response_ids))
        except TopKError as exc:
            raise GenerationFailed(f"top-k OPD: {exc}") from None

    def _teacher_body(self, tokens: list[int], rows: list | None, n: int) -> dict[str, Any]:
        top_k = self.topk.k if self.topk.teacher_top else 0
        if self.topk.teacher_on_student:
            return opd_topk.ids_body(tokens, rows, n, self.topk, top_k)
        return opd_topk.score_body(tokens, top_k)

    async def _ask(self, url: str, body: dict[str, Any]) -> dict:
        self.counters["requests"] = self.counters.get("requests", 0) + 1
        try:
            return await generate_one(self._client, base_url(url), body, self.counters)
        except GenerationFailed as exc:
            raise GenerationFailed(f"the OPD teacher at {url}: {exc}") from None

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


def topk_settings(rollout) -> TopKSettings | None:
    """A ``RolloutConfig``'s top-k OPD settings (None: sampled-token OPD, ``--opd-log-prob-top-k 0``)."""
    if rollout.opd_log_prob_top_k <= 0:
        return None
    return TopKSettings(rollout.opd_log_prob_top_k, rollout.opd_top_k_strategy, rollout.opd_reward_weight_mode,
                        rollout.opd_topk_per_position)


def teacher_routes(rollout, teacher_url: str | None) -> TeacherRoutes:
    """``--opd-teacher-urls`` by name, else the one teacher at ``teacher_url``."""
    if rollout.opd_teacher_urls:
        return TeacherRoutes(named=parse_teacher_urls(rollout.opd_teacher_urls), key=rollout.opd_teacher_key)
    return TeacherRoutes(teacher_url)


def probe_body(topk: TopKSettings | None) -> dict[str, Any]:
    """The start-up probe: two tokens scored, with the top-k fields the run will send."""
    tokens = [0, 1]
    if topk is None:
        return scoring_body(tokens)
    top_k = topk.k if topk.teacher_top else 0
    if not topk.teacher_on_student:
        return opd_topk.score_body(tokens, top_k)
    return opd_topk.ids_body(tokens, [[[0.0, 0, None], [0.0, 1, None]]], 1, topk, top_k)


def check_probe_answer(answer: Any, topk: TopKSettings | None) -> str | None:
    """The probed teacher's ``weight_version``; ``GenerationFailed`` unless it answered every field asked."""
    version = read_scores(answer, [0, 1], 1)[1]
    if topk is not None:
        try:
            if topk.teacher_top:
                opd_topk.response_rows(answer["meta_info"], "input_top_logprobs", 1)
            if topk.teacher_on_student:
                row = opd_topk.response_rows(answer["meta_info"], "input_token_ids_logprobs", 1)[0]
                if sorted(opd_topk.to_map(row)) != [0, 1]:
                    raise TopKError(f"it scored the ids {sorted(opd_topk.to_map(row))} for the 0 and 1 asked")
        except TopKError as exc:
            how = "token_ids_logprob_positions (drop --opd-topk-per-position for a stock SGLang)" \
                if topk.per_position else "top_logprobs_num / token_ids_logprob"
            raise GenerationFailed(f"top-k OPD needs {how}: {exc}") from None
    return version


def probe_teacher(generate_url: str, flag: str, headers: dict[str, str] | None = None,
                  timeout_s: float = 60.0, topk: TopKSettings | None = None) -> str | None:
    """One scoring call of two tokens before the run starts (with ``topk``'s fields); the teacher's
    ``weight_version``. ``ConfigError`` naming ``flag`` when it does not answer one as SGLang does."""
    import httpx

    try:
        response = httpx.post(f"{base_url(generate_url)}{GENERATE_PATH}", json=probe_body(topk), timeout=timeout_s,
                              headers=headers or {}, trust_env=False)
        if response.status_code != 200:
            raise GenerationFailed(f"it refused a scoring call ({response.status_code}: {response.text[:300]})")
        return check_probe_answer(response.json(), topk)
    except (httpx.HTTPError, ValueError, GenerationFailed) as exc:
        raise ConfigError(f"{flag}: the OPD teacher at {generate_url} does not score tokens as SGLang does "
                          f"(logprob_start_len 0, max_new_tokens 0): {exc}", (flag,)) from None


def job_teacher(config):
    """What a job does for the ``--use-opd`` teacher of a ``RunConfig``, before its rollout starts: serve
    ``--opd-teacher-hf-checkpoint`` (:func:`start_teacher`), then probe every teacher the run uses
    with one scoring call. Returns ``(the engine it started or None, its /generate URL or None)``."""
    from miles_disagg.net.auth import ApiKeys
    from miles_disagg.tracking import status

    if not config.train.use_opd:
        return None, None
    rollout, topk = config.rollout, topk_settings(config.rollout)
    if not rollout.opd_teacher_hf_checkpoint:
        flag = "--opd-teacher-urls" if rollout.opd_teacher_urls else "--rm-url"
        for url in teacher_routes(rollout, rollout.rm_url).urls:
            version = probe_teacher(url, flag, topk=topk)
            status(f"OPD teacher: {url} (weight_version {version})")
        return None, None
    status(f"starting the OPD teacher: a built-in engine serving {rollout.opd_teacher_hf_checkpoint}")
    engine = start_teacher(rollout.opd_teacher_hf_checkpoint, Path(config.tracking.run_dir) / "logs")
    try:
        url = f"{engine.url}{GENERATE_PATH}"
        version = probe_teacher(url, "--opd-teacher-hf-checkpoint", ApiKeys.from_env().headers_for(GENERATE_PATH),
                                topk=topk)
    except BaseException:
        engine.stop()
        raise
    status(f"OPD teacher: {url} (weight_version {version})")
    return engine, url
