"""The flow builder: real os-ken messages, serialised and parsed back."""
import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from os_ken.ofproto import ofproto_protocol  # noqa: E402

from nfshunt.core import core as c  # noqa: E402
from nfshunt.core import layout  # noqa: E402
from nfshunt.openflow.flows import FlowBuilder  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import OFP10, OFP13, UDP  # noqa: E402
from tests.helpers import config, event  # noqa: E402


def builder(version, templated=False):
    """templated=False: os-ken message objects, whose fields the tests inspect."""
    dp = ofproto_protocol.ProtocolDesc(version)
    fb = FlowBuilder(dp, config(shunt_priority=33000, default_shunt_timeout=12, default_block_timeout=30))
    fb.templated = templated
    return fb


def conn_for(**kw):
    core = c.Core(config())
    core.switch_connected(OFP13)
    core.reconcile([], 0)
    return core.conntrack_event(event(**kw))[0].conn


def test_a_cookie_names_its_kind_connection_and_direction_and_foreign_ones_nothing():
    for kind in cookies.Kind:
        for ct_id, reply in ((0, False), (2**32 - 1, True)):
            assert cookies.parse(cookies.make(kind, ct_id, reply)) == (kind, ct_id, reply)
    assert cookies.parse(cookies.make_teardown(9, True, True)) == (cookies.Kind.TEARDOWN, 9, True)
    for kind in (0, 9, 0xFF):  # ours by the magic byte, of no kind NFShunt makes
        assert cookies.parse(cookies.OWNED_VALUE | kind << 48 | 7) is None
    assert cookies.parse(0x4F02000000000007) is None and cookies.parse(0) is None


@pytest.mark.parametrize("version", [OFP10, OFP13])
def test_shunt_is_two_exact_flows_to_the_peer_fast_port(version):
    fb = builder(version)
    fwd, rev = fb.install(conn_for())[:2]
    for msg in (fwd, rev):
        msg.serialize()  # must be valid on the wire
        assert msg.idle_timeout == 12 and msg.priority == 33000
        assert msg.flags & fb.ofp.OFPFF_SEND_FLOW_REM
    assert cookies.parse(fwd.cookie) == (cookies.Kind.SHUNT, 7, False)
    assert cookies.parse(rev.cookie) == (cookies.Kind.SHUNT, 7, True)
    in_fwd, t_fwd = fb.parse_match(fwd.match)
    in_rev, t_rev = fb.parse_match(rev.match)
    assert (in_fwd, t_fwd.src, t_fwd.dst, t_fwd.sport, t_fwd.dport) == (1, "10.0.0.1", "10.0.0.2", 40000, 5201)
    assert (in_rev, t_rev.src, t_rev.sport) == (3, "10.0.0.2", 5201)
    actions = fwd.actions if version == OFP10 else fwd.instructions[0].actions
    assert [a.port for a in actions] == [3]


@pytest.mark.parametrize("version", [OFP10, OFP13])
def test_block_has_no_actions_and_block_timeout(version):
    fb = builder(version)
    for msg in fb.install(conn_for(action=2, proto=UDP)):
        msg.serialize()
        assert msg.idle_timeout == 30
        assert (msg.actions if version == OFP10 else msg.instructions) == []


def test_ipv6_match_on_openflow13():
    fb = builder(OFP13)
    fwd = fb.install(conn_for(family=6))[0]
    fwd.serialize()
    assert fwd.match["eth_type"] == 0x86DD and fwd.match["ipv6_src"] == "fd00::1"
    assert fb.parse_match(fwd.match)[1].family == 6


def test_ipv6_cannot_be_built_for_openflow10():
    with pytest.raises(ValueError):
        builder(OFP10).install(conn_for(family=6))


@pytest.mark.parametrize("version", [OFP10, OFP13])
def test_defaults_removal_and_requests_serialise(version):
    fb = builder(version)
    msgs = fb.defaults(config().switches[0].ports) + fb.remove(conn_for(), (False, True)) + [
        fb.delete_all(), fb.barrier(), fb.owned_flow_stats_request()]
    for msg in msgs:
        msg.serialize()
    assert len(fb.defaults(config().switches[0].ports)) == 4


def test_tcp_shunt_on_openflow13_gets_catchers_that_forward_and_tell_the_controller():
    fb = builder(OFP13)
    conn = conn_for()
    msgs = fb.install(conn)
    assert len(msgs) == 6
    catchers = msgs[2:]
    for msg in catchers:
        msg.serialize()
        assert msg.priority == 33001 and msg.idle_timeout == 0 and msg.hard_timeout == 0
        assert not msg.flags & fb.ofp.OFPFF_SEND_FLOW_REM
        peer, controller = msg.instructions[0].actions
        # Forwarded in the switch (never re-injected); the controller gets the headers.
        assert peer.port == (3 if msg.match["in_port"] == 1 else 1)
        assert controller.port == fb.ofp.OFPP_CONTROLLER and controller.max_len == 128
    flags = sorted((cookies.parse(m.cookie)[2], cookies.is_rst(m.cookie), m.match["tcp_flags"]) for m in catchers)
    assert flags == [(False, False, (1, 1)), (False, True, (4, 4)), (True, False, (1, 1)), (True, True, (4, 4))]
    # Removing the pair deletes its catchers too, each by its exact cookie (Open vSwitch's
    # cookie index; a masked cookie would scan the table).
    removal = fb.remove(conn, (False, True))
    assert len(removal) == 6
    for msg in removal[2:]:
        msg.serialize()
        assert msg.command == fb.ofp.OFPFC_DELETE and msg.cookie_mask == 0xFFFFFFFFFFFFFFFF
    assert sorted(m.cookie for m in removal[2:]) == sorted(m.cookie for m in catchers)


