"""Static shunts through a routing firewall (`via`, issue 38 item 5, docs/design/routed.md 5.9):
the config key and its refusals, and the core's decisions on the rig (fake switch): a static
stream's flows go on with the router's rewrite once the firewall's tables give their next hops,
follow a neighbour's new MAC, and are withdrawn (counted, logged) when the next hop goes, so the
stream crosses the firewall again."""
from __future__ import annotations

import dataclasses
import os

import pytest

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.config.settings import ConfigError, from_dict  # noqa: E402
from nfshunt.core.routing import R_HOP_UNKNOWN  # noqa: E402
from nfshunt.core.static_table import R_VIA_OFF_LINK  # noqa: E402
from nfshunt.records import cookies  # noqa: E402
from nfshunt.records.model import OFP13, UDP, FlowRewrite, FlowTuple, NextHop  # noqa: E402
from nfshunt.records.routed import R_NEXT_HOP_FAILED, R_NO_ROUTE  # noqa: E402
from tests.helpers import BASE  # noqa: E402
from tests.support.rig import Rig  # noqa: E402
from tests.test_routed import FW0, FW1, GOOD, H1_MAC, H2_MAC, ROUTED_PORTS  # noqa: E402
from tests.test_routed_adopt import ROUTED, FakeFollower  # noqa: E402

H1, H2 = "10.0.0.1", "10.0.0.2"
NEW_MAC = "02:00:00:00:02:99"
STREAM = {"name": "plc", "protocol": "udp", "src": H1, "dst": H2, "dst_port": 34964, "fast_ports": [1, 3],
          "via": "table"}
FWD = FlowTuple(4, UDP, H1, H2, 40000, 34964)
SLOW = 2  # port 1's group's slow port: the firewall


def raw(*entries, **kw):
    return {**BASE, "forwarding": "routed", "ports": ROUTED_PORTS, "openflow_versions": ["1.3"],
            "experimental_routed": True, "flow_layout": "single", "static_shunts": list(entries), **kw}


# --- the config --------------------------------------------------------------------------------

def test_via_reads_an_address_or_table_and_names_each_direction_s_next_hop():
    cfg = from_dict(raw(STREAM, {**STREAM, "name": "b", "src": "fd01::1", "dst": "fd02::1", "via": "FD02:0:0::FE"}))
    table, given = cfg.static_shunts
    assert table.via == "table" and given.via == "fd02::fe"  # (an address as the kernel spells it)


@pytest.mark.parametrize("config,key,words", [
    ({**BASE, "openflow_versions": ["1.3"], "static_shunts": [STREAM]}, "static_shunts[0].via",
     "forwarding is bridged"),
    (raw({k: v for k, v in STREAM.items() if k != "via"}), "static_shunts[0].via", "required with forwarding"),
    (raw(STREAM, experimental_routed=False), "static_shunts[0].via", "need experimental_routed true"),
    (raw({**STREAM, "via": "10.0.2.300"}), "static_shunts[0].via", "neither an address"),
    (raw({**STREAM, "via": "next"}), "static_shunts[0].via", "neither an address"),
    (raw({**STREAM, "src": "fd01::1", "dst": "fd02::1", "via": "fe80::1%eth0"}), "static_shunts[0].via",
     "IPv6 scope id (%eth0)"),
    (raw({**STREAM, "via": 5}), "static_shunts[0].via", "expected a non-empty string"),
    (raw({**STREAM, "via": "fd02::1"}), "static_shunts[0].via", "not of dst 10.0.0.2/32's family"),
    (raw({**STREAM, "dst": "10.0.0.0/24"}), "static_shunts[0].dst", "name one host"),
    (raw({**STREAM, "src": "10.0.0.0/24", "via": "10.0.0.2"}), "static_shunts[0].src", "both_directions false"),
])
def test_a_via_that_cannot_work_is_refused_naming_the_key(config, key, words):
    with pytest.raises(ConfigError) as err:
        from_dict(config)
    assert err.value.key == key and words in str(err.value)


