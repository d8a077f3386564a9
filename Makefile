# The two commands a fresh machine needs: `make demo` and `make test`. Both build .venv first.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test
venv:
	@bash scripts/bootstrap.sh

demo: venv
	mkdir -p out
	$(VENV)/bin/lagom reproduce --quick --out out/demo

test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -n 2 --dist loadfile tests
