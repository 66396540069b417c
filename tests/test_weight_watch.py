"""`weight_watch`: the content hash that decides whether a copy of an expert's weights is current
sees every write, structured ones included; the host-only write marks see what they claim."""
import numpy as np
import pytest
import torch

from deepspeed_feplb.weight_watch import HASH_PRIME, _weights, content_hash, write_marks


def flip_lowest_bit(p):  # the smallest write there is
    p.data.view(-1)[3:4].view({2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]).bitwise_xor_(1)


def scale_a_block(p):
    """x2 and x1/2 on a 2x2 block's diagonals: its row and column sums of bit patterns stay put (the
    exponent moves by +1 and -1), which the row/column-sum fingerprint before missed every time."""
    block = p.data.reshape(p.shape[0], -1)[2:4, 0:2]
    block.mul_(torch.tensor([[2.0, 0.5], [0.5, 2.0]], dtype=p.dtype))


WRITES = {"p.data.mul_": lambda p: p.data.mul_(0.98), "no_grad copy_": lambda p: p.copy_(p * 1.01),
          "rows swapped": lambda p: p.data.copy_(p.data.flip(0)),
          "columns swapped": lambda p: p.data.copy_(p.data.flip(-1)),
          "one element's lowest bit": flip_lowest_bit, "a 2x2 block scaled x2 and /2": scale_a_block,
          "two elements exchanged": lambda p: p.data.view(-1).index_copy_(0, torch.tensor([0, 5]),
                                                                          p.data.view(-1)[[5, 0]]),
          "sign flipped": lambda p: p.data.neg_()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_content_hash_sees_every_write(dtype):
    torch.manual_seed(0)
    params = [torch.randn(8, 4).to(dtype), torch.randn(8, 2).to(dtype) + 3, torch.randn(6, 2, 2).to(dtype)]
    for name, write in WRITES.items():
        for p in params:
            before = content_hash(params)
            with torch.no_grad():
                write(p)
            assert not torch.equal(content_hash(params), before), f"{name} on a {tuple(p.shape)} {dtype} went unseen"
    assert torch.equal(content_hash(params), content_hash([p.clone() for p in params])), "equal content, other hash"


def test_the_content_hash_is_the_bilinear_form_mod_the_prime():
    """Each parameter's two hashes are ``r^T B c mod P`` of its bit patterns as residues (module
    docstring), computed here with Python's exact integers; more rows than one pass holds."""
    from deepspeed_feplb import weight_watch
    torch.manual_seed(1)
    p = torch.randn(40, 3)
    bits = [[int(v) % HASH_PRIME for v in row] for row in p.view(torch.int32).tolist()]
    r, c = _weights(40, 0, torch.device("cpu")).tolist(), _weights(3, 1, torch.device("cpu")).tolist()
    want = [sum(r[h][i] * bits[i][j] * c[h][j] for i in range(40) for j in range(3)) % HASH_PRIME for h in range(2)]
    chunk, weight_watch._CHUNK = weight_watch._CHUNK, 7  # 2 rows a pass: 20 passes
    try:
        assert content_hash([p]).tolist() == want
    finally:
        weight_watch._CHUNK = chunk
    assert content_hash([p]).tolist() == want
    assert 0 <= min(want) and max(want) < HASH_PRIME


def test_the_hash_weights_are_the_same_in_every_process():
    """A home's hash compares with a holder's: the weights depend on the shape alone."""
    import subprocess
    import sys
    code = ("from deepspeed_feplb.weight_watch import _weights; import torch; "
            "print(_weights(5, 1, torch.device('cpu')).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(_weights(5, 1, torch.device("cpu")).tolist())
    assert not np.array_equal(_weights(5, 0, torch.device("cpu")), _weights(5, 1, torch.device("cpu")))


def test_write_marks_see_in_place_writes_and_replaced_data_but_not_writes_through_data():
    p = torch.nn.Parameter(torch.randn(4, 3))
    marks = write_marks([p])
    p.data.mul_(2.0)  # the one write they miss (`weights_changed` declares it)
    assert write_marks([p]) == marks
    with torch.no_grad():
        p[0, 0] += 0.05
    assert write_marks([p]) != marks
    marks = write_marks([p])
    p.data = torch.randn(4, 3)
    assert write_marks([p]) != marks
    marks = write_marks([p])
    with torch.no_grad():
        p.detach()[1].zero_()  # through a view or a detached alias: the same counter
    assert write_marks([p]) != marks
    marks = write_marks([p])
    torch.nn.Linear(3, 4).load_state_dict({"weight": torch.zeros(4, 3), "bias": torch.zeros(4)})
    module = torch.nn.Linear(3, 4)
    marks = write_marks(list(module.parameters()))
    module.load_state_dict({"weight": torch.zeros(4, 3), "bias": torch.zeros(4)})
    assert write_marks(list(module.parameters())) != marks
