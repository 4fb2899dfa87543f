"""composerun: declarative training runs over PyTorch's composable distributed APIs."""

from composerun.console import quiet_on_closed_pipe

__version__ = "0.1.0"


@quiet_on_closed_pipe
def main() -> None:
    """The `composerun` command (composerun.cli.main).  Its imports take a second or two:
    Ctrl-C during them is one line and exit 130 too, not a KeyboardInterrupt traceback."""
    import sys

    try:
        from composerun.cli import main as cli_main
    except KeyboardInterrupt:
        print("composerun: interrupted (SIGINT)", file=sys.stderr)
        sys.exit(130)
    cli_main()
