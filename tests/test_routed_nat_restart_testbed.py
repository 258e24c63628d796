"""A masqueraded transfer through a routing firewall survives a controller restart (docs/design/
routed.md 5.6; `experimental_routed`): on the masquerade bed behind a strict firewall (INVALID
dropped, no loose pickup: a NAT connection without its translated entry is dead), the restarted
controller pairs the NAT flows by their reply tuple and adopts them once the kept conntrack entry
is found with the same tuples; the same flows carry on (same cookies, not re-installed), no stall
over 1 s. A module of its own: a bed is one machine-wide lock (tests/test_routed_restart_testbed.py
holds the plain routed bed's)."""
from __future__ import annotations

import pytest

from tests.beds import Bed, Strict
from tests.test_routed_restart_testbed import KEEP, restart_keeps_the_pairs

pytestmark = [pytest.mark.integration, pytest.mark.testbed, pytest.mark.third_bed]

TESTBED = Bed(mode="routed", nat="masquerade", strict=Strict.FULL, config=KEEP)


def test_a_masqueraded_transfer_survives_a_controller_restart_with_its_nat_pairs_adopted(tb):
    restart_keeps_the_pairs(tb, nat=True, cport=47302)
