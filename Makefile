# Every target uses .venv and creates it first when it is missing, so a fresh clone works.
PY      := .venv/bin/python
VENV_OK := .venv/.installed
export PYTHONDONTWRITEBYTECODE=1

.PHONY: install proto spec-table test test-unit lint demo bench chaos clean

PYPROJECTS := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml bench/pyproject.toml)

$(VENV_OK): requirements-dev.txt $(PYPROJECTS)
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	# torch first, pinned to the local CPU wheel; the ml extra's range then installs nothing more
	.venv/bin/pip install -q "torch==2.13.0"
	.venv/bin/pip install -q -r requirements-dev.txt
	touch $(VENV_OK)

install: $(VENV_OK)

proto: $(VENV_OK)
	$(PY) -m grpc_tools.protoc -I proto --python_out=libs/brigade --pyi_out=libs/brigade --grpc_python_out=libs/brigade proto/brigade/v1/brigade.proto

# the README's run-spec table, from the declarations in libs/brigade/brigade/spec.py
spec-table: $(VENV_OK)
	$(PY) -m brigade.spec_table --readme README.md

test: $(VENV_OK)
	$(PY) -m pytest -q tests

test-unit: $(VENV_OK)
	$(PY) -m pytest -q tests/unit

lint: $(VENV_OK)
	$(PY) -m ruff check libs services bench tests

demo: $(VENV_OK)
	.venv/bin/brigade up --demo

bench: $(VENV_OK)
	.venv/bin/brigade bench all --report bench/report.md

chaos: $(VENV_OK)
	BRIGADE_CHAOS_LONG=1 $(PY) -m pytest -q tests/system/test_chaos.py

clean:
	rm -rf .venv brigade-runs .pytest_cache .ruff_cache
