"""`moerun keys`: a CURVE key pair for a daemon or a parent that talk over tcp://."""
from __future__ import annotations

import re
import socket

import click

from moerun.commands.options import friendly_errors
from moerun.ipc.curve import write_key_pair

KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@click.command()
@click.option("-o", "--output", "directory", type=click.Path(file_okay=False), required=True,
              help="Directory for the key files (made with mode 0700 if it does not exist).")
@click.option("--name", default=None, help="File name for the pair [default: this host's name].")
@friendly_errors
def keys(directory, name):
    """Make a CURVE key pair: NAME.key (public) and NAME.key_secret (secret, mode 0600).

    A daemon on a tcp:// address other hosts can reach serves only the parents whose public
    keys it is given; a parent connects with its own pair and the daemon's public key."""
    name = name or socket.gethostname().split(".")[0]
    if not KEY_NAME.match(name):
        raise click.BadParameter(f"{name!r}: use letters, digits, '.', '_' and '-'", param_hint="--name")
    public_file, secret_file = write_key_pair(directory, name)
    click.echo(f"public key: {public_file}  (give it to the other side)\n"
               f"secret key: {secret_file}  (mode 0600; it never leaves this machine)\n"
               f"\n"
               f"On a daemon, serving the parents whose public keys are in PARENT_KEYS (a .key file "
               f"or a directory of them):\n"
               f"  moerun daemon -m MODEL --listen tcp://0.0.0.0:PORT --curve-secret-key {secret_file} "
               f"--curve-authorized-keys PARENT_KEYS\n"
               f"On a parent: --curve-secret-key {secret_file} --daemon-public-key DAEMON.key (that daemon's "
               f".key file), or in its rig config client_secret_key = \"{secret_file}\" under [auth] and each "
               f"[[daemon]]'s curve_public_key = that daemon's .key file.")
