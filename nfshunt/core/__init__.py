"""The decisions, pure (no I/O, no os-ken): a connection's states, the core's parts, the commands they return."""
