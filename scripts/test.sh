#!/usr/bin/env bash
# Set up (if needed), then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
set +e
.venv/bin/python -m pytest tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; the suite must not be empty" >&2
  exit 1
fi
exit "$rc"
