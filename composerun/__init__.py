"""composerun: declarative training runs over PyTorch's composable distributed APIs."""

import time as _time

from composerun.console import quiet_on_closed_pipe

IMPORTED = _time.time()  # when Python imported composerun: the done line's clock (launch/timing.py)

__version__ = "0.1.0"


@quiet_on_closed_pipe
def main() -> None:
    """The `composerun` command (composerun.cli.main).  Its imports take a second or two:
    Ctrl-C during them is one line and exit 130 too, not a KeyboardInterrupt traceback."""
    import signal
    import sys

    # Ctrl-C is held while they run and acted on after: an extension module's start-up can drop
    # a KeyboardInterrupt raised inside it (the command then went on to the end; see
    # launch/signals.py interrupt_deferred, which does the same for torch's import)
    got: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        from composerun.cli import main as cli_main
    except KeyboardInterrupt:
        got.append(signal.SIGINT)
    finally:
        if previous is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous)
    if got:
        print("composerun: interrupted (SIGINT)", file=sys.stderr)
        sys.exit(130)
    cli_main()
