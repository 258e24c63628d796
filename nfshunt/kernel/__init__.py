"""Conntrack over netlink: the codec, the listener, the worker."""
