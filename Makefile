# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv itself.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv browser postgres faketime clean gpu-check

$(STAMP): pyproject.toml setup.py src/torsh_tune/analysis/traces/_scan.c src/torsh_tune/profiler/_lines.c
	@command -v $(PY) >/dev/null 2>&1 || { echo "python3.11 is required"; exit 2; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel from local disk where one exists, never a CUDA build by accident.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# The main job on the bundled data-bound example: baseline profile (io bottleneck), an 8-trial study,
# confirmation, the ablation to the minimal winning config (each kept knob's share of the speedup),
# study report (about 5-8 minutes on 2 CPU cores, the ablation ~30 of its runs; STUDY/summary.md holds
# the verdict, the confirmed speedup with its CI, and the command to run the winner).
demo: $(STAMP)
	$(BIN)/python -m compileall -q src examples >/dev/null 2>&1 || true
	$(BIN)/torsh-tune --nproc-per-node 2 --trials 8 --steps 15 --warmup-steps 3 --seed 0 \
	  examples/data_bound.py --log-every 1000

# Debian's Chromium drives the dashboard's browser tests (Playwright never downloads one).
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "chromium could not be installed: browser tests will be skipped"; \
	  else echo "not root or no apt-get: install Debian's chromium to run the browser tests"; fi; \
	fi

# Debian's PostgreSQL server for the shared-study test (tests/autotune/test_postgres.py starts its own
# on a private data directory and port, as an unprivileged user, and stops it after).
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) \
	      || echo "postgresql could not be installed: the PostgreSQL study test will be skipped"; \
	  else echo "not root or no apt-get: install Debian's postgresql to run the PostgreSQL study test"; fi; \
	fi

# Debian's libfaketime for the emulated cluster's clock skew (tests/launch/test_emulate.py runs two nodes whose
# clocks disagree by 20 ms, and the analysis must put them on one).
faketime:
	@if ! ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime >/dev/null) \
	      || echo "faketime could not be installed: the clock-skew test will be skipped"; \
	  else echo "not root or no apt-get: install Debian's faketime to run the clock-skew test"; fi; \
	fi

# Bytecode first: where PYTHONDONTWRITEBYTECODE is set (this machine's shell sets it), every rank, CLI and
# tuner process of the suite's ~250 launches would otherwise compile torsh-tune's sources again
# (~60 ms per rank, ~50 ms per CLI: BENCHMARKS.md). Python still reads the files it did not write;
# a file that does not compile is the tests' business, not this speed-up's.
#
# Two parts: every test not marked `serial` on TEST_WORKERS pytest-xdist workers (a test file stays on one
# worker, so a module's fixture runs once), then the `serial` tests alone: those whose assertions are what
# measured time decides (the self-check within 5 pp, a planted bottleneck, advice, kept knobs) or that count
# host-wide state (network namespaces), which another test's ranks on the same cores would change. Both
# parts always run; the exit status is the first failure's.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q --timeout 600 --durations=15
test: $(STAMP) browser postgres faketime
	$(BIN)/python -m compileall -q src tests examples benchmarks >/dev/null 2>&1 || true
	@status=0; \
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial" tests || status=$$?; \
	$(PYTEST) -m serial tests || { s=$$?; [ $$status -ne 0 ] || status=$$s; }; \
	exit $$status

# What only a GPU can show (gpu-marked tests, NCCL runs with the self-check vs Kineto, overhead,
# two ranks sharing a GPU over gloo), in one table and one JSON line; without CUDA it runs what it
# can and says what it skipped. On a machine whose Python already has torch (a lent GPU machine:
# torch 2.11, no network) run it with that Python: `make gpu-check GPU_PY=python3`.
GPU_PY ?= $(BIN)/python
gpu-check:
	@if [ "$(GPU_PY)" = "$(BIN)/python" ]; then $(MAKE) --no-print-directory venv; \
	else $(GPU_PY) setup.py -q build_ext --inplace >/dev/null 2>&1 \
	  || echo "gpu-check: the C extensions did not build for $(GPU_PY): Python's record writer and trace scanner run"; fi
	PYTHONPATH=$(CURDIR)/src:$(CURDIR)/tests$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) torsh-runs build
	rm -f src/torsh_tune/analysis/traces/_scan.*.so src/torsh_tune/profiler/_lines.*.so
