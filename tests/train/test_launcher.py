"""The multi-node launch (tasks/train/launcher.py) without a job: its command, where it listens, what
it refuses. The jobs themselves: tests/train/test_ddp_resume.py (two launchers on one machine) and
tests/hosts/test_ddp_hosts.py (two hosts that share no disk)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from tasks.core.config.params import Params
from tasks.core.errors import ExpectedFailure
from tasks.train.devices import Distributed
from tasks.train.launcher import join, launch_env, node_address, rendezvous_store, torchrun_command
from tests.conftest import free_port


def _params(**train: object) -> Params:
    return Params.model_validate({"train": {"strategy": "ddp", **train}})


def _listening(port: int) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process(os.getpid()).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_every_node_runs_the_same_torchrun_as_a_client_of_the_stages_rendezvous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    params = _params(nnodes=2, nproc_per_node=1, rdzv_endpoint="127.0.0.1:29511")
    cmd = torchrun_command(params, tmp_path)
    assert "--rdzv-endpoint=127.0.0.1:29511" in cmd and "--rdzv-conf=is_host=false" in cmd
    # the node's address towards the endpoint: MASTER_ADDR, and the interface gloo uses
    assert "--local-addr=127.0.0.1" in cmd and node_address("127.0.0.1:29511") == "127.0.0.1"
    env = launch_env(params, tmp_path)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # no agent hosts a store on every interface
    loopback = next(n for n, a in psutil.net_if_addrs().items() if any(x.address == "127.0.0.1" for x in a))
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == loopback


def test_the_rendezvous_store_listens_on_the_endpoints_address_alone() -> None:
    port = free_port()
    with rendezvous_store(f"127.0.0.1:{port}"):
        assert _listening(port) == {"127.0.0.1"}  # torch's TCPStore alone would bind every interface
        with pytest.raises(ExpectedFailure, match=f"127.0.0.1:{port}: cannot listen there"):
            with rendezvous_store(f"127.0.0.1:{port}"):
                pass
    assert _listening(port) == set()


def test_an_endpoint_on_another_machine_is_refused_naming_what_to_run_there() -> None:
    # 192.0.2.1 (TEST-NET-1) is no address of this machine; binding it sends nothing
    with pytest.raises(ExpectedFailure, match=r"192\.0\.2\.1:29512: not an address of this machine.*--join"):
        with rendezvous_store("192.0.2.1:29512"):
            pass


def test_join_refuses_a_one_node_job() -> None:
    with pytest.raises(ExpectedFailure, match="--join: train.nnodes is 1"):
        join(_params(nnodes=1))


def test_a_lone_process_is_its_own_node() -> None:
    alone = Distributed()
    assert alone.one_node and alone.node_leader
    assert alone.broadcast_bytes(b"checkpoint", 0) == b"checkpoint"
    assert not Distributed(rank=1, world_size=2, local_rank=0, backend="gloo", local_world_size=1).one_node
