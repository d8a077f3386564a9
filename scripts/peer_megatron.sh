#!/usr/bin/env bash
# Megatron-LM's own CPU-collectable unit tests, run from a local Megatron-LM checkout twice:
# without Lagom (the checkout as it is), and with Lagom (a copy patched by
# `lagom patch megatron --path COPY`, so megatron/training/arguments.py registers --lagom and calls
# Lagom's setup, with Lagom's interception of megatron-core installed for the whole session).
# Prints collected/passed/failed/errored/skipped for each run and the tests whose outcome differs.
# Fetches nothing: the checkout must already be there, and the suite's asset download is refused.
#
#   scripts/peer_megatron.sh [MEGATRON_LM_CHECKOUT]     (default: $PEER_MEGATRON_DIR or /work/peer/Megatron-LM)
#
# Environment:
#   PEER_PYTHON        interpreter with torch and Lagom installed (default: .venv/bin/python); the
#                      checkout's own megatron package is put first on PYTHONPATH
#   PEER_OUT           folder for junit XML, logs and the patched copy (default: a new temporary folder)
#   PEER_RUNS          "without with" (default), or "with" alone to rerun only the Lagom half
#                      against an earlier PEER_OUT/without.xml
#   PEER_SELECTION     file of pytest node ids, one per line, relative to the checkout
#                      (default: scripts/peer/megatron_selection.txt)
#   PEER_TEST_TIMEOUT  seconds one test phase may run before it fails (default 120)
set -euo pipefail

# One function, parsed whole before it runs: editing this file during a run cannot change the run.
main() {
  repo=$(cd "$(dirname "$0")/.." && pwd)
  checkout=$(cd "${1:-${PEER_MEGATRON_DIR:-/work/peer/Megatron-LM}}" && pwd)
  python=${PEER_PYTHON:-$repo/.venv/bin/python}
  out=${PEER_OUT:-$(mktemp -d -t lagom-peer-megatron.XXXXXX)}
  runs=${PEER_RUNS:-without with}
  selection=${PEER_SELECTION:-$repo/scripts/peer/megatron_selection.txt}
  test_timeout=${PEER_TEST_TIMEOUT:-120}

  if [ ! -f "$checkout/megatron/training/arguments.py" ] || [ ! -d "$checkout/tests/unit_tests" ]; then
    echo "error: $checkout is not a Megatron-LM checkout (no megatron/training/arguments.py, tests/unit_tests)" >&2
    exit 2
  fi
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  mapfile -t tests < <(grep -v -e '^\s*#' -e '^\s*$' "$selection")

  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
  unset LAGOM_PEER_INJECT  # scripts/peer/sitecustomize.py is for DeepSpeed runs only
  "$python" -c 'import torch, lagom_megatron.patching' 2>/dev/null \
    || { echo "error: $python cannot import torch and lagom_megatron (run scripts/bootstrap.sh)" >&2; exit 2; }
  checkout_rev=$(git -C "$checkout" rev-parse --short HEAD 2>/dev/null || echo "no git")
  lagom_state() {  # the commit Lagom's code comes from, and whether its files differ from it
    local rev dirty
    rev=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null) || { echo "no git"; return; }
    dirty=$(git -C "$repo" status --porcelain -- lagom lagom_megatron | wc -l)
    [ "$dirty" -eq 0 ] && echo "$rev" || echo "$rev + $dirty uncommitted files"
  }
  lagom_rev=$(lagom_state)
  echo "Megatron-LM checkout: $checkout ($checkout_rev); Lagom: $repo ($lagom_rev)"
  echo "selection: $selection (${#tests[@]} entries); output: $out"

  # The checkout itself is never modified: the Lagom run uses a patched copy (without .git).
  patched=$out/megatron-lm-lagom
  if [[ " $runs " == *" with "* ]]; then
    rm -rf "$patched" && mkdir -p "$patched"
    tar -C "$checkout" --exclude=./.git -cf - . | tar -C "$patched" -xf -
    "$python" -m lagom.cli patch megatron --path "$patched"
  fi

  for run in $runs; do
    plugins=(-p peer_timeout -p megatron_offline)
    tree=$checkout
    if [ "$run" = with ]; then
      plugins+=(-p lagom_megatron_intercept)
      tree=$patched
    fi
    start=$SECONDS
    (cd "$tree" && PYTHONPATH="$repo/scripts/peer:$tree${PYTHONPATH:+:$PYTHONPATH}" \
        "$python" -m pytest "${plugins[@]}" -p no:cacheprovider --peer-timeout "$test_timeout" \
        --junitxml="$out/$run.xml" "${tests[@]}") >"$out/$run.log" 2>&1 || true
    echo "run '$run Lagom' (Lagom $(lagom_state) at its end): $((SECONDS - start)) s, log $out/$run.log"
  done
  grep -h -A20 "^lagom interception:" "$out/with.log" 2>/dev/null | grep -E "^(lagom interception|  \S+/\S+: [0-9]+$)" || true

  if [ -f "$out/without.xml" ] && [ -f "$out/with.xml" ]; then
    "$python" "$repo/scripts/peer/compare_runs.py" "$out/without.xml" "$out/with.xml"
  else
    echo "error: a run left no junit XML; see the logs in $out" >&2; exit 1
  fi
}

main "$@"
