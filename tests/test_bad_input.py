"""Bad input never yields a traceback: fuzzed configs are accepted or refused with a
ConfigError naming a key; malformed netlink datagrams are counted and skipped."""
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nfshunt.app.control import MAX_REQUEST, ControlServer, request
from nfshunt.config import jsonfile
from nfshunt.config.settings import MAX_CONFIG_BYTES, TOP_LEVEL, ConfigError, from_dict, load
from nfshunt.core.roles import Roles
from nfshunt.kernel.codec import parse_datagram
from tests.helpers import BASE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALID = json.load(open(os.path.join(REPO, "config", "nfshunt.json")))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
keys = st.one_of(st.sampled_from(sorted(TOP_LEVEL)), st.text(max_size=12))


def _check(raw, mutated=None):
    """A config is accepted, or refused with a ConfigError naming a key of the config's (or
    a known one: a required key missing, a default that conflicts); either way the input is
    left as it was. An unknown key is never accepted. `mutated`: the one key changed from a
    valid config, which a refusal names, or names in its problem (a check across keys)."""
    before = repr(raw)
    try:
        from_dict(raw)
    except ConfigError as exc:
        top = exc.key if exc.key in raw else re.split(r"[.\[]", exc.key)[0]
        assert exc.problem and (top in TOP_LEVEL or top in raw), (exc.key, exc.problem)
        if mutated is not None:
            assert top == mutated or mutated in exc.problem, (mutated, exc.key, exc.problem)
        return
    finally:
        assert repr(raw) == before  # bad input changes nothing, not even its own dict
    assert set(raw) <= set(TOP_LEVEL), f"unknown keys accepted: {set(raw) - set(TOP_LEVEL)}"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=6))
def test_random_configs_are_accepted_or_refused_with_a_key(raw):
    _check(raw)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(VALID)), values)
def test_one_mutated_key_of_a_valid_config(key, value):
    raw = dict(VALID)
    raw[key] = value
    _check(raw, key)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1), st.sampled_from(["fast", "slow", "physdevin", "bridge_port", "extra"]), values)
def test_mutated_port_groups(index, field, value):
    raw = json.loads(json.dumps(VALID))
    raw["ports"][index % len(raw["ports"])][field] = value
    _check(raw, "ports")


# 10 processes: the CLI's own path (read, parse, report, exit code); the parser's answer to
# random configs is tried in-process above, hundreds of times (50 processes here took 12 s of
# CPU in every `make test`).
@settings(max_examples=10, deadline=None)
@given(st.binary(max_size=300))
def test_check_config_cli_never_prints_a_traceback(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("cfg") / "c.json"
    path.write_bytes(blob)
    proc = subprocess.run([sys.executable, "-m", "nfshunt", "check-config", str(path)], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode in (0, 2)
    assert "Traceback" not in proc.stderr


def _nlmsg(mtype, flags, payload):
    return struct.pack("=IHHII", 16 + len(payload), mtype, flags, 1, 0) + payload


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400))
def test_random_netlink_datagrams_are_counted_never_raised(blob):
    """Each conntrack message of the datagram is an event or counted as malformed (one
    count); a length that runs past the datagram is counted and ends it; messages of other
    subsystems and types are not conntrack events, skipped."""
    bad = []
    events = parse_datagram(blob, 0.0, bad.append)
    assert len(events) + len(bad) == _outcomes(blob) and all(isinstance(what, str) and what for what in bad)
    assert all(ev.orig.family in (4, 6) for ev in events)


def _outcomes(blob):
    """What parse_datagram must report for `blob`, walked independently: one outcome per
    conntrack NEW or DELETE message, one for a bad length (which ends the walk)."""
    count, offset = 0, 0
    while offset + 16 <= len(blob):
        length, mtype = struct.unpack_from("=IH", blob, offset)
        if length < 16 or offset + length > len(blob):
            return count + 1
        count += mtype >> 8 == 1 and mtype & 0xFF in (0, 2)
        offset += (length + 3) & ~3
    return count


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=200), st.sampled_from([0, 0x400]))
def test_ctnetlink_headers_with_garbage_bodies_are_counted(body, flags):
    # A conntrack NEW/UPDATE header (subsystem 1, message 0) around random attributes.
    bad = []
    data = _nlmsg((1 << 8) | 0, flags, b"\x02\x00\x00\x00" + body)
    events = parse_datagram(data, 0.0, bad.append)
    assert len(events) + len(bad) == 1  # an event, or counted: never silently dropped


def test_truncated_and_oversized_lengths_are_reported():
    bad = []
    assert parse_datagram(struct.pack("=IHHII", 4, 256, 0, 0, 0), 0.0, bad.append) == []
    assert parse_datagram(struct.pack("=IHHII", 9999, 256, 0, 0, 0), 0.0, bad.append) == []
    assert len(bad) == 2


