#!/usr/bin/env bash
# Set up (if needed), then run the whole test suite. Extra arguments go to pytest
# (e.g. ./scripts/test.sh -m unit: the fast tier).
#
# Two pytest runs: everything but the SGLang conformance tier, spread over
# MILES_DISAGG_TEST_WORKERS processes (default 3: most of a test's time is spent waiting on
# processes and servers, not computing), then the SGLang tier alone (importing SGLang changes
# process-wide state, so it never shares a process with other tests).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
workers="${MILES_DISAGG_TEST_WORKERS:-3}"
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadgroup)

set +e
.venv/bin/python -m pytest tests --ignore=tests/sglang "${parallel[@]}" "$@"
rc_main=$?
.venv/bin/python -m pytest tests/sglang "$@"
rc_sglang=$?
set -e
if [ "$rc_main" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; the suite must not be empty" >&2
  exit 1
fi
[ "$rc_main" -ne 0 ] && exit "$rc_main"
[ "$rc_sglang" -eq 5 ] && exit 0  # the selection (-m unit, -k ...) left no SGLang-tier test
exit "$rc_sglang"
