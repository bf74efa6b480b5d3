"""Who may use the server: API keys, the paths open without one, and where a keyless server may listen.

With keys, every HTTP request must present one as `Authorization: Bearer KEY` or `x-api-key: KEY`,
except on the open paths (/health by default, /metrics when opened); otherwise it gets 401 in
OpenAI's error shape, with `WWW-Authenticate: Bearer`, before its body is read. A presented key
is compared as a SHA-256 digest against every key's digest with hmac.compare_digest, all of them
each time, so the time taken tells neither which key matched nor how much of one. Keys are
visible ASCII (what a header carries as it is); a key is never written into a message or a log.

Without keys the server answers everyone, so it may listen only on a loopback address unless
the operator says `--insecure`.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from moerun.errors import UsageError
from moerun.server.schemas import ApiError

KEY = re.compile(r"^[\x21-\x7e]+$")          # visible ASCII: no spaces, no control characters
LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class Access:
    """The keys requests must present (none: the server is open), and which paths need none."""
    keys: tuple[str, ...] = ()
    public_health: bool = True               # load balancers probe /health without a key
    public_metrics: bool = False             # /metrics tells what runs and how much: behind the key

    @property
    def open_paths(self) -> frozenset[str]:
        return frozenset(path for path, public in (("/health", self.public_health),
                                                   ("/metrics", self.public_metrics)) if public)


def keys_given(api_key: Iterable[str], api_key_file: str | None) -> tuple[str, ...]:
    """The keys of --api-key (each value may hold several, comma-separated) and of --api-key-file
    (one a line, blank lines skipped). Raises ValueError for an empty or malformed key and for a
    key file that is missing, unreadable or empty."""
    keys = [key.strip() for value in api_key for key in value.split(",")]
    if not all(KEY.match(key) for key in keys):
        raise UsageError("--api-key: a key is one or more visible ASCII characters, without spaces; "
                         "several keys are separated by commas")
    if api_key_file is not None:
        keys += read_key_file(Path(api_key_file))
    return tuple(keys)


def read_key_file(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise UsageError(f"--api-key-file {path}: cannot read it: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--api-key-file {path}: not UTF-8 text") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if key and not KEY.match(key):
            raise UsageError(f"--api-key-file {path}, line {number}: a key is visible ASCII characters, "
                             "without spaces")
        if key:
            keys.append(key)
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key: write one key per line")
    return keys


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only: localhost, 127.0.0.0/8 or ::1."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:                        # a host name: it may resolve anywhere
        return False


def refuse_open_listening(host: str, access: Access, insecure: bool) -> None:
    """Raise ValueError when a server without keys would listen beyond this machine, unless insecure."""
    if not access.keys and not insecure and not is_loopback(host):
        raise UsageError(f"--host {host} is reachable from other machines and the server has no API key: "
                         "give --api-key KEY or --api-key-file FILE, listen on 127.0.0.1, "
                         "or add --insecure to serve everyone who reaches it")


class ApiKeys:
    """Checks presented keys against the configured ones in constant time."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(key.encode()) for key in keys)

    def accepts(self, presented: Iterable[bytes]) -> bool:
        """Whether any presented key is one of the keys; every pair is compared, none skipped."""
        accepted = False
        for key in presented:
            digest = _digest(key)
            for known in self._digests:
                accepted |= hmac.compare_digest(digest, known)
        return accepted


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def presented_keys(headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """The keys a request carries: `Authorization: Bearer KEY` and `x-api-key: KEY` (raw ASGI headers)."""
    keys = []
    for name, value in headers:
        if name == b"authorization":
            scheme, _, credentials = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and credentials.strip():
                keys.append(credentials.strip())
        elif name == b"x-api-key" and value.strip():
            keys.append(value.strip())
    return keys


class RequireApiKey:
    """ASGI middleware: an HTTP request outside `access.open_paths` needs one of `access.keys`;
    a refusal is counted through `on_refusal`."""

    def __init__(self, app: ASGIApp, access: Access, on_refusal: Callable[[], None]):
        self.app = app
        self.keys = ApiKeys(access.keys)
        self.open_paths = access.open_paths
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            presented = presented_keys(scope["headers"])
            if not self.keys.accepts(presented):
                self.on_refusal()
                await unauthorized(bool(presented))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def unauthorized(key_presented: bool) -> JSONResponse:
    message = ("the API key is not valid" if key_presented else
               "this server needs an API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
    error = ApiError(401, message, type="authentication_error", code="invalid_api_key")
    return JSONResponse(error.body(), status_code=error.status, headers={"WWW-Authenticate": "Bearer"})
