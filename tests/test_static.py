"""Static shunts (static.py): their config checks, their flows, and how one switch's
table of them is installed, reconciled and reloaded."""
import json
import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")
from os_ken.ofproto import ofproto_protocol  # noqa: E402

from nfshunt.config.settings import ConfigError  # noqa: E402
from nfshunt.core import commands as cmds  # noqa: E402
from nfshunt.core import core as c  # noqa: E402
from nfshunt.core.pins import PIN_TTL  # noqa: E402
from nfshunt.core.static_table import StaticTable  # noqa: E402
from nfshunt.openflow.flows import FlowBuilder  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import OFP13, UDP, Action, FlowTuple, SwitchFlow  # noqa: E402
from tests.helpers import config, unbuildable  # noqa: E402

STREAM = {"name": "plc-cycle", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": 34964,
          "fast_ports": [1, 3]}


def static_config(*entries, **kw):
    return config(openflow_versions=["1.3"], static_shunts=list(entries), **kw)


def _table(cfg):
    """The one switch's static table."""
    return StaticTable(cfg, cfg.switches[0])


def test_a_stream_makes_one_flow_a_direction_between_shunts_and_blocks():
    cfg = static_config(STREAM)
    (shunt,) = cfg.static_shunts
    assert shunt.protocol == UDP and shunt.src_port is None and shunt.both_directions
    flows = sorted(StaticTable(cfg, cfg.switches[0]).flows.values(), key=lambda f: f.reply)
    assert [(f.in_port, f.out_port, f.reply) for f in flows] == [(1, 3, False), (3, 1, True)]
    fwd, rev = flows
    assert (str(rev.src), str(rev.dst), rev.src_port, rev.dst_port) == ("10.0.0.2/32", "10.0.0.1/32", 34964, None)
    assert cfg.shunt_priority + 1 < fwd.priority < cfg.block_priority
    assert {cookies.parse(f.cookie) for f in flows} == {(cookies.Kind.STATIC, fwd.cookie & 0xFFFFFFFF, False),
                                                         (cookies.Kind.STATIC, fwd.cookie & 0xFFFFFFFF, True)}


def test_one_direction_only():
    cfg = static_config({**STREAM, "both_directions": False})
    assert [f.in_port for f in StaticTable(cfg, cfg.switches[0]).flows.values()] == [1]


def test_an_entrys_cookie_is_stable_and_names_its_fields():
    a = _table(static_config(STREAM)).flows
    assert _table(static_config(STREAM)).flows.keys() == a.keys()
    assert _table(static_config({**STREAM, "name": "renamed"})).flows.keys() == a.keys()
    assert not _table(static_config({**STREAM, "dst_port": 34965})).flows.keys() & a.keys()


@pytest.mark.parametrize("entry,key,problem", [
    ({**STREAM, "colour": "red"}, "static_shunts[0].colour", "unknown key"),
    ({k: v for k, v in STREAM.items() if k != "dst"}, "static_shunts[0].dst", "missing"),
    ({**STREAM, "protocol": "sctp"}, "static_shunts[0].protocol", "not one of"),
    ({**STREAM, "src": "10.0.0.1/33"}, "static_shunts[0].src", "not an address or prefix"),
    ({**STREAM, "src": "10.0.0.1/24"}, "static_shunts[0].src", "host bits"),
    ({**STREAM, "src": "fd00::1%eth0", "dst": "fd00:3::/64"}, "static_shunts[0].src", "IPv6 scope id (%eth0)"),
    ({**STREAM, "src": "fd00::9", "dst": "fe80::%1/64"}, "static_shunts[0].dst", "IPv6 scope id (%1)"),
    ({**STREAM, "dst": "fd00::2"}, "static_shunts[0].dst", "one family"),
    ({**STREAM, "src": "10.0.0.0/16"}, "static_shunts[0].src", "wider than /24"),
    ({**STREAM, "dst": "fd00::/48", "src": "fd00:1::/64"}, "static_shunts[0].dst", "wider than /64"),
    ({**STREAM, "fast_ports": [1, 2]}, "static_shunts[0].fast_ports[1]", "not the fast port"),
    ({**STREAM, "fast_ports": [1, 1]}, "static_shunts[0].fast_ports[1]", "the same port"),
    ({**STREAM, "fast_ports": [1]}, "static_shunts[0].fast_ports", "expected [source side"),
    ({**STREAM, "dst_port": 0}, "static_shunts[0].dst_port", "outside 1-65535"),
    ({**STREAM, "both_directions": "yes"}, "static_shunts[0].both_directions", "true or false"),
])
def test_a_bad_entry_is_refused_naming_its_key(entry, key, problem):
    with pytest.raises(ConfigError) as err:
        static_config(entry)
    assert err.value.key == key and problem in err.value.problem


