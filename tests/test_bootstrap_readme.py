"""bootstrap/README.md works as written on a fresh machine: its setup commands run
in a temporary root (every absolute path prefixed with it, nothing else changed),
and the files they leave and the command line the systemd unit runs are checked.
Also: the daemon's control socket answers while it is still joining."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from p2pnode.cli.main import build_parser, main
from p2pnode.cli.node import _authority_key, read_bootstrap_file
from p2pnode.core.identity import load_identity
from p2pnode.core.jsonutil import b64encode
from p2pnode.node.config import parse_address
from p2pnode.node.control import control_call

pytestmark = pytest.mark.slow

BOOTSTRAP = Path(__file__).resolve().parent.parent / "bootstrap"
UNIT = "p2pnode-bootstrap.service"


def setup_commands() -> list[list[str]]:
    """The shell block of the README's "One-time setup" section, one argv per line."""
    text = (BOOTSTRAP / "README.md").read_text()
    section = text.split("## One-time setup", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def check_block() -> list[str]:
    text = (BOOTSTRAP / "README.md").read_text()
    section = text.split("## Checking it", 1)[1]
    [block] = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    [line] = [line for line in block.splitlines() if line.strip()]
    return shlex.split(line)


class Machine:
    """A fresh machine in a directory: absolute paths in commands are prefixed with
    ``root``; what needs root privileges or the network is done the way it would be."""

    #: What a fresh Debian with systemd has (and nothing of p2pnode's).
    SYSTEM_DIRS = ("etc/systemd/system", "opt", "var/lib", "usr/sbin")

    def __init__(self, root: Path) -> None:
        self.root = root
        for directory in self.SYSTEM_DIRS:
            (root / directory).mkdir(parents=True)
        self.users: dict[str, Path] = {}
        self.venvs: set[str] = set()
        self.enabled: list[str] = []

    def path(self, text: str) -> Path:
        return self.root / text.lstrip("/") if text.startswith("/") else BOOTSTRAP / text

    def prefixed(self, argv: list[str]) -> list[str]:
        return [str(self.path(a)) if a.startswith("/") else a for a in argv]

    def run(self, argv: list[str]) -> None:
        user = None
        if argv[0] == "sudo":
            argv = argv[1:]
            if argv[0] == "-u":
                user, argv = argv[1], argv[2:]
        if user is not None:
            assert user in self.users, f"sudo -u {user} before the user exists"
        name = Path(argv[0]).name
        if name == "apt-get":
            assert argv[1:] == ["install", "-y", "python3-venv"]
        elif name == "useradd":
            home = argv[argv.index("--home-dir") + 1]
            assert "--create-home" in argv and "--system" in argv
            self.path(home).mkdir(parents=True)
            self.users[argv[-1]] = self.path(home)
        elif argv[:3] == ["python3", "-m", "venv"]:
            # The venv gets a `p2pnode` executable once pip installs the package.
            self.path(
                argv[3],
            ).joinpath("bin").mkdir(parents=True)
            self.venvs.add(argv[3])
        elif name == "pip":
            venv = str(Path(argv[0]).parent.parent)
            assert venv in self.venvs, "pip of a venv that was not made"
            assert argv[1] == "install"
            project = (BOOTSTRAP / argv[2]).resolve()
            assert 'name = "p2pnode"' in (project / "pyproject.toml").read_text()
            shim = self.path(venv) / "bin" / "p2pnode"
            shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m p2pnode "$@"\n')
            shim.chmod(0o755)
        elif name == "p2pnode":
            executable = self.path(argv[0])
            assert executable.exists(), f"{argv[0]} is not installed"
            subprocess.run([str(executable), *self.prefixed(argv[1:])], check=True)
        elif name == "systemctl":
            if argv[1] == "enable":
                unit = self.root / "etc/systemd/system" / (argv[-1] + ".service")
                assert unit.exists(), f"{argv[-1]} is not installed"
                self.enabled.append(argv[-1])
            else:
                assert argv[1:] == ["daemon-reload"]
        else:
            # Ordinary commands (install, cp, mkdir) run as they are, paths prefixed.
            subprocess.run(self.prefixed(argv), check=True, cwd=BOOTSTRAP)


def environment(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def exec_start(unit: Path, env: dict[str, str]) -> list[str]:
    """ExecStart as systemd runs it: continuation lines joined, each ``${VAR}`` word
    replaced by exactly one argument (systemd.service(5), "Command lines")."""
    lines = unit.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ExecStart="))
    text = lines[start].removeprefix("ExecStart=")
    while text.endswith("\\"):
        start += 1
        text = text[:-1] + " " + lines[start].strip()
    argv = []
    for word in text.split():
        match = re.fullmatch(r"\$\{(\w+)\}", word)
        argv.append(env.get(match.group(1), "") if match else word)
    return argv


def unit_value(unit: Path, key: str) -> str:
    [line] = [line for line in unit.read_text().splitlines() if line.startswith(key + "=")]
    return line.split("=", 1)[1]


def test_the_bootstrap_readme_sets_up_a_runnable_service(tmp_path: Path) -> None:
    machine = Machine(tmp_path)
    for argv in setup_commands():
        machine.run(argv)
    assert machine.enabled == ["p2pnode-bootstrap"]
    unit = tmp_path / "etc/systemd/system" / UNIT
    assert unit.read_text() == (BOOTSTRAP / UNIT).read_text()
    assert unit_value(unit, "User") in machine.users

    # The environment file it names is installed; the authority key an operator
    # writes there reaches the command line.
    env_file = machine.path(unit_value(unit, "EnvironmentFile"))
    env = environment(env_file)
    authority = b64encode(bytes(range(32)))
    argv = exec_start(unit, {**env, "P2PNODE_AUTHORITY_KEY": authority})
    executable = machine.path(argv[0])
    assert executable.exists() and executable.stat().st_mode & 0o111
    args = build_parser().parse_args(argv[1:])
    assert args.command == "run"
    assert _authority_key(args) == bytes(range(32))
    # Left empty as shipped, it is an open swarm.
    assert _authority_key(build_parser().parse_args(exec_start(unit, env)[1:])) is None
    parse_address(args.listen)
    assert args.advertise_host == env["P2PNODE_ADVERTISE_HOST"]
    assert args.log_json

    # The data directory is the one `init` filled, and the service may write it.
    data_dir = machine.path(args.data_dir)
    assert data_dir == machine.users[unit_value(unit, "User")]
    assert args.data_dir in unit_value(unit, "ReadWritePaths").split()
    key = data_dir / "identity.key"
    assert key.stat().st_mode & 0o777 == 0o600
    load_identity(key)
    assert json.loads((data_dir / "card.json").read_text())["id"] == "bootstrap-1"

    # The bootstrap list is installed where the command line reads it, and parses.
    addresses = read_bootstrap_file(machine.path(args.bootstrap_file))
    assert addresses and all(parse_address(a) for a in addresses)

    # "Checking it" uses the installed executable and the same data directory.
    check = check_block()
    assert check[:3] == ["sudo", "-u", unit_value(unit, "User")]
    assert check[3] == argv[0]
    status = build_parser().parse_args(check[4:])
    assert status.command == "status" and status.data_dir == args.data_dir


async def test_the_control_socket_answers_while_the_node_joins(tmp_path: Path) -> None:
    """A bootstrap peer that accepts TCP and never answers the handshake keeps the
    node joining; `status` works meanwhile."""
    assert main(["--data-dir", str(tmp_path), "init"]) == 0
    with trio.socket.socket() as silent:
        await silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(tmp_path), "run",
                "--bootstrap", bootstrap, "--log-level", "WARNING"]  # fmt: skip
        process = await trio.lowlevel.open_process(argv, stdout=-1, stderr=-1, stdin=-3)
        try:
            with trio.fail_after(30):
                peer, _ = await silent.accept()  # the node is joining now
                with peer:
                    status = None
                    while status is None:
                        try:
                            status = await control_call(tmp_path / "control.sock", {"op": "status"})
                        except Exception:
                            await trio.sleep(0.05)
                    assert status["peerId"] == str(load_identity(tmp_path / "identity.key").peer_id)
                    assert process.returncode is None
        finally:
            process.terminate()
            with trio.fail_after(10):
                await process.wait()
            assert process.stdout is not None
            out = b"".join([chunk async for chunk in process.stdout])
            # It never finished joining: no ready line, and no traceback on the way out.
            assert b'"ready"' not in out
            if process.stderr is not None:
                assert b"Traceback" not in b"".join([chunk async for chunk in process.stderr])
