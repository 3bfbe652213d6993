"""The side channel answers vLLM's decode handshake and survives garbage (loopback 18640-18659)."""

import time

import msgspec
import pytest
import zmq

from service.kv_transfer.side_channel import SideChannel, SideChannelError
from service.kv_transfer.wire import GET_META_MSG

REQUEST = msgspec.msgpack.encode((GET_META_MSG, 0, 0))


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def channel():
    payloads = [b"payload-1"]
    ch = SideChannel("127.0.0.1", 18641, lambda: payloads[-1])
    ch.start()
    yield ch, payloads
    ch.close()


def vllm_handshake(ctx: zmq.Context, port: int) -> list[bytes]:
    """As vLLM 0.32's decode asks (nixl/base_worker.py): a REQ, one frame, 5 s receive timeout."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.send(REQUEST)
    try:
        return sock.recv_multipart()
    finally:
        sock.close()


def wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_answers_vllm_request_with_current_payload(ctx, channel):
    ch, payloads = channel
    payload, ts = vllm_handshake(ctx, 18641)
    assert payload == b"payload-1" and isinstance(msgspec.msgpack.decode(ts), float)
    payloads.append(b"payload-2")  # the agent metadata changed: the next handshake sees it
    assert vllm_handshake(ctx, 18641)[0] == b"payload-2"
    assert (ch.served, ch.refused) == (2, 0)


def test_garbage_is_refused_and_the_next_request_answered(ctx, channel):
    ch, _ = channel
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect("tcp://127.0.0.1:18641")
    bad = [[b"", b"junk"], [b"", REQUEST, b"extra"], [REQUEST], [b"", REQUEST[:-1]],
           [b"", msgspec.msgpack.encode((GET_META_MSG, 0, 1))], [b"", REQUEST + b"\x00" * 100]]
    for frames in bad:
        dealer.send_multipart(frames)
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect("tcp://127.0.0.1:18641")
    req.send(msgspec.msgpack.encode(("get_meta_msg", 0, 0)))  # str, not bin: refused
    assert wait_for(lambda: ch.refused == len(bad) + 1)
    huge = ctx.socket(zmq.DEALER)
    huge.setsockopt(zmq.LINGER, 0)
    huge.connect("tcp://127.0.0.1:18641")
    huge.send_multipart([b"", b"\x00" * (1 << 20)])  # over zmq's frame limit: the peer is dropped
    time.sleep(0.2)
    assert vllm_handshake(ctx, 18641)[0] == b"payload-1"
    assert dealer.poll(100) == 0 and req.poll(100) == 0  # nothing answered the garbage
    assert ch._thread.is_alive() and (ch.served, ch.refused) == (1, len(bad) + 1)
    for s in (dealer, req, huge):
        s.close()


def test_a_failing_payload_does_not_stop_the_thread(ctx):
    calls = []

    def payload() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("metadata not ready")
        return b"ok"

    ch = SideChannel("127.0.0.1", 18642, payload)
    ch.start()
    try:
        with pytest.raises(zmq.Again):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 500)
            sock.connect("tcp://127.0.0.1:18642")
            sock.send(REQUEST)
            sock.recv_multipart()
        assert vllm_handshake(ctx, 18642)[0] == b"ok"
    finally:
        ch.close()


def test_taken_port_is_a_typed_error(channel):
    other = SideChannel("127.0.0.1", 18641, lambda: b"")
    with pytest.raises(SideChannelError) as e:
        other.start()
    message = str(e.value)
    assert "\n" not in message and "tcp://127.0.0.1:18641" in message and "in use" in message
    other.close()


def test_close_stops_the_thread_and_frees_the_port():
    ch = SideChannel("127.0.0.1", 18643, lambda: b"")
    ch.start()
    thread = ch._thread
    ch.close()
    assert not thread.is_alive()
    again = SideChannel("127.0.0.1", 18643, lambda: b"")
    again.start()
    again.close()