def test_overlapping_entries_and_a_name_used_twice_are_refused():
    wide = {**STREAM, "name": "cell", "dst": "10.0.0.0/24", "dst_port": None}
    del wide["dst_port"]
    with pytest.raises(ConfigError) as err:
        static_config(STREAM, wide)
    assert err.value.key == "static_shunts[1]" and "overlaps static_shunts[0]" in err.value.problem
    with pytest.raises(ConfigError) as err:  # the prefix first, the host inside it after
        static_config(wide, {**STREAM, "name": "host"})
    assert err.value.key == "static_shunts[1]" and "overlaps static_shunts[0]" in err.value.problem
    # the reverse direction of one overlaps the forward of the other: refused too
    back = {"protocol": "udp", "src": "10.0.0.2", "dst": "10.0.0.1", "src_port": 34964, "fast_ports": [3, 1]}
    with pytest.raises(ConfigError, match="overlaps"):
        static_config(STREAM, back)
    # another port, another protocol or another destination: no overlap
    static_config(STREAM, {**STREAM, "name": "b", "dst_port": 34965}, {**STREAM, "name": "c", "protocol": "tcp"})
    with pytest.raises(ConfigError) as err:
        static_config(STREAM, {**STREAM, "dst_port": 1})
    assert err.value.key == "static_shunts[1].name" and "already used" in err.value.problem


def test_ten_thousand_streams_between_one_host_pair_written_one_key_a_line_load(tmp_path):
    """A config an admin writes for 10,000 streams (2 MB indented, past the old 1 MiB
    limit) is read; how long it takes is bench/run.py config's to measure."""
    from nfshunt.config.settings import load
    base = json.loads(open(os.path.join(os.path.dirname(__file__), "..", "config", "nfshunt.json")).read())
    streams = [dict(STREAM, name=f"s{i}", src_port=1024 + i) for i in range(10000)]
    path = tmp_path / "nfshunt.json"
    path.write_text(json.dumps({**base, "openflow_versions": ["1.3"], "static_shunts": streams}, indent=2))
    assert path.stat().st_size > 1 << 20
    assert len(load(str(path)).static_shunts) == 10000


def test_the_prefix_limit_priority_and_openflow_version_are_checked():
    wide = {**STREAM, "src": "10.0.0.0/16"}
    assert static_config(wide, static_shunt_max_prefix={"ipv4": 16}).static_shunts[0].src.prefixlen == 16
    with pytest.raises(ConfigError) as err:
        static_config(STREAM, static_shunt_max_prefix={"ipv4": 33})
    assert err.value.key == "static_shunt_max_prefix.ipv4"
    with pytest.raises(ConfigError) as err:
        static_config(STREAM, static_priority=33200)
    assert err.value.key == "static_priority" and "block" in err.value.problem
    with pytest.raises(ConfigError) as err:
        config(static_shunts=[STREAM])  # 1.0 negotiable: no prefixes, no delete by cookie
    assert err.value.key == "static_shunts" and "1.3" in err.value.problem


