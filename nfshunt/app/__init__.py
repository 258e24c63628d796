"""The process: the os-ken app (a shim), the operator API, the control socket, start-up."""
