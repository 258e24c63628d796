#!/bin/bash
# takedown.sh VARIANT CPORT: a 6 s echo connection h1 -> h2 through the strict masquerading fw; at 1.5 s its entry is deleted,
# at 2.5 s re-created by recreate.py VARIANT. Prints the client's result and the entry after.
F="ip netns exec nfsh-rt-fw"
$F conntrack -F 2>/dev/null
ip netns exec nfsh-rt-h1 python3 echo_client.py 10.0.2.1 6 $2 > /tmp/nfsh-rt-cli.txt &
sleep 1.5
entry=$($F conntrack -L -p tcp --sport $2 --dport 7000 2>/dev/null | head -1); echo "before: $entry"
nport=$(echo "$entry" | grep -o "dport=[0-9]*" | tail -1 | cut -d= -f2)
$F conntrack -D -p tcp --sport $2 --dport 7000 >/dev/null 2>&1
sleep 1
$F /opt/nfshunt-venv/bin/python recreate.py $1 10.0.1.1 $2 10.0.2.1 7000 10.0.2.254 $nport
echo "after:  $($F conntrack -L -p tcp --sport $2 --dport 7000 2>/dev/null | head -1)"
wait; cat /tmp/nfsh-rt-cli.txt