@pytest.mark.parametrize("above_shunts, ok", [(1, False), (2, True)], ids=["catchers-tie", "above-catchers"])
def test_static_priority_must_be_above_the_tcp_catchers_at_shunt_priority_plus_one(above_shunts, ok):
    """A static flow at the catchers' priority (shunt_priority + 1) would tie with them
    (which wins is the switch's choice); one above is the lowest allowed."""
    shunt = config().shunt_priority
    if ok:
        assert static_config(STREAM, static_priority=shunt + above_shunts).static_priority == shunt + above_shunts
        return
    with pytest.raises(ConfigError) as err:
        static_config(STREAM, static_priority=shunt + above_shunts)
    assert err.value.key == "static_priority" and f"shunt_priority + 1 ({shunt + 1}" in err.value.problem


@pytest.mark.parametrize("below_blocks, ok", [(0, False), (1, True)], ids=["ties-blocks", "below-blocks"])
def test_static_priority_must_be_below_block_priority(below_blocks, ok):
    block = config().block_priority
    if ok:
        assert static_config(STREAM, static_priority=block - below_blocks).static_priority == block - below_blocks
        return
    with pytest.raises(ConfigError) as err:
        static_config(STREAM, static_priority=block - below_blocks)
    assert err.value.key == "static_priority" and "block" in err.value.problem


def builder(cfg, templated=False):
    """templated=False: os-ken message objects, whose fields the tests inspect."""
    fb = FlowBuilder(ofproto_protocol.ProtocolDesc(OFP13), cfg)
    fb.templated = templated
    return fb


def _bytes(msg):
    msg.set_xid(1)
    msg.serialize()
    return bytes(msg.buf)


def test_templated_flow_mods_are_byte_for_byte_os_kens_for_every_shape():
    from nfshunt.records.model import FlowTuple
    entries = [STREAM, {**STREAM, "name": "b", "src": "10.0.1.0/24", "dst": "10.0.2.0/25", "src_port": 7},
               {**STREAM, "name": "c", "protocol": "tcp", "dst_port": 502},
               {**STREAM, "name": "d", "src": "fd00::1", "dst": "fd00:2::/64"},
               {**STREAM, "name": "e", "dst": "10.0.0.9", "both_directions": False}]
    entries[2].pop("dst_port")
    cfg = static_config(*entries)
    table = StaticTable(cfg, cfg.switches[0])
    blocks = table.block(FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 34964), 0.0, 3600)[0].flows
    plain, fast = builder(cfg), builder(cfg, templated=True)
    flows = [*table.flows.values(), *blocks]
    for _ in range(2):  # the second round from the cached templates
        for flow in flows:
            assert _bytes(fast.static_add(flow)) == _bytes(plain.static_add(flow)), flow.describe()


def test_the_flow_mod_masks_prefixes_leaves_omitted_ports_any_and_never_idles_out():
    cfg = static_config({**STREAM, "src": "10.0.1.0/24", "both_directions": False})
    fb = builder(cfg)
    (flow,) = StaticTable(cfg, cfg.switches[0]).flows.values()
    msg = fb.static_add(flow)
    fields = dict(msg.match.items())
    assert fields["ipv4_src"] == ("10.0.1.0", "255.255.255.0") and fields["ipv4_dst"] == "10.0.0.2"
    assert fields["udp_dst"] == 34964 and "udp_src" not in fields and fields["vlan_vid"] == 0
    assert fields["in_port"] == 1 and msg.instructions[0].actions[0].port == 3
    assert msg.idle_timeout == 0 and msg.hard_timeout == 0 and msg.priority == cfg.static_priority
    assert msg.cookie == flow.cookie and not msg.flags & fb.ofp.OFPFF_SEND_FLOW_REM
    msg.serialize()  # the switch gets valid bytes


