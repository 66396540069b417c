"""`python -m deepspeed_feplb {schema, simulate, trace, cleanup, report}`.

Each sub-command lives in the module that owns it and registers itself through
`add_parser(subparsers)`; the handler is stored as `func`.
"""
import argparse
import importlib
import sys

COMMAND_MODULES = (
    "deepspeed_feplb.config",
    "deepspeed_feplb.sim.cli",
    "deepspeed_feplb.trace.cli",
    "deepspeed_feplb.segments",
    "deepspeed_feplb.report",
)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m deepspeed_feplb")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
