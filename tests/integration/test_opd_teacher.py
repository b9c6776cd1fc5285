"""The on-policy distillation teacher (``rollout/teacher.py``) against a real built-in engine: each
sample's tokens scored with miles' request (``logprob_start_len`` 0, ``max_new_tokens`` 0), the
response's logprobs those of one forward pass of the teacher's checkpoint (raw logits), attributed
to the weight version the teacher reported; the start-up probe; and the answers refused."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from engine_fixtures import engine  # noqa: F401  (fixture)
from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.rollout.teacher import Teacher, base_url, probe_teacher, read_scores, scoring_body
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

pytestmark = pytest.mark.timeout(180)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def teacher_model(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


def _expected(model, prompt: list[int], response: list[int]) -> list[float]:
    tokens = prompt + response
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    return [float(logprobs[len(prompt) + i - 1, tok]) for i, tok in enumerate(response)]


def test_each_sample_is_scored_by_the_teacher_and_attributed_to_its_version(engine, teacher_model):
    engine.require_builtin("recomputes with the engine's checkpoint")
    samples = [Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], response_logprobs=[-1.0] * 4),
               Sample(prompt_ids=[30], response_ids=[31, 32], response_logprobs=[-1.0] * 2),
               Sample(prompt_ids=[40, 41, 42, 43, 44], response_ids=[45], response_logprobs=[-1.0])]

    async def score():
        client = httpx.AsyncClient(timeout=60)
        teacher = Teacher(client, f"{engine.url}/generate")
        try:
            await teacher.score(samples)
        finally:
            await teacher.aclose()
        return teacher

    teacher = asyncio.run(score())
    assert teacher.counters["requests"] == len(samples)  # one scoring call per sample
    for sample in samples:
        assert sample.teacher_logprobs == pytest.approx(_expected(teacher_model, sample.prompt_ids,
                                                                  sample.response_ids), abs=TOLERANCE)
        assert sample.teacher_version == engine.version()
        sample.check_consistent()
    assert probe_teacher(f"{engine.url}/generate", "--rm-url") == engine.version()
    assert probe_teacher(engine.url, "--rm-url") == engine.version()  # the server's address works too


def test_a_teacher_that_cannot_score_is_refused_at_start(engine):
    engine.require_builtin("the built-in engine's answers")
    with pytest.raises(ConfigError, match="--rm-url: the OPD teacher"):
        probe_teacher(f"{engine.url}/nothing-here/generate", "--rm-url", timeout_s=10)
    with pytest.raises(ConfigError, match="not reachable|does not score"):
        probe_teacher("http://127.0.0.1:9/generate", "--rm-url", timeout_s=5)


def test_answers_without_one_finite_logprob_per_token_fail_the_run():
    tokens = [1, 2, 3]
    good = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-0.25, 3, None]],
                          "weight_version": 7}}
    assert read_scores(good, tokens, 2) == ([-0.5, -0.25], "7")
    assert read_scores(good, tokens, 1) == ([-0.25], "7")
    short = {"meta_info": {"input_token_logprobs": [[None, 2, None], [-0.25, 3, None]]}}
    old_engine = {"meta_info": {"output_token_logprobs": []}}  # an engine that ignores logprob_start_len
    null = {"meta_info": {"input_token_logprobs": [[None, 1, None], [None, 2, None], [-0.25, 3, None]]}}
    for answer, reason in ((short, "2 input_token_logprobs for 3"), (old_engine, "no input_token_logprobs"),
                           (null, "token 1 is None")):
        with pytest.raises(GenerationFailed, match=reason):
            read_scores(answer, tokens, 2)


def test_miles_request_and_url_forms():
    assert scoring_body([4, 5]) == {"input_ids": [4, 5], "return_logprob": True, "logprob_start_len": 0,
                                    "sampling_params": {"temperature": 0, "max_new_tokens": 0,
                                                        "skip_special_tokens": False}}
    assert base_url("http://t:1/generate") == base_url("http://t:1/generate/") == base_url("http://t:1") == "http://t:1"


# ------------------------------------------------------------------ top-k (--opd-log-prob-top-k)


def _dense(model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` log-softmax of the raw logits: row ``p`` scores the token at ``p + 1``."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].double(), dim=-1)


def _check_entries(entries, row: torch.Tensor, ids) -> None:
    """SGLang's ``[[logprob, token_id, text], ...]``: exactly ``ids``, each with its logprob in ``row``."""
    assert [e[1] for e in entries] == list(ids) and all(e[2] is None for e in entries)
    assert [e[0] for e in entries] == pytest.approx([float(row[i]) for i in ids], abs=TOLERANCE)