def test_ipv6_flow():
    cfg = static_config({**STREAM, "src": "fd00::1", "dst": "fd00:2::/64"})
    msg = builder(cfg).static_add(next(iter(StaticTable(cfg, cfg.switches[0]).flows.values())))
    fields = dict(msg.match.items())
    assert fields["eth_type"] == 0x86DD and fields["ipv6_src"] == "fd00::1"
    assert fields["ipv6_dst"] == ("fd00:2::", "ffff:ffff:ffff:ffff::")


def test_installed_at_connect_before_the_defaults_and_counted_in_the_table_not_the_budget():
    core = c.Core(static_config(STREAM))
    out = core.switch_connected(OFP13)
    kinds = [type(x) for x in out]
    assert kinds.index(cmds.InstallStatic) < kinds.index(cmds.InstallDefaults)
    assert len(out[kinds.index(cmds.InstallStatic)].flows) == 2
    assert core.default_entries() == 4 + 2
    core.table_size(1000)
    assert core.budget == (1000 - 6) // core.max_pair_entries()
    assert core.shunts == 0


def as_read(flow, **kw):
    return SwitchFlow(**{"cookie": flow.cookie, "priority": flow.priority, "in_port": flow.in_port, "match": None,
                         "out_port": flow.out_port, "exact": False, **kw})


def test_reconcile_keeps_right_flows_repairs_wrong_and_missing_and_deletes_stale_ones():
    core = c.Core(static_config(STREAM))
    core.switch_connected(OFP13)
    fwd, rev = sorted(core.static.flows.values(), key=lambda f: f.reply)
    stale = cookies.make(cookies.Kind.STATIC, 12345)
    out = core.reconcile([as_read(fwd), SwitchFlow(stale, 33050, 1, None, 3, exact=False)], 0)
    assert not any(isinstance(x, cmds.DeleteSwitchFlow) for x in out)  # not deleted as foreign
    removes = [x for x in out if isinstance(x, cmds.RemoveStatic)]
    installs = [x for x in out if isinstance(x, cmds.InstallStatic)]
    assert [r.cookies for r in removes] == [(stale,)]
    assert [i.flows for i in installs] == [(rev,)]
    # a flow under our cookie that outputs elsewhere is replaced
    core2 = c.Core(static_config(STREAM))
    core2.switch_connected(OFP13)
    out = core2.reconcile([as_read(fwd, out_port=4), as_read(rev)], 0)
    assert [x.cookies for x in out if isinstance(x, cmds.RemoveStatic)] == [(fwd.cookie,)]
    assert [x.flows for x in out if isinstance(x, cmds.InstallStatic)] == [(fwd,)]
    # both right: nothing to do
    core3 = c.Core(static_config(STREAM))
    core3.switch_connected(OFP13)
    out = core3.reconcile([as_read(fwd), as_read(rev)], 0)
    assert not any(isinstance(x, (cmds.RemoveStatic, cmds.InstallStatic)) for x in out)


def test_reload_applies_the_difference_only():
    other = {**STREAM, "name": "drive", "dst": "10.0.0.3"}
    table = _table(static_config(STREAM, other))
    kept = {f.cookie for f in table.flows.values() if f.shunt.name == "plc-cycle"}
    changed = {**other, "dst_port": 1000}
    added = {**STREAM, "name": "new", "dst": "10.0.0.4"}
    new = static_config(STREAM, changed, added)
    out = table.reload(new, new.switches[0])
    install, remove = out
    assert isinstance(install, cmds.InstallStatic) and isinstance(remove, cmds.RemoveStatic)
    assert {f.shunt.name for f in install.flows} == {"drive", "new"} and len(install.flows) == 4
    assert len(remove.cookies) == 2 and not kept & set(remove.cookies)
    assert not kept & {f.cookie for f in install.flows}
    assert table.reload(new, new.switches[0]) == []