def test_a_given_next_hop_with_a_destination_subnet_one_way_is_taken():
    cfg = from_dict(raw({**STREAM, "dst": "10.0.0.0/24", "via": "10.0.0.2", "both_directions": False}))
    assert cfg.static_shunts[0].via == "10.0.0.2"


def test_a_bridged_entry_s_cookie_is_what_it_was():
    """`via` is in a routed entry's cookie only: a bridged one keeps its flows across the upgrade."""
    from nfshunt.config.static import switch_flows
    bridged = from_dict({**BASE, "openflow_versions": ["1.3"], "static_shunts": [
        {k: v for k, v in STREAM.items() if k != "via"}]})
    routed = from_dict(raw(STREAM))
    # (routed38's cookies for this entry, computed there)
    assert set(switch_flows(bridged, bridged.switches[0])) == {0x4E060000FC9B639A, 0x4E060001FC9B639A}
    assert not set(switch_flows(routed, routed.switches[0])) & set(switch_flows(bridged, bridged.switches[0]))


# --- the core, on the rig ------------------------------------------------------------------------

def _rig(answers=None, entries=(STREAM,), follower=None) -> Rig:
    rig = Rig(OFP13, connect=False, **{**ROUTED, "static_shunts": list(entries)})
    rig.dispatcher.tables.follower = follower or FakeFollower(dict(GOOD if answers is None else answers))
    rig.connect(rig.switch)
    return rig


def _static(rig: Rig) -> dict[bool, FlowRewrite | None]:
    """The switch's static flows read back as the controller reads them: each direction's rewrite."""
    from nfshunt.openflow.stats import FlowEntry
    fb = rig.s.fb
    out = {}
    for e in rig.flows(cookies.Kind.STATIC):
        flow = fb.parse_stats(FlowEntry.parser(rig.switch.stats_entry(e), 0))
        out[cookies.parse(flow.cookie)[2]] = flow.rewrite
    return out


def test_a_routed_static_stream_goes_on_with_the_router_s_rewrite_once_the_tables_answer():
    rig = _rig()
    assert (H1, H2) in {tuple(sorted(a)) for a in rig.dispatcher.tables.follower.asked}
    assert _static(rig) == {False: FlowRewrite(FW1, H2_MAC), True: FlowRewrite(FW0, H1_MAC)}
    fate = rig.packet(1, FWD)
    assert fate.outputs == (3,) and cookies.parse(fate.cookies[0])[0] is cookies.Kind.STATIC


class Silent(FakeFollower):
    """A follower whose answer has not come yet."""

    def ask(self, addresses, answered, solicit=False):
        self.asked.append(tuple(addresses))
        self.pending = answered


def test_until_its_next_hops_are_known_a_routed_static_stream_crosses_the_firewall():
    """Never installed with the bridge's flow: the receiver would get frames addressed to the
    firewall's MAC, their TTL not lowered."""
    rig = _rig(follower=Silent({}))
    assert _static(rig) == {}
    assert rig.packet(1, FWD).outputs == (SLOW,)
    rig.run(rig.core.tables_changed(dict(GOOD), rig.now, 0))  # (the answer, as the dispatcher gives it)
    assert _static(rig) == {False: FlowRewrite(FW1, H2_MAC), True: FlowRewrite(FW0, H1_MAC)}


def test_a_neighbour_s_new_mac_rewrites_the_static_flow_and_its_counters_stay():
    rig = _rig()
    rig.packet(1, FWD)
    rig.run(rig.core.tables_changed({H2: dataclasses.replace(GOOD[H2], eth_dst=NEW_MAC)}, rig.now))
    assert _static(rig) == {False: FlowRewrite(FW1, NEW_MAC), True: FlowRewrite(FW0, H1_MAC)}
    assert rig.packet(1, FWD).outputs == (3,)