@pytest.mark.parametrize("kw", [dict(proto=UDP), dict(action=2)])
def test_no_catchers_for_udp_blocks_openflow10_or_when_disabled(kw):
    assert len(builder(OFP13).install(conn_for(**kw))) == 2
    assert len(builder(OFP10).install(conn_for())) == 2
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), config(tcp_teardown=False))
    assert len(fb.install(conn_for())) == 2


def _wire(msgs, xid=77):
    out = []
    for m in msgs:
        m.xid = None
        m.set_xid(xid)
        m.serialize()
        out.append(bytes(m.buf))
    return out


SHAPES = [dict(), dict(proto=UDP), dict(action=2), dict(sport=1, dport=65535, ct_id=2**32 - 1),
          dict(ingress=2, egress=1), dict(family=6), dict(family=6, proto=UDP)]


@pytest.mark.parametrize("version, kw", [(v, kw) for v in (OFP10, OFP13) for kw in SHAPES
                                         if not (v == OFP10 and kw.get("family") == 6)])  # no IPv6 in 1.0
def test_templated_messages_are_byte_for_byte_what_os_ken_builds(version, kw):
    fast, slow = builder(version, templated=True), builder(version, templated=False)
    for sport in (40000, 40001, 7):  # the second and third come from the cached template
        conn = conn_for(**{**kw, "sport": kw.get("sport", sport)})
        assert _wire(fast.install(conn)) == _wire(slow.install(conn))
        assert _wire(fast.remove(conn, (False, True))) == _wire(slow.remove(conn, (False, True)))


@pytest.mark.parametrize("version", [OFP10, OFP13])
def test_shunt_and_block_flows_match_untagged_frames_only(version):
    fb = builder(version)
    for msg in fb.install(conn_for()) + fb.install(conn_for(action=2, proto=UDP)):
        msg.serialize()
        if version == OFP10:
            assert msg.match.dl_vlan == 0xFFFF and not msg.match.wildcards & fb.ofp.OFPFW_DL_VLAN
        else:
            assert msg.match["vlan_vid"] == 0  # OFPVID_NONE


@pytest.mark.parametrize("version", [OFP10, OFP13])
def test_the_table_size_request_asks_and_never_sets(version):
    msg = builder(version).table_size_request()
    msg.serialize()
    if version == OFP13:
        assert msg.body == [] and len(msg.buf) == 16  # a header and the multipart header only


def test_a_default_flow_is_deleted_by_its_port_not_by_the_cookie_every_default_shares():
    from nfshunt.records import cookies
    from nfshunt.records.model import SwitchFlow
    fb = builder(4)
    msg = fb.delete_switch_flow(SwitchFlow(cookies.make(cookies.Kind.DEFAULT), 100, 6, None, 1))
    assert msg.command == fb.ofp.OFPFC_DELETE_STRICT and msg.priority == 100
    assert msg.match["in_port"] == 6 and msg.cookie_mask == (1 << 64) - 1


# --- the pipeline layout (flow_layout) -------------------------------------------------------

def pipeline_builder(templated=False):
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13),
                     config(shunt_priority=33000, default_shunt_timeout=12), pipeline=True)
    fb.templated = templated
    return fb


def test_pipeline_tcp_shunt_is_two_flows_that_carry_the_connection_into_table_1():
    from nfshunt.openflow.flows import PIPELINE_TABLE, metadata_teardown
    fb = pipeline_builder()
    conn = conn_for(ct_id=2**32 - 1)
    conn.slot = 4095  # the highest slot of a colliding id: the metadata names it too
    msgs = fb.install(conn)
    assert len(msgs) == 2 == fb.install_cost(conn)
    for msg, reply, group in ((msgs[0], False, 1), (msgs[1], True, 0)):
        msg.serialize()
        assert msg.table_id == 0 and msg.idle_timeout == 12 and msg.flags & fb.ofp.OFPFF_SEND_FLOW_REM
        meta, goto = msg.instructions
        assert goto.table_id == PIPELINE_TABLE
        assert metadata_teardown(meta.metadata) == (conn.key, reply)
        assert (meta.metadata >> 48) - 1 == group  # the egress port group's index
    # No catchers of its own to remove: two deletes.
    assert len(fb.remove(conn, (False, True))) == 2


