"""The built-in engine's prefix cache: the radix tree alone (matches, splits, LRU eviction, the
version partition), then inside the scheduler on the tiny Qwen3 (a continuing prompt computes only
its new tokens, with the logprobs of a cold forward pass; after a weight swap nothing is reused)."""

from __future__ import annotations

import threading

import pytest
import torch

from miles_disagg.engines.builtin.model_runner import ModelRunner
from miles_disagg.engines.builtin.prefix_cache import PrefixCache
from miles_disagg.engines.builtin.protocol import GenerateItem, SamplingParams
from miles_disagg.engines.builtin.scheduler import Scheduler
from miles_disagg.engines.builtin.sequence import Sequence

pytestmark = pytest.mark.timeout(120)

KEY_V1, KEY_V2 = ("1", 0), ("2", 1)


def _layers(tokens: list[int], num_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake KV whose every value is its token id, so a match shows which tokens' KV it returned."""
    column = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(1, len(tokens), 2)
    return [(column.clone(), -column.clone()) for _ in range(num_layers)]


def _kv_tokens(layers) -> list[int]:
    return [int(x) for x in layers[0][0][0, 0, :, 0]]


def test_match_returns_the_longest_cached_prefix_and_its_own_kv():
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3, 4, 5], _layers([1, 2, 3, 4, 5]), KEY_V1)
    cache.insert([1, 2, 3, 9, 9, 9], _layers([1, 2, 3, 9, 9, 9]), KEY_V1)  # splits the edge after 3
    assert cache.held_tokens == 8
    length, layers = cache.match([1, 2, 3, 9, 9, 7], KEY_V1, limit=5)
    assert length == 5 and _kv_tokens(layers) == [1, 2, 3, 9, 9]
    assert layers[1][1].shape == (1, 1, 5, 2) and torch.equal(layers[1][1], -layers[1][0])
    length, layers = cache.match([1, 2, 3, 4, 5, 6], KEY_V1, limit=5)  # at least one token left to run
    assert length == 5 and _kv_tokens(layers) == [1, 2, 3, 4, 5]
    assert cache.match([7, 1, 2], KEY_V1, limit=3) == (0, None)
    assert cache.stats.hit_tokens == 10 and cache.stats.lookup_tokens == 15


def test_a_match_is_a_copy_the_caller_may_write():
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3], _layers([1, 2, 3]), KEY_V1)
    _, layers = cache.match([1, 2, 3, 4], KEY_V1, limit=3)
    layers[0][0].fill_(0)
    assert _kv_tokens(cache.match([1, 2, 3, 4], KEY_V1, limit=3)[1]) == [1, 2, 3]


def test_eviction_keeps_the_bound_and_drops_the_least_recently_used_leaves():
    cache = PrefixCache(max_tokens=10)
    cache.insert([1, 2, 3, 4], _layers([1, 2, 3, 4]), KEY_V1)
    cache.insert([5, 6, 7, 8], _layers([5, 6, 7, 8]), KEY_V1)
    cache.match([1, 2, 3, 4, 0], KEY_V1, limit=4)  # [1..4] is now the most recently used
    cache.insert([9, 10, 11, 12], _layers([9, 10, 11, 12]), KEY_V1)
    assert cache.held_tokens == 8 and cache.stats.evicted_tokens == 4
    assert cache.cached_prefix_length([5, 6, 7, 8], KEY_V1) == 0
    assert cache.cached_prefix_length([1, 2, 3, 4], KEY_V1) == 4
    assert cache.cached_prefix_length([9, 10, 11, 12], KEY_V1) == 4
    cache.insert(list(range(100, 130)), _layers(list(range(100, 130))), KEY_V1)  # longer than the cache
    assert cache.held_tokens <= 10 and cache.cached_prefix_length(list(range(100, 110)), KEY_V1) == 10


