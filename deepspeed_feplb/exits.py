"""How a FEPLB job ends on a configuration mistake or a Ctrl-C: one line, not a traceback per rank.

Every rank of a job validates the same ``"feplb"`` section and receives the same SIGINT, so an
uncaught `FEPLBConfigError` or an interruption would print the same long traceback once per
rank (for an interrupted collective, gloo's "remote worker crashing" on the others). `install`
replaces ``sys.excepthook`` so that

* a `FEPLBConfigError` (or `FEPLBModelError`) prints its message once, on global rank 0 (the others exit quietly);
* a SIGINT (Ctrl-C) is announced once, on local rank 0, as "interrupted", and every exception
  that then ends a rank prints nothing more (the job's shared memory and scheduler processes
  are removed by the exit handlers, `domain.shutdown`, as on any exit).

* any other exception prints as before (the previous hook is called), preceded by a line that
  names the dead ranks of this process's NVLink domains, if any: a collective that a dead peer
  broke (DeepSpeed's own, outside FEPLB) only says "connection reset" or times out.

The exit status stays 1.

The command-line tools (``feplb simulate``, ``trace``, ``report``) end on a bad option or input
file as argparse does: one line on stderr, exit status 2 (`fail`). The loaders of their input
files raise `InputFileError` naming the file and what is wrong in it, which ``__main__`` turns
into that line; any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

__all__ = ["InputFileError", "fail", "install", "interrupted"]

_installed = False
_interrupted = False


class InputFileError(ValueError):
    """A command's input file cannot be used; the message names the file and what is wrong.

    A ValueError, so that library callers that already catch bad values (a trace given to
    `testing.routing`) keep working."""


def fail(command: str, message: str):
    """End a command as argparse ends on a bad option: ``COMMAND: error: MESSAGE`` on one line of
    stderr, exit status 2, no traceback. Line breaks in the message (a path, a value quoted from a
    corrupt file) are flattened so that the line stays one."""
    print(f"{command}: error: {' '.join(str(message).splitlines())}", file=sys.stderr)
    raise SystemExit(2)


def interrupted() -> bool:
    """Whether this process received SIGINT since `install`."""
    return _interrupted


def _env_rank(name: str) -> int:
    try:
        return int(os.environ.get(name, "0"))
    except ValueError:
        return 0


_dead_peers: Optional[Callable[[], list]] = None


def install(dead_peers: Optional[Callable[[], list]] = None) -> None:
    """Install the excepthook (and a SIGINT handler that notes the interruption); idempotent.
    ``dead_peers(wait_s)``: names the dead peer ranks of this process (`domain.dead_peers`)."""
    global _installed, _dead_peers
    if dead_peers is not None:
        _dead_peers = dead_peers
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind, value, traceback):
        from deepspeed_feplb.config import FEPLBConfigError

        if isinstance(value, FEPLBConfigError):
            if _env_rank("RANK") == 0:
                print(f"deepspeed_feplb: {value.what}:\n{value}", file=sys.stderr)
            return
        if _interrupted or issubclass(kind, KeyboardInterrupt):
            _say_interrupted()
            return
        if issubclass(kind, Exception):
            _name_dead_peers()
        previous(kind, value, traceback)

    sys.excepthook = hook
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        def on_sigint(signum, frame):
            global _interrupted
            _interrupted = True
            _say_interrupted()  # now: the launcher's SIGTERM may end the process before any excepthook runs
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)


def _name_dead_peers() -> None:
    """A collective that fails because a peer died says only "connection reset" (gloo) or times
    out: name the dead ranks of this process's NVLink domains, which FEPLB watches."""
    dead = _dead_peers(wait_s=1.0) if _dead_peers is not None else []
    if dead:
        print(f"deepspeed_feplb: {', '.join(dead)} of this rank's NVLink domain died; the error below is this "
              "rank's view of it", file=sys.stderr, flush=True)


_said = False


def _say_interrupted() -> None:
    global _said
    if not _said and _env_rank("LOCAL_RANK") == 0:
        print("deepspeed_feplb: interrupted (Ctrl-C); FEPLB removes its shared memory and scheduler processes",
              file=sys.stderr, flush=True)
    _said = True
