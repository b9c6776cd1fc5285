"""miles' import paths for user code (``miles_disagg/rollout/miles_compat``) and miles' ``Sample`` names.

Import checks run in a fresh interpreter: ``sys.modules`` and ``sys.meta_path`` stay clean here.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_disagg.samples import Sample, SampleStatus
from miles_disagg.types import InvalidInput

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, *path: Path) -> subprocess.CompletedProcess:
    env_path = ":".join([*(str(p) for p in path), str(REPO)])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})


def test_miles_paths_are_served_when_miles_is_not_installed() -> None:
    result = run_python("""
        from miles_disagg.rollout.miles_compat import install_miles_imports
        install_miles_imports()
        from miles.utils.types import Sample
        from miles.utils.http_utils import get, post
        from miles.rollout.sglang_rollout import GenerateState, generate, generate_and_rm, generate_and_rm_group
        from miles.rollout.base_types import (RolloutFnConstructorInput, RolloutFnEvalInput, RolloutFnEvalOutput,
                                              RolloutFnTrainInput, RolloutFnTrainOutput)
        from miles.rollout.rm_hub import async_rm, batched_async_rm
        from miles.rollout.rm_hub.math_dapo_utils import compute_score
        from miles.rollout.rm_hub.math_utils import extract_answer, grade_answer_verl
        from miles.rollout.filter_hub.base_types import DynamicFilterOutput
        from miles.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
        import miles_disagg.samples
        assert Sample is miles_disagg.samples.Sample and Sample.Status.ABORTED == "aborted"
        assert RolloutFnTrainInput(3).evaluation is False and RolloutFnEvalInput(3).evaluation is True
        assert compute_score("so. Answer: 1,000", "1000") == {"score": 1.0, "acc": True, "pred": "1000"}
        assert extract_answer("x \\\\boxed{\\\\frac{1}{2}}") == "\\\\frac{1}{2}"
        assert grade_answer_verl("\\\\boxed{0.5}", "1/2")
        assert DynamicFilterOutput(keep=False, reason="r").keep is False
        for name in ("miles.ray.rollout", "miles.utils.types.Foo"):
            try:
                __import__(name)
            except ImportError as exc:
                print("REFUSED", exc)
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("REFUSED") for line in lines)
    assert "miles.ray is a miles module that miles-disagg does not serve" in lines[0]


def test_a_name_not_served_raises_one_line_naming_it() -> None:
    result = run_python("""
        from miles_disagg.rollout.miles_compat import install_miles_imports
        install_miles_imports()
        import miles.utils.types as types
        try:
            types.MultimodalTypes
        except AttributeError as exc:
            print(exc)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("miles.utils.types.MultimodalTypes is a miles name that miles-disagg "
                                            "does not serve")
    assert len(result.stdout.strip().splitlines()) == 1


def test_a_real_miles_on_the_path_is_never_shadowed(tmp_path: Path) -> None:
    real = tmp_path / "miles"
    (real / "utils").mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    (real / "utils" / "__init__.py").write_text("")
    (real / "utils" / "types.py").write_text("class Sample:\n    real = True\n")
    result = run_python("""
        from miles_disagg.rollout.miles_compat import install_miles_imports
        install_miles_imports()
        import miles
        from miles.utils.types import Sample
        print(miles.REAL, Sample.real)
        try:
            import miles.rollout.sglang_rollout  # not in the stand-in: never served from here
        except ModuleNotFoundError as exc:
            print("absent:", exc.name)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["True True", "absent: miles.rollout"]


def test_a_hook_importing_miles_loads_through_the_hook_loader(tmp_path: Path) -> None:
    (tmp_path / "user_hooks.py").write_text(textwrap.dedent("""
        from miles.utils.types import Sample
        from miles.rollout.sglang_rollout import GenerateState

        async def generate(args, sample: Sample, sampling_params):
            return sample
    """))
    result = run_python("""
        from miles_disagg.rollout.hooks import CUSTOM_GENERATE, load_hook
        print(load_hook(CUSTOM_GENERATE, "user_hooks.generate").__name__)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "generate"


def test_miles_hooks_fill_a_sample_by_hand() -> None:
    """What search-r1 does at the end of its generate: tokens, response_length, loss_mask, logprobs."""
    sample = Sample(prompt_ids=[5, 6, 7], response_ids=[], response_logprobs=[])
    sample.tokens = [5, 6, 7, 8, 9, 10, 11]
    sample.response_length = 4
    sample.loss_mask = [1, 0, 0, 1]
    sample.rollout_log_probs = [-0.1, 0.0, 0.0, -0.2]
    sample.status = Sample.Status.TRUNCATED
    sample.turns = 2  # a hook's own attribute
    assert sample.prompt_ids == [5, 6, 7] and sample.response_ids == [8, 9, 10, 11]
    assert sample.tokens == [5, 6, 7, 8, 9, 10, 11] and sample.response_length == 4
    assert sample.response_logprobs == [-0.1, 0.0, 0.0, -0.2] and sample.effective_response_length == 2
    sample.check_consistent()
    copy = pickle.loads(pickle.dumps(sample))
    assert copy.turns == 2 and copy.status == SampleStatus.TRUNCATED == "truncated"


def test_a_sample_is_built_with_miles_keywords() -> None:
    sample = Sample(prompt="12", label=3, metadata={"rm_type": "math"}, status=Sample.Status.PENDING)
    assert (sample.tokens, sample.response_length, sample.rollout_log_probs) == ([], 0, [])


def test_response_length_moves_the_prompt_response_split() -> None:
    sample = Sample(prompt_ids=[1, 2], response_ids=[], response_logprobs=[])
    sample.tokens = [1, 2, 3, 4, 5]  # re-tokenized prompt was longer: response_length decides
    sample.response_length = 2
    assert (sample.prompt_ids, sample.response_ids) == ([1, 2, 3], [4, 5])
    with pytest.raises(InvalidInput, match="response_length 9"):
        sample.response_length = 9
    sample.rollout_log_probs = None
    assert sample.response_logprobs == []


def test_a_class_that_cannot_take_miles_inputs_is_refused_naming_the_flag(tmp_path, monkeypatch) -> None:
    from miles_disagg.rollout.hooks import ROLLOUT_FUNCTION, ClassRolloutFunction, load_hook
    from miles_disagg.types import ConfigError

    (tmp_path / "class_hooks.py").write_text(textwrap.dedent("""
        class Good:
            def __init__(self, input):
                self.input = input

            async def __call__(self, input):
                return [[]]

        class NoInput:
            def __init__(self):
                pass

            def __call__(self, input):
                return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(load_hook(ROLLOUT_FUNCTION, "class_hooks.Good"), ClassRolloutFunction)
    with pytest.raises(ConfigError, match="--rollout-function-path 'class_hooks.NoInput' is a class") as info:
        load_hook(ROLLOUT_FUNCTION, "class_hooks.NoInput")
    assert info.value.flags == ("--rollout-function-path",)
    sys.modules.pop("class_hooks", None)