def test_the_engine_answers_top_k_and_token_ids_in_sglang_shape(engine, teacher_model):
    """``top_logprobs_num``, ``token_ids_logprob`` (SGLang's) and ``token_ids_logprob_positions`` (miles'
    patched SGLang's) on input and output tokens, against one forward pass of the same checkpoint."""
    engine.require_builtin("recomputes with the engine's checkpoint")
    tokens = [5, 6, 7, 8, 9]
    dense = _dense(teacher_model, tokens)
    meta = engine.generate({"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
                            "top_logprobs_num": 3, "token_ids_logprob": [4, 11, 2],
                            "sampling_params": {"max_new_tokens": 0, "temperature": 0}})["meta_info"]
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(meta["input_token_ids_logprobs"]) == len(tokens)
    for p in range(1, len(tokens)):
        best = torch.topk(dense[p - 1], 3).indices.tolist()
        _check_entries(meta["input_top_logprobs"][p], dense[p - 1], best)
        _check_entries(meta["input_token_ids_logprobs"][p], dense[p - 1], [4, 11, 2])
    positions = [[], [3], [], [4, 5], [6]]
    meta = engine.generate({"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
                            "token_ids_logprob_positions": positions,
                            "sampling_params": {"max_new_tokens": 0}})["meta_info"]
    rows = meta["input_token_ids_logprobs"]
    assert rows[0] is None and rows[2] is None and "input_top_logprobs" not in meta
    for p in (1, 3, 4):
        _check_entries(rows[p], dense[p - 1], positions[p])

    answers = engine.generate({"input_ids": [tokens, tokens[:3]], "return_logprob": True, "top_logprobs_num": 2,
                               "token_ids_logprob": [4, 11],
                               "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}})
    for prompt, answer in zip([tokens, tokens[:3]], answers):
        out, meta = answer["output_ids"], answer["meta_info"]
        dense = _dense(teacher_model, prompt + out)
        assert meta["input_token_ids_logprobs"] == [] and len(meta["output_token_ids_logprobs"]) == len(out) == 3
        for i in range(len(out)):
            row = dense[len(prompt) - 1 + i]  # T = 1: the reported distribution is the raw one
            best = torch.topk(row, 2).indices.tolist()
            _check_entries(meta["output_top_logprobs"][i], row, best)
            _check_entries(meta["output_token_ids_logprobs"][i], row, [4, 11])
    vocab = teacher_model.config.vocab_size
    for bad, reason in (({"token_ids_logprob": [vocab]}, "outside the vocabulary"),
                        ({"token_ids_logprob_positions": [[1], [2]]}, "one per input position"),
                        ({"token_ids_logprob": [[1]]}, "must be a list of token ids"),
                        ({"token_ids_logprob": list(range(vocab)) * 50, "sampling_params": {"max_new_tokens": 1000}},
                         "logprob entries, more than")):
        response = engine.post("/generate", {"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
                                             "sampling_params": {"max_new_tokens": 0}, **bad})
        assert response.status_code == 400 and reason in response.text, response.text[:300]


class TorchStudent:
    """The student's side where a strategy needs it: its top-K rows of a response, and its answers to a
    scoring call of given ids (SGLang's shape), from a local model (what the student's engines hold)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def top_rows(self, prompt: list[int], response: list[int], k: int) -> list:
        dense = _dense(self.model, prompt + response)
        rows = []
        for r in range(len(response)):
            values, ids = torch.topk(dense[len(prompt) + r - 1], k)
            rows.append([[float(v), int(i), None] for v, i in zip(values, ids)])
        return rows

    async def score(self, body: dict) -> dict:
        self.calls.append(body)
        dense = _dense(self.model, body["input_ids"])
        per_position = body.get("token_ids_logprob_positions") or [body["token_ids_logprob"]] * len(body["input_ids"])
        rows = [None] + [[[float(dense[p - 1, i]), i, None] for i in per_position[p]] or None
                         for p in range(1, len(body["input_ids"]))]
        return {"meta_info": {"input_token_ids_logprobs": rows}}


def _expected_topk_kl(student: torch.Tensor, teacher: torch.Tensor, k: int, strategy: str, mode: str) -> float:
    """One position's term from the dense distributions (sets by strategy, weights by mode)."""
    s_ids, t_ids = set(torch.topk(student, k).indices.tolist()), set(torch.topk(teacher, k).indices.tolist())
    chosen = {"only-student": s_ids, "only-teacher": t_ids, "intersection": s_ids & t_ids, "union": s_ids | t_ids,
              "xor": s_ids ^ t_ids}[strategy]
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    if not len(ids):
        return 0.0
    p = {"student_p": student[ids].exp(), "teacher_p": teacher[ids].exp(), "none": torch.ones(len(ids))}[mode]
    w = p if strategy == "xor" else p / p.sum()
    return float((w * (student[ids] - teacher[ids])).sum())


@pytest.mark.parametrize("strategy, mode, per_position", [
    ("only-student", "student_p", False), ("only-student", "teacher_p", True), ("only-teacher", "student_p", False),
    ("intersection", "none", False), ("union", "student_p", False), ("union", "teacher_p", True),
    ("xor", "student_p", False), ("xor", "none", True),
])
def test_top_k_opd_against_a_teacher_engine_with_known_logprobs(engine, teacher_model, strategy, mode, per_position):
    """Each response token's top-k term from the teacher engine's answers (and the student's), equal to
    the term computed from both models' whole distributions with plain torch."""
    import copy

    from miles_disagg.rollout.opd_topk import STUDENT_TOP_KEY, TopKSettings

    engine.require_builtin("recomputes with the engine's checkpoint")
    student_model = copy.deepcopy(teacher_model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(7)
        for param in student_model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    student, k = TorchStudent(student_model), 3
    prompts = [([5, 6, 7], [8, 9, 10, 11]), ([30, 2], [31, 32])]
    samples = [Sample(prompt_ids=p, response_ids=r, response_logprobs=[-1.0] * len(r),
                      metadata={STUDENT_TOP_KEY: student.top_rows(p, r, k)}) for p, r in prompts]
    settings = TopKSettings(k, strategy, mode, per_position)

    async def score():
        teacher = Teacher(httpx.AsyncClient(timeout=60), f"{engine.url}/generate", topk=settings,
                          student=student if settings.student_on_teacher else None)
        try:
            await teacher.score(samples)
        finally:
            await teacher.aclose()

    asyncio.run(score())
    assert len(student.calls) == (len(samples) if settings.student_on_teacher else 0)
    for sample, (prompt, response) in zip(samples, prompts):
        s_dense, t_dense = _dense(student_model, prompt + response), _dense(teacher_model, prompt + response)
        rows = range(len(prompt) - 1, len(prompt) + len(response) - 1)
        expected = [_expected_topk_kl(s_dense[i], t_dense[i], k, strategy, mode) for i in rows]
        assert sample.opd_reverse_kl == pytest.approx(expected, abs=TOLERANCE)
        assert sample.teacher_logprobs == pytest.approx(_expected(teacher_model, prompt, response), abs=TOLERANCE)
        assert any(abs(v) > 1e-3 for v in sample.opd_reverse_kl)  # the two models differ
    assert probe_teacher(f"{engine.url}/generate", "--rm-url", topk=settings) == engine.version()


def test_a_run_probes_every_named_teacher_with_the_top_k_fields_it_will_send(engine, tiny_qwen3_dir, capsys):
    """``--opd-teacher-urls`` with top-k: each teacher is probed at start with the run's top-k request
    (a teacher without ``token_ids_logprob_positions`` would be refused here, before any rollout)."""
    from miles_disagg.config import load_config
    from miles_disagg.rollout.teacher import job_teacher

    engine.require_builtin("answers token_ids_logprob_positions")
    flags = ["--train-backend", "fsdp", "--hf-checkpoint", str(tiny_qwen3_dir), "--rollout-batch-size", "2",
             "--global-batch-size", "2", "--use-opd", "--opd-type", "sglang", "--opd-log-prob-top-k", "2",
             "--opd-top-k-strategy", "union", "--opd-topk-per-position",
             "--opd-teacher-urls", f"math={engine.url}/generate", f"default={engine.url}"]
    config, _ = load_config(flags, entry="train")
    assert job_teacher(config) == (None, None)
    err = capsys.readouterr().err
    assert f"OPD teacher: {engine.url}/generate (weight_version {engine.version()})" in err
    assert f"OPD teacher: {engine.url} (weight_version {engine.version()})" in err
