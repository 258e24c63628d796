"""The static shunts' overlap check (config/static.py `_Seen`) finds exactly what comparing
every pair of flows finds: an index that answers in a few lookups is held equal to the
plain definition (StaticFlow.overlaps) on random configs, host pairs and prefixes, any
ports or given ones, both families, VLAN entries (tags, priorities, address-less ones)."""
from __future__ import annotations

import ipaddress

from hypothesis import given, settings
from hypothesis import strategies as st

from nfshunt.config.static import StaticFlow, StaticShunt, _Seen, flows_of
from nfshunt.records.model import TCP, UDP

# Few distinct values, so that overlaps are common.
V4 = [ipaddress.ip_network(n) for n in ("10.0.0.0/24", "10.0.0.0/25", "10.0.0.128/25", "10.0.0.1/32",
                                         "10.0.0.2/32", "10.0.0.200/32", "10.0.1.0/24", "10.0.1.9/32")]
V6 = [ipaddress.ip_network(n) for n in ("2001:db8::/64", "2001:db8::1/128", "2001:db8::2/128",
                                         "2001:db8:0:1::/64", "2001:db8:0:1::7/128")]
PORTS = st.one_of(st.none(), st.sampled_from([53, 80, 5201]))


@st.composite
def shunts(draw: st.DrawFn, tagged: bool = False) -> StaticShunt:
    nets = draw(st.sampled_from([V4, V6]))
    vlan = draw(st.sampled_from([None, 30, 100])) if tagged else None
    pcp = draw(st.sampled_from([None, 5, 6])) if vlan is not None else None
    ports = draw(st.sampled_from([(1, 3), (3, 1), (1, 5)]))
    if pcp is not None and draw(st.booleans()):  # a VLAN priority's every frame
        return StaticShunt(None, None, None, ports, both_directions=draw(st.booleans()), vlan=vlan, pcp=pcp)
    return StaticShunt(protocol=draw(st.sampled_from([TCP, UDP])), src=draw(st.sampled_from(nets)),
                       dst=draw(st.sampled_from(nets)), fast_ports=ports,
                       src_port=draw(PORTS), dst_port=draw(PORTS), both_directions=draw(st.booleans()), vlan=vlan,
                       pcp=pcp)


def _flows(entries: list[StaticShunt]) -> list[StaticFlow]:
    """Each entry's flows, a VLAN's tagged with its id on both sides (its zone too)."""
    return [f for shunt in entries for f in flows_of(shunt, 33050, 0, (shunt.vlan or 0,) * 3)]


def _first_overlap(flows: list[StaticFlow]) -> tuple[int, int] | None:
    """Pairwise, as the definition says: (new, earlier) of the first flow that overlaps an earlier one."""
    for i, flow in enumerate(flows):
        for j in range(i):
            if flow.overlaps(flows[j]):
                return i, j
    return None


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.lists(shunts(), min_size=1, max_size=12), st.lists(shunts(tagged=True), min_size=1, max_size=12)))
def test_the_index_finds_an_overlap_exactly_when_a_pairwise_comparison_does(entries: list[StaticShunt]):
    flows = _flows(entries)
    seen = _Seen()
    first = None
    for i, flow in enumerate(flows):
        hit = seen.overlapping(str(i), flow)
        if hit is not None:
            first = i, int(hit[0])
            break
    expected = _first_overlap(flows)
    assert (first is None) == (expected is None)
    if first is not None:
        assert first[0] == expected[0]  # the same new flow is refused
        assert flows[first[0]].overlaps(flows[first[1]])  # and what it names does overlap it