def test_eviction_walks_up_a_branch_and_never_leaves_inner_nodes_behind():
    cache = PrefixCache(max_tokens=6)
    cache.insert([1, 2, 3, 4], _layers([1, 2, 3, 4]), KEY_V1)
    cache.insert([1, 2, 5, 6], _layers([1, 2, 5, 6]), KEY_V1)  # [1,2] shared, two leaves of 2
    cache.insert([7, 8, 9, 10, 11], _layers([7, 8, 9, 10, 11]), KEY_V1)
    assert cache.held_tokens == 5 and cache.cached_prefix_length([1, 2], KEY_V1) == 0


def test_kv_of_one_version_never_serves_another():
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3, 4], _layers([1, 2, 3, 4]), KEY_V1)
    assert cache.match([1, 2, 3, 4, 5], KEY_V2, limit=4) == (0, None)  # a lookup under v2 misses
    cache.insert([1, 2, 3, 4, 5], _layers([1, 2, 3, 4, 5]), KEY_V2)  # an insert under v2 drops v1's KV
    assert cache.held_tokens == 5 and cache.stats.num_drops == 1
    assert cache.match([1, 2, 3, 4, 5, 6], KEY_V1, limit=5) == (0, None)
    assert cache.match([1, 2, 3, 4, 5, 6], KEY_V2, limit=5)[0] == 5
    assert cache.stats.cross_version_tokens == 0


def test_off_and_bad_sizes():
    cache = PrefixCache(max_tokens=0)
    assert cache.insert([1, 2], _layers([1, 2]), KEY_V1) == 0 and cache.match([1, 2, 3], KEY_V1, 2) == (0, None)
    with pytest.raises(ValueError, match="prefix cache size"):
        PrefixCache(max_tokens=-1)


# --------------------------------------------------------------------------- in the scheduler


@pytest.fixture(scope="module")
def runner(tiny_qwen3_dir):
    return ModelRunner(tiny_qwen3_dir)


class _Sink:
    def __init__(self):
        self.done = threading.Event()

    def on_token(self, seq):
        pass

    def on_finish(self, seq):
        self.done.set()


def _turn(scheduler: Scheduler, prompt: list[int], max_new: int = 6) -> Sequence:
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    item = GenerateItem(rid=f"r{len(prompt)}", input_ids=tuple(prompt), text=None, sampling=params,
                        return_logprob=True)
    seq = Sequence(item=item, prompt_ids=list(prompt), generator=scheduler.new_generator(7), sink=_Sink(),
                   stop_ids=frozenset())
    scheduler.submit(seq)
    assert seq.sink.done.wait(60)
    return seq


def _cold_logprobs(runner: ModelRunner, seq: Sequence) -> list[float]:
    """Each generated token's logprob from one unbatched forward pass over the whole sequence."""
    full = runner.full_logprobs(seq.all_ids)
    start = len(seq.prompt_ids) - 1
    return [float(full[start + i, token]) for i, token in enumerate(seq.output_ids)]


def _swap_perturbed(runner: ModelRunner, scheduler: Scheduler, version: str) -> None:
    """An activation as WeightUpdates does it: new tensors swapped in on the scheduler thread."""
    weights = runner.named_weights()
    generator = torch.Generator().manual_seed(3)
    tensors = {name: t + 0.05 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
               for name, t in weights.items() if "layers.0." in name}

    def activate(s: Scheduler) -> None:
        s.weights_changed()
        runner.swap_in(tensors)
        s.version = version

    scheduler.call(activate).result(30)


