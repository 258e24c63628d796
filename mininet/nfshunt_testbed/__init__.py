"""The one testbed: every test, the demo, the experiments and the benchmarks build their
network with `bed.Testbed`. Its parts, one module each: `topology` (the fixed names and
addresses; the only place that builds nodes), `machine` (Open vSwitch's daemons, the
machine lock, settings put back), `controller` (configs, the iptables plumbing, controller
processes), `pair` (a firewall pair's conntrackd and keepalived), `observe` (flows,
counters, conntrack, where loss happened), `traffic` (iperf3, many connections), `linkemu`
(delay: netem, or NFQUEUE where netem is missing) and `cyclicstream` (the jitter
experiment's stream). Programs run as processes stay beside the package in mininet/."""
