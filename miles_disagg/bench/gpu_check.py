"""``scripts/gpu_check.sh``: one prepared check of the GPU code paths, printing one JSON object.

``python -m miles_disagg.bench.gpu_check [--cpu] [--only engine,fsdp] [--work-dir DIR]``

Runs each section of :mod:`miles_disagg.bench.gpu_sections` in a process of its own, under its
own time box (a hung or crashed section is killed and reported; the others still run), with
progress on stderr and one JSON object on stdout:
``{"device", "torch", "cuda", "sections": {name: {"ok", "seconds", ... or "error"}}, "total_s"}``.
Exit code 0 when every section that ran is ok (a skipped section is ok), else 1.

``--cpu`` runs the same sections with small shapes on the CPU (CI keeps the script working);
without it a CUDA device is required. Needs torch and transformers; neither Ray nor SGLang.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# seconds per section: the sum stays under the 9 minutes the check is given on a GPU machine
TIME_BOX_S = {"engine": 130, "fsdp": 120, "megatron": 80, "delta": 110, "moe": 90}
TIME_BOX_CPU_S = {"engine": 120, "fsdp": 120, "megatron": 120, "delta": 60, "moe": 180}
TIME_BOX_ENV = "MILES_DISAGG_GPU_CHECK_TIME_BOX_S"  # one box for every section (tests)


def _progress(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="small shapes on the CPU (CI)")
    parser.add_argument("--only", default="", help="comma-separated sections (default: all)")
    parser.add_argument("--work-dir", default=None, help="keep models and logs here (default: a temp dir)")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # one section, in this process
    args = parser.parse_args(argv)
    if args.section:
        return _run_one(args.section, args.cpu, Path(args.work_dir))
    return _run_all(args)


def _run_all(args) -> int:
    from miles_disagg.bench.gpu_sections import SECTIONS

    names = [n for n in (args.only.split(",") if args.only else SECTIONS) if n]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        print(f"gpu_check: unknown section(s) {unknown}; choose from {sorted(SECTIONS)}", file=sys.stderr)
        return 2
    if args.cpu:  # the sections import torch; this process needs only its build (two CPU-seconds less)
        device, (version, cuda) = "cpu", _torch_build()
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --cpu for the small CPU run)", file=sys.stderr)
            return 2
        device, version, cuda = torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda
    start = time.perf_counter()
    result = {"device": device, "torch": version, "cuda": cuda, "cpus": os.cpu_count(), "sections": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        boxes = TIME_BOX_CPU_S if args.cpu else TIME_BOX_S
        override = os.environ.get(TIME_BOX_ENV)  # tests: make a section overrun its box
        for name in names:
            box = int(override) if override else boxes[name]
            result["sections"][name] = _run_section(name, args.cpu, work, box)
    result["total_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result, indent=2))
    return 0 if all(s["ok"] for s in result["sections"].values()) else 1


def _torch_build() -> tuple[str, str | None]:
    """torch's version and CUDA version, read from its ``version.py`` without importing torch."""
    import importlib.util

    package = importlib.util.find_spec("torch")
    if package is None or package.origin is None:
        raise SystemExit("gpu_check: torch is not installed")
    spec = importlib.util.spec_from_file_location("_gpu_check_torch_version", Path(package.origin).with_name("version.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.__version__, build.cuda


def _run_section(name: str, cpu: bool, work: Path, time_box_s: int) -> dict:
    """One section in a child process under its time box; its JSON, or the error and log tail."""
    _progress(f"{name}: starting (time box {time_box_s}s)")
    cmd = [sys.executable, "-m", "miles_disagg.bench.gpu_check", "--section", name, "--work-dir", str(work)]
    start = time.perf_counter()
    log_path = work / f"{name}.log"
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(cmd + (["--cpu"] if cpu else []), stdout=subprocess.PIPE, stderr=log, text=True,
                                  timeout=time_box_s, start_new_session=True)
        except subprocess.TimeoutExpired:
            return _failed(name, start, f"time box of {time_box_s}s exceeded", log_path)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return _failed(name, start, f"exit code {done.returncode}", log_path)
    report = json.loads(lines[-1])
    report = {"ok": "error" not in report, "seconds": round(time.perf_counter() - start, 1), **report}
    _progress(f"{name}: {'ok' if report['ok'] else 'FAILED'} in {report['seconds']}s")
    return report


def _failed(name: str, start: float, why: str, log_path: Path) -> dict:
    tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
    _progress(f"{name}: FAILED ({why})")
    return {"ok": False, "seconds": round(time.perf_counter() - start, 1), "error": why, "log_tail": tail}


def _run_one(name: str, cpu: bool, work: Path) -> int:
    """The child: run the section, print its JSON on one line (an exception is reported, not raised)."""
    import traceback

    from miles_disagg.bench.gpu_sections import SECTIONS, Shapes

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        report = SECTIONS[name](Shapes.for_run(cpu), work)
    except Exception as exc:  # noqa: BLE001 - the parent reports it beside the other sections
        traceback.print_exc()
        report = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
