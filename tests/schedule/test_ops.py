"""Schedule ops: the compact text form (``F1.3``, ``SEND_F1.3>2``, ``GRAD_SYNC1``) and its parser."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pipemesh.schedule import B, F, Op, OpKind, format_ops, parse_op

SENDS = (OpKind.SEND_FORWARD, OpKind.SEND_BACKWARD)
RECVS = (OpKind.RECV_FORWARD, OpKind.RECV_BACKWARD)

# One canonical example per kind, with its text form.
EXAMPLES = [
    (Op(OpKind.FORWARD, 1, 3), "F1.3"),
    (Op(OpKind.BACKWARD, 0, 7), "B0.7"),
    (Op(OpKind.RECV_FORWARD, 1, 3, 0), "RECV_F1.3<0"),
    (Op(OpKind.SEND_FORWARD, 1, 3, 2), "SEND_F1.3>2"),
    (Op(OpKind.RECV_BACKWARD, 2, 11, 3), "RECV_B2.11<3"),
    (Op(OpKind.SEND_BACKWARD, 0, 0, 1), "SEND_B0.0>1"),
    (Op(OpKind.PARAM_SYNC, 2), "PARAM_SYNC2"),
    (Op(OpKind.GRAD_SYNC, 1), "GRAD_SYNC1"),
    (Op(OpKind.OFFLOAD, 1, 3), "OFFLOAD1.3"),
    (Op(OpKind.RELOAD, 0, 7), "RELOAD0.7"),
    (Op(OpKind.GATHER, 1, 0), "GATHER1.0"),
    (Op(OpKind.RELEASE, 1, 2), "RELEASE1.2"),
    (Op(OpKind.REDUCE, 0, 1), "REDUCE0.1"),
]


def test_examples_cover_every_kind():
    """The example table exercises every OpKind."""
    assert {op.kind for op, _ in EXAMPLES} == set(OpKind)


@pytest.mark.parametrize("op,text", EXAMPLES, ids=[t for _, t in EXAMPLES])
def test_text_form(op, text):
    """str(op) is the documented text form and parse_op inverts it."""
    assert str(op) == text
    assert parse_op(text) == op
    assert parse_op(f"  {text}\n") == op  # surrounding whitespace is ignored


@st.composite
def ops(draw):
    kind = draw(st.sampled_from(list(OpKind)))
    chunk = draw(st.integers(0, 99))
    if kind.is_dp:
        return Op(kind, chunk)
    mb = draw(st.integers(0, 9999))
    peer = draw(st.integers(0, 63)) if kind.is_p2p else None
    return Op(kind, chunk, mb, peer)


@settings(max_examples=100, deadline=None)
@given(ops())
def test_round_trip_any_op(op):
    """parse_op(str(op)) == op for every kind, chunk, micro-batch and peer."""
    text = str(op)
    assert parse_op(text) == op
    if op.kind in SENDS:
        assert f">{op.peer}" in text
    if op.kind in RECVS:
        assert f"<{op.peer}" in text


def test_constructors_and_compute_link():
    """F()/B() build compute ops; p2p ops point back at the compute op they serve."""
    assert F(1, 2) == Op(OpKind.FORWARD, 1, 2) and B(0, 5) == Op(OpKind.BACKWARD, 0, 5)
    assert parse_op("SEND_F1.3>2").compute == F(1, 3)
    assert parse_op("RECV_F1.3<0").compute == F(1, 3)
    assert parse_op("RECV_B0.4<1").compute == B(0, 4)
    assert parse_op("SEND_B0.4>3").compute == B(0, 4)
    assert F(0, 0).compute == F(0, 0)
    assert parse_op("OFFLOAD1.3").compute == F(1, 3)  # the forward that saved the activations
    assert parse_op("RELOAD1.3").compute == B(1, 3)  # the backward that needs them
    with pytest.raises(ValueError, match="only sends"):
        parse_op("OFFLOAD1.3>2")
    with pytest.raises(ValueError):
        _ = parse_op("GRAD_SYNC1").compute


def test_kind_predicates():
    """Each kind is exactly one of compute, p2p, data-parallel, host copy or sharding."""
    for kind in OpKind:
        assert [kind.is_compute, kind.is_p2p, kind.is_dp, kind.is_host, kind.is_shard].count(True) == 1, kind


def test_format_ops_marks_one_step():
    """format_ops joins with spaces and brackets the marked index (used in error messages)."""
    program = [F(0, 0), F(0, 1), B(0, 0)]
    assert format_ops(program) == "F0.0 F0.1 B0.0"
    assert format_ops(program, mark=1) == "F0.0 [F0.1] B0.0"
    assert [parse_op(t) for t in format_ops(program).split()] == program


@pytest.mark.parametrize("text", [
    "", "X1.2", "f1.2", "F", "F1", "B0", "F1.", "F.3", "F-1.2", "F1.-2", "F1.2.3", "F 1.2",
    "SEND_F1", "RECV_B0", "F1.2>", "F1.2<x", "SEND_F1.3>>2", "PARAM_SYNC", "GRAD_SYNC1.2", "PARAM_SYNC0.0",
    "F1.3 B0.0",
])
def test_parse_errors(text):
    """Malformed text raises ValueError that quotes the input."""
    with pytest.raises(ValueError) as info:
        parse_op(text)
    assert repr(text) in str(info.value)
