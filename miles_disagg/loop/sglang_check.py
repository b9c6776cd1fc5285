"""``--sglang-*`` options judged by SGLang's own parser (``ServerArgs.add_cli_args``), before the run
starts: a typo or a bad value exits 2 naming the job flag and, for an unknown one, the closest
SGLang option. Imported only where SGLang is importable (it pulls in torch)."""

from __future__ import annotations

import argparse
import difflib
from typing import Mapping

from miles_disagg.config.sglang_args import PASSTHROUGH_PREFIX, PassthroughValue
from miles_disagg.types import ConfigError

PLACEHOLDER_MODEL = "/model"  # the model path is the job's own flag; any value parses
PLACEHOLDER_LAUNCH = dict(host="127.0.0.1", port=30000, tp_size=1, base_gpu_id=0, dtype="auto", weight_version=0)


class _Refused(Exception):
    pass


class _StrictParser(argparse.ArgumentParser):
    """SGLang's options without abbreviations (a prefix match would hide a typo), errors raised."""

    def error(self, message):  # argparse would exit the process
        raise _Refused(message)


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = _StrictParser(prog="sglang.launch_server", allow_abbrev=False, add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def parse_with_server_args(options: Mapping[str, PassthroughValue], parser: argparse.ArgumentParser | None = None) -> None:
    """``ConfigError`` for an option SGLang does not know or a value it refuses."""
    from miles_disagg.engines.sglang import sglang_command

    parser = parser or sglang_parser()
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    for name, value in options.items():
        flag = f"--{name}"
        job_flag = f"{PASSTHROUGH_PREFIX}{name}"
        if flag not in known:
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            hint = f" (did you mean {PASSTHROUGH_PREFIX}{close[0][2:]}?)" if close else ""
            raise ConfigError(f"{job_flag}: SGLang has no option {flag}{hint}", (job_flag,))
        argv = sglang_command(PLACEHOLDER_MODEL, extra_args={name: value}, **PLACEHOLDER_LAUNCH)  # as launched
        try:
            parser.parse_args(argv[3:])
        except _Refused as exc:
            raise ConfigError(f"{job_flag}: SGLang refuses it: {exc}", (job_flag,)) from None
