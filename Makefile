# Quick start: `make demo` and `make test`. Each builds .venv from nothing with python3.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean

# What the project, its tests and the demo import. pip byte-compiles every module it installs
# (48 s of one core here, most of it never imported); --no-compile and one import of these
# (20 s) compile just what runs. Bytecode is written also where PYTHONDONTWRITEBYTECODE is
# set (an empty value unsets it for Python), here and while the tests run.
IMPORTS := torch torch._dynamo torch.distributed.run numba sklearn.datasets matplotlib.pyplot \
	tqdm lightning.pytorch accelerate transformers.trainer torchft hypothesis pytest xdist \
	gradshare.app.cli gradshare.integrations

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[dev]'
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -c 'import importlib, importlib.util, sys; \
	[importlib.import_module(m) for m in sys.argv[1:] if importlib.util.find_spec(m.split(".")[0])]' \
	$(IMPORTS)
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
	@PYTHONDONTWRITEBYTECODE= $(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest; tests=$$?; \
	wait $$types; typed=$$?; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 -a $$typed -eq 0

bench: $(STAMP)
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis
