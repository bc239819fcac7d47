"""The ports a stack picks (stack/state.py): all distinct and free, and SeaweedFS's admin pair where
`weed mini`'s built-in worker looks for it (the gRPC port at the HTTP port + 10000), also for a stack
saved before that rule. The worker reaching the admin server in a running stack: test_team_stack.py."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from stack.state import ADMIN_GRPC_OFFSET, PORTS, open_stack


def test_a_new_stack_has_distinct_ports_and_its_admin_grpc_port_at_the_http_port_plus_the_offset(
    tmp_path: Path,
) -> None:
    for n in range(5):  # five stacks, each picked afresh
        ports = open_stack(tmp_path / f"stack{n}").ports
        assert set(ports) == set(PORTS) and len(set(ports.values())) == len(PORTS)
        assert ports["admin_grpc"] == ports["admin"] + ADMIN_GRPC_OFFSET <= 65535


def test_a_stack_saved_with_another_admin_pair_gets_a_new_pair_and_keeps_its_other_ports(tmp_path: Path) -> None:
    root = tmp_path / "stack"
    made = open_stack(root)
    state = json.loads((root / "state.json").read_text())
    with socket.socket() as sock:  # a port of an older stack's kind: anything but admin + 10000
        sock.bind(("127.0.0.1", 0))
        state["ports"]["admin_grpc"] = sock.getsockname()[1]
    assert state["ports"]["admin_grpc"] != state["ports"]["admin"] + ADMIN_GRPC_OFFSET
    (root / "state.json").write_text(json.dumps(state))

    ports = open_stack(root).ports
    assert ports["admin_grpc"] == ports["admin"] + ADMIN_GRPC_OFFSET
    kept = {name: port for name, port in ports.items() if not name.startswith("admin")}
    assert kept == {name: port for name, port in made.ports.items() if not name.startswith("admin")}
    assert not {ports["admin"], ports["admin_grpc"]} & set(kept.values())
    assert json.loads((root / "state.json").read_text())["ports"] == ports  # saved: picked once
    assert open_stack(root).ports == ports
