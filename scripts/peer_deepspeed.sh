#!/usr/bin/env bash
# DeepSpeed's own unit tests, run from a local DeepSpeed checkout twice: without Lagom, and with
# Lagom injected into every deepspeed.initialize (lagom_deepspeed.patch() plus a minimal
# "lagom": {"enabled": true} section added to each config, in the pytest process and in the rank
# processes DeepSpeed's harness starts). Prints collected/passed/failed/errored/skipped for each run
# and the tests whose outcome differs. Fetches nothing: the checkout must already be there.
#
#   scripts/peer_deepspeed.sh [DEEPSPEED_CHECKOUT]        (default: $PEER_DEEPSPEED_DIR or /work/peer/DeepSpeed)
#
# Environment:
#   PEER_PYTHON        interpreter with deepspeed and Lagom installed (default: .venv/bin/python)
#   PEER_OUT           folder for junit XML and logs (default: a new temporary folder)
#   PEER_RUNS          "without with" (default), or "with" alone to rerun only the Lagom half
#                      against an earlier PEER_OUT/without.xml
#   PEER_SELECTION     file of pytest node ids, one per line, relative to the checkout's tests/
#                      (default: scripts/peer/deepspeed_selection.txt)
#   PEER_RANKS         CPU "devices" DeepSpeed may use (default 2): tests needing more ranks are skipped
#   PEER_TEST_TIMEOUT  seconds one test phase may run before it fails and its ranks are killed (default 300)
# The tests use DeepSpeed's CPU accelerator (gloo); the checkout should match the installed deepspeed.
set -euo pipefail

# One function, parsed whole before it runs: editing this file during a run cannot change the run.
main() {
  repo=$(cd "$(dirname "$0")/.." && pwd)
  checkout=$(cd "${1:-${PEER_DEEPSPEED_DIR:-/work/peer/DeepSpeed}}" && pwd)
  python=${PEER_PYTHON:-$repo/.venv/bin/python}
  out=${PEER_OUT:-$(mktemp -d -t lagom-peer-deepspeed.XXXXXX)}
  runs=${PEER_RUNS:-without with}
  selection=${PEER_SELECTION:-$repo/scripts/peer/deepspeed_selection.txt}
  test_timeout=${PEER_TEST_TIMEOUT:-300}

  if [ ! -f "$checkout/tests/unit/common.py" ]; then
    echo "error: $checkout is not a DeepSpeed checkout (no tests/unit/common.py)" >&2; exit 2
  fi
  mkdir -p "$out"
  mapfile -t tests < <(grep -v -e '^\s*#' -e '^\s*$' "$selection")

  export DS_ACCELERATOR=cpu
  # The CPU accelerator counts NUMA nodes as devices (1 here), so the harness would skip every
  # 2-rank test; LOCAL_SIZE is the device count it honours instead.
  export LOCAL_SIZE=${PEER_RANKS:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  export PYTHONPATH="$repo/scripts/peer${PYTHONPATH:+:$PYTHONPATH}"
  # DeepSpeed's harness ends the whole session when a test outlives this; ours fails just the test first.
  export DS_UNITTEST_TIMEOUT=$((test_timeout * 3))
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
  unset LAGOM_PEER_INJECT

  "$python" -c 'import deepspeed, lagom_deepspeed' 2>/dev/null \
    || { echo "error: $python cannot import deepspeed and lagom_deepspeed (run scripts/bootstrap.sh)" >&2; exit 2; }
  ds_version=$("$python" -c 'import deepspeed; print(deepspeed.__version__)' 2>/dev/null | tail -1)
  checkout_rev=$(git -C "$checkout" rev-parse --short HEAD 2>/dev/null || echo "no git")
  lagom_state() {  # the commit Lagom's code comes from, and whether its files differ from it
    local rev dirty
    rev=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null) || { echo "no git"; return; }
    dirty=$(git -C "$repo" status --porcelain -- lagom lagom_deepspeed | wc -l)
    [ "$dirty" -eq 0 ] && echo "$rev" || echo "$rev + $dirty uncommitted files"
  }
  lagom_rev=$(lagom_state)
  echo "DeepSpeed checkout: $checkout ($checkout_rev, version.txt $(cat "$checkout/version.txt" 2>/dev/null)), installed deepspeed $ds_version"
  echo "Lagom: $repo ($lagom_rev); selection: $selection (${#tests[@]} entries); output: $out"

  # The CPU accelerator JIT-builds its ops (shared-memory collectives, FusedAdam, CPUAdam) at first
  # use. Build them now, once and without a time limit: a build that a test timeout kills leaves
  # torch's lock file behind, and every later build of that op waits on it forever.
  "$python" -c "from deepspeed.accelerator import get_accelerator
[get_accelerator().create_op_builder(name).load() for name in ('ShareMemCommBuilder', 'FusedAdamBuilder', 'CPUAdamBuilder')]" \
    >"$out/build.log" 2>&1 \
  || echo "warning: DeepSpeed's CPU ops did not all build (see $out/build.log); tests build them themselves"

  for run in $runs; do
    plugins=(-p peer_timeout -p deepspeed_preload)
    if [ "$run" = with ]; then
      plugins+=(-p lagom_deepspeed_inject)
      rm -f "$out/initialize-calls.jsonl"
    fi
    start=$SECONDS
    (cd "$checkout/tests" && LAGOM_PEER_LOG="$out/initialize-calls.jsonl" "$python" -m pytest "${plugins[@]}" -p no:cacheprovider --peer-timeout "$test_timeout" \
        --junitxml="$out/$run.xml" "${tests[@]}") >"$out/$run.log" 2>&1 || true
    echo "run '$run Lagom' (Lagom $(lagom_state) at its end): $((SECONDS - start)) s, log $out/$run.log"
  done

  if [ -f "$out/initialize-calls.jsonl" ]; then  # how often Lagom was really on in the ranks, and how it ended
    "$python" "$repo/scripts/peer/lagom_deepspeed_inject.py" "$out/initialize-calls.jsonl"
  fi
  if [ -f "$out/without.xml" ] && [ -f "$out/with.xml" ]; then
    "$python" "$repo/scripts/peer/compare_runs.py" "$out/without.xml" "$out/with.xml"
  else
    echo "error: a run left no junit XML; see the logs in $out" >&2; exit 1
  fi
}

main "$@"
