"""Every JSON body our engine client, updaters, trainer and agent send, judged by SGLang's own app.

SGLang's HTTP app runs in this process (``sglang_app.py``): its routes parse our bodies into
its ``io_struct`` request types, exactly as a real server would, and a fake tokenizer manager
records what they parsed into. A body SGLang cannot parse is its 4xx; a field it does not
know is ignored by it, so the tests check that every field we mean arrives with our value.
"""

from __future__ import annotations

import pytest
import torch

from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.updater import BroadcastUpdater, in_weight_update_session

pytestmark = pytest.mark.timeout(300)


def test_pause_flush_continue(sglang, manager, io_struct):
    with EngineClient(sglang.url) as client:
        for mode in ("abort", "retract", "in_place"):
            client.pause(mode)
        client.flush()
        client.resume()
    pauses = manager.of_type("PauseGenerationReqInput")
    assert [p.mode for p in pauses] == ["abort", "retract", "in_place"]
    assert all(isinstance(p, io_struct.PauseGenerationReqInput) for p in pauses)
    assert ("flush_cache", 0.0) in manager.received
    assert len(manager.of_type("ContinueGenerationReqInput")) == 1


def test_version_is_read_where_sglang_reports_it(sglang, manager):
    """SGLang 0.5.23 has no /get_weight_version: the version comes from /model_info."""
    manager.version = "12"
    with EngineClient(sglang.url) as client:
        assert client.version() == 12 and client.weight_version() == "12"
        assert client.model_info()["weight_version"] == "12"
        assert client.server_info()["tp_size"] == 1
    manager.version = "0"


def test_update_weights_from_disk_body(sglang, manager, io_struct, tmp_path):
    with EngineClient(sglang.url, local_checkpoint_dir=tmp_path / "local") as client:
        client.load(4)
    (req,) = manager.of_type("UpdateWeightFromDiskReqInput")
    assert isinstance(req, io_struct.UpdateWeightFromDiskReqInput)
    assert req.model_path == str(tmp_path / "local") and req.weight_version == "4"
    manager.version = "0"


def test_broadcast_bodies(sglang, manager, io_struct):
    updater = BroadcastUpdater([sglang.url], ranks_per_engine=[2], group_name="g")
    try:
        updater.init_group("10.1.2.3", 29500)
        meta = {"names": ["lm_head.weight"], "dtypes": ["bfloat16"], "shapes": [[32, 16]]}
        updater.update(3, meta)
    finally:
        updater.close()
    (init,) = manager.of_type("InitWeightsUpdateGroupReqInput")
    assert (init.master_address, init.master_port, init.rank_offset, init.world_size, init.group_name,
            init.backend) == ("10.1.2.3", 29500, 1, 3, "g", "nccl")
    (update,) = manager.of_type("UpdateWeightsFromDistributedReqInput")
    assert (update.names, update.dtypes, update.shapes) == (meta["names"], meta["dtypes"], meta["shapes"])
    assert (update.group_name, update.weight_version, update.flush_cache) == ("g", "3", True)
    # the load sits inside a weight-update session (SGLang >= 0.5.21 refuses it outside one)
    kinds = [type(o).__name__ for o in manager.received if not isinstance(o, tuple)]
    assert kinds[kinds.index("BeginWeightUpdateReqInput"):kinds.index("EndWeightUpdateReqInput") + 1] == [
        "BeginWeightUpdateReqInput", "UpdateWeightsFromDistributedReqInput", "EndWeightUpdateReqInput"]
    manager.version = "0"


def test_memory_and_tensor_bodies(sglang, manager, io_struct):
    """The colocated handoff (release, resume, update_weights_from_tensor); the payload opens
    with SGLang's own MultiprocessingSerializer into the tensors we sent."""
    from miles_disagg.trainer.colocated import push_named_tensors

    sent = {"model.norm.weight": torch.randn(16), "lm_head.weight": torch.randn(8, 16, dtype=torch.bfloat16)}
    with EngineClient(sglang.url) as client:
        client.release_memory(None)
        client.release_memory(["weights", "kv_cache"])
        client.resume_memory(["weights"])
    pushed = push_named_tensors([sglang.url], sent.items(), 6, bucket_bytes=1)  # one tensor per bucket
    releases = manager.of_type("ReleaseMemoryOccupationReqInput")
    assert [r.tags for r in releases] == [None, ["weights", "kv_cache"]]
    assert [r.tags for r in manager.of_type("ResumeMemoryOccupationReqInput")] == [["weights"]]
    updates = manager.of_type("UpdateWeightsFromTensorReqInput")
    assert pushed["buckets"] == len(updates) == 3  # two tensors, then the (empty) one labelling the version
    assert all(isinstance(u, io_struct.UpdateWeightsFromTensorReqInput) and u.load_format is None for u in updates)
    assert [u.weight_version for u in updates] == [None, None, "6"]
    assert [u.flush_cache for u in updates] == [False, False, True]
    received = dict(pair for batch in manager.tensors for pair in batch)
    assert received.keys() == sent.keys()
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
    with EngineClient(sglang.url) as client:
        assert client.version() == 6
    manager.version = "0"