# --- issue 26.7: files, keys and control requests that used to crash or hang ---------------

def _config_file(tmp_path, text):
    path = tmp_path / "nfshunt.json"
    path.write_text(text)
    return str(path)


def _refused(raw_or_path, key, *problems):
    with pytest.raises(ConfigError) as info:
        load(raw_or_path) if isinstance(raw_or_path, str) else from_dict(raw_or_path)
    assert info.value.key == key, str(info.value)
    for problem in problems:
        assert problem in info.value.problem, str(info.value)


def _with(**kw):
    raw = json.loads(json.dumps(BASE))
    raw.update(kw)
    return raw


@pytest.mark.parametrize("where,key", [
    ('"listen_port": N', "listen_port"),
    ('"ports": [{"fast": N, "slow": 2, "physdevin": 1}]', "ports[0].fast"),
    ('"mark_actions": {"0": -N}', "mark_actions.0"),
])
def test_a_number_of_thousands_of_digits_is_refused_naming_its_key_and_the_limit(tmp_path, where, key):
    raw = json.loads(json.dumps(BASE))
    raw.pop(key.split("[")[0].split(".")[0], None)  # given once: a duplicate key is refused too
    text = json.dumps(raw)[:-1] + ", " + where.replace("N", "9" * 5000) + "}"
    _refused(_config_file(tmp_path, text), key, "5000 digits", f"limit is {jsonfile.MAX_DIGITS}")


def test_the_check_config_command_names_the_key_of_a_huge_number(tmp_path):
    path = _config_file(tmp_path, json.dumps(BASE)[:-1] + ', "listen_port": ' + "1" * 5000 + "}")
    proc = subprocess.run([sys.executable, "-m", "nfshunt", "check-config", path], capture_output=True,
                          text=True, cwd=REPO, timeout=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'listen_port': a number of 5000 digits" in proc.stderr


def test_a_fifo_as_the_config_file_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "nfshunt.json"
    os.mkfifo(fifo)
    # Nothing ever writes the FIFO: a blocking open would wait for ever (timeout fails the test).
    proc = subprocess.run([sys.executable, "-m", "nfshunt", "check-config", str(fifo)], capture_output=True,
                          text=True, cwd=REPO, timeout=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is not a regular file" in proc.stderr


@pytest.mark.parametrize("path", ["/dev/null", "DIR"])  # not /dev/zero: a regression would eat memory
def test_only_a_regular_file_is_read_as_config(tmp_path, path):
    _refused(str(tmp_path) if path == "DIR" else path, "", "is not a regular file")


def test_a_config_file_over_the_size_limit_is_refused(tmp_path):
    text = json.dumps(BASE)
    path = _config_file(tmp_path, text + " " * (MAX_CONFIG_BYTES + 1 - len(text)))
    _refused(path, "", f"larger than {MAX_CONFIG_BYTES} bytes")
    path = _config_file(tmp_path, text + " " * (MAX_CONFIG_BYTES - len(text)))
    load(path)  # at the limit: read


def test_a_config_nested_past_the_limit_is_refused_naming_where(tmp_path):
    _refused(_config_file(tmp_path, "[" * 60000), "", "nested deeper than")
    deep = json.dumps(_with(listen_address=json.loads("[" * 40 + "]" * 40)))
    _refused(_config_file(tmp_path, deep), "listen_address" + "[0]" * (jsonfile.MAX_DEPTH - 1),
             f"nested deeper than {jsonfile.MAX_DEPTH} levels")


PATH_KEYS = [
    ({"control_socket": "/run/nfshunt/a\0b.sock"}, "control_socket"),
    ({"audit_log": "/var/log/nfshunt/a\0b.log"}, "audit_log"),
    ({"state_dir": "/var/lib/nfs\0hunt"}, "state_dir"),
    ({"pair": {"state_file": "/var/lib/nfshunt/pa\0ir.json"}}, "pair.state_file"),
    ({"tls": {"private_key": "/etc/nfshunt/k\0ey.pem", "certificate": "/etc/nfshunt/cert.pem"}},
     "tls.private_key"),
]


@pytest.mark.parametrize("overrides,key", PATH_KEYS)
def test_a_nul_byte_in_a_path_key_is_refused(overrides, key):
    _refused(_with(**overrides), key, "contains a NUL byte")


@pytest.mark.parametrize("key", sorted(TOP_LEVEL))
def test_no_key_takes_a_nul_byte(key):
    # A path key added later is covered too: a NUL would cut the name the kernel sees.
    with pytest.raises(ConfigError) as info:
        from_dict(_with(**{key: "/var/lib/nfshunt/a\0b"}))
    assert info.value.key == key


@pytest.mark.parametrize("overrides,key", [
    ({"control_socket": "/run/nfshunt/\ud800.sock"}, "control_socket"),
    ({"audit_log": "/var/log/\udcff.log"}, "audit_log"),
])
def test_a_path_that_is_not_utf8_text_is_refused(overrides, key):
    _refused(_with(**overrides), key, "not UTF-8")


@pytest.mark.parametrize("name", ["fw-eth0\n", "fw\neth0", " fw-eth0", "fw/eth0", "fw:0", "fw eth0", ".", "..",
                                  "fw-eth0123456789", "", "fw-\u0661"])
@pytest.mark.parametrize("where", ["bridge", "bridge_port", "switches"])
def test_bad_interface_names_are_refused(where, name):
    if where == "bridge":
        raw, key = _with(bridge=name), "bridge"
    elif where == "bridge_port":
        raw = _with()
        raw["ports"][1]["bridge_port"] = name
        raw, key = raw, "ports[1].bridge_port"
    else:
        raw = _with()
        ports = raw.pop("ports")
        ports[0]["bridge_port"] = name
        raw["switches"] = [{"datapath_id": "a1", "ports": ports}]
        key = "switches[0].ports[0].bridge_port"
    with pytest.raises(ConfigError) as info:
        from_dict(raw)
    assert info.value.key == key


def test_an_interface_name_of_15_bytes_is_accepted():
    assert from_dict(_with(bridge="b" * 15)).bridge == "b" * 15


@pytest.mark.parametrize("dpid", ["0x_1_2", "1_2", "\u0661\u0662", "\uff11\uff12", " a1", "a1 ", "a1\n", "+a1",
                                  "-1", "0x", "", "0x00000000000000001", "1:2:3:4:5:6:7:8:9", "a1::b2", ":a1",
                                  "a1:", "001:02", "0xa1:b2"])
def test_a_datapath_id_is_ascii_hex_only(dpid):
    _refused(_with(datapath_id=dpid), "datapath_id", "not a hexadecimal datapath id")


@pytest.mark.parametrize("dpid,value", [("a1", 0xA1), ("0xA1", 0xA1), ("00000000000000a1", 0xA1),
                                        ("00:00:00:00:00:00:00:a1", 0xA1), ("ffffffffffffffff", 2**64 - 1),
                                        (161, 161), ("0:1", 1)])
def test_a_datapath_id_in_hex_or_as_an_integer_is_accepted(dpid, value):
    assert from_dict(_with(datapath_id=dpid)).switches[0].datapath_id == value


# --- the pair state file ------------------------------------------------------------------

@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, '{"role": "master", "generation": ' + "7" * 5000 + "}",
                                  '{"role": "master", "role": "master", "generation": 3}',
                                  '{"role": "master", "generation": 3}' + " " * 5000])
