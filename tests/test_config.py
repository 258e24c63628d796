import dataclasses
import json

import pytest

from nfshunt.config import settings, switch
from nfshunt.config.settings import ConfigError, from_dict, load
from tests.helpers import BASE

ORIGINAL = {  # the thesis's nfshunt.json, unchanged
    "delete_flows_on_startup": True,
    "delete_flows_on_shutdown": True,
    "default_shunt_timeout": 10,
    "default_block_timeout": 10,
    "default_no_shunting": True,
    "ports": [{"fast": 1, "slow": 2, "physdevin": 1}, {"fast": 3, "slow": 4, "physdevin": 2}],
    "mark_actions": {"0": "ignore", "1": "shunt", "2": "block"},
}


def with_(**kw):
    raw = json.loads(json.dumps(BASE))
    raw.update(kw)
    return raw


def test_original_config_is_accepted_with_safe_defaults():
    cfg = from_dict(ORIGINAL)
    assert cfg.default_shunt_timeout == 10
    assert cfg.listen_address == "0.0.0.0" and cfg.listen_port == 6653
    assert cfg.openflow_versions == ("1.0", "1.3")
    (sw,) = cfg.switches  # one switch: the top level's
    assert cfg.tls is None and sw.max_shunts == 0 and sw.at == ""
    assert sw.by_physdevin[2].fast == 3
    assert cfg.mark_actions == {0: "ignore", 1: "shunt", 2: "block"}


def test_shipped_example_config_is_valid():
    load("config/nfshunt.json")


@pytest.mark.parametrize("raw,key,problem", [
    (with_(colour="blue"), "colour", "unknown key"),
    (with_(ports=[{"fast": 1, "slow": 2, "physdevin": 1, "speed": 10}]), "ports[0].speed", "unknown key"),
    (with_(default_shunt_timeout="10"), "default_shunt_timeout", "expected an integer"),
    (with_(delete_flows_on_startup=1), "delete_flows_on_startup", "expected true or false"),
    (with_(listen_port=True), "listen_port", "expected an integer"),
    (with_(ports=[{"fast": 1, "slow": 2, "physdevin": 1}, {"fast": 3, "slow": 4, "physdevin": 1}]),
     "ports[1].physdevin", "already used"),
    (with_(ports=[{"fast": 1, "slow": 2, "physdevin": 0}]), "ports[0].physdevin", "outside 1-15"),
    (with_(ports=[{"fast": 1, "slow": 2, "physdevin": 16}]), "ports[0].physdevin", "outside 1-15"),
    (with_(ports=[{"fast": 1, "slow": 2, "physdevin": 1}, {"fast": 1, "slow": 4, "physdevin": 2}]),
     "ports[1].fast", "already used"),
    (with_(ports=[{"fast": 1, "slow": 1, "physdevin": 1}]), "ports[0].slow", "same switch port"),
    (with_(ports=[{"fast": 1, "physdevin": 1}]), "ports[0].slow", "missing"),
    (with_(ports=[]), "ports", "non-empty"),
    (with_(mark_actions={"1": "forward"}), "mark_actions.1", "not one of"),
    (with_(mark_actions={"x": "shunt"}), "mark_actions.x", "action number"),
    (with_(mark_actions={"16": "shunt"}), "mark_actions.16", "action number"),
    (with_(openflow_versions=["1.5"]), "openflow_versions[0]", "not one of"),
    (with_(listen_address="controller.example"), "listen_address", "not an IP address"),
    (with_(tls={"private_key": "/nonexistent/key.pem", "certificate": "/nonexistent/c.pem"}),
     "tls.private_key", "does not exist"),
    (with_(log_level="LOUD"), "log_level", "not one of"),
    (with_(default_priority=40000), "default_priority", "lower than"),
    (with_(datapath_id="zz"), "datapath_id", "hexadecimal"),
    ({"mark_actions": {"1": "shunt"}}, "ports", "missing"),
    ([1, 2], "", "expected an object"),
])
def test_bad_input_names_key_and_problem(raw, key, problem):
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    assert info.value.key == key
    assert problem in info.value.problem


