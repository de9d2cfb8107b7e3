# Each target builds .venv from nothing when it is missing (or when pyproject.toml or
# constraints.txt changed).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Keep results reproducible and the 2-core CI machine responsive.
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: venv demo lint test bench clean

venv: $(STAMP)

# Every version comes from constraints.txt (the lock), so a clean machine builds the environment
# the suite last passed with, not whatever a registry holds newest that day.
PIP := $(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m hil.demo

# The checks that catch mistakes before the suite runs (docs/architecture.md "Habits"): ruff's lint
# and format check over all the code, mypy over the packages (incremental: .mypy_cache/ keeps a
# second run to seconds).
LINT_PATHS := common flight ground hil traces bench tests
TYPED_PACKAGES := common flight ground hil traces bench

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy $(TYPED_PACKAGES)

# The SSH power-switch tests run a real sshd: Debian's openssh-server, installed when missing
# (root and apt-get only; otherwise those tests skip and say why). The console's browser tests
# run Debian's headless chromium and chromium-driver, installed the same way.
# A hung test fails on its own (pytest-timeout, pyproject.toml); should the run as a whole still
# overstay 50 minutes (four times its length on a busy 2-core machine), it is interrupted with
# SIGINT, so pytest still prints the failures it has seen (a bare kill would print nothing).
test: $(STAMP)
	$(MAKE) --no-print-directory lint
	$(BIN)/python tests/bus/sshd_testkit.py --install
	$(BIN)/python tests/ground/chromium_testkit.py --install
	timeout -s INT -k 120 3000 $(BIN)/python -m pytest -q -n 2 --dist loadgroup

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache runs
