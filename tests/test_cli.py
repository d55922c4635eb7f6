"""The command line: init, id, card show/validate/sign/export."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import trio

from p2pnode.cli.datalock import hold_data_dir
from p2pnode.cli.main import build_parser, main
from p2pnode.cli.process import NodeProcess
from p2pnode.core.card import AgentCard
from p2pnode.core.cardfile import card_from_template
from p2pnode.core.identity import load_identity


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def home(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    code, out, _ = run(
        capsys, "--data-dir", str(tmp_path), "init", "--agent-id", "sun", "--tier", "0"
    )
    assert code == 0
    assert "peer id" in out
    return tmp_path


def test_init_creates_identity_and_card_and_refuses_to_overwrite(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (home / "identity.key").stat().st_mode & 0o777 == 0o600
    template = json.loads((home / "card.json").read_text())
    assert template["id"] == "sun" and template["tier"] == 0
    code, _, err = run(capsys, "--data-dir", str(home), "init")
    assert code == 1
    assert "--force" in err
    code, out, _ = run(capsys, "--data-dir", str(home), "init", "--force")
    assert code == 0
    assert out.splitlines()[0].startswith(f"moved the previous identity and its state to {home}")


def test_id_and_card_show_agree(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, peer_id, _ = run(capsys, "--data-dir", str(home), "id")
    code, out, _ = run(capsys, "--data-dir", str(home), "card", "show")
    assert code == 0
    card = AgentCard.from_json_untrusted(out)
    assert card.is_signed_by_owner()
    assert str(card.peer_id) == peer_id.strip()
    _, out, _ = run(capsys, "--data-dir", str(home), "id", "--json")
    assert json.loads(out)["peerId"] == peer_id.strip()


def test_sign_then_validate(home: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    signed = tmp_path / "signed.json"
    code, _, _ = run(capsys, "--data-dir", str(home), "card", "sign", "-o", str(signed))
    assert code == 0
    code, out, _ = run(capsys, "card", "validate", str(signed))
    assert code == 0 and "valid signed card" in out
    data = json.loads(signed.read_text())
    data["tier"] = 1
    signed.write_text(json.dumps(data))
    code, _, err = run(capsys, "card", "validate", str(signed))
    assert code == 1 and "INVALID_SIGNATURE" in err


def test_validate_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"id": "no spaces allowed", "tier": 9, "capabilities": [{}]}))
    code, _, err = run(capsys, "card", "validate", str(bad))
    assert code == 1
    for needle in ("id:", "name: required", "version: required", "tier:", "capabilities[0]"):
        assert needle in err
    bad.write_text("{not json")
    code, _, err = run(capsys, "card", "validate", str(bad))
    assert code == 1 and "invalid JSON" in err
    code, _, err = run(capsys, "card", "validate", str(tmp_path / "missing.json"))
    assert code == 1 and "cannot read" in err


def test_export_a2a(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--data-dir", str(home), "card", "export", "--a2a")
    assert code == 0
    doc = json.loads(out)
    assert doc["skills"][0]["id"] == "echo"
    assert doc["signatures"]
    code, _, err = run(capsys, "--data-dir", str(home), "card", "export")
    assert code == 1 and "--a2a" in err


def test_commands_without_identity_fail_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path), "id")
    assert code == 1 and "p2pnode init" in err


def test_world_readable_key_is_refused(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.chmod(home / "identity.key", 0o644)
    code, _, err = run(capsys, "--data-dir", str(home), "id")
    assert code == 1 and "KEY_FILE_ERROR" in err


@pytest.mark.slow
def test_help_runs_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "p2pnode", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "init" in result.stdout and "card" in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "p2pnode", "frobnicate"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2


@pytest.mark.slow
def test_global_options_are_accepted_after_the_subcommand(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, before, _ = run(capsys, "--data-dir", str(home), "id")
    code, after, _ = run(capsys, "id", "--data-dir", str(home))
    assert code == 0 and after == before
    # Given in both places, the one after the subcommand wins; given before only, it holds.
    code, after, _ = run(
        capsys, "--data-dir", str(tmp_path / "none"), "id", "--data-dir", str(home)
    )
    assert code == 0 and after == before
    code, _, _ = run(capsys, "--data-dir", str(home), "card", "show")
    assert code == 0
    code, _, err = run(capsys, "card", "show", "--data-dir", str(home))
    assert code == 0, err
    # Every command and subcommand takes it (parsed only: these would dial a daemon).
    for argv in (["status"], ["find", "x"], ["send", "x"], ["doc", "read", "d"], ["run"]):
        args = build_parser().parse_args([*argv, "--data-dir", "D"])
        assert args.data_dir == "D", argv


def test_init_gives_each_node_its_own_default_agent_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = []
    for name in ("one", "two"):
        code, out, _ = run(capsys, "--data-dir", str(tmp_path / name), "init")
        assert code == 0
        peer_id = out.split()[2]
        agent_id = json.loads((tmp_path / name / "card.json").read_text())["id"]
        assert agent_id == f"agent-{peer_id[:6]}"
        ids.append(agent_id)
    assert ids[0] != ids[1]


def test_init_force_moves_the_old_identity_and_its_state_aside(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What a daemon of the old identity left: state bound to its peer id.
    for name in ("routing.snapshot", "crdt.sqlite3", "crdt.sqlite3-wal", "crdt-subscriptions.json"):
        (home / name).write_bytes(b"old")
    old_key = (home / "identity.key").read_bytes()
    code, out, _ = run(capsys, "--data-dir", str(home), "init", "--force")
    assert code == 0
    [folder] = [p for p in home.iterdir() if p.name.startswith("replaced-")]
    assert out.splitlines()[0] == f"moved the previous identity and its state to {folder}"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in folder.iterdir()) == [
        "card.json", "crdt-subscriptions.json", "crdt.sqlite3", "crdt.sqlite3-wal",
        "identity.key", "routing.snapshot",
    ]  # fmt: skip
    assert (folder / "identity.key").read_bytes() == old_key
    assert (home / "identity.key").read_bytes() != old_key
    assert not (home / "crdt.sqlite3").exists() and not (home / "routing.snapshot").exists()
    # A second --force keeps the first folder and makes another.
    code, _, _ = run(capsys, "--data-dir", str(home), "init", "--force")
    assert code == 0
    assert len([p for p in home.iterdir() if p.name.startswith("replaced-")]) == 2


def test_init_force_refuses_while_a_daemon_holds_the_directory(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old_key = (home / "identity.key").read_bytes()
    with hold_data_dir(home, home / "control.sock"):
        code, _, err = run(capsys, "--data-dir", str(home), "init", "--force")
    assert code == 1 and "BUSY" in err
    assert (home / "identity.key").read_bytes() == old_key
    assert not [p for p in home.iterdir() if p.name.startswith("replaced-")]


@pytest.mark.slow
async def test_a_node_runs_after_init_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data-dir", str(tmp_path), "init"]) == 0
    node = NodeProcess(tmp_path)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            try:
                await node.start(nursery, None)
                await node.call({"op": "doc.subscribe", "doc": "plan"})
                await node.stop()
                assert main(["--data-dir", str(tmp_path), "init", "--force"]) == 0
                new_id = capsys.readouterr().out.split("peer id")[-1].split()[0]
                await node.start(nursery, None)
                status = await node.call({"op": "status"})
                assert status["peerId"] == new_id
            finally:
                await node.stop()


def test_card_show_gives_the_revision_a_node_publishes(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "--data-dir", str(home), "card", "show")
    assert code == 0
    card = AgentCard.from_json_untrusted(out)
    # docs/protocol/data-model.md: a card is issued at revision = its issue time (ms).
    assert card.revision == card.issued_at > 0


def test_a_signed_card_file_gets_the_publishing_nodes_addresses(
    home: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    signed = tmp_path / "signed.json"
    assert main(["--data-dir", str(home), "card", "sign", "-o", str(signed)]) == 0
    identity = load_identity(home / "identity.key")
    data = json.loads(signed.read_text())
    original = AgentCard.from_dict(data)
    assert original.addresses == ()
    # Shown or exported, a signed file is what it holds.
    assert card_from_template(data, identity, original.issued_at + 5) == original
    # Published by a node, it carries the node's addresses and key, re-issued and re-signed.
    now = original.issued_at + 60_000
    card = card_from_template(
        data, identity, now, revision=now, addresses=("127.0.0.1:7400",), noise_static_key=b"k" * 32
    )
    card.verify()
    assert card.addresses == ("127.0.0.1:7400",) and card.noise_static_key == b"k" * 32
    assert (card.issued_at, card.revision) == (now, now)
    assert card.expires_at - card.issued_at == original.expires_at - original.issued_at


@pytest.mark.slow
async def test_run_with_a_signed_card_publishes_its_address(tmp_path: Path) -> None:
    home, other = tmp_path / "home", tmp_path / "other"
    assert main(["--data-dir", str(home), "init", "--agent-id", "signed-one"]) == 0
    signed = tmp_path / "signed.json"
    assert main(["--data-dir", str(home), "card", "sign", "-o", str(signed)]) == 0
    node, peer = NodeProcess(home), NodeProcess(other)
    peer.prepare("asker", 3)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            try:
                await node.start(nursery, None, run_args=["--card", str(signed)])
                await peer.start(nursery, node.address)
                found = await peer.call({"op": "find", "capability": "echo"})
                [mine] = [c for c in found if c["id"] == "signed-one"]
                assert mine["addresses"] == [node.address]
            finally:
                await node.stop()
                await peer.stop()


def test_export_a2a_url_names_the_nodes_address(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, peer_id, _ = run(capsys, "--data-dir", str(home), "id")
    code, out, _ = run(
        capsys, "--data-dir", str(home), "card", "export", "--a2a", "--address", "127.0.0.1:7400"
    )
    assert code == 0
    [interface] = json.loads(out)["supportedInterfaces"]
    assert interface["url"] == f"p2pnode://127.0.0.1:7400/{peer_id.strip()}/sun"
    assert interface["protocolBinding"] == "P2PNODE-NOISE"
    code, _, err = run(
        capsys, "--data-dir", str(home), "card", "export", "--a2a", "--address", "nowhere"
    )
    assert code == 1 and "not a host:port" in err


@pytest.mark.slow
async def test_export_a2a_asks_the_running_node_for_its_address(tmp_path: Path) -> None:
    assert main(["--data-dir", str(tmp_path), "init", "--agent-id", "sun"]) == 0
    node = NodeProcess(tmp_path)
    out, err = io.StringIO(), io.StringIO()

    def export() -> int:
        # The command only asks the daemon's control socket: it runs here, in a thread
        # (it runs its own trio loop); the daemon is a real process.
        with redirect_stdout(out), redirect_stderr(err):
            return main(["--data-dir", str(tmp_path), "card", "export", "--a2a"])

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            try:
                await node.start(nursery, None)
                code = await trio.to_thread.run_sync(export)
            finally:
                await node.stop()
    assert code == 0
    [interface] = json.loads(out.getvalue())["supportedInterfaces"]
    assert interface["url"].startswith(f"p2pnode://{node.address}/")
    assert err.getvalue() == ""
