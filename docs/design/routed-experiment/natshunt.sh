#!/bin/bash
# natshunt.sh liberal|plain CPORT: a 5 s iperf3 h1 -> h2 through the masquerading strict fw; at 1.5 s the NAT shunt's two
# flows go in (one add-flows), with or without the entry made liberal just before. The entry is kept (not deleted).
B=nfshrt0; F="ip netns exec nfsh-rt-fw"; C=$2
ip netns exec nfsh-rt-h1 iperf3 -c 10.0.2.1 -t 5 --cport $C -J > /tmp/nfsh-rt-iperf.json 2>&1 &
sleep 1.5
P=$($F conntrack -L -p tcp --sport $C --dport 5201 2>/dev/null | grep -o "dport=[0-9]*" | tail -1 | cut -d= -f2)
[ "$1" = liberal ] && $F /opt/nfshunt-venv/bin/python liberal.py 10.0.1.1 $C 10.0.2.1 5201
cat > /tmp/nfsh-rt-natflows.txt <<EOT
priority=100,tcp,in_port=1,nw_src=10.0.1.1,nw_dst=10.0.2.1,tp_src=$C,tp_dst=5201,actions=dec_ttl,set_field:02:00:00:00:fe:01->eth_src,set_field:02:00:00:00:02:01->eth_dst,set_field:10.0.2.254->ip_src,set_field:$P->tcp_src,output:3
priority=100,tcp,in_port=3,nw_src=10.0.2.1,nw_dst=10.0.2.254,tp_src=5201,tp_dst=$P,actions=dec_ttl,set_field:02:00:00:00:fe:00->eth_src,set_field:02:00:00:00:01:01->eth_dst,set_field:10.0.1.1->ip_dst,set_field:$C->tcp_dst,output:1
EOT
if [ -n "$GAP" ]; then head -1 /tmp/nfsh-rt-natflows.txt | ovs-ofctl -O OpenFlow13 add-flows $B -; sleep $GAP; tail -1 /tmp/nfsh-rt-natflows.txt | ovs-ofctl -O OpenFlow13 add-flows $B -; else ovs-ofctl -O OpenFlow13 add-flows $B /tmp/nfsh-rt-natflows.txt; fi
sleep 0.3; [ -n "$CAP" ] && { ip netns exec nfsh-rt-h2 timeout 1 tcpdump -nn -v -i eth0 -c 6 tcp 2>/dev/null | cut -c1-190; ip netns exec nfsh-rt-h1 timeout 1 tcpdump -nn -v -i eth0 -c 6 tcp 2>/dev/null | cut -c1-190; }
wait
python3 -c "
import json; d = json.load(open('/tmp/nfsh-rt-iperf.json'))
if 'error' in d: print('iperf3 error:', d['error'])
e = d.get('end', {}); s = e.get('sum_sent', {}); print('sent %.0f Mbit/s retransmits %s' % (s.get('bits_per_second', 0) / 1e6, s.get('retransmits')))
print('per second Mbit/s:', [round(i['sum']['bits_per_second'] / 1e6) for i in d.get('intervals', [])])"
ovs-ofctl -O OpenFlow13 dump-flows $B | grep priority=100 | grep -o "n_packets=[0-9]*" | paste -sd' '
ovs-ofctl -O OpenFlow13 del-flows $B "tcp,in_port=1"; ovs-ofctl -O OpenFlow13 del-flows $B "tcp,in_port=3"
