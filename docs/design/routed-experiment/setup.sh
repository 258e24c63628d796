#!/bin/bash
# Routed bed: h1 (10.0.1.1, fd01::1) -- port1 [OVS nfshrt0] port2 -- fw-eth0 (10.0.1.254, fd01::fe)
#             h2 (10.0.2.1, fd02::1) -- port3 [OVS nfshrt0] port4 -- fw-eth1 (10.0.2.254, fd02::fe)
set -e
B=nfshrt0
for n in fw h1 h2; do ip netns add nfsh-rt-$n; ip -n nfsh-rt-$n link set lo up; done
ovs-vsctl add-br $B -- set bridge $B datapath_type=netdev fail_mode=secure protocols=OpenFlow13 \
  other_config:datapath-id=00000000000000e1
port() {  # $1 ns, $2 name in ns, $3 ofport
  ip link add nfshrt-p$3 type veth peer name nfshrt-t$3
  ip link set nfshrt-t$3 netns nfsh-rt-$1; ip -n nfsh-rt-$1 link set nfshrt-t$3 name $2
  ip link set nfshrt-p$3 up; sysctl -qw net.ipv6.conf.nfshrt-p$3.disable_ipv6=1
  ovs-vsctl add-port $B nfshrt-p$3 -- set interface nfshrt-p$3 ofport_request=$3
  ip -n nfsh-rt-$1 link set $2 up
}
port h1 eth0 1; port fw fw-eth0 2; port h2 eth0 3; port fw fw-eth1 4
ip -n nfsh-rt-h1 link set eth0 address 02:00:00:00:01:01
ip -n nfsh-rt-h2 link set eth0 address 02:00:00:00:02:01
ip -n nfsh-rt-fw link set fw-eth0 address 02:00:00:00:fe:00
ip -n nfsh-rt-fw link set fw-eth1 address 02:00:00:00:fe:01
for h in 1 2; do
  ip -n nfsh-rt-h$h addr add 10.0.$h.1/24 dev eth0
  ip -n nfsh-rt-h$h -6 addr add fd0$h::1/64 dev eth0 nodad
  ip -n nfsh-rt-h$h route add default via 10.0.$h.254
  ip -n nfsh-rt-h$h -6 route add default via fd0$h::fe
  ip -n nfsh-rt-fw addr add 10.0.$h.254/24 dev fw-eth$((h-1))
  ip -n nfsh-rt-fw -6 addr add fd0$h::fe/64 dev fw-eth$((h-1)) nodad
  ip netns exec nfsh-rt-h$h ethtool -K eth0 tx off >/dev/null 2>&1 || true
done
ip netns exec nfsh-rt-fw ethtool -K fw-eth0 tx off >/dev/null 2>&1 || true
ip netns exec nfsh-rt-fw ethtool -K fw-eth1 tx off >/dev/null 2>&1 || true
ip netns exec nfsh-rt-fw sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1
# default flows: fast <-> slow
for a in "1 2" "3 4"; do set -- $a
  ovs-ofctl -O OpenFlow13 add-flow $B "priority=1,in_port=$1,actions=output:$2"
  ovs-ofctl -O OpenFlow13 add-flow $B "priority=1,in_port=$2,actions=output:$1"
done
