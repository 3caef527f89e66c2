"""The typer application every command module registers with."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer
from typer.core import TyperCommand

from edgecache.clients.cli.context import flowing

__all__ = ["EXIT_CLOSED_STDOUT", "app", "main"]

F = TypeVar("F", bound=Callable[..., Any])


class _OnceCommand(TyperCommand):
    """A command whose options of one value each are refused when given twice.

    click keeps the last of them without a word: ``publish --column-types a=int32
    --column-types b=int32`` published ``a`` as inferred, a setting parsed and
    dropped. Options that take several (``--include``, ``--param``) and flags are
    not counted.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # typer's own copy of click's classes: an option is told by its type name.
        once: dict[str, Any] = {
            name: param
            for param in self.params
            if param.param_type_name == "option"
            and not (
                param.multiple or getattr(param, "is_flag", False) or getattr(param, "count", False)
            )
            for name in param.opts
        }
        given: dict[Any, tuple[str, str]] = {}
        at = 0
        while at < len(args) and args[at] != "--":
            name, eq, value = args[at].partition("=")
            param = once.get(name)
            if param is not None:
                if not eq:  # its value is the next argument
                    at += 1
                    value = args[at] if at < len(args) else ""
                if param in given:
                    first, before = given[param]
                    together = (  # a list of settings (a=int32): one option holds them all
                        f", its values together: {first} {before},{value}"
                        if "=" in before and "=" in value
                        else ""
                    )
                    raise typer.BadParameter(
                        f"given twice ({before!r} and {value!r}): give it once{together}",
                        ctx=ctx,
                        param=param,
                        param_hint=first,
                    )
                given[param] = (name, value)
            at += 1
        return super().parse_args(ctx, args)


class _FlowingTyper(typer.Typer):
    """typer's application, every command's help (and the root's) flowed by :func:`flowing`.

    Here, once, rather than a decorator on each command: a command added later
    wraps its help at the terminal too, without anyone remembering to ask. Each
    command also refuses an option of one value given twice (:class:`_OnceCommand`).
    """

    def command(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:  # type: ignore[override]
        kwargs.setdefault("cls", _OnceCommand)
        register = super().command(*args, **kwargs)
        return lambda function: register(flowing(function))

    def callback(self, *args: Any, **kwargs: Any) -> Callable[[F], F]:  # type: ignore[override]
        register = super().callback(*args, **kwargs)
        return lambda function: register(flowing(function))


app = _FlowingTyper(name="edgecache", no_args_is_help=True, add_completion=False)

# 128 + SIGPIPE: what a shell reports for `yes | head -1`'s `yes`, killed by SIGPIPE.
EXIT_CLOSED_STDOUT = 141


@app.callback()
def _root() -> None:
    """Stage training data into regional caches next to the GPUs.

    Exit codes: 0 ok; 1 failed (a node, a transfer, the origin: retrying may
    help); 2 bad input (options, files, names: it will not); 3 a scheduled job
    cannot be met; 130 interrupted by Ctrl-C (run it again to resume); 141 the
    output was closed (| head), quietly. Every command's --help says which it
    uses; docs/operations.md has a section per command.
    """


def _closed_stdout(stream: Any, code: int = EXIT_CLOSED_STDOUT) -> NoReturn:
    """Exit quietly with 141, ``stream`` pointed at /dev/null so no later flush fails again."""
    try:
        fd = stream.fileno() if stream is not None else None
    except (OSError, ValueError):  # not a file (a test's capture): nothing to point
        fd = None
    if fd is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)
    raise SystemExit(code)


class _ClosedStdoutExits:
    """``sys.stdout`` as it is, except that a write to a closed pipe exits quietly (141).

    A proxy for the real stream: everything but ``write``, ``writelines`` and
    ``flush`` (``fileno``, ``isatty``, ``encoding``, ``buffer``…) is the stream's own.
    ``None`` (Python's stdout when the command started with it closed, ``>&-``)
    is a closed output from the start. Another write error (``>/dev/full``: no
    space) is one ``error:`` line and exit 1, not a traceback.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            if self._stream is None:
                raise BrokenPipeError
            return self._stream.write(text)
        except OSError as exc:
            _failed_stdout(self._stream, exc)

    def writelines(self, lines: Any) -> None:
        try:
            if self._stream is None:
                raise BrokenPipeError
            self._stream.writelines(lines)
        except OSError as exc:
            _failed_stdout(self._stream, exc)

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as exc:
            _failed_stdout(self._stream, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _failed_stdout(stream: Any, exc: OSError) -> NoReturn:
    """A closed output exits quietly (141); any other write error says so (exit 1)."""
    if isinstance(exc, BrokenPipeError):
        _closed_stdout(stream)
    print(f"error: cannot write the output to stdout: {exc}", file=sys.stderr)
    _closed_stdout(stream, code=1)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def main() -> None:
    """Console-script entry point (``edgecache`` and ``python -m edgecache.clients.cli``).

    A closed stdout (``edgecache versions big | head -1``) ends the command quietly
    with exit 141, as if SIGPIPE had killed it, the way Unix tools behave. Catching
    ``BrokenPipeError`` around ``app()`` would be too late: rich's console turns it
    into exit 1 (``Console.on_broken_pipe``), typer does too for one raised by a
    command, and ``reporting()`` would print it as an error. So it is caught where it
    is raised, in the writes to ``sys.stdout`` (every command's output goes there:
    ``print`` and the rich console, which looks ``sys.stdout`` up when it writes),
    then stdout is pointed at /dev/null so the interpreter's last flush cannot fail
    again. Restoring SIGPIPE's default action instead would be one line, but this
    entry point also runs nodes (``serve``) and the controller: with SIGPIPE at its
    default, a write to a peer's closed socket would kill such a process instead of
    raising an error its code handles. Only stdout is guarded: a closed stderr keeps
    rich's and typer's handling (exit 1).
    """
    if sys.stdout is None and not _is_open(1):
        # fd 1 closed: the next file or socket opened would be given it, and anything
        # written to "stdout" from C would land in that file (an LMDB cache, say).
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)
    sys.stdout = _ClosedStdoutExits(sys.stdout)
    try:
        app()
    finally:
        sys.stdout.flush()  # what is still buffered, while a closed pipe can end quietly
