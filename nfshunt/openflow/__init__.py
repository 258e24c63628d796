"""OpenFlow messages: the flow builder, reads and stats, requests in flight, the channel, a switch's session."""
