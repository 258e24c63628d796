#!/bin/bash
ovs-vsctl --if-exists del-br nfshrt0
for n in fw h1 h2; do ip netns del nfsh-rt-$n 2>/dev/null; done
for p in 1 2 3 4; do ip link del nfshrt-p$p 2>/dev/null; done
true
