"""What miles' flags do at run time, in the pure pieces: delta-filter choice, balanced batches,
broadcast buckets, CI gates, miles-signature hooks, stop strings, wandb team and key."""

from __future__ import annotations

import argparse
import sys

import pytest

from miles_disagg.config.components import RolloutConfig, RunConfig, WeightUpdateConfig
from miles_disagg.fleet.plan import delta_filter_choice
from miles_disagg.engines.updater import plan_buckets
from miles_disagg.loop.ci_gates import CIGateFailed, check_step
from miles_disagg.rollout.generate import SamplingSettings
from miles_disagg.trainer.shares import split_for_steps
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError
from miles_disagg.weights.hooks import POST_WRITE_FLAG, MilesHookContext, load_hook
from miles_disagg.weights.publisher import choose_delta_filter

AUTO = WeightUpdateConfig(update_weight_delta_filter="auto")


def test_auto_filter_picks_byte_planes_only_when_every_consumer_announces_them() -> None:
    ours = ["byteplane", "none"]
    assert choose_delta_filter("auto", [("a", ours), ("b", ours)]).filter == "byteplane"
    choice = choose_delta_filter("auto", [("a", ours), ("stock sglang", None)])
    assert choice.filter == "none" and "stock sglang" in choice.reason
    assert choose_delta_filter("auto", [("old agent", ["none"])]).filter == "none"
    assert choose_delta_filter("auto", []).filter == "none"
    assert choose_delta_filter("byteplane", [("stock sglang", None)]).filter == "byteplane"  # asked for explicitly


def test_auto_filter_per_topology() -> None:
    managed = RolloutConfig()
    assert delta_filter_choice(AUTO, managed, backend="builtin", num_engines=2).filter == "byteplane"
    assert delta_filter_choice(AUTO, managed, backend="sglang", num_engines=2).filter == "none"
    attached = RolloutConfig(rollout_external=True, rollout_external_engine_addrs=["h:1", "h:2"])
    assert delta_filter_choice(AUTO, attached, backend=None, num_engines=0,
                               attached=[["byteplane", "none"], ["byteplane", "none"]]).filter == "byteplane"
    assert delta_filter_choice(AUTO, attached, backend=None, num_engines=0,
                               attached=[["byteplane", "none"], None]).filter == "none"
    service = RolloutConfig(rollout_service_url="http://gw:1")
    assert delta_filter_choice(AUTO, service, backend=None, num_engines=0).filter == "none"


def _sample(tokens: int) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2] * (tokens - 1), response_logprobs=[-1.0] * (tokens - 1))


def test_balance_data_deals_equal_counts_with_similar_token_totals() -> None:
    samples = [_sample(n) for n in (100, 2, 90, 3, 80, 4, 70, 5)]
    round_robin = split_for_steps(samples, 8, 2)[0]
    balanced = split_for_steps(samples, 8, 2, balance=True)[0]

    def tokens(share):
        return sum(len(s.prompt_ids) + len(s.response_ids) for s in share)

    assert [len(share) for share in balanced] == [4, 4]
    assert sorted(map(id, balanced[0] + balanced[1])) == sorted(map(id, samples))
    assert abs(tokens(balanced[0]) - tokens(balanced[1])) < abs(tokens(round_robin[0]) - tokens(round_robin[1]))
    assert abs(tokens(balanced[0]) - tokens(balanced[1])) <= 10


