# The two commands of the README. Both create .venv on first use and install into it:
# torch's CPU build first (pinned: an unpinned torch pulls a multi-GB CUDA build), then us.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STEPS  ?= 30
PORT   ?= 29671

.PHONY: run test install clean-shm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0

$(VENV)/.installed: $(BIN)/python setup.py
	$(BIN)/pip install --quiet -e ".[test,plot]"
	touch $@

install: $(VENV)/.installed

# A short FEPLB training with the deepspeed CLI on 2 CPU processes; prints what FEPLB did.
run: install
	OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus 2 --master_port $(PORT) \
		examples/train_moe.py --deepspeed_config examples/ds_config.json --steps $(STEPS)

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

# Remove /dev/shm segments that a SIGKILLed FEPLB job left behind.
clean-shm: install
	$(BIN)/python -m deepspeed_feplb cleanup