def test_a_continuing_prompt_runs_only_its_new_tokens_and_a_swap_reuses_nothing(tiny_qwen3_dir):
    runner = ModelRunner(tiny_qwen3_dir)  # its own: the weights are swapped
    scheduler = Scheduler(runner, version="1", max_running=4, seed=0, stop_text=lambda seq: None,
                          prefix_cache_tokens=4096)
    scheduler.start()
    try:
        first = _turn(scheduler, [5, 6, 7, 8, 9, 10])
        assert first.cached_tokens == 0
        second = _turn(scheduler, first.all_ids + [11, 12, 13])
        assert second.cached_tokens == len(first.all_ids) - 1  # all but the never-fed last token
        assert second.output_logprobs == pytest.approx(_cold_logprobs(runner, second), abs=1e-4)
        _swap_perturbed(runner, scheduler, "2")
        third = _turn(scheduler, second.all_ids + [14, 15])
        assert third.cached_tokens == 0 and third.version_start == "2"
        assert third.output_logprobs == pytest.approx(_cold_logprobs(runner, third), abs=1e-4)
        fourth = _turn(scheduler, third.all_ids + [16])
        assert fourth.cached_tokens == len(third.all_ids) - 1
        assert fourth.output_logprobs == pytest.approx(_cold_logprobs(runner, fourth), abs=1e-4)
        stats = scheduler.prefix_cache.stats
        assert stats.cross_version_tokens == 0 and stats.num_drops == 1
        assert scheduler.call(lambda s: s.flush()).result(10)
        assert scheduler.prefix_cache.held_tokens == 0
    finally:
        scheduler.stop()


def test_kv_of_a_request_spanning_a_swap_never_joins_the_cache(runner):
    scheduler = Scheduler(runner, version="1", max_running=4, seed=0, stop_text=lambda seq: None,
                          prefix_cache_tokens=4096)
    scheduler.start()
    try:
        params = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)
        item = GenerateItem(rid="long", input_ids=(5, 6, 7), text=None, sampling=params, return_logprob=True)
        seq = Sequence(item=item, prompt_ids=[5, 6, 7], generator=scheduler.new_generator(1), sink=_Sink(),
                       stop_ids=frozenset())
        scheduler.submit(seq)
        while len(seq.output_ids) < 3:
            threading.Event().wait(0.001)
        scheduler.call(lambda s: (s.weights_changed(), setattr(s, "version", "2"))).result(10)  # in place
        assert seq.sink.done.wait(60) and seq.version_start == "1" and seq.version_end == "2"
        assert scheduler.prefix_cache.held_tokens == 0  # mixed-version KV is not cached
    finally:
        scheduler.stop()


def test_namespaces_keep_entries_apart_and_share_one_bound():
    cache = PrefixCache(max_tokens=8)
    cache.insert([1, 2, 3, 4], _layers([1, 2, 3, 4]), KEY_V1, namespace="weight-version:1")
    assert cache.match([1, 2, 3, 4, 5], KEY_V1, 4, namespace="weight-version:2") == (0, None)
    assert cache.match([1, 2, 3, 4, 5], KEY_V1, 4) == (0, None)
    assert cache.match([1, 2, 3, 4, 5], KEY_V1, 4, namespace="weight-version:1")[0] == 4
    cache.insert([1, 2, 3, 4, 5, 6], _layers([1, 2, 3, 4, 5, 6]), KEY_V1, namespace="other")
    assert cache.held_tokens == 6 and cache.cached_prefix_length([1, 2, 3, 4], KEY_V1, "weight-version:1") == 0


def test_generate_bodies_carry_sglangs_extra_key_per_item():
    from miles_disagg.engines.builtin.protocol import parse_generate
    from miles_disagg.types import InvalidInput

    one = parse_generate({"input_ids": [1, 2], "extra_key": "weight-version:3"})
    assert one.items[0].extra_key == "weight-version:3"
    batch = parse_generate({"input_ids": [[1], [2]], "extra_key": ["a", None]})
    assert [item.extra_key for item in batch.items] == ["a", None]
    assert parse_generate({"input_ids": [1]}).items[0].extra_key is None
    with pytest.raises(InvalidInput, match="extra_key"):
        parse_generate({"input_ids": [1], "extra_key": "x" * 300})
    with pytest.raises(InvalidInput, match="extra_key"):
        parse_generate({"input_ids": [1], "extra_key": 5})
