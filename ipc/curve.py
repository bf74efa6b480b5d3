"""ZeroMQ CURVE keys for the stream transport: certificate files, which endpoints need them,
and the socket options that turn them on.

Keys are ZeroMQ certificate files as `moerun keys` writes them: NAME.key holds the public key,
NAME.key_secret both keys (mode 0600). A daemon reachable from other hosts needs its own secret
key and the public keys of the parents it serves; a parent needs its own secret key and the
daemon's public key.
"""
from __future__ import annotations

import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils.z85 import Z85CHARS

from moerun.errors import UsageError

KEY_CHARS = 40                 # a 32-byte key in Z85
PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"
SECRET_BANNER = "#   ZeroMQ CURVE **Secret** Certificate\n#   Keep it on this machine, readable by its owner only.\n"
PUBLIC_BANNER = "#   ZeroMQ CURVE Public Certificate\n#   Give it to the peers that talk to its owner.\n"
MAKE_KEYS_HINT = "(`moerun keys -o DIR` makes a key pair)"


class CurveKeyError(UsageError):
    """A missing, unreadable, malformed or unprotected key file, or keys missing where needed."""


@dataclass(frozen=True)
class CurveClientKeys:
    """A parent's keys: its own pair and the public key of the daemon it connects to (Z85)."""
    public_key: bytes
    secret_key: bytes
    server_public_key: bytes

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike,
                   server_public_key_file: str | os.PathLike) -> CurveClientKeys:
        public, secret = read_key_pair(secret_key_file)
        return cls(public, secret, read_public_key(server_public_key_file))


@dataclass(frozen=True)
class CurveServerKeys:
    """A daemon's key pair and the parents it admits: {public key: name (the file's stem)}."""
    public_key: bytes
    secret_key: bytes
    authorized: dict[bytes, str]

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike,
                   authorized_keys: str | os.PathLike) -> CurveServerKeys:
        public, secret = read_key_pair(secret_key_file)
        return cls(public, secret, read_authorized_keys(authorized_keys))


def server_keys_for(endpoint: str, secret_key_file: str | None,
                    authorized_keys: str | None) -> CurveServerKeys | None:
    """The daemon's CURVE keys from its flags, or None where the endpoint may go without."""
    if (secret_key_file is None) != (authorized_keys is None):
        raise CurveKeyError("--curve-secret-key and --curve-authorized-keys go together: the daemon "
                            "needs its own secret key and the public keys of the parents it serves")
    keys = None if secret_key_file is None else CurveServerKeys.from_files(secret_key_file,
                                                                             authorized_keys)
    require_keys_if_exposed(endpoint, keys is not None)
    return keys


def require_keys_if_exposed(endpoint: str, has_keys: bool) -> None:
    if not has_keys and reachable_from_other_hosts(endpoint):
        raise CurveKeyError(
            f"{endpoint} can be reached from other hosts, so the daemon authenticates its parents "
            f"with CURVE: give it --curve-secret-key FILE and --curve-authorized-keys FILE|DIR "
            f"{MAKE_KEYS_HINT}, or listen on ipc://PATH or tcp://127.0.0.1:PORT")


def reachable_from_other_hosts(endpoint: str) -> bool:
    """True for a tcp:// endpoint on anything but a loopback address (`*`, 0.0.0.0, a
    routable address, a host or interface name)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def set_server_keys(socket: zmq.Socket, keys: CurveServerKeys) -> None:
    socket.curve_server = True
    socket.curve_publickey = keys.public_key
    socket.curve_secretkey = keys.secret_key
    socket.zap_domain = b"moerun"


def set_client_keys(socket: zmq.Socket, keys: CurveClientKeys) -> None:
    socket.curve_publickey = keys.public_key
    socket.curve_secretkey = keys.secret_key
    socket.curve_serverkey = keys.server_public_key


# -- certificate files ------------------------------------------------------------------------

def write_key_pair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret (mode 0600) into directory (made 0700 if new);
    never overwrites. Returns (public file, secret file)."""
    directory = Path(directory)
    public_file, secret_file = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    for path in (public_file, secret_file):
        if path.exists():
            raise FileExistsError(f"{path} exists; pick another name or remove it first")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    _write_certificate(secret_file, SECRET_BANNER, public, secret, 0o600)
    _write_certificate(public_file, PUBLIC_BANNER, public, None, 0o644)
    return public_file, secret_file


def read_key_pair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate that only its owner can read."""
    fields = _read_certificate(path, "secret key")
    if "secret-key" not in fields:
        raise CurveKeyError(f"{path} holds no secret key: give the NAME{SECRET_SUFFIX} file of "
                            f"the pair {MAKE_KEYS_HINT}")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise CurveKeyError(f"{path} can be read by other users (mode {mode:04o}); "
                            f"run `chmod 600 {path}`")
    secret = _checked_key(fields["secret-key"], path)
    public = zmq.curve_public(secret)
    if "public-key" in fields and _checked_key(fields["public-key"], path) != public:
        raise CurveKeyError(f"{path}: the public key does not belong to the secret key")
    return public, secret


def read_public_key(path: str | os.PathLike) -> bytes:
    fields = _read_certificate(path, "public key")
    if "public-key" not in fields:
        raise CurveKeyError(f"{path} holds no public key {MAKE_KEYS_HINT}")
    return _checked_key(fields["public-key"], path)


def read_authorized_keys(path: str | os.PathLike) -> dict[bytes, str]:
    """{public key: name} from one public key file, or from every *.key file in a directory."""
    path = Path(path)
    files = sorted(path.glob(f"*{PUBLIC_SUFFIX}")) if path.is_dir() else [path]
    if not files:
        raise CurveKeyError(f"{path} has no *{PUBLIC_SUFFIX} files: put the public key of every "
                            f"parent this daemon serves there")
    return {read_public_key(file): file.stem for file in files}


def _read_certificate(path: str | os.PathLike, what: str) -> dict[str, bytes]:
    """The `name = "value"` lines of a ZeroMQ certificate file."""
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise CurveKeyError(f"cannot read the {what} file {path}: {e.strerror or e}") from None
    fields = {}
    for line in text.splitlines():
        name, equals, value = line.strip().partition(b"=")
        if equals and not name.startswith(b"#"):
            fields[name.strip().decode("ascii", "replace")] = value.strip(b" \t'\"")
    return fields


def _checked_key(key: bytes, path: str | os.PathLike) -> bytes:
    if len(key) != KEY_CHARS or not all(char in Z85CHARS for char in key):
        raise CurveKeyError(f"{path}: a key is {KEY_CHARS} Z85 characters, found {key[:60]!r}")
    return key


def _write_certificate(path: Path, banner: str, public: bytes, secret: bytes | None,
                       mode: int) -> None:
    lines = [banner, "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    os.fchmod(descriptor, mode)   # whatever the umask
    with os.fdopen(descriptor, "w") as file:
        file.write("\n".join(lines) + "\n")
