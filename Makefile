# The README's two commands: `make demo` and `make test` (as root, on Debian 12).
VENV ?= /opt/nfshunt-venv
PY := $(VENV)/bin/python

.PHONY: deps demo demo-failover demo-routed-failover demo-vlan demo-routed test lint unit mutants experiments experiments-quick jitter jitter-quick bench bench-quick clean

deps:
	bash scripts/install-deps.sh

demo: deps
	$(PY) mininet/demo.py

# The firewall pair: the active firewall dies mid-transfer; what happened to each transfer.
demo-failover: deps
	$(PY) mininet/demo.py --failover

# The same for a pair of routing firewalls (docs/routed.md, "A firewall pair"): the new master
# rewrites the shunts with its MACs and tells the hosts.
demo-routed-failover: deps
	$(PY) mininet/demo.py --failover --routed

# The demo's table over VLAN trunks (docs/vlans.md): the same tuple in two VLANs, a translated VLAN.
demo-vlan: deps
	$(PY) mininet/demo.py --vlan

# The demo's table for a routing firewall (docs/routed.md; experimental_routed): the shunted path
# carries the router's rewrite (its MACs, the TTL one lower at the receiver).
demo-routed: deps
	$(PY) mininet/demo.py --routed

# Lint is part of the build: unused imports and names, dead code, likely bugs, import order
# (ruff) and the type check of every package (mypy, mypy.ini) fail it.
lint: deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The testbed's tests and the rest side by side (tests/run_suite.py).
test: lint
	$(PY) tests/run_suite.py

# The thesis experiments (mininet/experiments.py): full runs take about an hour;
# results/<experiment>-<time>/ gets CSV, PNG and a markdown report.
experiments: deps
	$(PY) mininet/experiments.py all

experiments-quick: deps
	$(PY) mininet/experiments.py all --quick

# Delay and jitter of a cyclic industrial stream by path, load on the firewall and cycle (30 cells
# of 60 s: about 35 min).
jitter: deps
	$(PY) mininet/experiments.py jitter

jitter-quick: deps
	$(PY) mininet/experiments.py jitter --quick

# Benchmarks of the shunting machinery (bench/run.py): results in bench/results/.
bench: deps
	$(PY) bench/run.py all

bench-quick: deps
	$(PY) bench/run.py all --quick

# The pure tests (no root, no testbed): everything not marked integration (conftest marks
# every test that needs the real parts).
unit:
	$(PY) -m pytest -q -p no:cacheprovider -m "not integration"

# Mutation testing of the decision modules (setup.cfg's [mutmut]: nfshunt/core, the mark's
# codec, the config's checks; docs/testing.md): each one-line change is run against the unit
# tests that reach it. Not part of make test: 30-50 min on a 2-core VM. Then the score
# per module; `mutmut results` lists the survivors, `mutmut show NAME` shows one.
mutants:
	$(VENV)/bin/mutmut run --max-children 2
	$(PY) scripts/mutation_score.py

clean:
	-ovs-vsctl --if-exists del-br s1
	-ip link del nfsmgmt0 2>/dev/null
	-mn -c >/dev/null 2>&1
	-pkill -f build/nfqdelay
	-pkill -f build/cyclic
