"""NFShunt: an OpenFlow hybrid shunting firewall controller."""

__version__ = "0.1.0"
