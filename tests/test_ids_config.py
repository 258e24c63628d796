"""The `ids` config section: off unless configured, every key validated, safe defaults."""
import ipaddress
import os

import pytest

from nfshunt.config.settings import ConfigError
from tests.helpers import config


@pytest.fixture
def token(tmp_path):
    path = tmp_path / "token"
    path.write_text("zeek 0123456789abcdef0123\n")
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture
def pem(tmp_path):
    path = tmp_path / "cert.pem"
    path.write_text("not checked here\n")
    return str(path)


def test_off_by_default():
    assert config().ids is None


def test_defaults_are_safe(token):
    cfg = config(ids={"token_file": token}, state_dir="/var/lib/x")
    ids = cfg.ids
    assert ids.listen_address == "127.0.0.1" and ids.tls is None
    assert ids.may_shunt.prefixes == () and ids.may_shunt.ports == ()  # no IDS may shunt anything
    assert ids.state_file == "/var/lib/x/ids-rules.json"
    assert ids.max_rules > 0 and ids.rate_limit > 0 and ids.max_body_bytes <= 65536
    assert ids.max_prefix == {4: 16, 6: 48}
    assert ids.user == "nfshunt-ids" and not ids.shared_whitelists  # issue 36: unprivileged; own whitelists
    assert ids.max_connections_per_client < ids.max_connections and ids.rate_limit_unauthenticated < ids.rate_limit


def test_every_key(token, pem):
    cfg = config(ids={"listen_address": "192.0.2.1", "listen_port": 9999, "token_file": token,
                      "tls": {"certificate": pem, "private_key": pem, "client_ca": pem},
                      "may_shunt": {"prefixes": ["10.1.0.0/16", "fd00::/64"], "ports": [5201, "50000-50100"]},
                      "max_rules": 5, "rate_limit": 10, "max_body_bytes": 4096,
                      "max_prefix": {"ipv4": 24}, "max_connections": 8, "answer_timeout": 1.5,
                      "default_expire": 600, "state_file": "/tmp/x/rules.json"})
    ids = cfg.ids
    assert ids.may_shunt.prefixes == (ipaddress.ip_network("10.1.0.0/16"), ipaddress.ip_network("fd00::/64"))
    assert ids.may_shunt.ports == ((5201, 5201), (50000, 50100))
    assert ids.max_prefix == {4: 24, 6: 48} and ids.state_file == "/tmp/x/rules.json"
    assert ids.tls.client_ca == pem


def test_client_certificates_alone_authenticate(pem):
    cfg = config(ids={"tls": {"certificate": pem, "private_key": pem, "client_ca": pem}})
    assert cfg.ids.token_file is None


@pytest.mark.parametrize("ids,key,problem", [
    ({"token_file": "TOKEN", "colour": 1}, "ids.colour", "unknown key"),
    ({}, "ids.token_file", "required"),
    ({"token_file": "TOKEN", "listen_address": "192.0.2.1"}, "ids.listen_address", "needs TLS"),
    ({"token_file": "TOKEN", "listen_address": "::"}, "ids.listen_address", "needs TLS"),
    ({"token_file": "TOKEN", "listen_address": "localhost"}, "ids.listen_address", "not an IP address"),
    ({"token_file": "TOKEN", "listen_port": 0}, "ids.listen_port", "outside"),
    ({"token_file": "/nonexistent/token"}, "ids.token_file", "cannot read"),
    ({"token_file": "TOKEN", "may_shunt": {"prefixes": ["10.0.0.0/33"]}}, "ids.may_shunt.prefixes[0]",
     "not an IP address or network"),
    ({"token_file": "TOKEN", "may_shunt": {"prefixes": ["fd00::%eth0/64"]}}, "ids.may_shunt.prefixes[0]",
     "IPv6 scope id (%eth0)"),
    ({"token_file": "TOKEN", "may_shunt": {"ports": [0]}}, "ids.may_shunt.ports[0]", "outside"),
    ({"token_file": "TOKEN", "may_shunt": {"ports": ["9-1"]}}, "ids.may_shunt.ports[0]", "low end"),
    ({"token_file": "TOKEN", "may_shunt": {"ports": ["1-70000"]}}, "ids.may_shunt.ports[0]", "outside"),
    ({"token_file": "TOKEN", "may_shunt": {"hosts": []}}, "ids.may_shunt.hosts", "unknown key"),
    ({"token_file": "TOKEN", "max_rules": 0}, "ids.max_rules", "outside"),
    ({"token_file": "TOKEN", "rate_limit": "fast"}, "ids.rate_limit", "expected an integer"),
    ({"token_file": "TOKEN", "max_body_bytes": 10}, "ids.max_body_bytes", "outside"),
    ({"token_file": "TOKEN", "max_prefix": {"ipv4": 33}}, "ids.max_prefix.ipv4", "outside"),
    ({"token_file": "TOKEN", "tls": {"certificate": "/nonexistent", "private_key": "/nonexistent"}},
     "ids.tls.certificate", "does not exist"),
    ({"token_file": "TOKEN", "state_file": "relative.json"}, "ids.state_file", "absolute path"),
    ({"token_file": "TOKEN", "default_expire": 10**9}, "ids.default_expire", "outside"),
    ({"token_file": "TOKEN", "user": "root"}, "ids.user", "unprivileged"),
    ({"token_file": "TOKEN", "user": "a b"}, "ids.user", "not a user name"),
    ({"token_file": "TOKEN", "max_connections": 8, "max_connections_per_client": 9},
     "ids.max_connections_per_client", "over ids.max_connections"),
    ({"token_file": "TOKEN", "rate_limit_unauthenticated": 0}, "ids.rate_limit_unauthenticated", "outside"),
    ({"token_file": "TOKEN", "shared_whitelists": "yes"}, "ids.shared_whitelists", "expected"),
])
def test_bad_ids_config_names_the_key(token, ids, key, problem):
    ids = {k: token if v == "TOKEN" else v for k, v in ids.items()}
    with pytest.raises(ConfigError) as info:
        config(ids=ids)
    assert info.value.key == key
    assert problem in info.value.problem


def test_token_file_must_be_0600(token):
    os.chmod(token, 0o640)
    with pytest.raises(ConfigError) as info:
        config(ids={"token_file": token})
    assert info.value.key == "ids.token_file" and token in info.value.problem and "0640" in info.value.problem


def test_ids_port_not_another_listeners(token):
    with pytest.raises(ConfigError) as info:
        config(ids={"token_file": token, "listen_port": 6653})  # the OpenFlow port on 0.0.0.0
    assert info.value.key == "ids.listen_port" and "listen_port" in info.value.problem
    with pytest.raises(ConfigError) as info:
        config(metrics_address="127.0.0.1", ids={"token_file": token, "listen_port": 9753})
    assert "metrics_port" in info.value.problem
    assert config(listen_address="192.0.2.1", ids={"token_file": token, "listen_port": 6653}).ids.listen_port == 6653