def test_a_bad_pair_state_file_starts_as_backup(tmp_path, caplog, text):
    path = tmp_path / "pair.json"
    path.write_text(text)
    roles = Roles(str(path), start_role="master")
    assert roles.wanted == "backup" and roles.generation == 0
    assert "cannot read the pair state file" in caplog.text


def test_a_fifo_as_the_pair_state_file_starts_as_backup_without_hanging(tmp_path, caplog):
    path = tmp_path / "pair.json"
    os.mkfifo(path)
    done: list[Roles] = []
    worker = threading.Thread(target=lambda: done.append(Roles(str(path), start_role="master")), daemon=True)
    worker.start()
    worker.join(10)
    if not done:  # unblock the open so the thread ends, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO as the state file hung")
    assert done[0].wanted == "backup" and "not a regular file" in caplog.text


def test_a_good_pair_state_file_is_still_read(tmp_path):
    path = tmp_path / "pair.json"
    path.write_text('{"role": "master", "generation": 12}')
    roles = Roles(str(path))
    assert (roles.wanted, roles.generation) == ("master", 12)


# --- the control socket -------------------------------------------------------------------

@pytest.fixture
def control(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the control socket answers root only")
    seen: list[dict] = []

    def handle(request):
        seen.append(request)
        return {"ok": True}
    server = ControlServer(str(tmp_path / "ctl" / "nfshunt.sock"), handle)
    server.start()
    yield server, seen
    server.stop()


def _ask_raw(path, data: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(data)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = sock.recv(1 << 16)
            assert chunk, f"the server closed without answering (got {answer!r})"
            answer += chunk
    return json.loads(answer)


def test_a_deeply_nested_request_gets_an_error_and_the_server_goes_on(control):
    server, seen = control
    reply = _ask_raw(server.path, b"[" * 60000 + b"\n")
    assert "nested deeper than" in reply["error"]
    assert request(server.path, {"cmd": "status"}) == {"ok": True} and seen == [{"cmd": "status"}]


def test_a_request_over_the_size_limit_is_answered_too_large(control):
    server, seen = control
    for size in (MAX_REQUEST + 1, 4 * MAX_REQUEST):
        reply = _ask_raw(server.path, b'{"cmd": "status", "reason": "' + b"x" * size + b'"}\n')
        assert reply == {"error": f"request too large (limit {MAX_REQUEST} bytes)"}
    # Without a newline at all: the same answer, not a wait for more.
    assert "too large" in _ask_raw(server.path, b"x" * (MAX_REQUEST + 1))["error"]
    assert seen == []
    # At the limit (the newline not counted): handled.
    pad = MAX_REQUEST - len(b'{"cmd": "status", "reason": ""}')
    assert _ask_raw(server.path, b'{"cmd": "status", "reason": "' + b"x" * pad + b'"}\n') == {"ok": True}


def test_a_huge_number_in_a_request_is_refused_naming_its_key(control):
    server, seen = control
    reply = _ask_raw(server.path, b'{"cmd": "unshunt", "ct_id": ' + b"9" * 5000 + b"}\n")
    assert reply["error"] == f"bad request: ct_id: a number of 5000 digits (the limit is {jsonfile.MAX_DIGITS})"
    assert seen == []


# --- the shared reader --------------------------------------------------------------------

@pytest.mark.parametrize("text,key,problem", [
    ('{"a": [1, {"b": -' + "1" * 101 + "}]}", "a[1].b", "101 digits (the limit is 100)"),
    ('{"a": 1, "a": 2}', "a", "appears twice"),
    ('{"a": ' * 33 + "1" + "}" * 33, ".".join("a" * 32), "nested deeper than 32 levels"),
    (b"\xff", "", "doc is not UTF-8"),
])
def test_the_shared_reader_names_where_and_the_limit(text, key, problem):
    with pytest.raises(jsonfile.JsonInputError) as info:
        jsonfile.parse(text, "doc")
    assert info.value.key == key and problem in info.value.problem


def test_the_shared_reader_keeps_numbers_up_to_the_limit():
    assert jsonfile.parse("[" + "9" * jsonfile.MAX_DIGITS + ", 1.5e400]", "doc")[0] == int("9" * jsonfile.MAX_DIGITS)


def test_a_peer_that_is_not_root_gets_its_refusal_even_when_it_sends_after_the_answer(control, monkeypatch):
    """The refusal is sent before the request is read: closed with the request unread, the
    socket reset and the client (which sends, then reads) lost the answer now and then."""
    import struct
    import time

    from nfshunt.app import control as ctl
    server, seen = control

    class NotRoot:
        size = ctl.SO_PEERCRED_FMT.size

        @staticmethod
        def unpack(_data):
            return (1, 1000, 1000)  # pid, uid, gid of an ordinary user
    monkeypatch.setattr(ctl, "SO_PEERCRED_FMT", NotRoot)
    assert struct.calcsize("3i") == NotRoot.size
    for _ in range(5):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(server.path)
            time.sleep(0.05)  # the server has answered and would have closed by now
            sock.sendall(b'{"cmd": "status"}\n')
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                assert chunk, f"the server closed without answering (got {answer!r})"
                answer += chunk
        assert json.loads(answer) == {"error": "permission denied: the control socket is for root only"}
    assert seen == [] and server.refused == 5


@pytest.mark.parametrize("depth", [1, 2, jsonfile.MAX_DEPTH - 2, jsonfile.MAX_DEPTH - 1, jsonfile.MAX_DEPTH,
                                   jsonfile.MAX_DEPTH + 1, 40])
@pytest.mark.parametrize("number", ["1", "9" * jsonfile.MAX_DIGITS, "-" + "9" * jsonfile.MAX_DIGITS,
                                    "9" * (jsonfile.MAX_DIGITS + 1), '"' + "9" * 200 + '"', '"[[[{{{"'])
@pytest.mark.parametrize("shape", ['{"a": [1, {"b": %s}], "c": [[], {}]}', '[{"x": 2}, "s", %s]', '{"n": %s}', "%s"])
def test_a_document_is_walked_when_it_may_break_a_bound(depth, number, shape):
    """parse walks the tree (_check_tree) only for a text of more than MAX_DEPTH brackets or
    a run of more than MAX_DIGITS digits: it must answer as if it walked every document."""
    text = "[" * depth + shape % number + "]" * depth
    value = json.loads(text, parse_int=jsonfile._parse_int, object_pairs_hook=jsonfile._no_duplicates)
    try:
        jsonfile._check_tree(value)
        named = None
    except jsonfile.JsonInputError as exc:
        named = str(exc)
    if named is None:
        assert jsonfile.parse(text, "t") == json.loads(text)
    else:
        with pytest.raises(jsonfile.JsonInputError) as caught:
            jsonfile.parse(text, "t")
        assert str(caught.value) == named