@pytest.mark.parametrize("answer,reason", [
    (R_NEXT_HOP_FAILED, R_NEXT_HOP_FAILED),
    (R_NO_ROUTE, R_NO_ROUTE),
    (NextHop("fw-eth0", FW0, H2_MAC, H2), "routed: the route leaves by another interface than the port group's"),
])
def test_a_next_hop_gone_withdraws_the_static_flow_counted_and_the_stream_crosses_the_firewall(answer, reason):
    rig = _rig()
    rig.run(rig.core.tables_changed({H2: answer}, rig.now))
    assert _static(rig) == {True: FlowRewrite(FW0, H1_MAC)}  # (the reverse direction's next hop is h1: kept)
    assert rig.packet(1, FWD).outputs == (SLOW,)
    assert rig.counters.flat().get(f"static_flows:removed:{reason}") == 1
    rig.run(rig.core.tables_changed({H2: answer}, rig.now + 1))  # said again: nothing more to withdraw
    assert rig.counters.flat().get(f"static_flows:removed:{reason}") == 1
    rig.run(rig.core.tables_changed(dict(GOOD), rig.now + 2))  # back: installed again
    assert _static(rig)[False] == FlowRewrite(FW1, H2_MAC) and rig.packet(1, FWD).outputs == (3,)


def test_status_rows_name_each_routed_flow_s_next_hop_or_why_it_has_none():
    rig = _rig(follower=Silent({}))
    asked = {(r["direction"], r["no_next_hop"]) for r in rig.core.static.rows()}
    assert asked == {("original", R_HOP_UNKNOWN), ("reply", R_HOP_UNKNOWN)}  # (asked, not answered yet)
    rig.run(rig.core.tables_changed({**GOOD, H2: R_NEXT_HOP_FAILED}, rig.now, 0))
    rows = {r["direction"]: r for r in rig.core.static.rows()}
    assert rows["original"]["next_hop"] is None and rows["original"]["no_next_hop"] == R_NEXT_HOP_FAILED
    assert rows["reply"]["next_hop"] == {"interface": GOOD[H1].ifname, "neighbour": GOOD[H1].neighbour, "mac": H1_MAC}
    assert rows["reply"]["no_next_hop"] is None
    (sw,) = rig.control({"cmd": "status"})["switches"]  # what h1's loss would withdraw
    assert [(h["neighbour"], h["pairs"], h["static_flows"]) for h in sw["next_hops"]] == [(GOOD[H1].neighbour, 0, 1)]


def test_a_flow_withdrawn_while_the_switch_was_away_goes_at_the_reconnect():
    rig = _rig()
    rig.disconnect()
    rig.run(rig.core.tables_changed({H2: R_NEXT_HOP_FAILED}, rig.now))  # (its RemoveStatic went nowhere)
    assert len(rig.flows(cookies.Kind.STATIC)) == 2  # (both still on the switch)
    rig.dispatcher.tables.follower.answers[H2] = R_NEXT_HOP_FAILED
    rig.connect(rig.switch)
    assert _static(rig) == {True: FlowRewrite(FW0, H1_MAC)} and rig.packet(1, FWD).outputs == (SLOW,)


def test_a_given_next_hop_behind_a_gateway_is_not_on_the_subnet_and_is_refused():
    """`via` must be on the destination side's subnet: the route to it is direct (it is its own
    neighbour). One the firewall reaches through another router is refused, counted."""
    far = "10.9.0.1"
    answers = {**GOOD, far: NextHop("fw-eth1", FW1, H2_MAC, "10.0.0.254")}
    rig = _rig(answers, entries=({**STREAM, "via": far},))
    assert False not in _static(rig) and rig.packet(1, FWD).outputs == (SLOW,)
    assert rig.counters.flat().get(f"static_flows:withheld:{R_VIA_OFF_LINK}") == 1  # (never installed)


