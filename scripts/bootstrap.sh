#!/usr/bin/env bash
# Create .venv with Python 3.12 (python3.12 on PATH, else pyenv's) and install Lagom with the extras
# the tests and the demo need. Idempotent: a stamp file records the pyproject it installed.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for cand in python3.12 "$(command -v pyenv >/dev/null 2>&1 && ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"; do
    if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      echo "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    pyenv install -s 3.12 >&2 && ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 | tail -1 && return 0
  fi
  echo "error: Python 3.12 not found (install python3.12 or pyenv)" >&2; return 1
}
if [ ! -x .venv/bin/python ]; then
  py=$(find_python)
  "$py" -m venv .venv
fi
stamp=.venv/.lagom-installed
# reinstall when the install recipe changes (setup.py builds the NCCL tuner plugin)
if [ ! -f "$stamp" ] || ! cat pyproject.toml setup.py | cmp -s - "$stamp"; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test,megatron,deepspeed]"
  cat pyproject.toml setup.py > "$stamp"
fi
