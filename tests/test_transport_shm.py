"""The CPU transport (`migrate.shm`) and the phase-2 message layouts (`migrate.messages`): messages
arrive intact, in order and only for their own tag; a message of the wrong length is refused."""
import secrets

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_feplb.migrate import messages
from deepspeed_feplb.migrate.shm import ShmTransport
from deepspeed_feplb.segments import leftover_segments


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 40)), min_size=1, max_size=25))
def test_transport_messages_arrive_intact_in_order(sends):
    """Random senders, receivers and sizes through real shared memory and copy threads (3 local ranks)."""
    name = f"feplb-test-{secrets.token_hex(4)}"
    ranks = [ShmTransport(name, 0, 3, timeout_s=10, create=True)]
    ranks += [ShmTransport(name, r, 3, timeout_s=10, create=False) for r in (1, 2)]
    try:
        for i, (src, dst, rows) in enumerate(sends):
            if src == dst:
                continue
            message = [torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + i,
                       torch.full((2, ), i, dtype=torch.bfloat16), torch.tensor([i], dtype=torch.int64)]
            ranks[src].send(dst, i, message).result(timeout=10)
            got = ranks[dst].recv(src, i)
            assert len(got) == 3 and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, message))
    finally:
        for t in reversed(ranks):
            t.close()
    assert leftover_segments(name) == []


def test_a_message_lands_in_the_receivers_buffers_and_a_wrong_one_is_refused():
    name = f"feplb-test-{secrets.token_hex(4)}"
    a = ShmTransport(name, 0, 2, timeout_s=5, create=True)
    b = ShmTransport(name, 1, 2, timeout_s=5, create=False)
    try:
        message = [torch.arange(12.0).view(3, 4), torch.ones(2, dtype=torch.bfloat16)]
        stacked = torch.zeros(2, 3, 4)
        a.send(1, 0x11, message).result(timeout=5)
        got = b.recv(0, 0x11, lambda found: [stacked[1], torch.empty(found[1][0], dtype=found[1][1])])
        assert got[0].data_ptr() == stacked[1].data_ptr() and torch.equal(stacked[1], message[0])
        assert torch.equal(got[1], message[1]) and not stacked[0].any()
        a.send(1, 0x12, message).result(timeout=5)
        with pytest.raises(RuntimeError, match=r"receive buffer 0 is torch.float32 \(4, 3\) on cpu, the message's "
                                               r"tensor torch.float32 \(3, 4\) on cpu"):
            b.recv(0, 0x12, lambda found: [torch.empty(4, 3), torch.empty(2, dtype=torch.bfloat16)])
    finally:
        b.close()
        a.close()


def test_a_message_of_another_step_is_refused():
    name = f"feplb-test-{secrets.token_hex(4)}"
    a = ShmTransport(name, 0, 2, timeout_s=5, create=True)
    b = ShmTransport(name, 1, 2, timeout_s=5, create=False)
    try:
        a.send(1, tag=0x51, tensors=[torch.ones(2)]).result(timeout=5)
        with pytest.raises(RuntimeError, match="out of step: expected message 0x61 from local rank 0, got 0x51"):
            b.recv(0, tag=0x61)
    finally:
        b.close()
        a.close()


def test_a_layout_packs_and_unpacks_the_same_chunks():
    layout = messages.rows_to_helper([True, False], n_params=2, n_buffers=1)
    w, b, x = [torch.full((1, ), float(i)) for i in range(2)], [torch.ones(1)], torch.zeros(3, 4)
    chunks = [{"weights": w, "buffers": b, "rows": [x]}, {"weights": w, "buffers": b, "rows": [x + 1]}]
    flat = layout.pack(chunks)
    assert len(flat) == 2 + 1 + 1 + 0 + 1 + 1  # the second chunk carries no weights
    back = layout.unpack(flat, "forward rows")
    assert back[1]["weights"] == [] and torch.equal(back[1]["rows"][0], x + 1)
    assert all(a is b for a, b in zip(back[0]["weights"], w))


def test_a_message_of_the_wrong_length_is_refused_naming_it():
    layout = messages.grads_to_home([True, False], n_params=3)
    with pytest.raises(RuntimeError, match="a backward results message holds 4 tensors, its layout 5"):
        layout.unpack([torch.zeros(1)] * 4, "backward results")
    with pytest.raises(ValueError, match="part 'weight_grads': 2 tensors, the layout says 3"):
        layout.pack([{"input_grads": [torch.zeros(1)], "weight_grads": [torch.zeros(1)] * 2},
                     {"input_grads": [torch.zeros(1)], "weight_grads": []}])