def test_a_change_worked_out_beforehand_changes_nothing_until_committed_and_only_against_its_table():
    """A reload works the difference out off the event loop (StaticTable.change) and commits
    it on the loop (reload): worked out, nothing changed; committed, the table is the new one;
    worked out against a table that has changed since, it is worked out again."""
    other = {**STREAM, "name": "drive", "dst": "10.0.0.3"}
    first = static_config(STREAM)
    table = StaticTable(first, first.switches[0])
    before = table.flows
    cfg = static_config(STREAM, other)
    change = table.change(cfg, cfg.switches[0])
    assert table.flows is before and [type(x) for x in change.commands] == [cmds.InstallStatic]
    only_other = static_config(other)
    stale = table.change(only_other, only_other.switches[0])  # (against the table as it is now)
    assert table.reload(cfg, cfg.switches[0], change) == list(change.commands) and table.flows is change.flows
    out = table.reload(only_other, only_other.switches[0], stale)  # the table changed since: the difference again
    assert [type(x) for x in out] == [cmds.RemoveStatic] and set(table.flows) == set(stale.flows)
    (remove,) = out
    assert set(remove.cookies) == set(before) and len(remove.what) == 2


def test_an_operators_block_of_a_tuple_inside_a_stream_drops_it_above_the_stream_until_unshunt():
    from nfshunt.records.model import FlowTuple
    cfg = static_config(STREAM)
    core = c.Core(cfg)
    core.switch_connected(OFP13)
    core.reconcile([], 0)
    t = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 34964)
    out = core.pin(t, Action.BLOCK, 10.0)
    (install,) = [x for x in out if isinstance(x, cmds.InstallStatic)]
    drops = sorted(install.flows, key=lambda f: f.in_port)
    assert [(f.in_port, f.out_port, f.priority) for f in drops] == [(1, None, cfg.block_priority),
                                                                    (3, None, cfg.block_priority)]
    msg = builder(cfg).static_add(drops[0])
    assert msg.instructions == [] and msg.hard_timeout == int(PIN_TTL) + 1  # and a second (pins.hard_timeout)
    assert dict(msg.match.items())["udp_src"] == 40000
    # kept across a reconnect, not deleted as stale
    again = core.switch_connected(OFP13)
    assert {f.cookie for f in drops} <= {f.cookie for x in again if isinstance(x, cmds.InstallStatic) for f in x.flows}
    rest = core.reconcile([as_read(f) for f in (*core.static.flows.values(), *drops)], 1)
    assert not any(isinstance(x, cmds.RemoveStatic) for x in rest)
    # a tuple outside every stream: nothing
    outside = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 1)
    assert not any(isinstance(x, cmds.InstallStatic) for x in core.pin(outside, Action.BLOCK, 11))
    (remove,) = [x for x in core.pin(t, Action.IGNORE, 12) if isinstance(x, cmds.RemoveStatic)]
    assert set(remove.cookies) == {f.cookie for f in drops}


def test_a_core_whose_switch_is_not_its_own_keeps_blocks_and_writes_them_only_when_it_is():
    """Review s57/2 V5: a pair's backup (EQUAL before a grant, SLAVE, or a switch that refuses
    roles), or a controller whose switch is away, made the static and address blocks' drops
    anyway, and the dispatcher sent them to any connected switch. They are kept, and the
    switch gets them once it is this controller's (switch_connected installs them)."""
    import ipaddress
    cfg = static_config(STREAM)
    core = c.Core(cfg)
    t = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 34964)
    net = ipaddress.ip_network("192.0.2.0/24")
    on_switch = (cmds.InstallStatic, cmds.RemoveStatic, cmds.InstallAddressBlocks, cmds.RemoveAddressBlocks)

    def flow_mods(out):
        return [x for x in out if isinstance(x, on_switch)]
    core.switch_connected(OFP13)
    core.reconcile([], 0)
    assert flow_mods(core.pin(t, Action.BLOCK, 1.0)) and flow_mods(core.block_address(net, 100.0, "ids/1"))
    assert flow_mods(core.unblock_address(net, "ended")) and flow_mods(core.pin(t, Action.IGNORE, 2.0))
    core.stand_by()  # no longer master (a pair's step-down; switch_disconnected likewise)
    assert flow_mods(core.pin(t, Action.BLOCK, 3.0)) == [] and core.static.blocks
    assert flow_mods(core.block_address(net, 200.0, "ids/2")) == [] and core.shared.address_blocks.flows
    connected = core.switch_connected(OFP13)  # granted MASTER: what it kept goes in first
    (install,) = [x for x in connected if isinstance(x, cmds.InstallStatic)]
    assert {f.cookie for f in install.flows} >= set(core.static.blocks)
    assert [x for x in connected if isinstance(x, cmds.InstallAddressBlocks)]
    core.stand_by()
    assert flow_mods(core.pin(t, Action.IGNORE, 4.0)) == [] and not core.static.blocks  # an unblock: kept too
    assert flow_mods(core.unblock_address(net, "ended")) == [] and not core.shared.address_blocks.flows


