"""Reloading the config (reload.py, operator_api.reload): a bad file changes nothing, the
live keys change, static shunts change as the difference only, other keys are kept."""
import json
import os
import time
from types import SimpleNamespace

os.environ.setdefault("OSKEN_HUB_TYPE", "native")

from nfshunt.app.operator_api import EventControl, OperatorAPI  # noqa: E402
from nfshunt.config import reload  # noqa: E402
from nfshunt.config.settings import from_dict  # noqa: E402
from nfshunt.core import commands as cmds  # noqa: E402
from nfshunt.core import core as c  # noqa: E402
from nfshunt.observe.metrics import Metrics  # noqa: E402
from nfshunt.switch.switch import Switch  # noqa: E402
from tests.helpers import BASE  # noqa: E402

STREAM = {"name": "plc", "protocol": "udp", "src": "10.0.0.1", "dst": "10.0.0.2", "dst_port": 34964,
          "fast_ports": [1, 3]}


def raw(**kw):
    return {**json.loads(json.dumps(BASE)), "openflow_versions": ["1.3"], "static_shunts": [STREAM], **kw}


def test_the_plan_takes_the_live_keys_and_keeps_the_others():
    running = from_dict(raw())
    new = from_dict(raw(default_shunt_timeout=30, listen_port=7000, log_level="DEBUG",
                        static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}]))
    p = reload.plan(running, new)
    assert set(p.changed) == {"default_shunt_timeout", "log_level", "static_shunts"}
    assert p.kept == ("listen_port",)
    assert p.config.listen_port == running.listen_port and p.config.default_shunt_timeout == 30
    assert len(p.config.static_shunts) == 2 and p.config.by_physdevin == running.by_physdevin
    assert reload.plan(running, from_dict(raw())).changed == ()


def test_another_list_of_switches_changes_nothing():
    two = {"mark_actions": BASE["mark_actions"], "switches": [
        {"datapath_id": "a1", "ports": BASE["ports"]},
        {"datapath_id": "a2", "ports": [{"fast": 1, "slow": 2, "physdevin": 3}]}]}
    one = {"mark_actions": BASE["mark_actions"], "switches": two["switches"][:1], "default_shunt_timeout": 30}
    p = reload.plan(from_dict(two), from_dict(one))
    assert p.changed == () and "switches" in p.kept and p.config.default_shunt_timeout == 10


def _app(path, cfg):
    switches = [Switch(sw_cfg, i) for i, sw_cfg in enumerate(cfg.served)]
    for sw in switches:
        sw.core.switch_connected(c.OFP13)
        sw.core.reconcile([], 0.0)
    ran = []

    def run(sw, out, waiter=None):
        ran.append(list(out))
        if waiter is not None:
            waiter.set()  # the switch's barrier reply
    return SimpleNamespace(cfg=cfg, config_path=str(path), switches=switches, counters=Metrics(lambda: {}).counters,
                           started=time.time(), run=run), ran


def _reload(api):
    ev = EventControl({"cmd": "reload"})
    api.handle(ev)
    assert ev.done.wait(5)
    return ev.reply


def test_a_bad_config_changes_nothing_and_says_why(tmp_path):
    path = tmp_path / "nfshunt.json"
    cfg = from_dict(raw())
    app, ran = _app(path, cfg)
    flows = dict(app.switches[0].core.static.flows)
    path.write_text(json.dumps(raw(default_shunt_timeout=30, static_shunts=[{**STREAM, "src": "10.0.0.0/8"}])))
    reply = _reload(OperatorAPI(app))
    assert "nothing changed" in reply["error"] and "static_shunts[0].src" in reply["error"]
    assert app.cfg is cfg and app.switches[0].core.cfg is cfg and app.switches[0].core.static.flows == flows
    assert ran == []
    path.write_text("{")
    assert "not valid JSON" in _reload(OperatorAPI(app))["error"] and app.cfg is cfg


def test_a_good_config_applies_the_difference_and_reports_what_it_kept(tmp_path):
    path = tmp_path / "nfshunt.json"
    app, ran = _app(path, from_dict(raw()))
    sw = app.switches[0]
    kept = set(sw.core.static.flows)
    path.write_text(json.dumps(raw(default_shunt_timeout=30, listen_port=7000,
                                   static_shunts=[STREAM, {**STREAM, "name": "b", "dst_port": 1}])))
    reply = _reload(OperatorAPI(app))
    assert reply["ok"] and reply["confirmed"] and reply["confirmed_ms"] >= 0
    assert reply["static"] == {"added": 2, "removed": 0, "flows": 4}
    assert set(reply["changed"]) == {"default_shunt_timeout", "static_shunts"}
    assert list(reply["kept"]) == ["listen_port"] and "restart" in reply["kept"]["listen_port"]
    (out,) = ran
    (install,) = out
    assert isinstance(install, cmds.InstallStatic) and not kept & {f.cookie for f in install.flows}
    assert sw.core.cfg.default_shunt_timeout == 30 and app.cfg.listen_port == 6653
