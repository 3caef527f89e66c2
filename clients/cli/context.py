"""What every command shares: topology and token options, exit codes, error reporting.

Errors become one line on stderr and an exit code here, in one place, so
every command reports the same kind of failure the same way and scripts
can rely on the codes.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from edgecache.cache.errors import CacheDirError, EdgeCacheError, VersionNotFound, WriterLocked
from edgecache.cache.tokens import token_problem
from edgecache.clients.cli.render import err_console, error
from edgecache.clients.topology import Topology, load_topology

__all__ = [
    "ConfigOption",
    "ExitCode",
    "JsonOption",
    "LogLevel",
    "LogLevelOption",
    "Options",
    "TokenOption",
    "exit_with",
    "flowing",
    "reporting",
]

F = TypeVar("F", bound=Callable[..., object])


class ExitCode(IntEnum):
    """What a command's exit status means (documented in ``edgecache --help``)."""

    OK = 0
    FAILED = 1  # a node, a transfer or the origin failed: retrying may help
    BAD_INPUT = 2  # options, files or names are wrong: retrying will not help
    CANNOT_BE_MET = 3  # a scheduled job's data cannot be ready in time
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, the shell's code): run the command again to resume


class LogLevel(StrEnum):
    """What ``--log-level`` takes, in any case; another is bad input (exit 2), not a traceback."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


# Libraries that log at INFO what is news only when debugging: botocore and aiobotocore
# say "Found credentials in environment variables" for every S3 client they make, and a
# controller makes clients every round (thousands of lines a day).
_CHATTY_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec")


# What botocore's DEBUG lines carry that must not reach a log: a session token (a pod role's
# STS credentials), an access key id, and a signed query's token; and the password of a URL
# (``https://user:password@host/registry``), which any line naming a registry, origin or
# peer of the topology may hold (the controller names its registry when it cannot read it).
_SECRETS = re.compile(
    r"(?P<k>X-Amz-Security-Token['\"]?\s*[:=]\s*b?['\"]?)[^'\"&\s,}]+"
    r"|(?P<c>Credential=)[^/,\s'\"]+"
    r"|(?P<u>\b[a-z][a-z0-9+.-]*://[^/@:\s'\"]*:)[^/\s'\"]+(?=@[^/@\s'\"]+)"
    r"|\b(?:AKIA|ASIA)[A-Z0-9]{16}\b",
    re.IGNORECASE,
)


def _masked(text: str) -> str:
    """``text`` with each credential :data:`_SECRETS` finds replaced by ``***``."""
    kept = ("k", "c", "u")  # what stays before the secret: a header's name, a URL's user
    return _SECRETS.sub(lambda m: "".join(m.group(g) or "" for g in kept) + "***", text)


class _Redacting(logging.Formatter):
    """Masks credentials in every line it formats, a traceback's included.

    A node at DEBUG logged botocore's request headers (a session token); an
    exception's text may carry a URL's password, and ``log.exception`` prints it
    in the traceback, which a filter on the message does not see.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The line, as the usual formatter writes it, with its credentials masked."""
        return _masked(super().format(record))


def configure_logging(level: LogLevel) -> None:
    """Log lines with time, level and logger for a long-running command (serve, controller).

    The chatty libraries above speak at WARNING and above unless ``level`` is DEBUG;
    credentials in any line are masked (:class:`_Redacting`).
    """
    line = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.value, format=line)
    # Called again once serve has read its settings (a level from EDGECACHE_LOG_LEVEL or
    # the --config file): basicConfig does nothing the second time, so set it here.
    logging.getLogger().setLevel(level.value)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, _Redacting):
            handler.setFormatter(_Redacting(line))
    # Never below the level asked (ERROR hides their warnings too); DEBUG lets them speak.
    quiet = max(logging.WARNING, logging.getLevelNamesMapping()[level.value])
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if level == LogLevel.DEBUG else quiet)


LogLevelOption = Annotated[
    LogLevel,
    typer.Option(
        case_sensitive=False,
        envvar="EDGECACHE_LOG_LEVEL",
        help="DEBUG, INFO, WARNING or ERROR (any case).",
    ),
]

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", help="Topology file [$EDGECACHE_CONFIG, ./edgecache.yaml]."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
TokenOption = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        envvar="EDGECACHE_TOKEN_FILE",
        help="File holding the bearer token of nodes that require one "
        "(the admin token for warm/evict; the read token is enough otherwise).",
    ),
]


@dataclass
class Options:
    """The topology and token a command was given, read when first needed."""

    config: Path | None = None
    token_file: Path | None = None
    _topology: Topology | None = field(default=None, init=False, repr=False)

    @property
    def topology(self) -> Topology:
        """The validated topology: ``--config``, ``$EDGECACHE_CONFIG``, ``./edgecache.yaml``."""
        if self._topology is None:
            self._topology = load_topology(self.config)
        return self._topology

    def flags(self, *, token: bool = True) -> str:
        """``--config`` (and ``--token-file``) as given, for the commands a message prints.

        Printed without them, a next step the user pastes read ``./edgecache.yaml``
        (another topology, another registry) and did something else, or failed.
        ``token``: only where the command printed needs the same token (an admin
        one for ``warm``, which a read token given to ``plan`` is not).
        """
        parts = [] if self.config is None else ["--config", str(self.config)]
        if token and self.token_file is not None:
            parts += ["--token-file", str(self.token_file)]
        return "".join(f" {shlex.quote(p)}" for p in parts)

    @property
    def token(self) -> str | None:
        """The token in ``--token-file``; an unreadable or empty file is bad input.

        Bad input (exit 2, naming the file) rather than a refused call later.
        """
        if self.token_file is None:
            return None
        # Named as it was given: a file from the environment was said to be --token-file's.
        named = f"--token-file {self.token_file}"
        if _from_environment("--token-file", "EDGECACHE_TOKEN_FILE"):
            named = f"$EDGECACHE_TOKEN_FILE ({self.token_file})"
        try:
            raw = self.token_file.read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{named}: {exc.strerror}") from None
        if (why := token_problem(raw)) is not None:
            # Sent anyway, gRPC failed every call "INTERNAL: Invalid metadata" and the node
            # was said to be down (exit 1; ready --wait polled it for an hour).
            raise ValueError(f"{named} {why}")
        token = raw.decode("ascii")
        if not token:
            # Sending no token would only come back from the node as "the token was missing".
            raise ValueError(
                f"{named} is empty: put the node's token in it, or "
                "leave out --token-file (and $EDGECACHE_TOKEN_FILE) for nodes without tokens"
            )
        return token


def _from_environment(flag: str, variable: str) -> bool:
    """Whether an option's value came from its environment variable, not the command line."""
    given = any(arg == flag or arg.startswith(f"{flag}=") for arg in sys.argv[1:])
    return not given and bool(os.environ.get(variable))


