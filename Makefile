# Two commands matter: `make run` and `make test`. Everything else is for developers.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test bench lint clean browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,demo]'
	touch $(STAMP)

$(VENV)/.bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,demo,bench]'
	touch $(VENV)/.bench

run: $(STAMP)
	$(BIN)/turnout up $(ARGS)

test: $(STAMP) browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Debian's chromium for the dashboard's browser tests (Playwright drives it; Playwright's own browser download
# never runs). Installed only where this host can: root with apt-get; elsewhere those tests skip and say why.
# An install cut short before (a make test interrupted while it ran) leaves dpkg refusing every later one
# until `dpkg --configure -a`: that runs first, and does nothing where nothing was cut short.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the browser tests"; \
		(DEBIAN_FRONTEND=noninteractive dpkg --configure -a >/dev/null && apt-get update -qq \
			&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "chromium could not be installed: the browser tests will say so"; \
	else echo "no /usr/bin/chromium and no root apt-get here: the browser tests will be skipped"; fi

bench: $(VENV)/.bench
	$(BIN)/python -m bench $(BENCH_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy src

clean:
	rm -rf $(VENV) .pytest_cache
