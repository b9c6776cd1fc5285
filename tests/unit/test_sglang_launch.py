"""The SGLang launch argv: SGLang's flag names, miles' --sglang-* passthrough, refused conflicts."""

from __future__ import annotations

import pytest

from miles_disagg.config.sglang_args import parse_sglang_passthrough, split_sglang_passthrough
from miles_disagg.engines.sglang import sglang_command, sglang_device_view
from miles_disagg.types import ConfigError

BASE = dict(host="10.0.0.5", port=30001, tp_size=2, base_gpu_id=4, dtype="bfloat16", weight_version=0)


def _pairs(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of an argv (switches map to "")."""
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            out[argv[i]] = argv[i + 1] if has_value else ""
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def test_command_uses_sglang_flag_names():
    argv = sglang_command("/ckpt/qwen", python="/venv/bin/python", **BASE)
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    assert _pairs(argv) == {
        "--model-path": "/ckpt/qwen", "--host": "10.0.0.5", "--port": "30001", "--tp-size": "2",
        "--base-gpu-id": "4", "--dtype": "bfloat16", "--weight-version": "0", "--trust-remote-code": "",
    }


def test_trust_remote_code_can_be_turned_off():
    assert "--trust-remote-code" not in sglang_command("/m", trust_remote_code=False, **BASE)


def test_passthrough_values_switches_and_lists():
    argv = sglang_command("/m", **BASE, extra_args={
        "mem-fraction-static": "0.8", "enable_metrics": True, "disable-radix-cache": False,
        "--cuda-graph-bs": ["1", "2", "4"], "chunked-prefill-size": -1,
    })
    tail = argv[argv.index("--trust-remote-code") + 1:]
    assert tail == ["--mem-fraction-static", "0.8", "--enable-metrics", "--cuda-graph-bs", "1", "2", "4",
                    "--chunked-prefill-size", "-1"]


def test_each_engine_gets_its_random_seed():
    argv = sglang_command("/m", **BASE, random_seed=1234)
    assert _pairs(argv)["--random-seed"] == "1234"
    assert "--random-seed" not in sglang_command("/m", **BASE)
    with pytest.raises(ConfigError, match="random-seed"):
        sglang_command("/m", **BASE, random_seed="7")


@pytest.mark.parametrize("name", ["port", "tp-size", "tp", "model-path", "dtype", "weight_version", "--base-gpu-id",
                                  "random-seed"])
def test_passthrough_may_not_override_managed_flags(name):
    with pytest.raises(ConfigError, match="conflicts"):
        sglang_command("/m", **BASE, extra_args={name: "1"})


@pytest.mark.parametrize("override, named", [
    ({"tp_size": 0}, "--rollout-num-gpus-per-engine"), ({"port": 0}, "port"), ({"port": 70000}, "port"),
    ({"dtype": "fp8"}, "--dtype"), ({"base_gpu_id": -1}, "--base-gpu-id"), ({"host": ""}, "host"),
])
def test_bad_managed_values_are_config_errors(override, named):
    with pytest.raises(ConfigError, match=named):
        sglang_command("/m", **{**BASE, **override})


def test_parse_pulls_sglang_options_out_of_a_job_argv():
    argv = ["--actor-num-nodes", "1", "--sglang-mem-fraction-static", "0.8", "--sglang-enable-metrics",
            "--sglang-log-level=warning", "--sglang-cuda-graph-bs", "1", "2", "--sglang-chunked-prefill-size", "-1",
            "--sglang-custom-pull-weights-pre-read-hook", "hooks:pre", "--colocate"]
    options, rest = split_sglang_passthrough(argv)
    assert options == {"mem-fraction-static": "0.8", "enable-metrics": True, "log-level": "warning",
                       "cuda-graph-bs": ["1", "2"], "chunked-prefill-size": "-1"}
    # the pre-read hook is this project's (the agent runs it), never passed to stock SGLang
    assert rest == ["--actor-num-nodes", "1", "--sglang-custom-pull-weights-pre-read-hook", "hooks:pre", "--colocate"]
    assert parse_sglang_passthrough(argv) == options


def test_parsed_options_round_trip_into_the_command():
    options = parse_sglang_passthrough(["--sglang-mem-fraction-static", "0.7", "--sglang-enable-metrics"])
    argv = sglang_command("/m", **BASE, extra_args=options)
    assert argv[-3:] == ["--mem-fraction-static", "0.7", "--enable-metrics"]


def test_a_passthrough_flag_given_twice_takes_its_last_value():
    """As every other flag (argparse), as miles: a flag appended to a script overrides the script's."""
    assert parse_sglang_passthrough(["--sglang-port-x", "1", "--sglang-a", "--sglang-port_x", "2"]) == \
        {"a": True, "port-x": "2"}
    assert parse_sglang_passthrough(["--sglang-cuda-graph-bs", "1", "2", "--sglang-cuda-graph-bs=8"]) == \
        {"cuda-graph-bs": "8"}
    # SGLang's other name of an option replaces it too (one option, the last value)
    assert parse_sglang_passthrough(["--sglang-ep-size", "8", "--sglang-dp-size", "2", "--sglang-ep", "4"]) == \
        {"dp-size": "2", "ep": "4"}


@pytest.mark.parametrize("bad", ["--sglang-", "--sglang-sglang-x", "--sglang-a b"])
def test_malformed_passthrough_names_are_refused(bad):
    with pytest.raises(ConfigError):
        parse_sglang_passthrough([bad, "1"])


@pytest.mark.parametrize("ray_ids, node_visible, tp, expected", [
    (["5"], None, 1, (5, None)),  # nothing restricted: Ray's id is the physical index
    (["5"], ["2", "3", "5", "7"], 2, (2, "2,3,5,7")),  # restricted: the position in the node's list
    (["GPU-b"], ["GPU-a", "GPU-b"], 1, (1, "GPU-a,GPU-b")),  # UUIDs
    ([], None, 1, (0, None)),
])
def test_device_view_maps_ray_ids_through_the_node_visible_devices(ray_ids, node_visible, tp, expected):
    assert sglang_device_view(ray_ids, node_visible, tp) == expected


@pytest.mark.parametrize("ray_ids, node_visible, tp, message", [
    (["4"], ["2", "3"], 1, "not in its node's CUDA_VISIBLE_DEVICES"),
    (["3"], ["2", "3"], 2, "needs 2 devices"),
    (["GPU-b"], None, 1, "not an index"),
])
def test_device_view_refuses_what_cannot_be_placed(ray_ids, node_visible, tp, message):
    with pytest.raises(ConfigError, match=message):
        sglang_device_view(ray_ids, node_visible, tp)
