"""`feplb` (or `python -m deepspeed_feplb`) {schema, simulate, trace, cleanup, report}.

Each sub-command lives in the module that owns it and registers itself through
`add_parser(subparsers)`; the handler is stored as `func`. An input file that its loader refuses
(`exits.InputFileError`) ends the command in one line on stderr with exit status 2.
"""
import argparse
import importlib
import os
import sys

COMMAND_MODULES = (
    "deepspeed_feplb.config",
    "deepspeed_feplb.sim.cli",
    "deepspeed_feplb.trace.cli",
    "deepspeed_feplb.segments",
    "deepspeed_feplb.report",
)


def program_name(argv0: str) -> str:
    """How the user called us: ``feplb`` (the installed script) or ``python -m deepspeed_feplb``."""
    name = os.path.basename(argv0)
    return name if name and not name.startswith("__main__") else "python -m deepspeed_feplb"


def build_parser(prog: str) -> argparse.ArgumentParser:
    from deepspeed_feplb import __version__

    parser = argparse.ArgumentParser(
        prog=prog, description="FEPLB tools: replay routing traces through balancing policies (simulate), make or "
                               "import traces (trace), plot training stats (report), print the \"feplb\" config "
                               "schema (schema), remove shared memory a killed job left (cleanup).")
    parser.add_argument("--version", action="version", version=f"deepspeed_feplb {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    parser.commands = sub.choices  # {name: its parser}, to name a bad option by the command's usage
    return parser


def main(argv=None):
    parser = build_parser(program_name(sys.argv[0]))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's own usage (argparse would print the top-level one)
        parser.commands[args.command].error(
            f"unrecognized arguments: {' '.join(unknown)}")
    from deepspeed_feplb.exits import InputFileError, fail

    try:
        return args.func(args) or 0
    except InputFileError as e:  # raised by the loaders only; any other error is a bug and keeps its traceback
        fail(args.command, str(e))


if __name__ == "__main__":
    sys.exit(main())
