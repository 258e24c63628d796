import pytest

from nfshunt.records import markcodec as m


def test_layout_is_bit_exact():
    assert m.encode(ingress=1, egress=2, action=1) == 0x71210000
    assert m.ingress_xmark(3) == (0x43000000, 0x4F000000)
    assert m.egress_xmark(15) == (0x20F00000, 0x20F00000)
    assert m.action_xmark(1) == (0x10010000, 0x100F0000)  # shunt, as in the original rules
    assert m.action_xmark(2) == (0x10020000, 0x100F0000)  # block


def test_decode_reads_fields_only_when_flagged():
    assert m.decode(0x0F000000) == m.Mark(None, None, None)  # numbers without flags mean nothing
    assert m.decode(0x41000000) == m.Mark(1, None, None)
    mark = m.decode(0x71210000)
    assert (mark.ingress, mark.egress, mark.action, mark.complete) == (1, 2, 1, True)
    assert not m.decode(0x61200000).complete  # no policy decision yet


def test_admin_low_bits_are_kept_apart():
    value = m.encode(1, 2, 1, admin=0xBEEF)
    assert value & 0xFFFF == 0xBEEF
    assert m.decode(value) == m.decode(value & m.NFSHUNT_BITS)


@pytest.mark.parametrize("ingress,egress,action", [(1, 15, 0), (15, 1, 15), (7, 9, 2)])
def test_round_trip(ingress, egress, action):
    d = m.decode(m.encode(ingress, egress, action))
    assert (d.ingress, d.egress, d.action) == (ingress, egress, action)


def test_out_of_range_is_rejected():
    with pytest.raises(ValueError):
        m.ingress_xmark(0)
    with pytest.raises(ValueError):
        m.egress_xmark(16)
    with pytest.raises(ValueError):
        m.action_xmark(16)
