"""Conntrack over netlink, as pyroute2 layers it: a pure codec (`codec`) under the
listener (`listener`), the worker (`worker`) and the direct requests (`table`)."""