def test_a_flow_that_cannot_be_built_is_counted_and_named_and_the_other_streams_still_go_in(monkeypatch, caplog):
    """One InstallStatic carries every stream's flows at a connect: one the switch side
    cannot build (a bug past the checks) keeps none of the others off the switch."""
    from tests.support.rig import FAST_A, FAST_B, Rig
    good = {**STREAM, "name": "good", "src": "10.0.0.1"}
    bad = {**STREAM, "name": "bad", "src": "10.0.0.9"}
    rig = Rig(openflow_versions=["1.3"], static_shunts=[good, bad], connect=False)
    rig._check = lambda: None  # (the rig fails a test on an internal error: here the one counted is the point)
    unbuildable(monkeypatch, "bad")
    rig.connect(rig.switch)
    flows = rig.core.static.flows
    installed = {flows[e.cookie].shunt.name for e in rig.switch.entries if e.cookie in flows}
    # bad's two directions, at the connect and again when the reconcile finds them missing
    assert installed == {"good"} and rig.counters.flat().get("internal_errors") == 4
    assert rig.packet(FAST_A, FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 4000, 34964)).outputs == (FAST_B,)
    assert "static flow bad (original)" in caplog.text and "static flow bad (reply)" in caplog.text


def test_metrics_show_each_flows_counters_and_audit_lines_name_each_flow():
    import logging
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from nfshunt.app.operator_api import static_gauges
    from nfshunt.observe.accounting import Outcomes
    from nfshunt.observe.metrics import Metrics
    table = _table(static_config(STREAM))
    fwd = next(f for f in table.flows.values() if not f.reply)
    table.counted([as_read(fwd, packets=7, bytes=3584, duration=2.5)])
    rows = table.rows()
    assert [(r["direction"], r["packets"], r["on_switch"]) for r in sorted(rows, key=lambda r: r["direction"])] == [
        ("original", 7, True), ("reply", None, False)]
    metrics = Metrics(lambda: {"shunts": 0, "blocks": 0, "connected": 1, "max_shunts": 0, "waiting": 0,
                               "static": static_gauges([SimpleNamespace(core=SimpleNamespace(static=table))])})
    text = generate_latest(metrics.registry).decode()
    assert 'nfshunt_static_packets_total{direction="original",name="plc-cycle"} 7.0' in text
    assert 'nfshunt_static_bytes_total{direction="original",name="plc-cycle"} 3584.0' in text
    assert "nfshunt_static_flows_missing 1.0" in text

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())
    audit = logging.getLogger("nfshunt.audit.test")
    audit.propagate = False
    audit.setLevel(logging.INFO)
    lines = Lines()
    audit.addHandler(lines)
    Outcomes(metrics, audit).static("static_installed", "s1", [(f.cookie, f.describe()) for f in table.flows.values()],
                                    "switch connected")
    records = [json.loads(line) for line in lines.lines]
    assert [r["event"] for r in records] == ["static_installed"] * 2
    assert {r["flow"] for r in records} == {f.describe() for f in table.flows.values()}
    assert metrics.counters.flat()["static_flows:installed:switch connected"] == 2


