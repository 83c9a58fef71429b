# Every target sets up what it needs: a .venv with torch (TORCH_SPEC) and the package.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
# make test's pytest processes (pytest-xdist): CI has 2 cores
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
# One stamp per torch spec: asking for another torch reinstalls it into the venv.
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9.\n' _)

.PHONY: venv test test-gpu test-differential test-models test-distributed demo conformance bench bench-distributed clean

$(STAMP): pyproject.toml setup.py aotgrad/guards/_tags.c aotgrad/_tensors.cpp aotgrad/_native.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	@# The test extras (timm -> torchvision) must not move torch: pin the one just installed.
	$(PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > $(VENV)/torch-pin.txt
	@# No build isolation: setup.py builds aotgrad's C++ tensor check against the torch just installed.
	$(PY) -m pip install -q "setuptools>=64" wheel
	$(PY) -m pip install -q --no-build-isolation -e ".[test,models]" -c $(VENV)/torch-pin.txt
	rm -f $(VENV)/.installed-* $(VENV)/.aotgrad-installed
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; } >/dev/null 2>&1 \
		|| echo "no chromium: the HTML report's browser test will skip"
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" -n $(TEST_WORKERS) tests

# tests/gpu (skipped without CUDA) where a CUDA torch is already installed and nothing can be fetched:
# GPU_PY's torch, the package from this tree (its entry point and its C/C++ checks built in place).
GPU_PY ?= python3
GPU_WORKERS ?= 16
test-gpu:
	$(GPU_PY) setup.py -q egg_info > /dev/null
	$(GPU_PY) setup.py -q build_ext --inplace -j 8 > /dev/null
	PYTHONPATH=$(CURDIR) TORCHINDUCTOR_COMPILE_THREADS=1 $(GPU_PY) -m pytest -q -p no:cacheprovider -m "not slow" \
		-n $(GPU_WORKERS) -rfE tests/gpu

# Every real model of tests/models x entry point (make test runs one text and one vision model).
test-models: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/models

# Every differential program x entry point (make test runs only its fast slice).
# A table of counts and a JSON of cases: python -m tests.differential.run
test-differential: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -rf -n $(TEST_WORKERS) tests/differential

# DDP and FSDP2 x every entry point, 2 gloo processes (make test runs a fast slice).
test-distributed: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/distributed

# Step time of a small GPT under DDP per entry point, and when each bucket's all-reduce is issued.
bench-distributed: $(STAMP)
	$(PY) -m benchmarks.distributed

demo: $(STAMP)
	$(PY) -m examples.demo

conformance: $(STAMP)
	$(PY) -m tests.conformance.run_opinfo --all --json conformance-results.json

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) aotgrad-out
