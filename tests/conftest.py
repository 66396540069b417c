import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# ranks start from a forkserver that imported torch and DeepSpeed once (`testing.launcher`), not
# spawned afresh: about 2 s of imports saved per rank, half the suite's time on 2 cores;
# FEPLB_TEST_START_METHOD=spawn to spawn them
os.environ.setdefault("FEPLB_TEST_START_METHOD", "forkserver")
sys.path.insert(0, os.path.dirname(__file__))