def test_with_several_switches_an_entry_names_its_switch_when_its_ports_are_on_more_than_one():
    from nfshunt.config.settings import from_dict
    from tests.helpers import BASE
    two = {"mark_actions": BASE["mark_actions"], "openflow_versions": ["1.3"], "switches": [
        {"datapath_id": "a1", "ports": BASE["ports"]},
        {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3}, {"fast": 3, "slow": 4,
                                                                                 "physdevin": 4}]}]}
    with pytest.raises(ConfigError) as err:
        from_dict({**two, "static_shunts": [STREAM]})
    assert err.value.key == "static_shunts[0].datapath_id" and "several switches" in err.value.problem
    with pytest.raises(ConfigError) as err:
        from_dict({**two, "static_shunts": [{**STREAM, "datapath_id": "b7"}]})
    assert err.value.key == "static_shunts[0].datapath_id" and "not a served switch" in err.value.problem
    cfg = from_dict({**two, "static_shunts": [{**STREAM, "datapath_id": "a2"}]})
    assert [StaticTable(cfg, sw).entries for sw in cfg.switches] == [0, 2]


def test_a_reload_puts_the_held_blocks_drops_above_its_new_flows_first_and_keeps_them_while_not_ours():
    """A block held before a reload adds the stream that carries it: its drops are the
    reload's first commands (in the switch before the stream), for what is left of the pin;
    the unchanged stream's block is not written again; a pin that ended or an unshunt pin
    makes none. A core whose switch is not its own keeps the drops for its connect."""
    from nfshunt.core.pins import IdsHold
    new = {**STREAM, "name": "new", "dst_port": 5000}
    t = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 5000)
    old = FlowTuple(4, UDP, "10.0.0.1", "10.0.0.2", 40000, 34964)  # in STREAM, blocked already
    cfg, two = static_config(STREAM), static_config(STREAM, new)
    for ours in (True, False):
        core = c.Core(cfg)
        core.switch_connected(OFP13)
        core.reconcile([], 0)
        core.pin(t, Action.BLOCK, 10.0)
        core.pin(old, Action.BLOCK, 10.0)
        core.pin(t._replace(sport=40001), Action.IGNORE, 10.0)
        core.ids_pin(t._replace(sport=40002), IdsHold(Action.BLOCK, "ids:zeek", until=40.0), 10.0)
        core.pin(t._replace(sport=40003), Action.BLOCK, 10.0, ttl=5)  # ended by the reload's time
        if not ours:
            core.switch_disconnected()
        out = core.reload(two, two.switches[0], None, 20.0)
        # (source port, hard timeout) of each drop above the new stream: both directions of
        # the operator's block (what is left of its hour, and a second) and the IDS's
        drops = sorted((max(f.src_port, f.dst_port), f.hard_timeout) for f, _ in core.static.blocks.values()
                       if 5000 in (f.src_port, f.dst_port))
        assert drops == [(40000, 3591), (40000, 3591), (40002, 21), (40002, 21)], drops
        if ours:
            assert [(type(x), getattr(x, "reason", None)) for x in out] == \
                [(cmds.InstallStatic, "blocked"), (cmds.InstallStatic, "blocked"), (cmds.InstallStatic, "reload")]
            assert sorted((max(f.src_port, f.dst_port), f.hard_timeout) for x in out[:2] for f in x.flows) == drops
        else:
            assert out == []
            again = core.switch_connected(OFP13)
            (install, *_) = [x for x in again if isinstance(x, cmds.InstallStatic)]
            assert {f.cookie for f, _ in core.static.blocks.values()} <= {f.cookie for f in install.flows}
