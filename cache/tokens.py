"""Bearer tokens as files hold them: what a token may be, so that a client can send it.

Here, below the node and the clients both: the node checks its token files at
start and the CLI its ``--token-file`` by the same rule (``clients`` may not
import ``edge``).
"""

from __future__ import annotations

__all__ = ["token_problem"]


def token_problem(token: bytes) -> str | None:
    """Why ``token`` (stripped) cannot be sent as a bearer token, or None.

    Clients send the token as an HTTP/2 header value: gRPC refuses anything else there
    on the client's side ("Invalid metadata"), so every call would fail with no word
    of the file. One line of printable ASCII (spaces inside are allowed there). The
    node checks its files with it, and the CLI its ``--token-file``.
    """
    bad = next((b for b in token if not 0x20 <= b <= 0x7E), None)
    if bad is None:
        return None
    if bad in b"\r\n":
        what = "more than one line"
    elif bad > 0x7E:
        what = "a non-ASCII character"
    else:
        what = f"the control character {bad:#04x}"
    return (
        f"holds {what}: a token is one line of printable ASCII (letters, digits, "
        "punctuation; e.g. from openssl rand -hex 32), since clients send it as a header "
        "and could not present this one"
    )