def test_rollout_generate_body_and_response(sglang, manager, io_struct):
    """The rollout's /generate body (after the router took its version constraint) parses and
    passes SGLang's own batch validation; the answer, with SGLang's FINISH_LENGTH, parses back."""
    from miles_disagg.rollout.generate import SamplingSettings, request_body, sample_from_response
    from miles_disagg.router.policy import request_constraint

    body = request_body([3, 4, 5], SamplingSettings(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20),
                        min_version=2, num_samples=3)
    request_constraint(body, {})  # what the router forwards
    with EngineClient(sglang.url) as client:
        answers = client.generate(body)
    (req,) = manager.of_type("GenerateReqInput")
    # as SGLang normalized it: one entry per prompt
    assert req.input_ids == [[3, 4, 5]] * 3 and req.return_logprob == [True] * 3
    assert req.sampling_params == [{"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20}] * 3
    assert len(answers) == 3
    for answer in answers:
        answer["meta_info"].update(weight_version_start="0", weight_version_end="0")  # the router adds these
        sample = sample_from_response([3, 4, 5], answer)
        assert sample.finish_reason == "length" and sample.response_ids == [7] * 4
        assert sample.response_logprobs == [-0.5] * 4


def test_a_session_error_does_not_hide_the_load_error(sglang, manager):
    with EngineClient(sglang.url) as client:
        with pytest.raises(RuntimeError, match="load failed"):
            in_weight_update_session(client, lambda: (_ for _ in ()).throw(RuntimeError("load failed")))
    assert [type(o).__name__ for o in manager.received] == ["BeginWeightUpdateReqInput", "EndWeightUpdateReqInput"]


def test_the_opd_teacher_scoring_call_and_its_answer(sglang, manager, io_struct):
    """The ``--use-opd`` teacher's request (miles' body) parses into SGLang's ``GenerateReqInput`` as a
    scoring call (every input token from position 0, nothing generated), and SGLang's answer (input
    logprobs from ``logprob_start_len``, the first one null) gives each response token its teacher
    logprob and the sample its teacher's version."""
    import asyncio

    import httpx

    from miles_disagg.rollout.teacher import Teacher, probe_teacher
    from miles_disagg.samples import Sample

    manager.version = "5"
    sample = Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7], response_logprobs=[-1.0, -1.0])

    async def score() -> None:
        teacher = Teacher(httpx.AsyncClient(timeout=60), f"{sglang.url}/generate")
        try:
            await teacher.score([sample])
        finally:
            await teacher.aclose()

    asyncio.run(score())
    (req,) = manager.of_type("GenerateReqInput")
    assert isinstance(req, io_struct.GenerateReqInput)
    assert req.input_ids == [3, 4, 5, 6, 7] and req.return_logprob is True and req.logprob_start_len == 0
    assert req.sampling_params == {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False}
    assert sample.teacher_logprobs == [-0.03, -0.04] and sample.teacher_version == "5"
    assert probe_teacher(f"{sglang.url}/generate", "--rm-url") == "5"
    manager.version = "0"


@pytest.mark.parametrize("body", [
    {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 0},
    {"input_ids": [1, 2, 3], "return_logprob": True},
    {"input_ids": [1, 2, 3], "logprob_start_len": 1},
    {"input_ids": [[1, 2, 3], [4, 5]], "return_logprob": True, "logprob_start_len": [2, 0]},
    {"input_ids": [[1, 2, 3], [4, 5]], "return_logprob": [True, False], "logprob_start_len": 1},
])
def test_the_engine_reads_logprob_start_len_as_sglang_does(io_struct, body):
    """Our engine's parse of a body against SGLang's own normalization of it: the same start per item,
    taken only with return_logprob (SGLang's scheduler resets it to -1 otherwise)."""
    import copy

    from miles_disagg.engines.builtin.protocol import parse_generate

    req = io_struct.GenerateReqInput(**copy.deepcopy(body))
    req.normalize_batch_and_arguments()
    batched = not req.is_single
    starts = req.logprob_start_len if batched else [req.logprob_start_len]
    wants = req.return_logprob if batched else [req.return_logprob]
    expected = [start if want else -1 for start, want in zip(starts, wants)]
    assert [item.logprob_start_len for item in parse_generate(copy.deepcopy(body)).items] == expected


