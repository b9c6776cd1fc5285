"""The session endpoint's flags (miles' ``--use-session-server`` family): what each needs, what is refused.

Pure: names and rules only; the endpoint itself is :mod:`miles_disagg.rollout.sessions`.
"""

from __future__ import annotations

from miles_disagg.config.miles_flags import miles_refusal
from miles_disagg.types import ConfigError

TITO_MODELS = ("default", "qwen3")
MILES_TITO_MODELS = ("qwen35", "qwen36", "qwen38small", "qwen4exp", "qwennext", "glm47", "glm53", "nemotron3",
                     "kimi25", "kimi26", "minimax_m25", "minimax_m27", "deepseekv32", "deepseekv4", "deepseekv41",
                     "inkling")
APPEND_ROLES = ("tool", "user", "system")
MATCHERS = ("strict", "loose_tool_call", "role_content_only")
AGENTIC_GENERATE = "miles.rollout.generate_hub.agentic_tool_call.generate"
"""miles' generate function of agentic rollout: here the session endpoint's own (the same contract)."""


def session_server_argv(argv: list[str]) -> list[str]:
    """miles' ``--use-session-server v2`` (its trajectory tree: what ``--use-session-server`` serves here) as
    ``--use-session-server``; miles' ``v1`` (linear, a retried turn rolled back) refused with one line."""
    out = list(argv)
    for index, arg in enumerate(out[:-1]):
        if arg != "--use-session-server" or out[index + 1] not in ("v1", "v2"):
            continue
        if out[index + 1] == "v1":
            raise ConfigError(miles_refusal("--use-session-server v1", "the session endpoint serves miles' v2 "
                                            "trajectory tree (a linear session is its one-branch case; a retried turn "
                                            "becomes a branch, not a rollback)", "give --use-session-server (or v2)"),
                              ("--use-session-server",))
        del out[index + 1]
        break
    return out


def check_tito_model(name: str) -> str:
    """``name`` if its merge rule is implemented here; ``ConfigError`` naming the flag otherwise."""
    if name in TITO_MODELS:
        return name
    if name in MILES_TITO_MODELS:
        raise ConfigError(miles_refusal(f"--tito-model {name}", "that model family's merge rule is not implemented here "
                                        f"(implemented: {', '.join(TITO_MODELS)})",
                                        "use qwen3 for ChatML templates, or default"), ("--tito-model",))
    raise ConfigError(f"--tito-model {name!r}: unknown (choose from {', '.join(TITO_MODELS)})", ("--tito-model",))


def check_matcher(name: str) -> str:
    """``name`` if it is one of miles' matchers or a dotted import path (``pkg.module.function``, imported when
    the endpoint starts); ``ConfigError`` naming the flag otherwise."""
    if name in MATCHERS or ("." in name and all(part.isidentifier() for part in name.split("."))):
        return name
    raise ConfigError(f"--session-message-matcher {name!r}: unknown (choose from {', '.join(MATCHERS)}, or a "
                      "trusted pkg.module.function)", ("--session-message-matcher",))


def check_append_roles(roles: list[str] | tuple[str, ...]) -> None:
    unknown = sorted(set(roles) - set(APPEND_ROLES))
    if unknown:
        raise ConfigError(f"--tito-allowed-append-roles: unknown roles {unknown} (choose from "
                          f"{', '.join(APPEND_ROLES)})", ("--tito-allowed-append-roles",))


def check_session_rules(config) -> None:
    """The session flags of a :class:`~miles_disagg.config.components.RunConfig` (``ConfigError`` naming them)."""
    rollout = config.rollout
    if rollout.custom_agent_function_path and not rollout.use_session_server:
        raise ConfigError("--custom-agent-function-path runs an agent against the session endpoint: add "
                          "--use-session-server", ("--custom-agent-function-path", "--use-session-server"))
    if not rollout.use_session_server:
        if rollout.custom_generate_function_path == AGENTIC_GENERATE:
            raise ConfigError(f"--custom-generate-function-path {AGENTIC_GENERATE} runs agents against the session "
                              "endpoint: add --use-session-server and --custom-agent-function-path",
                              ("--custom-generate-function-path", "--use-session-server"))
        return
    generate = rollout.custom_generate_function_path
    if not rollout.custom_agent_function_path:
        raise ConfigError("--use-session-server needs --custom-agent-function-path (the agent each sample runs "
                          "against its session)", ("--use-session-server", "--custom-agent-function-path"))
    if generate not in (None, AGENTIC_GENERATE):
        raise ConfigError(f"--use-session-server generates each sample with the agent of --custom-agent-function-path; "
                          f"--custom-generate-function-path {generate} would replace it (give none, or miles' "
                          f"{AGENTIC_GENERATE})", ("--use-session-server", "--custom-generate-function-path"))
    if rollout.rollout_function_path:
        raise ConfigError("--use-session-server generates samples one session each; --rollout-function-path replaces "
                          "how samples are generated: give one of them",
                          ("--use-session-server", "--rollout-function-path"))
    if len(rollout.session_server_port) > 1:
        raise ConfigError(miles_refusal("--session-server-port with several ports", "it starts one session server "
                                        "instance per port, and the run serves one endpoint", "give one port"),
                          ("--session-server-port",))
    if rollout.session_server_port and not 0 < rollout.session_server_port[0] < 65536:
        raise ConfigError(f"--session-server-port {rollout.session_server_port[0]} is not a port (1-65535)",
                          ("--session-server-port",))
    check_tito_model(rollout.tito_model)
    check_matcher(rollout.session_message_matcher)
    check_append_roles(rollout.tito_allowed_append_roles)
