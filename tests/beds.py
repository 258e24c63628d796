"""The integration tests' one testbed fixture family.

A module describes the testbed it needs as a `Bed` (a module-level `TESTBED = Bed(...)` for the
shared `tb` fixture in conftest.py); a test or fixture that needs one of its own, or several,
builds it with `running(Bed(...))`. Either way the bed is built by mininet/nfshunt_testbed/bed.py
(the one place that builds nodes), its controller has the switch before the first test runs,
the firewall is made as strict as asked, and everything is removed afterwards."""
from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


class Strict(enum.Enum):
    """How strict the firewall is beyond the testbed's policy."""
    NO = "no"
    INVALID_DROPPED = "invalid-dropped"  # INVALID dropped; loose pickup stays on
    FULL = "full"                        # INVALID dropped and no loose pickup: a connection
                                         # without its entry is dead (strict_firewalls)


@dataclass(frozen=True)
class Bed:
    # One of the testbed's modes (nfshunt_testbed/bed.py): nfshunt, firewall, direct, ha,
    # two-switch, or vlan (trunks: VLANs 100 and 200 with the same addresses, 30 bridged to
    # 301; tests/test_vlan.py, docs/vlans.md).
    mode: str = "nfshunt"
    of_version: str = "1.3"
    config: Mapping[str, Any] = field(default_factory=dict)
    strict: Strict = Strict.NO
    mtu: int | None = None
    switch_lag_ms: float | None = None
    switch_reorder: bool = False
    late_barriers: bool = False  # switch_lag_ms on the switch's barrier replies instead of its flow-mods
    host_offload: bool = False
    vrrp_gateway: bool = False  # mode "ha": a second VRRP instance on keepalived (a gateway address)
    nat: str | None = None  # routed: "masquerade" (or "snat", to h2's gateway) translates h1's subnet on its way
    pcp_stream: tuple[int, int] | None = None  # mode "vlan": (UDP port, PCP) the hosts' trunks tag with the PCP
    vlan: bool = False  # mode "ha": both firewalls on trunks, as mode vlan's (tests/test_vlan_ha.py)
    routed: bool = False  # mode "ha": both firewalls route, the gateways keepalived's (tests/test_routed_ha.py)


@contextmanager
def running(bed: Bed) -> Iterator[Any]:
    """The testbed `bed` describes, ready: the controller has the switch, the firewall is as
    strict as asked. Torn down on exit, also on failure or Ctrl-C."""
    from nfshunt_testbed.bed import Testbed
    from nfshunt_testbed.linkemu import Emulation
    emulation = Emulation(mtu=bed.mtu) if bed.mtu is not None else None
    with Testbed(mode=bed.mode, of_version=bed.of_version, config=dict(bed.config), emulation=emulation,
                 switch_lag_ms=bed.switch_lag_ms, switch_reorder=bed.switch_reorder,
                 late_barriers=bed.late_barriers, host_offload=bed.host_offload,
                 vrrp_gateway=bed.vrrp_gateway, nat=bed.nat, pcp_stream=bed.pcp_stream,
                 vlan=bed.vlan, routed=bed.routed) as tb:
        if tb.controlled and bed.mode != "ha":  # a pair's start waited for its election
            tb.wait_for_controller()
        if bed.strict is Strict.FULL:
            tb.strict_firewalls()
        elif bed.strict is Strict.INVALID_DROPPED:
            tb.strict_firewalls(loose_pickup=True)
        try:
            yield tb
        except BaseException:  # a test on a bed of its own failed: its controllers' logs, to read in CI
            if tb.controlled:
                for fw in tb.firewalls:
                    print(f"--- {fw.name}'s controller:\n{tb.controller_output(fw)[-6000:]}")
            raise
