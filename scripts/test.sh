#!/usr/bin/env bash
# Set up (if needed), then run the whole test suite. Extra arguments go to pytest
# (e.g. ./scripts/test.sh -m unit: the fast tier).
#
# Two pytest processes side by side: everything but the SGLang conformance tier, spread over
# MILES_DISAGG_TEST_WORKERS processes (default: the cores + 1, 3 on a 2-core machine: a whole run
# waits on its engines and its Ray part of the time, and 3 keep both cores busy; 4 is no faster),
# and the SGLang tier in a process of its own (importing SGLang changes process-wide state, so it
# never shares a process with other tests). The tier's report is printed after the main one's; the
# exit status is the first failure's.
#
# Scheduling (--dist loadgroup --no-loadscope-reorder): the tests of a module that builds something
# costly once (a whole run, a server, a Ray cluster) form one unit that stays on one worker;
# units start in the order tests/conftest.py gives them, the longest first (whole runs, then
# integration, then the unit tier filling the gaps), so no worker is left with a long unit at the
# end. (xdist's default reorders units by their number of tests, which started the whole runs last.)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
unset PYTHONDONTWRITEBYTECODE  # each module's byte code is written the first time it is imported (setup.sh)
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
# deadlines: quiet values times the load of everything else, measured before the suite starts (tests/deadlines.py)
MILES_DISAGG_TEST_LOAD_FACTOR="${MILES_DISAGG_TEST_LOAD_FACTOR:-$(.venv/bin/python tests/deadlines.py)}"
export MILES_DISAGG_TEST_LOAD_FACTOR
echo "test.sh: deadlines x${MILES_DISAGG_TEST_LOAD_FACTOR} (the machine's load before the suite)"
cores="$(nproc 2>/dev/null || echo 2)"
workers="${MILES_DISAGG_TEST_WORKERS:-$((cores + 1))}"
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)

sglang_report="$(mktemp -t miles-disagg-sglang-tier.XXXXXX)"
set +e
.venv/bin/python -m pytest tests/sglang -p no:cacheprovider "$@" >"$sglang_report" 2>&1 &
sglang_pid=$!
trap 'kill "$sglang_pid" 2>/dev/null || true; rm -f "$sglang_report"' EXIT
.venv/bin/python -m pytest tests --ignore=tests/sglang "${parallel[@]}" "$@"
rc_main=$?
wait "$sglang_pid"
rc_sglang=$?
set -e
echo "== the SGLang conformance tier (tests/sglang) =="
cat "$sglang_report"
if [ "$rc_main" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; the suite must not be empty" >&2
  exit 1
fi
[ "$rc_main" -ne 0 ] && exit "$rc_main"
[ "$rc_sglang" -eq 5 ] && exit 0  # the selection (-m unit, -k ...) left no SGLang-tier test
exit "$rc_sglang"
