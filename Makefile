# The two commands a fresh machine needs: `make demo` and `make test`. Both build .venv first.
# `make smoke`: Lagom built into a wheel and an sdist, installed and run from outside the checkout (CI runs it).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test test-slow test-python-loop smoke
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

# The simulator tests again on the Python event loop (the fallback where no C compiler built the compiled one):
# CI runs them both ways.
test-python-loop: venv
	LAGOM_SIMULATOR=python $(PY) -m pytest -n 2 --dist loadfile -m "not slow" tests/test_simulator.py \
		tests/test_simulator_equivalence.py tests/test_simulator_scale.py tests/test_search_reuse.py tests/test_bound.py

smoke: venv
	PYTHON=$(PY) bash scripts/wheel_smoke.sh
