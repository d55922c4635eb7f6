"""A2A version negotiation at the gateway (docs/protocol/a2a.md §1 "Version"): a request
naming a version other than 1.0 in ``A2A-Version`` gets the spec's VersionNotSupported on
both bindings, one of 1.0 (any patch) is served, and the card is served to every version.
GetExtendedAgentCard, which the cards do not offer, is refused as the spec says."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.bridges.a2a.gateway import SERVED_VERSION, unserved_version
from tests.test_a2a_push import run, served


def _rpc(method: str, params: dict[str, Any], request_id: Any = 7) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}


@given(st.integers(0, 999), st.integers(0, 999), st.none() | st.integers(0, 999))
def test_only_1_0_with_any_patch_is_served(major: int, minor: int, patch: int | None) -> None:
    text = f"{major}.{minor}" + ("" if patch is None else f".{patch}")
    refused = unserved_version([(b"a2a-version", text.encode())])
    assert (refused is None) == ((major, minor) == SERVED_VERSION)
    assert refused in (None, text)


@given(st.binary(max_size=16))
def test_a_header_that_is_no_version_is_left_to_the_sdk(value: bytes) -> None:
    refused = unserved_version([(b"a2a-version", value)])
    assert refused is None or refused.count(".") in (1, 2)
    assert unserved_version([]) is None


@pytest.mark.slow
def test_versions_other_than_1_0_get_version_not_supported_on_both_bindings() -> None:
    async def main() -> None:
        async with served() as s:
            base = f"{s.url}/agents/worker"
            get_task = _rpc("GetTask", {"id": "no-such-task"})
            for version, code in [("1.1", -32009), ("2.0", -32009), ("0.3", -32009),
                                  ("1.0", -32001), ("1.0.7", -32001)]:  # fmt: skip
                answer = await s.http.post(
                    f"{base}/jsonrpc", json=get_task, headers={"A2A-Version": version}
                )
                assert answer.status_code == 200
                body = answer.json()
                assert body["id"] == 7 and body["error"]["code"] == code, (version, body)
            answer = await s.http.post(f"{base}/jsonrpc", json=get_task)  # no header: 0.3
            assert answer.json()["error"]["code"] == -32009
            for version, status in [("1.1", 400), ("3.0", 400), ("1.0", 404)]:
                answer = await s.http.get(
                    f"{base}/rest/tasks/no-such-task", headers={"A2A-Version": version}
                )
                assert answer.status_code == status, (version, answer.text)
                if status == 400:
                    assert answer.json()["error"]["details"][0]["reason"] == (
                        "VERSION_NOT_SUPPORTED"
                    )
            card = await s.http.get(
                f"{base}/.well-known/agent-card.json", headers={"A2A-Version": "1.1"}
            )
            assert card.status_code == 200 and "extendedAgentCard" not in card.json().get(
                "capabilities", {}
            )
            extended = await s.http.post(
                f"{base}/jsonrpc", json=_rpc("GetExtendedAgentCard", {}),
                headers={"A2A-Version": "1.0"},
            )  # fmt: skip
            assert extended.json()["error"]["code"] == -32004  # UnsupportedOperation
            extended = await s.http.get(
                f"{base}/rest/extendedAgentCard", headers={"A2A-Version": "1.0"}
            )
            assert extended.status_code == 400
            assert extended.json()["error"]["details"][0]["reason"] == "UNSUPPORTED_OPERATION"

    run(main)
