"""The core process never blocks forever on a send once the API process that reads it is gone."""

from __future__ import annotations

import os

import pytest
import zmq

from hybridserve.engine.core.loop import ApiProcessGone, send_while_parent_lives


def _push_pull(ctx: zmq.Context, tmp_path_str: str) -> tuple[zmq.Socket, zmq.Socket]:
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(f"ipc://{tmp_path_str}/out")
    push.connect(f"ipc://{tmp_path_str}/out")
    return push, pull


def test_a_send_reaches_a_live_reader(tmp_path: pytest.TempPathFactory) -> None:
    ctx = zmq.Context()
    push, pull = _push_pull(ctx, str(tmp_path))
    send_while_parent_lives(push, b"ready", os.getppid())
    assert pull.poll(5000) and pull.recv() == b"ready"
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def test_a_send_to_a_full_queue_with_no_parent_raises_instead_of_blocking() -> None:
    """The API process died mid-run: its queue fills (SNDHWM) and a plain send would then block forever."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1)
    push.connect("ipc:///nonexistent-hybridserve-test/out")  # never a reader
    not_our_parent = os.getppid() + 1
    with pytest.raises(ApiProcessGone):
        for _ in range(16):  # the first messages queue; one more than the queue holds must not block
            send_while_parent_lives(push, b"outputs", not_our_parent)
    push.close(linger=0)
    ctx.term()
