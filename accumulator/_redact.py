"""Secrets out of everything shown: the one place that masks passwords in Redis URLs.

Every URL the package shows (CLI output and errors, demo output, log records) goes through
:func:`redact_url`; text that may echo parts of a URL (an exception's message) goes through
:func:`scrub` with the URL's :func:`url_secrets`.

What counts as a secret in a URL:

- the userinfo password, ``redis://user:PASSWORD@host`` (also when it holds unencoded ``@``,
  ``/``, ``?`` or ``#``, which make the URL invalid for redis-py but must not leak in the
  error that says so);
- the value of every query parameter whose name contains ``pass``, ``pwd``, ``auth``,
  ``secret``, ``token`` or ``credential`` (any case, percent-decoded): ``?password=``,
  ``?ssl_password=``, ... A value with an unencoded ``&`` or ``;`` is masked up to the next
  ``name=value`` parameter.

Everything else (scheme, user name, host, port, database, other parameters) stays readable.
Nothing here raises: malformed input gives a best-effort masked string.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, unquote_plus

__all__ = ["MASK", "redact_url", "scrub", "url_secrets"]

#: What a secret is replaced with.
MASK = "***"

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_SECRET_NAME = re.compile(r"pass|pwd|auth|secret|token|credential", re.IGNORECASE)
_QUERY_SEP = re.compile(r"([&;])")
#: Characters that end the host part early: a password holding them is cut into fragments.
_FRAGMENT_SEP = re.compile(r"[/?#@&;]")


@dataclass
class _Parts:
    head: str  # "scheme://" or ""
    user: str | None  # the userinfo's user part; None: no userinfo
    password: str | None  # raw (percent-encoded) userinfo password; None: none given
    body: str  # host, port, path
    #: The query (None: no "?") as (separator before, piece, secret) triples: the first
    #: separator is "", a secret piece is a password-like parameter or the rest of its value.
    query: list[tuple[str, str, bool]] | None = None


def _host_port(text: str) -> bool:
    """Whether ``text`` reads as ``host:port``, ``[v6]:port`` or ``[v6]``."""

    def bracketed(s: str) -> bool:
        return s.startswith("[") and s.endswith("]")

    host, colon, port = text.rpartition(":")
    if bracketed(text):
        return True
    return bool(colon and host and port.isdigit() and (":" not in host or bracketed(host)))


def _parse(url: str) -> _Parts:
    match = _SCHEME.match(url)
    head = match.group(0) if match else ""
    rest = url[len(head) :]
    user: str | None = None
    password: str | None = None
    # The authority ends at the first "/", "?" or "#"; its userinfo at its last "@".
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)
    last = rest.rfind("@")
    # No "@" in the authority but one later, and a ":" before the cut: most likely a password
    # holding an unencoded "/", "?" or "#"; mask up to that "@". Unless the authority reads
    # as host:port and a query precedes the "@" (then it is an "@" in a query value).
    if (
        at < 0
        and last > end
        and ":" in rest[:end]
        and not (_host_port(rest[:end]) and "?" in rest[end:last])
    ):
        at = last
    # An "@" in the authority and another one after it: a password holding both "@" and "/",
    # "?" or "#" (redis://:Ab@c/Def@host:6379); masked up to the last "@", unless a query
    # comes between (an "@" in a query value: ?client_name=a@b) and what follows the last "@"
    # is no host:port. Masking too much is the safe side.
    if 0 <= at < end < last:
        after = rest[last + 1 :]
        cut = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
        if "?" not in rest[end:last] or _host_port(after[:cut]):
            at = last
    if at >= 0:
        userinfo, rest = rest[:at], rest[at + 1 :]
        name, colon, secret = userinfo.partition(":")
        user, password = name, (secret if colon else None)
    body, qmark, query = rest.partition("?")
    parts = _Parts(head, user, password, body)
    if qmark:
        split = _QUERY_SEP.split(query)
        parts.query = []
        masking = False
        for i in range(0, len(split), 2):
            piece = split[i]
            name, eq, _ = piece.partition("=")
            if eq:
                masking = bool(_SECRET_NAME.search(unquote(name)))
            # a piece without "=" right after a secret one is the rest of its value
            parts.query.append((split[i - 1] if i else "", piece, masking and bool(piece)))
    return parts


def _render(parts: _Parts, *, drop: bool) -> str:
    out = parts.head
    if parts.user is not None:
        if parts.password is None:
            out += parts.user + "@"
        elif not drop:
            out += f"{parts.user}:{MASK}@"
        elif parts.user:
            out += parts.user + "@"
    out += parts.body
    if parts.query is not None:
        query = ""
        for sep, piece, secret in parts.query:
            if secret:
                name, eq, _ = piece.partition("=")
                if drop or not eq:  # dropped, or the tail of a value already masked
                    continue
                piece = f"{name}={MASK}"
            query += (sep if query else "") + piece
        if query or not drop:
            out += "?" + query
    return out


def redact_url(url: object, *, drop: bool = False) -> str:
    """``url`` fit to be shown: its password and password-like query parameters masked as
    ``***`` (``drop=True``: removed, e.g. for a command line to copy that gets the password
    from elsewhere). Never raises; ``None`` gives ``""``, a non-string its type's name."""
    if url is None:
        return ""
    if isinstance(url, (bytes, bytearray)):
        url = bytes(url).decode("utf-8", "replace")
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    try:
        return _render(_parse(url), drop=drop)
    except Exception:  # noqa: BLE001 - never let showing a URL fail
        return "<unprintable URL>"


def url_secrets(url: object) -> list[str]:
    """The secret values a URL holds (raw and percent-decoded), for :func:`scrub`."""
    if not isinstance(url, str):
        return []
    try:
        parts = _parse(url)
    except Exception:  # noqa: BLE001
        return []
    found: list[str] = []
    if parts.password:
        found.append(parts.password)
    value: str | None = None
    for sep, piece, masked in parts.query or []:
        _, eq, rest = piece.partition("=")
        if value is not None and (not masked or eq):
            found.append(value)
            value = None
        if masked:
            value = rest if eq else f"{value or ''}{sep}{piece}"
    if value is not None:
        found.append(value)
    out: list[str] = []
    for secret in found:
        for form in (secret, unquote(secret), unquote_plus(secret)):
            if form and form not in out:
                out.append(form)
    return out


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every secret replaced by ``***``; also the pieces of a secret that an
    unencoded ``/``, ``?``, ``#``, ``@``, ``&`` or ``;`` cut it into (as whole words), which
    a parser's error message may quote."""
    values = sorted({s for s in secrets if s}, key=len, reverse=True)
    if not values:
        return text
    try:
        for secret in values:
            text = text.replace(secret, MASK)
        for secret in values:
            for piece in sorted(set(_FRAGMENT_SEP.split(secret)), key=len, reverse=True):
                if piece and piece != secret:
                    pattern = r"(?<![A-Za-z0-9])" + re.escape(piece) + r"(?![A-Za-z0-9])"
                    text = re.sub(pattern, MASK, text)
        return text
    except Exception:  # noqa: BLE001 - never let an error message fail
        return "<message withheld: it may contain a password>"
