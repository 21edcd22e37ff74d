# Quick start: `make demo` and `make test`. Each builds .venv from nothing with python3.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gradshare train

lint: $(STAMP)
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/ruff check src tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy

# mypy (~30 s of one core, cold in a fresh clone) runs beside pytest rather than before it:
# its report follows pytest's, and either failing fails the target.
test: lint $(STAMP)
	@echo "$(BIN)/mypy (beside pytest) && $(BIN)/python -m pytest"
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(BIN)/python -m pytest; tests=$$?; \
	wait $$types; typed=$$?; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 -a $$typed -eq 0

bench: $(STAMP)
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis
