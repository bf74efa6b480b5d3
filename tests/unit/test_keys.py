"""`moerun keys` and the key files it writes: modes, format, and the checks on reading them."""
from __future__ import annotations

import os
import stat

import pytest
import zmq
import zmq.auth
from click.testing import CliRunner

from moerun.commands.keys import keys
from moerun.ipc.curve import (
    CurveClientKeys,
    CurveKeyError,
    CurveServerKeys,
    read_authorized_keys,
    read_key_pair,
    read_public_key,
    write_key_pair,
)


def make_keys(*args) -> object:
    return CliRunner().invoke(keys, [str(a) for a in args], catch_exceptions=False)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_keys_writes_a_private_pair_zeromq_can_read(tmp_path):
    folder = tmp_path / "new" / "keys"
    result = make_keys("-o", folder, "--name", "daemon-1")
    assert result.exit_code == 0, result.output
    public_file, secret_file = folder / "daemon-1.key", folder / "daemon-1.key_secret"
    assert (mode(folder), mode(secret_file), mode(public_file)) == (0o700, 0o600, 0o644)
    public, secret = zmq.auth.load_certificate(secret_file)
    assert zmq.auth.load_certificate(public_file) == (public, None)
    assert zmq.curve_public(secret) == public
    assert str(public_file) in result.output and str(secret_file) in result.output
    assert f"--curve-secret-key {secret_file}" in result.output
    assert "--curve-authorized-keys" in result.output


def test_keys_never_overwrites_a_pair(tmp_path):
    assert make_keys("-o", tmp_path, "--name", "parent").exit_code == 0
    before = (tmp_path / "parent.key_secret").read_bytes()
    result = make_keys("-o", tmp_path, "--name", "parent")
    assert result.exit_code == 1
    assert "parent.key exists" in result.output and "Traceback" not in result.output
    assert (tmp_path / "parent.key_secret").read_bytes() == before


def test_keys_refuses_a_name_that_is_a_path(tmp_path):
    result = make_keys("-o", tmp_path, "--name", "../elsewhere")
    assert result.exit_code == 2 and "--name" in result.output
    assert list(tmp_path.iterdir()) == []


def test_keys_default_name_is_the_host_name(tmp_path):
    assert make_keys("-o", tmp_path).exit_code == 0
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".key", ".key_secret"]


def test_a_secret_key_readable_by_others_is_refused(tmp_path):
    _, secret_file = write_key_pair(tmp_path, "loose")
    os.chmod(secret_file, 0o640)
    with pytest.raises(CurveKeyError, match="can be read by other users.*chmod 600"):
        read_key_pair(secret_file)


def test_a_public_key_file_is_not_a_secret_key(tmp_path):
    public_file, _ = write_key_pair(tmp_path, "pair")
    with pytest.raises(CurveKeyError, match="holds no secret key"):
        read_key_pair(public_file)


def test_a_mismatched_pair_is_refused(tmp_path):
    _, secret_file = write_key_pair(tmp_path, "pair")
    other_public, _ = zmq.curve_keypair()
    text = secret_file.read_text().replace(zmq.auth.load_certificate(secret_file)[0].decode(),
                                           other_public.decode())
    secret_file.write_text(text)
    with pytest.raises(CurveKeyError, match="does not belong to the secret key"):
        read_key_pair(secret_file)


@pytest.mark.parametrize("content, message", [
    ('curve\n    public-key = "short"\n', "40 Z85 characters"),
    ("just some text\n", "holds no public key"),
])
def test_malformed_public_keys_are_refused(tmp_path, content, message):
    (tmp_path / "bad.key").write_text(content)
    with pytest.raises(CurveKeyError, match=message):
        read_public_key(tmp_path / "bad.key")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CurveKeyError, match=f"cannot read the secret key file {tmp_path}/nope"):
        CurveClientKeys.from_files(tmp_path / "nope", tmp_path / "daemon.key")


def test_authorized_keys_from_a_directory_or_one_file(tmp_path):
    first, _ = write_key_pair(tmp_path, "parent-a")
    second, _ = write_key_pair(tmp_path, "parent-b")
    everyone = read_authorized_keys(tmp_path)          # *.key_secret files are not read
    assert everyone == {read_public_key(first): "parent-a", read_public_key(second): "parent-b"}
    assert read_authorized_keys(first) == {read_public_key(first): "parent-a"}
    _, daemon_secret = write_key_pair(tmp_path / "daemon", "daemon")
    server = CurveServerKeys.from_files(daemon_secret, tmp_path)
    assert server.authorized == everyone


def test_an_empty_authorized_directory_is_refused(tmp_path):
    with pytest.raises(CurveKeyError, match=r"has no \*\.key files"):
        read_authorized_keys(tmp_path)
