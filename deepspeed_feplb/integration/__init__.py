"""FEPLB inside DeepSpeed's engines.

* `engine`: `convert` and `initialize` (the user-facing entry points next to `deepspeed.initialize`);
* `pipeline`: `FEPLBPipelineEngine`, the 1F1B schedule with per-micro-batch FEPLB work;
* `autoep`: phase 2 at DeepSpeed AutoEP's ``experts`` seam (Hugging Face MoE models);
* `monitor`: per-step statistics, written to DeepSpeed's monitor;
* `seams`: every reach into DeepSpeed that has no supported extension point, in one place.
"""
