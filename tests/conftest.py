import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "mininet"))


def _missing_for_integration() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, Open vSwitch, iptables)"
    for tool in ("ovs-vsctl", "ovs-ofctl", "iptables-restore", "ip6tables-restore", "iperf3", "ethtool",
                 "tcpdump", "ping", "tc", "cc", "curl"):
        if shutil.which(tool) is None:
            return f"needs {tool} (run `make deps`)"
    if not os.path.exists("/usr/include/libnetfilter_queue/libnetfilter_queue.h"):
        return "needs libnetfilter-queue-dev for the NFQUEUE delay program (run `make deps`)"
    for module, package in (("mininet.net", "mininet"), ("scipy.stats", "python3-scipy"),
                            ("matplotlib", "python3-matplotlib")):
        try:
            __import__(module)
        except ImportError:
            return f"needs the Python module {module} (Debian package {package}; run `make deps`)"
    return None


@pytest.fixture(scope="session")
def integration_ready():
    reason = _missing_for_integration()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"integration prerequisites missing in CI: {reason}")
        print(f"\nSKIP reason: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def tb(request, integration_ready):
    """The module's testbed, as its `TESTBED = Bed(...)` describes (tests/beds.py)."""
    from tests.beds import running
    bed = getattr(request.module, "TESTBED", None)
    if bed is None:
        pytest.fail(f"{request.module.__name__} uses the tb fixture without a TESTBED")
    with running(bed) as built:
        yield built


@pytest.fixture(autouse=True)
def _controller_log_on_failure(request):
    """After a test on a testbed (`tb`, or a module's own fixture that yields one): the
    controller's log when the test failed (or NFSHUNT_SHOW_LOG is set), so that a failure in
    CI can be read without a re-run."""
    yield
    beds = [value for value in (request.node.funcargs or {}).values()  # None once pytest was interrupted
            if hasattr(value, "controller_output") and getattr(value, "controlled", False)]
    if beds:
        from tests.helpers import show_log_if_failed
        for bed in beds:
            show_log_if_failed(bed, request)


@pytest.fixture
def netns(integration_ready):
    """A fresh, empty network namespace, removed afterwards; yields a runner."""
    name = f"nfshunt-t{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)

    def run(*args, check=True, input=None):
        return subprocess.run(["ip", "netns", "exec", name, *args], check=check, capture_output=True,
                              text=True, input=input)
    run.name = name
    try:
        run("ip", "link", "set", "lo", "up")
        yield run
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def pytest_collection_modifyitems(items):
    """Every test that needs the real parts (the integration_ready fixture, directly or
    through another fixture) is an integration test, marked or not: `make unit` selects
    the rest by that marker."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "integration_ready" in fixtures:
            item.add_marker(pytest.mark.integration)
        if "tb" in fixtures:
            item.add_marker(pytest.mark.testbed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Lets fixtures see whether their test failed (item.rep_call), to print logs then."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
