#!/usr/bin/env bash
# Set up .venv (first run only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The Debian package shellcheck lints the launch scripts; its test is skipped where it cannot be installed.
if ! command -v shellcheck >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq shellcheck) >/dev/null 2>&1 || echo "note: could not install shellcheck"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two pytest workers (pytest-xdist), one test file each at a time: a single pytest process keeps 2 cores only
# ~73% busy (a test waits on its torchrun ranks' start-up, or runs on one core), two keep them ~97% busy. Whole
# files, so a module's torchrun fixture starts once. `-n 0` (an extra argument wins) runs in one process.
# The slowest tests are listed so the suite's time (kept under 20 min on 2 cores) can be watched.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 tests "$@"