def test_broadcast_buckets_respect_the_buffer_size_and_keep_order() -> None:
    meta = {"names": ["a", "b", "c", "d"], "dtypes": ["float32", "bfloat16", "float32", "float32"],
            "shapes": [[10], [100], [1000], [5]]}  # 40, 200, 4000, 20 bytes
    buckets = plan_buckets(meta, 256)
    assert [b["names"] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert buckets[1]["shapes"] == [[1000]] and buckets[0]["dtypes"] == ["float32", "bfloat16"]
    assert [b["names"] for b in plan_buckets(meta, 1 << 30)] == [["a", "b", "c", "d"]]


def _ci(**kwargs) -> RunConfig:
    config = RunConfig()
    config.ci.ci_test = True
    for key, value in kwargs.items():
        setattr(config.ci, key, value)
    return config


@pytest.mark.parametrize("record, gate", [
    ({"step": 3, "train/ppo_kl_first_step": 1e-3}, "first-step ppo_kl: step 3 train/ppo_kl_first_step = 0.001"),
    ({"step": 0, "train/ppo_kl_first_step": -2e-6}, "first-step ppo_kl"),
    ({"step": 1, "train/ppo_kl_first_step": 0.0, "train/pg_clipfrac_first_step": 0.25}, "first-step pg_clipfrac"),
    ({"step": 2, "weights/version": 3, "weights/engine_versions": ["3", "2"]}, "engine versions: step 2 published "
                                                                              "v3 but engines report engine 1: '2'"),
    ({"step": 2, "weights/version": 3, "weights/engine_versions": ["3", None]}, "engine 1: None"),
])
def test_ci_gates_fail_the_run_naming_the_gate_and_values(record, gate) -> None:
    with pytest.raises(CIGateFailed) as info:
        check_step(record, _ci())
    assert gate in str(info.value) and "\n" not in str(info.value)


def test_ci_gates_pass_on_policy_steps_and_can_be_disabled() -> None:
    good = {"step": 0, "train/ppo_kl_first_step": 0.0, "train/pg_clipfrac_first_step": 0.0,
            "weights/version": 1, "weights/engine_versions": ["1", "1"]}
    check_step(good, _ci())
    check_step({"step": 0, "train/ppo_kl_first_step": 0.5}, _ci(ci_disable_kl_checker=True))
    check_step({"step": 0, "train/ppo_kl_first_step": 0.5}, RunConfig())  # no --ci-test: no gate


def test_miles_signature_post_write_hook_gets_args_version_dir_and_engines() -> None:
    calls = []

    def miles_hook(args, version_dir, rollout_engines):
        calls.append((args.update_weight_disk_dir, version_dir, rollout_engines))

    engines = ["http://e0"]
    hook = load_hook(miles_hook, POST_WRITE_FLAG,
                     MilesHookContext(argparse.Namespace(update_weight_disk_dir="/store"), lambda: engines))
    engines.append("http://e1")  # read at call time
    hook("/store/weight_v000001", object())
    assert calls == [("/store", "/store/weight_v000001", ["http://e0", "http://e1"])]
    with pytest.raises(ConfigError, match="or miles' \\(args, version_dir, rollout_engines\\)"):
        load_hook(lambda a, b, c, d: None, POST_WRITE_FLAG)


def test_dotted_hook_path_resolves_like_miles(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_hooks.py").write_text("def after(args, version_dir, rollout_engines):\n    return version_dir\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = load_hook("my_hooks.after", POST_WRITE_FLAG)
    assert hook("/v", None) == "/v"


def test_rollout_stop_strings_and_ids_reach_the_request() -> None:
    body = SamplingSettings(8, stop=("</answer>",), stop_token_ids=(7,)).to_json()
    assert body["stop"] == ["</answer>"] and body["stop_token_ids"] == [7]
    assert "stop" not in SamplingSettings(8).to_json()


def test_wandb_team_and_key(tmp_path, monkeypatch) -> None:
    """A stand-in ``wandb`` package on the path records what the tracker asks of it."""
    (tmp_path / "wandb.py").write_text(
        "calls = []\n"
        "def login(key=None, relogin=None):\n    calls.append(('login', key))\n"
        "class _Run:\n    def log(self, *a, **k): pass\n    def finish(self): pass\n"
        "def init(project=None, group=None, entity=None, config=None, **options):\n"
        "    calls.append(('init', project, group, entity))\n    return _Run()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    from miles_disagg.tracking import MetricsTracker

    tracker = MetricsTracker(tmp_path / "run", use_wandb=True, wandb_project="p", wandb_group="g",
                             wandb_team="lab", wandb_key="k3y")
    tracker.close()
    fake = sys.modules.pop("wandb")  # the stand-in must not outlive this test
    assert fake.calls == [("login", "k3y"), ("init", "p", "g", "lab")]


def test_megatron_flags_reach_the_transformer_config() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core.transformer.enums import AttnBackend

    from miles_disagg.config.components import TrainConfig
    from miles_disagg.trainer.megatron.convert import ModelShape
    from miles_disagg.trainer.megatron.model import ParallelLayout, transformer_config

    shape = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       head_dim=16, vocab_size=24, max_position_embeddings=2048, rope_theta=10000.0, norm_eps=1e-6,
                       tied_embeddings=False)
    layout = ParallelLayout(tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, cp_size=1, cp_rank=0, dp_size=1, dp_rank=0)
    given = transformer_config(shape, TrainConfig(attention_dropout=0.1, hidden_dropout=0.2,
                                                  attention_softmax_in_fp32=False, attention_backend="flash"), layout)
    assert (given.attention_dropout, given.hidden_dropout, given.attention_softmax_in_fp32,
            given.attention_backend) == (0.1, 0.2, False, AttnBackend.flash)
    unset = transformer_config(shape, TrainConfig(), layout)  # RL defaults: no dropout, fp32 softmax
    assert (unset.attention_dropout, unset.hidden_dropout, unset.attention_softmax_in_fp32,
            unset.attention_backend) == (0.0, 0.0, True, AttnBackend.auto)
