"""``miles-disagg bench agentic``: multi-turn agent sessions over N built-in engines, with and without
session affinity, with weight activations during each run.

Sets up a random Qwen3 (character vocabulary, ``--hidden-size``/``--num-layers``), ``--engines`` built-in
engines behind the router (processes, one torch thread each: ``--engine-threads``), and the session endpoint
(:mod:`miles_disagg.rollout.sessions`) in this process. Each engine's prefix cache is its KV memory, sized
as a fleet sizes a KV pool: its share of the sessions in flight at their mean length, with headroom
(``--prefix-cache-tokens`` 0, the default). Each mode runs ``--sessions`` sessions of ``--turns`` turns,
``--concurrency`` at a time (several per engine): a unique first message, then per turn the engine's answer
and, after the tool's time (drawn around ``--tool-ms``), a tool message of ``--appended-tokens`` characters
(one token each). ``--activations`` times during a mode (after equal shares of its sessions finished) every
engine activates a new version (``/update_weights_from_disk`` of the same weights under a new label: a real
swap, the caches drop). The two modes differ only in the routing key the session endpoint sends
(``X-SMG-Routing-Key``); without it the router routes every turn by its own policy (fewest outstanding
requests, ties round robin). The caches are flushed before each mode.

The workload is prefill-dominated, as agentic rollout on a fleet is: long contexts (8 turns of a few hundred
appended tokens), short answers, a model wide enough that prefilling a context costs far more than decoding
8 tokens. The tool's time matters for the mode without affinity: while a session's tool runs, many other
turns reach the router, so its next turn lands on any engine (``same_engine_as_previous_turn`` about 1/N);
with a short tool time, fewest-outstanding routing sends a lone session back to the engine it just left.

Figures per mode: prefix-cache hit rate (cached prompt tokens / prompt tokens) and the workload's ideal
(a turn may reuse its session's previous prompt and output, less the never-fed last token, when the same
version served both), prefill tokens computed per turn against the tokens the turn appended, turn latency
p50/p99, sessions per second (wall) and per CPU-second of the engines (the machine may be shared: the
second does not move with other processes' load), how often a turn went to its session's previous engine,
session moves (the router's count), token drift (turns whose prompt does not
extend the previous turn's prompt and output, plus prefix-check failures) and KV reuse across versions
(turns after a version change that reused more than any other session can share with them: the template's
opening and half the session's unique first message (other sessions' prefixes computed under the new
version may share its first few characters), plus the engines' own ``cross_version_tokens``).
Ratios: ``prefix_cache_hit_ratio_vs_ideal`` (affinity), the same without,
``sessions_per_s_affinity_vs_none``, ``sessions_per_engine_cpu_s_affinity_vs_none``,
``prefill_per_turn_vs_appended`` (affinity; every turn, those that recompute a context after an activation
included) and ``prefill_per_turn_vs_appended_same_version_turns`` (the turns whose previous turn ended on the
version they start on: what the cache alone leaves to compute).

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import string
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.bench.common import print_result, progress, qwen3_shape, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag

_progress = progress("agentic")
TEXT = string.ascii_letters + string.digits
FIRST_MESSAGE_TOKENS = 40
"""A session's unique opening message (one token per character in the bench's vocabulary)."""


@dataclass(kw_only=True)
class AgenticBench:
    """multi-turn agentic sessions: prefix-cache hits and sessions/s with and without affinity, across activations"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    engines: int = flag(4, "Built-in engines behind the router.")
    sessions: int = flag(96, "Sessions per mode.")
    turns: int = flag(8, "Turns per session.")
    appended_tokens: int = flag(200, "Tokens a tool message appends per turn.")
    max_new_tokens: int = flag(8, "Tokens generated per turn.")
    concurrency: int = flag(48, "Sessions in flight at once (12 per engine at 4 engines, as on a fleet).")
    tool_ms: float = flag(3000.0, "Mean time the tool takes between two turns of a session (each drawn uniformly in "
                                  "0.5-1.5x; the agent waits, its engine serves others). Long enough that many other "
                                  "turns reach the router meanwhile, as on a fleet with many sessions per engine.")
    activations: int = flag(2, "Activations of every engine during each mode.")
    prefix_cache_tokens: int = flag(0, "Each engine's --prefix-cache-tokens (its KV memory for cached prefixes); 0: "
                                       "sized for its share of the sessions in flight, as a GPU's KV pool is "
                                       "(ceil(concurrency / engines) sessions at their mean length, times "
                                       "--cache-headroom).")
    cache_headroom: float = flag(1.5, "With --prefix-cache-tokens 0: the KV memory per engine over its share of "
                                      "the sessions in flight at their mean length (half a whole session).")
    engine_threads: int = flag(1, "Torch threads per engine (OMP_NUM_THREADS): 1 keeps engines from contending "
                                  "for the same cores, so each gets a fair share of the CPU.")
    hidden_size: int = flag(512, "Hidden size of the random Qwen3 (a multiple of 64): wide enough that prefilling "
                                 "a long context costs far more than decoding a short answer.")
    num_layers: int = flag(4, "Layers of the random Qwen3.")
    work_dir: Path | None = flag(None, "Keep the model and logs here (default: a temp dir).")

    def __post_init__(self) -> None:
        qwen3_shape(self.hidden_size, self.num_layers)
        for name in ("engines", "sessions", "turns", "appended_tokens", "max_new_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.engine_threads < 1 or self.cache_headroom <= 0 or self.prefix_cache_tokens < 0:
            raise ValueError("--engine-threads must be at least 1, --cache-headroom above 0, "
                             "--prefix-cache-tokens at least 0")
        if self.activations < 0 or self.tool_ms < 0:
            raise ValueError(f"--activations and --tool-ms must be >= 0, got {self.activations}, {self.tool_ms}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, AgenticBench)


def run(args: argparse.Namespace) -> int:
    command = config_from_args(AgenticBench, args)
    with work_dir("agentic", command.work_dir) as root:
        return print_result(_bench(root, command))


def _bench(root: Path, command: AgenticBench) -> dict:
    from miles_disagg.engines.launch import launch_engine
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3
    from miles_disagg.router.launch import launch_router

    # room for a whole session: its turns' appended and generated tokens and their template (< 64 a turn)
    context = FIRST_MESSAGE_TOKENS + command.turns * (command.appended_tokens + command.max_new_tokens + 64)
    model_dir = make_tiny_qwen3(root / "model", **qwen3_shape(command.hidden_size, command.num_layers),
                                max_position_embeddings=max(2048, context))
    cache_tokens = command.prefix_cache_tokens or kv_pool_tokens(command, session_tokens(model_dir, command))
    _progress(f"starting {command.engines} engines ({command.engine_threads} torch thread(s), "
              f"{cache_tokens} prefix-cache tokens each) and the router")
    with _environment(OMP_NUM_THREADS=str(command.engine_threads)):
        engines = [launch_engine(model_dir, log_path=root / f"engine-{i}.log",
                                 extra_args=("--allow-unverified-versions", "--max-running-requests", "32",
                                             "--prefix-cache-tokens", str(cache_tokens)))
                   for i in range(command.engines)]
    router = launch_router(log_path=root / "router.log", workers=[e.url for e in engines], health_check_interval_s=0.5)
    try:
        fleet = Fleet(model_dir, [e.url for e in engines], router.url, [e.proc.pid for e in engines])
        modes = {mode: asyncio.run(fleet.run_mode(command, affinity=mode == "affinity"))
                 for mode in ("affinity", "none")}
    finally:
        router.stop()
        for engine in engines:
            engine.stop()
    return _result(command, modes, cache_tokens)


def session_tokens(model_dir: Path, command: AgenticBench) -> int:
    """The tokens of one whole session of the workload (its last prompt rendered by the checkpoint's
    template, each answer taken as ``max_new_tokens`` tokens)."""
    from miles_disagg.models.tokenizer import load_tokenizer
    from miles_disagg.rollout.sessions.templates import checkpoint_template, render

    messages = [{"role": "user", "content": "u" * FIRST_MESSAGE_TOKENS}]
    for _ in range(command.turns):
        messages += [{"role": "assistant", "content": "a" * command.max_new_tokens},
                     {"role": "tool", "content": "t" * command.appended_tokens}]
    text = render(checkpoint_template(model_dir), messages, add_generation_prompt=True)
    return len(load_tokenizer(model_dir)(text, add_special_tokens=False)["input_ids"])


def kv_pool_tokens(command: AgenticBench, per_session: int) -> int:
    """An engine's KV memory for cached prefixes as a fleet sizes it: its share of the sessions in
    flight at their mean length (sessions in flight are spread over their turns: half a whole one),
    times the headroom."""
    share = -(-command.concurrency // command.engines)
    return int(share * per_session / 2 * command.cache_headroom)


@contextlib.contextmanager
def _environment(**values: str):
    """``values`` in this process's environment while engines start (they inherit it), then restored."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Fleet:
    """The engines, the router and the session endpoint's service, driven mode by mode."""

    def __init__(self, model_dir: Path, engine_urls: list[str], router_url: str, engine_pids: list[int]):
        from miles_disagg.models.tokenizer import load_tokenizer

        self.model_dir, self.engine_urls, self.router_url = model_dir, engine_urls, router_url
        self.engine_pids = engine_pids
        self.tokenizer = load_tokenizer(model_dir)
        self.version = 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def run_mode(self, command: AgenticBench, affinity: bool) -> dict:
        import httpx

        from miles_disagg.rollout.sessions.service import SessionService, SessionSettings
        from miles_disagg.rollout.sessions.templates import checkpoint_template
        from miles_disagg.rollout.sessions.tito import TitoRule

        rule = TitoRule.make("qwen3", checkpoint_template(self.model_dir), self.encode, ("tool", "user"))
        settings = SessionSettings({"temperature": 1.0}, command.max_new_tokens, routing_key=affinity)
        async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
            await self._flush(client)
            moves_before, cross_before = await self._moves(client), await self._cross_version_tokens(client)
            service = SessionService(client, self.router_url, rule,
                                     lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), settings,
                                     lambda: (None, None), Counter())
            _progress(f"{'with' if affinity else 'without'} affinity: {command.sessions} sessions x {command.turns} turns")
            runner = ModeRun(self, service, command)
            started, cpu_before = time.perf_counter(), self.engines_cpu_s()
            turns = await runner.run(client)
            wall_s, engine_cpu_s = time.perf_counter() - started, self.engines_cpu_s() - cpu_before
            moves = await self._moves(client) - moves_before
            cross = await self._cross_version_tokens(client) - cross_before
        figures = _mode_figures(turns, runner.latencies_s, wall_s, command, moves, cross,
                                service.counters["prefix_mismatches"], len(self.encode("<|im_start|>user\n")))
        return {**figures, "engine_cpu_s": round(engine_cpu_s, 2), "engine_cpu_cores": round(engine_cpu_s / wall_s, 2),
                "load_avg_1m_end": round(os.getloadavg()[0], 2),
                "sessions_per_engine_cpu_s": round(len(turns) / engine_cpu_s, 4) if engine_cpu_s else None}

    def engines_cpu_s(self) -> float:
        """CPU seconds the engine processes used so far (user and system)."""
        import psutil

        return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in self.engine_pids)

    async def activate_all(self, client) -> None:
        """Every engine swaps in the same weights under the next version (its prefix cache drops)."""
        self.version += 1
        for url in self.engine_urls:
            answer = await client.post(f"{url}/update_weights_from_disk",
                                       json={"model_path": str(self.model_dir), "weight_version": str(self.version)})
            answer.raise_for_status()

    async def _flush(self, client) -> None:
        for url in self.engine_urls:
            (await client.post(f"{url}/flush_cache")).raise_for_status()

    async def _moves(self, client) -> int:
        return int((await client.get(f"{self.router_url}/metrics")).json().get("session_moves", 0))

    async def _cross_version_tokens(self, client) -> int:
        total = 0
        for url in self.engine_urls:
            info = (await client.get(f"{url}/get_server_info")).json()
            total += int(info["internal_states"][0]["prefix_cache"]["cross_version_tokens"])
        return total


class ModeRun:
    """One mode's sessions (``concurrency`` at a time) and its activations."""

    def __init__(self, fleet: Fleet, service, command: AgenticBench):
        self.fleet, self.service, self.command = fleet, service, command
        self.latencies_s: list[float] = []
        self.finished = 0

    async def run(self, client) -> list[list]:
        slots = asyncio.Semaphore(self.command.concurrency)
        every = max(1, self.command.sessions // (self.command.activations + 1))
        pending: set[asyncio.Task] = set()

        async def one(index: int) -> list:
            async with slots:
                turns = await self.session(index)
            self.finished += 1
            if self.finished % every == 0 and self.finished // every <= self.command.activations:
                pending.add(asyncio.ensure_future(self.fleet.activate_all(client)))
            return turns

        sessions = await asyncio.gather(*(one(i) for i in range(self.command.sessions)))
        await asyncio.gather(*pending)
        return sessions

    async def session(self, index: int) -> list:
        """One session; its texts and tool times come from its own seed (the same in both modes)."""
        rng = random.Random(index)
        state = self.service.create({"index": index})
        messages = [{"role": "user", "content": _text(rng, FIRST_MESSAGE_TOKENS)}]
        for _ in range(self.command.turns):
            started = time.perf_counter()
            answer = await self.service.chat(state.session_id, {"messages": messages})
            self.latencies_s.append(time.perf_counter() - started)
            # the tool runs (its time drawn around --tool-ms); the session holds no engine meanwhile
            await asyncio.sleep(self.command.tool_ms * rng.uniform(0.5, 1.5) / 1000)
            messages += [answer["choices"][0]["message"],
                         {"role": "tool", "content": _text(rng, self.command.appended_tokens)}]
        return self.service.delete(state.session_id).turns


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(TEXT) for _ in range(n))


def _mode_figures(sessions: list[list], latencies_s: list[float], wall_s: float, command: AgenticBench, moves: int,
                  cross_tokens: int, prefix_mismatches: int, shared_head: int) -> dict:
    from miles_disagg.rollout.sessions.types import token_drift

    prompt = cached = ideal = appended = reused_across = same_engine = 0
    kept_prefill = kept_appended = 0  # over the turns whose previous turn ended on the version they start on
    reuse_cases: list[dict] = []
    shareable = shared_head + FIRST_MESSAGE_TOKENS // 2  # what another session's prefix may have in common
    for turns in sessions:
        previous = None
        for turn in turns:
            same_engine += previous is not None and previous.worker == turn.worker
            held = len(previous.prompt_ids) + len(previous.output_ids) if previous is not None else 0
            same_version = previous is not None and previous.version_end == turn.version_start
            prompt, cached = prompt + len(turn.prompt_ids), cached + turn.cached_tokens
            ideal += max(0, held - 1) if same_version else 0
            appended += len(turn.prompt_ids) - held
            if same_version:
                kept_prefill += len(turn.prompt_ids) - turn.cached_tokens
                kept_appended += len(turn.prompt_ids) - held
            if previous is not None and not same_version and turn.cached_tokens > shareable:
                reused_across += 1
                reuse_cases.append({"previous_versions": [previous.version_start, previous.version_end],
                                    "previous_finish": previous.finish_reason,
                                    "versions": [turn.version_start, turn.version_end],
                                    "cached_tokens": turn.cached_tokens, "worker": turn.worker})
            previous = turn
    num_turns = sum(len(t) for t in sessions)
    ordered = sorted(latencies_s)
    return {
        "prefix_cache_hit_rate": round(cached / prompt, 4), "ideal_hit_rate": round(ideal / prompt, 4),
        "prefill_tokens_per_turn": round((prompt - cached) / num_turns, 1),
        "appended_tokens_per_turn": round(appended / num_turns, 1),
        "prefill_vs_appended_same_version_turns": round(kept_prefill / kept_appended, 3) if kept_appended else None,
        "turn_latency_ms": {"p50": round(ordered[len(ordered) // 2] * 1e3, 1),
                            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 1)},
        "sessions_per_s": round(len(sessions) / wall_s, 3), "wall_s": round(wall_s, 2), "turns": num_turns,
        "same_engine_as_previous_turn": round(same_engine / max(1, num_turns - len(sessions)), 3),
        "session_moves": moves, "token_drift": sum(token_drift(t) for t in sessions) + prefix_mismatches,
        "kv_reuse_across_versions": int(reused_across) + cross_tokens,
        "kv_reuse_cases": {"engine_cross_version_tokens": cross_tokens, "turns": reuse_cases[:5]},
        "version_changes_seen": sum(1 for t in sessions for a, b in zip(t, t[1:]) if a.version_end != b.version_start),
    }


def _result(command: AgenticBench, modes: dict[str, dict], cache_tokens: int) -> dict:
    with_, without = modes["affinity"], modes["none"]
    ratio = lambda a, b: round(a / b, 3) if b else None  # noqa: E731
    settings = {name: getattr(command, name) for name in ("engines", "sessions", "turns", "appended_tokens",
                                                          "max_new_tokens", "concurrency", "activations", "hidden_size",
                                                          "num_layers", "tool_ms", "engine_threads")}
    return {
        "settings": {**settings, "prefix_cache_tokens": cache_tokens},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
        "routing": {"affinity": "the router's session affinity (X-SMG-Routing-Key: the session id)",
                    "none": "the router's own policy without a routing key: fewest outstanding requests, "
                            "ties round robin"},
        "affinity": with_, "none": without,
        "prefix_cache_hit_ratio_vs_ideal": ratio(with_["prefix_cache_hit_rate"], with_["ideal_hit_rate"]),
        "prefix_cache_hit_ratio_vs_ideal_without_affinity": ratio(without["prefix_cache_hit_rate"],
                                                                  without["ideal_hit_rate"]),
        "prefill_per_turn_vs_appended": ratio(with_["prefill_tokens_per_turn"], with_["appended_tokens_per_turn"]),
        "prefill_per_turn_vs_appended_same_version_turns": with_["prefill_vs_appended_same_version_turns"],
        "sessions_per_s_affinity_vs_none": ratio(with_["sessions_per_s"], without["sessions_per_s"]),
        "sessions_per_engine_cpu_s_affinity_vs_none": ratio(with_["sessions_per_engine_cpu_s"],
                                                            without["sessions_per_engine_cpu_s"]),
        "token_drift": with_["token_drift"] + without["token_drift"],
        "kv_reuse_across_versions": with_["kv_reuse_across_versions"] + without["kv_reuse_across_versions"],
        "session_moves": {"affinity": with_["session_moves"], "none": without["session_moves"]},
    }
