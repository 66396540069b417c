# The two commands of the README. Both create .venv on first use and install into it:
# torch first (pinned: an unpinned torch pulls a multi-GB CUDA build), then us.
PYTHON ?= python3
# an index to take torch from (empty: pip's own); https://download.pytorch.org/whl/cpu for the CPU
# build where pip's indexes offer only the CUDA one (public PyPI on Linux x86_64)
TORCH_INDEX ?=
VENV   ?= .venv
BIN     = $(VENV)/bin
STEPS  ?= 30
# the rendezvous port of `make run`: give concurrent runs on one machine their own (PORT=29672 make run)
PORT   ?= 29671

.PHONY: run compare test install clean-shm device-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0

$(VENV)/.installed: $(BIN)/python setup.py
	$(BIN)/pip install --quiet -e ".[test,plot]"
	# compile the planner into numba's cache now, not in the first run (whose scheduler process would)
	$(BIN)/python -c "import deepspeed_feplb.plan.passes"
	touch $@

install: $(VENV)/.installed

# A short FEPLB training with the deepspeed CLI on 2 CPU processes; prints what FEPLB did.
run: install
	OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus 2 --master_port $(PORT) \
		examples/train_moe.py --deepspeed_config examples/ds_config.json --steps $(STEPS)

# The same training with FEPLB and without (DeepSpeed's MoE), then both side by side in feplb_report/.
compare: install
	OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus 2 --master_port $(PORT) \
		examples/train_moe.py --deepspeed_config examples/ds_config.json --steps $(STEPS) | tee feplb_on.log
	OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus 2 --master_port $(PORT) \
		examples/train_moe.py --deepspeed_config examples/ds_config.json --steps $(STEPS) --no-feplb | tee feplb_off.log
	$(BIN)/feplb report feplb_on.log feplb_off.log --label FEPLB --label DeepSpeed --out feplb_report

# ruff.toml says what the lint checks; it runs first, in a second, and stops the tests when it fails
test: install
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

# Remove /dev/shm segments that a SIGKILLed FEPLB job left behind.
clean-shm: install
	$(BIN)/python -m deepspeed_feplb cleanup

# Wheels the lent GPU machine lacks (its image has torch, CuPy and numba, not pydantic, DeepSpeed or
# cuda-bindings for its CUDA 13),
# into .whl/ (ignored by git): carry .whl to the device and run tests/gpu/run_device_checks.sh.
DEVICE_PIP = --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
device-wheels: install
	$(BIN)/pip download --quiet $(DEVICE_PIP) -d .whl pydantic==2.14.4 pydantic-core==2.50.5 \
		annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1
	$(BIN)/pip wheel --quiet --no-deps deepspeed==0.19.8 -w .whl