def test_pipeline_keeps_udp_shunts_and_blocks_in_table_0():
    fb = pipeline_builder()
    udp = fb.install(conn_for(proto=UDP))
    assert [m.instructions[0].actions[0].port for m in udp] == [3, 1]
    assert all(m.instructions == [] for m in fb.install(conn_for(action=2)))


def test_pipeline_table_1_has_an_output_and_four_catchers_per_port_group():
    fb = pipeline_builder()
    ports = config().switches[0].ports
    msgs = fb.pipeline_flows(ports)
    assert len(msgs) == layout.PIPELINE_ENTRIES * len(ports)
    for msg in msgs:
        msg.serialize()
        assert msg.table_id == 1 and msg.idle_timeout == 0
        kind, group, catcher = cookies.parse(msg.cookie)
        assert kind is cookies.Kind.PIPELINE
        assert msg.match["metadata"] == ((group + 1) << 48, 0xFFFF << 48)
        actions = msg.instructions[0].actions
        assert actions[0].port == ports[group].fast
        if catcher:
            assert msg.priority == 2 and actions[1].port == fb.ofp.OFPP_CONTROLLER
            assert msg.match["tcp_flags"] == ((4, 4) if cookies.is_rst(msg.cookie) else (1, 1))
        else:
            assert msg.priority == 1 and len(actions) == 1


def test_pipeline_flows_read_back_name_the_port_table_1_outputs_to():
    from types import SimpleNamespace
    fb = pipeline_builder()
    conn = conn_for()
    for msg, out_port in zip(fb.install(conn), (3, 1), strict=True):
        stats = SimpleNamespace(match=msg.match, instructions=msg.instructions, cookie=msg.cookie,
                                priority=msg.priority, packet_count=0, byte_count=0, duration_sec=0,
                                duration_nsec=0, hard_timeout=0)
        flow = fb.parse_stats(stats)
        assert flow.goto and flow.out_port == out_port


@pytest.mark.parametrize("kw", SHAPES)
def test_pipeline_templated_messages_are_byte_for_byte_what_os_ken_builds(kw):
    fast, slow = pipeline_builder(templated=True), pipeline_builder(templated=False)
    for sport, ct_id in ((40000, 7), (40001, 8), (7, 2**32 - 1)):
        conn = conn_for(**{**kw, "sport": kw.get("sport", sport), "ct_id": kw.get("ct_id", ct_id)})
        assert _wire(fast.install(conn)) == _wire(slow.install(conn))
        assert _wire(fast.remove(conn, (False, True))) == _wire(slow.remove(conn, (False, True)))


def test_an_openflow10_pair_with_wildcarded_addresses_is_not_read_as_exact():
    """Issue 26.6: OpenFlow 1.0 reports wildcarded nw_src/nw_dst as 0.0.0.0; such a flow
    under a pair's cookie is not a pair this version installs (nor one without dl_vlan)."""
    from types import SimpleNamespace
    fb = builder(OFP10)
    fb.templated = False
    mod = fb.install(conn_for(proto=17))[0]

    def read(match):
        return fb.parse_stats(SimpleNamespace(match=match, actions=mod.actions, cookie=mod.cookie,
                                              priority=mod.priority, packet_count=0, byte_count=0,
                                              duration_sec=0, duration_nsec=0, hard_timeout=0))
    ofp = fb.ofp
    assert read(mod.match).exact
    wild = fb.parser.OFPMatch(wildcards=mod.match.wildcards | ofp.OFPFW_NW_SRC_ALL | ofp.OFPFW_NW_DST_ALL,
                              in_port=1, dl_vlan=0xFFFF, dl_type=0x800, nw_proto=17, tp_src=40000, tp_dst=5201)
    assert read(wild).match is not None and not read(wild).exact
    untagged_any = fb.parser.OFPMatch(in_port=1, dl_type=0x800, nw_proto=17, nw_src="10.0.0.1", nw_dst="10.0.0.2",
                                      tp_src=40000, tp_dst=5201)
    assert not read(untagged_any).exact


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("version", [OFP10, OFP13])
def test_a_bounded_pairs_hard_timeout_and_authority_are_in_every_flow_templated_or_not(version, pipeline):
    """An IDS's pair (issue 36.1): the hard timeout patched into the cached templates is what
    os-ken writes, in the pair's flows and its catchers; its cookie names the IDS."""
    if pipeline and version == OFP10:
        pytest.skip("no pipeline layout in OpenFlow 1.0")
    make = pipeline_builder if pipeline else (lambda templated: builder(version, templated))
    fast, slow = make(templated=True), make(templated=False)
    for hard, sport in ((61, 40000), (65535, 40001), (0, 40002)):
        conn = conn_for(sport=sport)
        conn.hard_timeout, conn.authority = hard, cookies.Authority.IDS
        assert _wire(fast.install(conn)) == _wire(slow.install(conn))
        assert _wire(fast.remove(conn, (False, True))) == _wire(slow.remove(conn, (False, True)))
        msgs = slow.install(conn)
        assert {m.hard_timeout for m in msgs} == {hard}
        assert cookies.authority(msgs[0].cookie) is cookies.Authority.IDS and cookies.parse(msgs[0].cookie).key == 7
