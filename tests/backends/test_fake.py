"""The test hooks of ``FakeBackend`` that the master's tests rely on (its behaviour as a backend
is checked by the contract suite, test_contract.py)."""

from __future__ import annotations

import pytest

from tidal.backends.api import NodeExit, NodeHandle, NodeSpec
from tidal.backends.fake import FakeBackend


def spec(node_id: str) -> NodeSpec:
    return NodeSpec(node_id, "worker", ["python", "train.py"], env={"RANK": node_id})


def test_pids_count_from_10000_with_create_time_1() -> None:
    backend = FakeBackend()
    backend.launch([spec("worker-0"), spec("worker-1")], "r1")
    backend.launch([spec("ps-0")], "r2")
    assert backend.poll().running == {"worker-0": NodeHandle("worker-0", 10_000, 1.0),
                                      "worker-1": NodeHandle("worker-1", 10_001, 1.0),
                                      "ps-0": NodeHandle("ps-0", 10_002, 1.0)}
    assert backend.launched == [spec("worker-0"), spec("worker-1"), spec("ps-0")]


def test_refused_launches_are_errors_and_not_launched() -> None:
    backend = FakeBackend()
    backend.refuse, backend.refuse_retryable = "no room", True
    backend.launch([spec("worker-0"), spec("worker-1")], "r1")
    state = backend.poll()
    assert [(e.node_id, e.message, e.retryable) for e in state.errors] == [
        ("worker-0", "no room", True), ("worker-1", "no room", True)]
    assert backend.launched == [] and state.running == {}
    backend.refuse = None
    backend.launch([spec("worker-0")], "r2")
    assert backend.launched == [spec("worker-0")]


def test_terminated_lists_each_kill_once_in_order() -> None:
    backend = FakeBackend(clock=lambda: 7.0)
    backend.launch([spec("worker-0"), spec("worker-1"), spec("worker-2")], "r1")
    backend.terminate(["worker-2", "worker-0"], "t1")
    backend.terminate(["worker-0", "worker-9"], "t2")
    assert backend.terminated == ["worker-2", "worker-0"]
    state = backend.poll()
    assert state.ended == [NodeExit("worker-2", -9, 7.0), NodeExit("worker-0", -9, 7.0)]
    assert list(state.running) == ["worker-1"]


def test_exit_is_reported_by_the_next_poll_only() -> None:
    backend = FakeBackend(clock=lambda: 3.0)
    backend.launch([spec("worker-0")], "r1")
    backend.exit("worker-0", 1)
    assert backend.poll().ended == [NodeExit("worker-0", 1, 3.0)]
    assert backend.poll().ended == []
    with pytest.raises(ValueError, match="ended already"):
        backend.exit("worker-0", 0)  # a process ends once
    with pytest.raises(ValueError, match="not running"):
        backend.exit("worker-5", 0)


def test_a_restarted_master_on_the_same_instance_keeps_its_nodes() -> None:
    """The master's tests restart the master over one FakeBackend: its nodes stay running."""
    backend = FakeBackend()
    backend.launch([spec("worker-0")], "r1")
    handles = list(backend.poll().running.values())
    backend.adopt(handles, "a1")
    backend.exit("worker-0", 0)
    assert [e.exit_code for e in backend.poll().ended] == [0]