def test_unreadable_and_invalid_json_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ports: }")
    with pytest.raises(ConfigError, match="not valid JSON: line 1"):
        load(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        load(str(tmp_path / "missing.json"))


def test_check_config_cli_exit_codes(tmp_path, capsys):
    from nfshunt.cli import main
    good = tmp_path / "good.json"
    good.write_text(json.dumps(ORIGINAL))
    assert main(["check-config", str(good)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(with_(ports=[{"fast": 1, "slow": 2, "physdevin": 99}])))
    with pytest.raises(SystemExit) as info:
        main(["check-config", str(bad)])
    assert info.value.code == 2
    assert "ports[0].physdevin" in capsys.readouterr().err


@pytest.mark.parametrize("raw,key,problem", [
    (with_(mark_actions={"²": "shunt"}), "mark_actions.²", "action number"),
    (with_(mark_actions={"١": "shunt"}), "mark_actions.١", "action number"),  # an Arabic-Indic digit
    (with_(mark_actions={"01": "shunt"}), "mark_actions.01", "leading zero"),
    (with_(ports=[{"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "eth+"}]), "ports[0].bridge_port",
     "not a valid interface name"),
    (with_(ports=[{"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "!eth0"}]), "ports[0].bridge_port",
     "not a valid interface name"),
    (with_(ports=[{"fast": 1, "slow": 2, "physdevin": 1, "bridge_port": "eth0:1"}]), "ports[0].bridge_port",
     "not a valid interface name"),
    (with_(shunt_priority=65535), "shunt_priority", "outside 1-65534"),
    (with_(switch_addresses=["switch.example"]), "switch_addresses[0]", "not an IP address"),
    (with_(switch_addresses=["fe80::1%eth0"]), "switch_addresses[0]", "IPv6 scope id (%eth0)"),
    (with_(echo_interval=0), "echo_interval", "outside"),
    (with_(max_block_share=1.5), "max_block_share", "outside"),
])
def test_bad_input_of_issue_11_names_key_and_problem(raw, key, problem):
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    assert info.value.key == key and problem in info.value.problem


def test_a_key_twice_in_one_object_is_an_error_not_last_wins(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"ports": [{"fast": 1, "slow": 2, "physdevin": 1}], "mark_actions": {"1": "shunt", "1": "block"}}')
    with pytest.raises(ConfigError) as info:
        load(str(path))
    assert info.value.key == "1" and "twice" in info.value.problem


def test_check_config_warns_about_an_open_listener(tmp_path, capsys):
    from nfshunt.cli import main
    path = tmp_path / "c.json"
    path.write_text(json.dumps(ORIGINAL))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "WARNING: the OpenFlow listener on 0.0.0.0 has no TLS" in out
    path.write_text(json.dumps(with_(listen_address="127.0.0.1", datapath_id="1")))
    assert main(["check-config", str(path)]) == 0
    assert "WARNING" not in capsys.readouterr().out


def test_control_tuples_use_the_listeners_text_for_ipv4_mapped_addresses():
    from nfshunt.app.control import parse_tuple
    t = parse_tuple("tcp [::ffff:10.0.0.1]:40000 -> [::ffff:10.0.0.2]:5201")
    assert (t.src, t.dst) == ("::ffff:10.0.0.1", "::ffff:10.0.0.2")
    with pytest.raises(ValueError):
        parse_tuple("tcp 10.0.0.1:４0000 -> 10.0.0.2:5201")  # fullwidth digits are not a port


PAIR = {"state_file": "/var/lib/nfshunt/pair.json"}


def test_a_pair_config_is_accepted_with_openflow_13_only():
    cfg = from_dict(with_(openflow_versions=["1.3"], delete_flows_on_shutdown=False, pair=PAIR))
    assert cfg.pair is not None and cfg.pair.start_role == "backup" and cfg.pair.role_check_interval == 1.0
    assert cfg.pair.vrrp_instances == ("NFSHUNT",)  # the shipped keepalived.conf's one instance
    named = from_dict(with_(openflow_versions=["1.3"], delete_flows_on_shutdown=False,
                            pair={**PAIR, "vrrp_instances": ["NFSHUNT", "fw-pair.2"]}))
    assert named.pair is not None and named.pair.vrrp_instances == ("NFSHUNT", "fw-pair.2")


@pytest.mark.parametrize("extra,key,problem", [
    ({"openflow_versions": ["1.0", "1.3"]}, "pair", "OpenFlow 1.3 only"),
    ({"delete_flows_on_shutdown": True}, "delete_flows_on_shutdown", "the other controller adopts"),
    ({"delete_foreign_flows_on_startup": True}, "delete_foreign_flows_on_startup", "wipe"),
    ({"pair": {**PAIR, "start_role": "primary"}}, "pair.start_role", "not one of"),
    ({"pair": {"start_role": "backup"}}, "pair.state_file", "required"),
    ({"pair": {**PAIR, "state_file": "pair.json"}}, "pair.state_file", "absolute path"),
    ({"pair": {**PAIR, "peer": "fw-b"}}, "pair.peer", "unknown key"),
    ({"pair": {**PAIR, "vrrp_instance": "NFSHUNT"}}, "pair.vrrp_instance", "allowed: role_check_interval, start_role, "
                                                                           "state_file, vrrp_instances"),
    ({"pair": {**PAIR, "vrrp_instances": "NFSHUNT"}}, "pair.vrrp_instances", "non-empty list"),
    ({"pair": {**PAIR, "vrrp_instances": []}}, "pair.vrrp_instances", "non-empty list"),
    ({"pair": {**PAIR, "vrrp_instances": ["NFSHUNT", "VI 2"]}}, "pair.vrrp_instances[1]", "not a VRRP instance name"),
    ({"pair": {**PAIR, "vrrp_instances": ['"NFSHUNT"']}}, "pair.vrrp_instances[0]", "not a VRRP instance name"),
    ({"pair": {**PAIR, "vrrp_instances": [7]}}, "pair.vrrp_instances[0]", "not a VRRP instance name"),
    ({"pair": {**PAIR, "vrrp_instances": ["A", "A"]}}, "pair.vrrp_instances", "twice"),
])
def test_a_bad_pair_config_says_what_to_fix(extra, key, problem):
    raw = with_(openflow_versions=["1.3"], delete_flows_on_shutdown=False, pair=PAIR)
    raw.update(extra)
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.key == key and problem in str(err.value)


def test_check_config_says_how_entries_are_confirmed_and_that_it_is_one_of_a_pair(tmp_path):
    import subprocess
    import sys
    raw = json.load(open("config/ha/nfshunt.json"))
    raw.pop("tls")
    path = tmp_path / "pair.json"
    path.write_text(json.dumps(raw))
    out = subprocess.run([sys.executable, "-m", "nfshunt", "check-config", str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert "confirm=counters (+0.5 s) and a 0.05 s drain" in out
    assert "firewall pair member: starts backup" in out and "for the VRRP instance(s) NFSHUNT only" in out


def test_the_shipped_pair_example_is_valid():
    raw = json.load(open("config/ha/nfshunt.json"))
    raw.pop("tls")  # its certificates exist only on a deployed host
    cfg = from_dict(raw)
    assert cfg.pair is not None and cfg.openflow_versions == ("1.3",)


def test_counters_confirmation_needs_openflow_13():
    with pytest.raises(ConfigError) as err:
        from_dict(with_(confirm="counters"))
    assert err.value.key == "confirm" and "OpenFlow 1.3" in str(err.value)
    assert from_dict(with_(confirm="counters", openflow_versions=["1.3"])).switches[0].confirm == "counters"
    with pytest.raises(ConfigError):
        from_dict(with_(confirm="eventually"))


@pytest.mark.parametrize("overrides, problem", [
    (dict(flow_layout="pipeline", openflow_versions=["1.0"]), "needs OpenFlow 1.3"),
    (dict(flow_layout="pipeline", tcp_teardown=False), "tcp_teardown is false"),
    (dict(flow_layout="two tables"), "one of"),
])
def test_flow_layout_errors_name_the_key_and_the_fix(overrides, problem):
    with pytest.raises(ConfigError) as err:
        from_dict(with_(**overrides))
    assert err.value.key == "flow_layout" and problem in str(err.value)
    assert from_dict(with_()).switches[0].flow_layout == "auto"
    (sw,) = from_dict(with_(flow_layout="pipeline", openflow_versions=["1.0", "1.3"])).switches
    assert sw.flow_layout == "pipeline"


def _two_switches(**extra):
    first = {"datapath_id": "00:00:00:00:00:00:00:a1", "ports": BASE["ports"]}
    second = {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3, "bridge_port": "fw-eth2"},
                                             {"fast": 3, "slow": 4, "physdevin": 4, "bridge_port": "fw-eth3"}],
              **extra}
    return {"mark_actions": BASE["mark_actions"], "switches": [first, second]}


def test_each_key_has_one_record_the_controller_s_or_the_switch_s():
    """A key is read from one place: the controller's (Config) or each switch's own
    (SwitchConfig), never both, so the type check refuses a read from the wrong one."""
    controller = {f.name for f in dataclasses.fields(settings.Config)}
    own = {f.name for f in dataclasses.fields(switch.SwitchConfig) if f.init and f.compare}
    assert not controller & own
    assert own == set(switch.PER_SWITCH)
    assert controller | own == set(settings.TABLE.keys)


def test_several_switches_each_get_their_own_config_and_the_firewall_all_groups():
    cfg = from_dict({**_two_switches(max_shunts=5, flow_layout="single"), "flow_mod_rate": 100})
    assert [g.physdevin for g in cfg.all_port_groups] == [1, 2, 3, 4]  # the plumbing marks every bridge port
    a1, a2 = cfg.switches
    assert (a1.at, a2.at) == ("switches[0].", "switches[1].")
    assert (a1.datapath_id, a2.datapath_id) == (0xA1, 0xA2)
    assert sorted(a1.by_physdevin) == [1, 2] and sorted(a2.by_physdevin) == [3, 4]
    assert (a1.max_shunts, a2.max_shunts) == (0, 5) and (a1.flow_layout, a2.flow_layout) == ("auto", "single")
    assert a1.flow_mod_rate == a2.flow_mod_rate == 100  # a top-level key is every switch's default
    assert not any("datapath_id" in w for w in cfg.security_warnings())


@pytest.mark.parametrize("raw,key,problem", [
    ({**_two_switches(), "ports": BASE["ports"]}, "ports", "goes into each entry of 'switches'"),
    ({**_two_switches(), "datapath_id": 1}, "datapath_id", "goes into each entry of 'switches'"),
    ({"mark_actions": BASE["mark_actions"]}, "ports", "required key is missing"),
    ({"mark_actions": BASE["mark_actions"], "switches": []}, "switches", "non-empty list"),
    (_two_switches(datapath_id="a1:zz"), "switches[1].datapath_id", "not a hexadecimal datapath id"),
    (_two_switches(datapath_id="a1"), "switches[1].datapath_id", "already used by switches[0]"),
    (_two_switches(datapath_id=None), "switches[1].datapath_id", "needs its datapath id"),
    (_two_switches(ports=BASE["ports"]), "switches[1].ports[0].physdevin", "already used by switches[0].ports[0]"),
    (_two_switches(tls=None), "switches[1].tls", "unknown key"),
    (_two_switches(confirm="counters"), "switches[1].confirm", "counters needs OpenFlow 1.3"),
    ({**_two_switches(), "openflow_versions": ["1.3"], "pair": {"state_file": "/tmp/nfshunt-pair.json"},
      "delete_flows_on_shutdown": False}, "pair", "a firewall pair serves one switch"),
])
def test_several_switches_config_errors_name_the_key(raw, key, problem):
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    assert err.value.key == key and problem in err.value.problem, str(err.value)