@pytest.mark.parametrize("body", [
    {"input_ids": [1, 2, 3], "token_ids_logprob": [4, 5], "top_logprobs_num": 2},
    {"input_ids": [1, 2, 3], "token_ids_logprob": []},
    {"input_ids": [[1, 2], [3, 4]], "token_ids_logprob": [4, 5]},
    {"input_ids": [[1, 2], [3, 4]], "token_ids_logprob": [[4], [5, 6]], "top_logprobs_num": [1, 3]},
])
def test_the_engine_reads_token_ids_logprob_and_top_logprobs_num_as_sglang_does(io_struct, body):
    """``token_ids_logprob`` (one list shared by a batch, or one per item) and ``top_logprobs_num``:
    the built-in engine's parse against SGLang's own normalization of the same body."""
    import copy

    from miles_disagg.engines.builtin.protocol import parse_generate

    req = io_struct.GenerateReqInput(**copy.deepcopy(body))
    req.normalize_batch_and_arguments()
    ids = req.token_ids_logprob if not req.is_single else [req.token_ids_logprob]
    tops = req.top_logprobs_num if not req.is_single else [req.top_logprobs_num]
    items = parse_generate(copy.deepcopy(body)).items
    assert [None if i.token_ids_logprob is None else list(i.token_ids_logprob) for i in items] == \
        [v if v else None for v in ids]
    assert [i.top_logprobs_num for i in items] == tops


def test_the_top_k_opd_calls_parse_as_sglang_requests(sglang, manager, io_struct):
    """Top-k OPD (``--opd-top-k-strategy union``): the student's generation call asks for
    ``top_logprobs_num``, the teacher's scoring call for ``top_logprobs_num`` and the student's ids
    (``token_ids_logprob``), the student's scoring call for the teacher's top ids; each parses into SGLang's
    ``GenerateReqInput`` with those fields, and SGLang's answers (the fake manager's, shaped as its
    tokenizer manager shapes them) give each response token the term worked out by hand. The per-position
    form is not stock SGLang's: it is refused at start with the flag to drop."""
    import asyncio
    import math

    import httpx

    from miles_disagg.rollout.generate import SamplingSettings, request_body
    from miles_disagg.rollout.opd_topk import STUDENT_TOP_KEY, TopKSettings, keep_student_top
    from miles_disagg.rollout.teacher import StudentScorer, Teacher, probe_teacher
    from miles_disagg.samples import Sample
    from miles_disagg.types import ConfigError

    answers = httpx.post(f"{sglang.url}/generate", json=request_body([3, 4, 5], SamplingSettings(2), None,
                                                                     num_samples=2, top_logprobs_num=2)).json()
    (generation,) = manager.of_type("GenerateReqInput")
    assert generation.top_logprobs_num == [2, 2] and generation.return_logprob == [True, True]
    metadata: dict = {}
    keep_student_top(metadata, answers[0]["meta_info"], 2)
    assert [[e[1] for e in row] for row in metadata[STUDENT_TOP_KEY]] == [[1, 2], [1, 2]]
    manager.received.clear()

    sample = Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7], response_logprobs=[-1.0, -1.0],
                    metadata={STUDENT_TOP_KEY: [[[-0.1, 1, None], [-0.3, 2, None]], [[-0.2, 3, None]]]})
    settings = TopKSettings(2, "union", "student_p")

    async def score() -> None:
        client = httpx.AsyncClient(timeout=60)
        student = StudentScorer(client, sglang.url, {}, lambda: (None, None))
        teacher = Teacher(httpx.AsyncClient(timeout=60), f"{sglang.url}/generate", topk=settings, student=student)
        try:
            await teacher.score([sample])
        finally:
            await teacher.aclose()
            await client.aclose()

    asyncio.run(score())
    teacher_req, student_req = manager.of_type("GenerateReqInput")
    assert all(isinstance(r, io_struct.GenerateReqInput) for r in (teacher_req, student_req))
    assert teacher_req.input_ids == student_req.input_ids == [3, 4, 5, 6, 7]
    assert teacher_req.top_logprobs_num == 2 and teacher_req.token_ids_logprob == [1, 2, 3]
    assert teacher_req.logprob_start_len == student_req.logprob_start_len == 0
    assert student_req.token_ids_logprob == [1, 2] and student_req.top_logprobs_num == 0
    assert student_req.sampling_params["max_new_tokens"] == 0

    def term(student: list[float], teacher: list[float]) -> float:
        weights = [math.exp(s) for s in student]
        return sum(w / sum(weights) * (s - t) for w, s, t in zip(weights, student, teacher))

    # position 3: S {1, 2}, both from the tops; position 4: S {3, 1, 2}, 3 from the student's top and the
    # teacher's ids, 1 and 2 from the teacher's top (-(p + id) / 10) and the student's ids (-id / 100)
    assert sample.opd_reverse_kl == pytest.approx([term([-0.1, -0.3], [-0.4, -0.5]),
                                                   term([-0.2, -0.01, -0.02], [-0.03, -0.5, -0.6])], abs=1e-9)
    manager.received.clear()
    with pytest.raises(ConfigError, match="drop --opd-topk-per-position for a stock SGLang"):
        probe_teacher(f"{sglang.url}/generate", "--rm-url", topk=TopKSettings(2, per_position=True))
    (probe,) = manager.of_type("GenerateReqInput")
    assert not hasattr(probe, "token_ids_logprob_positions") and probe.token_ids_logprob is None
    assert probe_teacher(f"{sglang.url}/generate", "--rm-url", topk=settings) == "0"