def test_a_next_hop_not_given_at_the_start_is_withheld_not_removed_and_a_later_loss_is_a_removal():
    """The delete at the start only clears what an earlier run may have left on the switch: the
    log, the counters and the audit say the flow was withheld, not that one was removed."""
    rig = _rig({**GOOD, H2: R_NEXT_HOP_FAILED})
    flat = rig.counters.flat()
    assert flat.get(f"static_flows:withheld:{R_NEXT_HOP_FAILED}") == 1 and not any(
        k.startswith("static_flows:removed") for k in flat)
    rig.run(rig.core.tables_changed(dict(GOOD), rig.now))  # given: installed
    assert _static(rig)[False] == FlowRewrite(FW1, H2_MAC)
    rig.run(rig.core.tables_changed({H2: R_NEXT_HOP_FAILED}, rig.now + 1))  # lost: removed
    assert rig.counters.flat().get(f"static_flows:removed:{R_NEXT_HOP_FAILED}") == 1


def test_a_given_next_hop_on_the_subnet_is_the_destination_mac():
    gw = "10.0.0.254"
    answers = {**GOOD, gw: NextHop("fw-eth1", FW1, "02:00:00:00:02:fe", gw)}
    rig = _rig(answers, entries=({**STREAM, "via": gw},))
    assert _static(rig)[False] == FlowRewrite(FW1, "02:00:00:00:02:fe")


def test_a_reload_adding_a_routed_stream_asks_its_next_hops_then_installs_it():
    rig = _rig(entries=())
    assert _static(rig) == {}
    cfg = from_dict(raw(STREAM))
    rig.run(rig.core.reload(cfg, cfg.switches[0], None, rig.now))
    assert _static(rig) == {False: FlowRewrite(FW1, H2_MAC), True: FlowRewrite(FW0, H1_MAC)}


def test_a_restarted_controller_keeps_the_routed_static_flows_it_finds_and_checks_them():
    first = _rig()
    again = Rig(OFP13, switch=first.switch, now=first.now + 1, connect=False,
                **{**ROUTED, "static_shunts": [STREAM]})
    again.dispatcher.tables.follower = FakeFollower({**GOOD, H2: dataclasses.replace(GOOD[H2], eth_dst=NEW_MAC)})
    again.connect(again.switch)
    assert _static(again) == {False: FlowRewrite(FW1, NEW_MAC), True: FlowRewrite(FW0, H1_MAC)}


def test_nfshunt_status_static_prints_a_routed_flow_s_next_hop_or_why_it_crosses_the_firewall(capsys):
    from nfshunt import cli
    rig = _rig({**GOOD, H2: R_NEXT_HOP_FAILED})
    rows = rig.core.static.rows()
    cli._print_static({"static": rig.core.static.summary(), "static_shunts": rows,
                       "static_page": {"name": None, "offset": 0, "limit": 100, "matched": 2, "next": None}})
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("plc ")}
    assert lines["orig"].endswith(f"({R_NEXT_HOP_FAILED})")
    assert lines["repl"].endswith(f"via {GOOD[H1].neighbour or '?'} {H1_MAC} on {GOOD[H1].ifname}")


@pytest.mark.parametrize("withdrawn", [False, True])
def test_an_operators_block_inside_a_routed_stream_drops_the_tuple_until_unshunt_and_the_stream_goes_on(withdrawn):
    """The block's exact drops sit above the stream's routed flows (or, the flow withdrawn, above
    the firewall's default): the tuple is dropped on the switch either way; the rest of the
    stream keeps its rewrite, and after the unshunt the tuple has it again."""
    rig = _rig()
    if withdrawn:
        rig.run(rig.core.tables_changed({H2: R_NEXT_HOP_FAILED}, rig.now))
    other = FWD._replace(sport=40001)
    assert rig.control({"cmd": "block", "tuple": str(FWD)})["ok"]
    assert rig.packet(1, FWD).dropped and rig.packet(3, FWD.reversed()).dropped
    assert rig.packet(1, other).outputs == ((SLOW,) if withdrawn else (3,))
    assert rig.control({"cmd": "unshunt", "tuple": str(FWD)})["ok"]
    assert rig.packet(1, FWD).outputs == ((SLOW,) if withdrawn else (3,))
    assert _static(rig)[True] == FlowRewrite(FW0, H1_MAC)  # (the stream's flows untouched by the block)