def exit_code_for(exc: BaseException) -> ExitCode:
    """Bad input (2) for what the user can fix in the command; failure (1) otherwise."""
    if isinstance(exc, ValueError | VersionNotFound | FileNotFoundError | NotADirectoryError):
        return ExitCode.BAD_INPUT
    # A cache directory that cannot be made, written or locked is a setting to change
    # (--cache-dir), as an address in use is: serve documents 2 for bad settings.
    if isinstance(exc, CacheDirError | WriterLocked):
        return ExitCode.BAD_INPUT
    return ExitCode.FAILED


def flowing(command: F) -> F:
    """Join each paragraph of a command's docstring into one line, for ``--help`` to wrap.

    typer prints the paragraphs after the first with the docstring's own line
    breaks, and rich wraps each of those lines again to the terminal: a line
    that did not fit broke in two mid-sentence ("with --if-changed, an" then
    "earlier version"), and one broken early in the source stayed short ("1
    failed:"). As one line per paragraph, rich wraps it to whatever width
    there is. Paragraphs stay apart (a blank line between them), and so do
    the lines of a list or a block (see :func:`_flowed`).
    """
    text = inspect.cleandoc(command.__doc__ or "")
    command.__doc__ = "\n\n".join(_flowed(part) for part in text.split("\n\n"))
    return command


# A list item: "- ", "* ", "• ", "1. " or "1) ", maybe indented.
_ITEM = re.compile(r"\s*(?:[-*•]|\d+[.)])\s+")


def _flowed(paragraph: str) -> str:
    """One paragraph as the lines ``--help`` prints: prose joined, lists and blocks kept.

    A list item starts a line of its own, and the lines indented to its text
    (a wrapped item) join it; other indented lines (a table, a command to
    run) stay as written. Only prose joins prose: ``--force.`` at the start
    of a line is a sentence going on, not an item.
    """
    lines: list[str] = []
    joins: int | None = 0  # the indent of a line that continues the last; None: nothing does
    for line in paragraph.splitlines():
        indent = len(line) - len(line.lstrip())
        item = _ITEM.match(line)
        if lines and item is None and indent == joins:
            lines[-1] += " " + line.strip()
            continue
        lines.append(line.rstrip())
        joins = item.end() if item else (0 if indent == 0 else None)
    return "\n".join(lines)


def exit_with(code: ExitCode) -> typer.Exit:
    """The ``typer.Exit`` to raise for ``code``."""
    return typer.Exit(int(code))


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    """Print an edgecache error (or a bad value, or an OS error) as one line and exit."""
    try:
        yield
    except (EdgeCacheError, ValueError, OSError) as exc:
        error(str(exc))
        for note in getattr(exc, "__notes__", ()):
            err_console.print(f"  {note}", soft_wrap=True, highlight=False, markup=False)
        raise exit_with(exit_code_for(exc)) from exc
