"""Bad input never yields a traceback: fuzzed configs are accepted or refused with a
ConfigError naming a key; malformed netlink datagrams are counted and skipped."""
import json
import os
import struct
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nfshunt.config import TOP_LEVEL, ConfigError, from_dict
from nfshunt.conntrack import parse_datagram

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALID = json.load(open(os.path.join(REPO, "config", "nfshunt.json")))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
keys = st.one_of(st.sampled_from(sorted(TOP_LEVEL)), st.text(max_size=12))


def _check(raw):
    try:
        from_dict(raw)
    except ConfigError as exc:
        assert isinstance(exc.key, str) and exc.problem  # a message, naming the key where there is one


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=6))
def test_random_configs_are_accepted_or_refused_with_a_key(raw):
    _check(raw)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(VALID)), values)
def test_one_mutated_key_of_a_valid_config(key, value):
    raw = dict(VALID)
    raw[key] = value
    _check(raw)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1), st.sampled_from(["fast", "slow", "physdevin", "bridge_port", "extra"]), values)
def test_mutated_port_groups(index, field, value):
    raw = json.loads(json.dumps(VALID))
    raw["ports"][index % len(raw["ports"])][field] = value
    _check(raw)


@settings(max_examples=50, deadline=None)
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
    bad = []
    events = parse_datagram(blob, 0.0, bad.append)
    assert isinstance(events, list)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=200), st.sampled_from([0, 0x400]))
def test_ctnetlink_headers_with_garbage_bodies_are_counted(body, flags):
    # A conntrack NEW/UPDATE header (subsystem 1, message 0) around random attributes.
    bad = []
    data = _nlmsg((1 << 8) | 0, flags, b"\x02\x00\x00\x00" + body)
    events = parse_datagram(data, 0.0, bad.append)
    assert len(events) + len(bad) <= 1


def test_truncated_and_oversized_lengths_are_reported():
    bad = []
    assert parse_datagram(struct.pack("=IHHII", 4, 256, 0, 0, 0), 0.0, bad.append) == []
    assert parse_datagram(struct.pack("=IHHII", 9999, 256, 0, 0, 0), 0.0, bad.append) == []
    assert len(bad) == 2
