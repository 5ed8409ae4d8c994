# The two set-up commands of the README: `make demo` and `make test`.
# CPU by default: torch is pinned to the CPU wheel that pip finds on this kind of machine.
# GPU machines: see docs/guide/gpu.md (the [gpu] extra and an unpinned torch).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= torch==2.13.0
EXTRAS ?= train,cpu,dev,bench,ray,db,meds
DEMO_DIR ?= demo
DEMO_PATIENTS ?= 2000
DEMO_EPOCHS ?= 8

.PHONY: demo test test-quick failures bench lint commands install clean

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/cognet data synth --out $(DEMO_DIR)/data --patients $(DEMO_PATIENTS) --seed 0
	$(VENV)/bin/cognet data stats $(DEMO_DIR)/data
	$(VENV)/bin/cognet train --data $(DEMO_DIR)/data --out $(DEMO_DIR)/ckpt --epochs $(DEMO_EPOCHS) --seed 0 --threads 1 --quiet
	$(VENV)/bin/cognet evaluate --checkpoint $(DEMO_DIR)/ckpt --data $(DEMO_DIR)/data --rounds 3
	$(VENV)/bin/cognet-export --checkpoint $(DEMO_DIR)/ckpt --out $(DEMO_DIR)/model
	$(PY) -m cognet.demo input $(DEMO_DIR)/data $(DEMO_DIR)/to_score.parquet
	$(VENV)/bin/cognet-batch score $(DEMO_DIR)/to_score.parquet --model $(DEMO_DIR)/model \
		--out $(DEMO_DIR)/recommendations.parquet --explain --summary-json $(DEMO_DIR)/summary.json
	$(PY) -m cognet.demo report $(DEMO_DIR)/summary.json $(DEMO_DIR)/recommendations.parquet

test: install
	$(PY) -m pytest -q

# the suite less the tests marked slow (a trained model, the wheel, the README's blocks)
# and ray (a local Ray cluster): for a change that touches neither
test-quick: install
	$(PY) -m pytest -q -m "not slow and not ray"

# every case of docs/guide/failures.md, one test or more each
failures: install
	$(PY) -m pytest -q tests/test_failures_batch.py tests/test_failures_memory.py \
		tests/test_failures_train.py tests/test_failures_outputs.py tests/test_failures_writers.py \
		tests/test_failures_numbers.py tests/test_failures_db.py tests/test_failures_values.py \
		tests/test_failures_pickles.py tests/test_failures_fields.py \
		tests/test_failures_pickle_budget.py tests/test_failures_pickle_property.py \
		tests/test_failures_resume.py tests/test_failures_sinks.py tests/test_failures_inputs.py \
		tests/test_failures_secrets.py tests/test_failures_graphs.py tests/test_failures_decisions.py

bench: install
	$(VENV)/bin/cognet-bench --out bench

# ruff, then tools/check_layout.py: the layering of DESIGN.md §1, no test
# module importing another, every "DESIGN.md §N" naming a heading of docs/DESIGN.md;
# then docs/guide/commands.md against the commands' --help (`make commands` rewrites it)
lint: install
	$(VENV)/bin/ruff check cognet export runtime benchmarks tests tools
	$(VENV)/bin/ruff format --check cognet export runtime benchmarks tests tools
	$(PY) tools/check_layout.py
	$(PY) tools/command_reference.py --check

# docs/guide/commands.md from the commands' --help, after an option or a help text changed
commands: install
	$(PY) tools/command_reference.py --write

clean:
	rm -rf $(DEMO_DIR) bench
