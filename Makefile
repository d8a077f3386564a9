# The two commands a fresh machine needs: `make demo` and `make test`. Both build .venv first.
# `make smoke`: Lagom built into a wheel and an sdist, installed and run from outside the checkout (CI runs it).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test test-slow smoke
venv:
	@bash scripts/bootstrap.sh

demo: venv
	mkdir -p out
	$(VENV)/bin/lagom reproduce --quick --out out/demo

test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow" tests

# CI's slower tier: the tests marked slow, the long-lived-process test at full length (50 engines in one pair of ranks)
test-slow: venv
	LAGOM_LONG_LIVED_ENGINES=50 $(PY) -m pytest -n 2 --dist loadfile -m slow tests

smoke: venv
	PYTHON=$(PY) bash scripts/wheel_smoke.sh
