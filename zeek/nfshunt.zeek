##! NFShunt as a NetControl backend: NetControl rules become requests to NFShunt's IDS
##! API (HTTP with JSON bodies, see nfshunt/ids/api.py), sent with ActiveHTTP::request
##! (curl underneath), which every Zeek version has: no Broker, no record layouts.
##!
##!   @load ./nfshunt
##!   event NetControl::init()
##!       {
##!       local p = NetControl::create_nfshunt(NetControl::NFShuntConfig(
##!           $url="http://127.0.0.1:9754", $header_file="/etc/nfshunt/zeek.header"));
##!       NetControl::activate(p, 0);
##!       }
##!
##! What NFShunt takes:
##!   DROP on a CONNECTION, target FORWARD     -> block of the connection (drop_connection)
##!   DROP on a FLOW or CONNECTION, MONITOR    -> shunt of the connection (shunt_flow); a flow
##!                                               must name both hosts and both ports
##!   DROP on an ADDRESS, target FORWARD       -> block of the address or prefix (drop_address,
##!                                               catch-and-release)
##!   WHITELIST on an ADDRESS                  -> whitelist: exempt from IDS blocks
##! Anything else (REDIRECT, MODIFY, MAC, wildcard flows) is answered rule_error with the reason.
##! NFShunt expires rules itself (hard expiry, across restarts of either side): when a
##! rule's time is up this script asks for it (DELETE) and reports rule_timeout with the
##! packet and byte counts NFShunt answers. Written for Zeek 5.0 or later (`when` with
##! capture lists); not run against a real Zeek here (see the README).

@load base/frameworks/netcontrol
@load base/utils/active-http

module NetControl;

export {
	type NFShuntConfig: record {
		## NFShunt's IDS API (its ids.listen_address and ids.listen_port); https:// with TLS.
		url: string &default="http://127.0.0.1:9754";
		## A file (mode 0600) of one line "Authorization: Bearer <token>": curl reads it
		## (-H @file), so the token is on no command line.
		header_file: string;
		## More curl arguments, e.g. "--cacert /etc/nfshunt/ca.pem" (or client certificates).
		curl_args: string &default="";
		## The expiry of a rule that has none: NFShunt's rules always expire.
		default_expire: interval &default=1hr;
		## How long one request may take.
		max_time: interval &default=10sec;
	};

	## A NetControl plugin instance that sends its rules to NFShunt.
	global create_nfshunt: function(config: NFShuntConfig) : PluginState;

	## Why NFShunt cannot take a rule; "" if it can.
	global nfshunt_refusal: function(r: Rule) : string;

	## The body of the POST /v1/rules that adds a rule NFShunt can take.
	global nfshunt_body: function(p: PluginState, r: Rule) : string;

	## A rule's expiry has come: NFShunt removed it; ask for its counters, report the timeout.
	global nfshunt_expired: event(p: PluginState, r: Rule);

	redef record PluginState += {
		nfshunt_config: NFShuntConfig &optional;
	};
}

# Rules NFShunt holds for us, by id: their expiry is still to be reported.
global nfshunt_live: set[string];

function nfshunt_name(p: PluginState) : string
	{
	return fmt("NFShunt-%s", p$nfshunt_config$url);
	}

function nfshunt_is_host(s: subnet) : bool
	{
	return (is_v4_subnet(s) && subnet_width(s) == 32) || (is_v6_subnet(s) && subnet_width(s) == 128);
	}

function nfshunt_refusal(r: Rule) : string
	{
	local e = r$entity;
	if ( |r$id| > 128 || ! (/[A-Za-z0-9._:@~-]+/ == r$id) )
		return fmt("NFShunt takes rule ids of 1-128 of A-Z a-z 0-9 . _ : @ ~ - (not %s)", r$id);
	if ( r$ty == REDIRECT || r$ty == MODIFY )
		return "NFShunt does not redirect or modify traffic: it shunts, blocks and whitelists";
	if ( e$ty == MAC )
		return "NFShunt matches IP connections and addresses, not MAC addresses";
	if ( r$ty == WHITELIST )
		return e$ty == ADDRESS ? "" : "NFShunt whitelists addresses and prefixes only";
	if ( e$ty == ADDRESS )
		return r$target == FORWARD ? "" : "NFShunt shunts connections, not whole addresses";
	local pt: port;
	if ( e$ty == CONNECTION )
		pt = e$conn$orig_p;
	else
		{
		if ( r$target != MONITOR )
			return "NFShunt blocks connections and addresses, not flows: use drop_connection or drop_address";
		local f = e$flow;
		if ( ! (f?$src_h && f?$dst_h && f?$src_p && f?$dst_p) || f?$src_m || f?$dst_m
		     || ! nfshunt_is_host(f$src_h) || ! nfshunt_is_host(f$dst_h) )
			return "NFShunt shunts whole connections: a flow must name both hosts and both ports";
		pt = f$src_p;
		}
	local proto = get_port_transport_proto(pt);
	if ( proto != tcp && proto != udp )
		return "NFShunt shunts and blocks TCP and UDP connections only";
	return "";
	}

function nfshunt_expire(p: PluginState, r: Rule) : interval
	{
	return r?$expire && r$expire > 0secs ? r$expire : p$nfshunt_config$default_expire;
	}

function nfshunt_body(p: PluginState, r: Rule) : string
	{
	local e = r$entity;
	local expire = interval_to_double(nfshunt_expire(p, r));
	if ( e$ty == ADDRESS )
		# nfshunt-body: address
		return fmt("{\"id\": \"%s\", \"action\": \"%s\", \"address\": \"%s\", \"priority\": %d, \"expire\": %.3f}",
		           r$id, r$ty == WHITELIST ? "whitelist" : "block", e$ip, r$priority, expire);

	local src: addr;
	local dst: addr;
	local sport: port;
	local dport: port;
	if ( e$ty == CONNECTION )
		{
		src = e$conn$orig_h;
		sport = e$conn$orig_p;
		dst = e$conn$resp_h;
		dport = e$conn$resp_p;
		}
	else
		{
		src = subnet_to_addr(e$flow$src_h);
		sport = e$flow$src_p;
		dst = subnet_to_addr(e$flow$dst_h);
		dport = e$flow$dst_p;
		}
	# nfshunt-body: connection
	return fmt("{\"id\": \"%s\", \"action\": \"%s\", \"connection\": {\"protocol\": \"%s\", \"src\": \"%s\", \"sport\": %d, \"dst\": \"%s\", \"dport\": %d}, \"priority\": %d, \"expire\": %.3f}",
	           r$id, r$target == MONITOR ? "shunt" : "block", get_port_transport_proto(sport), src,
	           port_to_count(sport), dst, port_to_count(dport), r$priority, expire);
	}

function nfshunt_request(p: PluginState, method: string, path: string, body: string) : ActiveHTTP::Request
	{
	local c = p$nfshunt_config;
	local args = fmt("-H %s -H %s", safe_shell_quote(cat("@", c$header_file)),
	                 safe_shell_quote("Content-Type: application/json"));
	if ( c$curl_args != "" )
		args = cat(args, " ", c$curl_args);
	local req = ActiveHTTP::Request($url=cat(c$url, path), $method=method, $max_time=c$max_time,
	                                $addl_curl_args=args);
	if ( body != "" )
		req$client_data = body;
	return req;
	}

# NFShunt's answer to a DELETE carries the rule's counters as "packets":N and "bytes":N.
function nfshunt_flow_info(body: string) : FlowInfo
	{
	local info = FlowInfo();
	local m = match_pattern(body, /"packets":[0-9]+/);
	if ( m$matched )
		info$packet_count = to_count(sub(m$str, /"packets":/, ""));
	m = match_pattern(body, /"bytes":[0-9]+/);
	if ( m$matched )
		info$byte_count = to_count(sub(m$str, /"bytes":/, ""));
	return info;
	}

function nfshunt_add_rule(p: PluginState, r: Rule) : bool
	{
	local why = nfshunt_refusal(r);
	if ( why != "" )
		{
		event NetControl::rule_error(r, p, why);
		return T;
		}
	local req = nfshunt_request(p, "POST", "/v1/rules", nfshunt_body(p, r));
	when [p, r, req] ( local resp = ActiveHTTP::request(req) )
		{
		local body = resp?$body ? resp$body : "";
		# 201: added, on the switch; 202: added, pending (the body says what it waits for);
		# 200: exists; anything else: an error, its reason in the body.
		if ( resp$code == 201 || resp$code == 202 || resp$code == 200 )
			{
			add nfshunt_live[r$id];
			schedule nfshunt_expire(p, r) + 1sec { NetControl::nfshunt_expired(p, r) };
			if ( resp$code == 200 )
				event NetControl::rule_exists(r, p, body);
			else
				event NetControl::rule_added(r, p, body);
			}
		else
			event NetControl::rule_error(r, p, fmt("NFShunt answered %d: %s", resp$code, body));
		}
	return T;
	}

function nfshunt_remove_rule(p: PluginState, r: Rule, reason: string) : bool
	{
	if ( nfshunt_refusal(r) != "" )
		return F;
	delete nfshunt_live[r$id];
	local req = nfshunt_request(p, "DELETE", cat("/v1/rules/", r$id), "");
	when [p, r, req] ( local resp = ActiveHTTP::request(req) )
		{
		local body = resp?$body ? resp$body : "";
		if ( resp$code == 200 || resp$code == 404 )  # 404: gone already
			event NetControl::rule_removed(r, p, body);
		else
			event NetControl::rule_error(r, p, fmt("NFShunt answered %d to the removal: %s", resp$code, body));
		}
	return T;
	}

event NetControl::nfshunt_expired(p: PluginState, r: Rule)
	{
	if ( r$id !in nfshunt_live )
		return;  # removed meanwhile
	delete nfshunt_live[r$id];
	local req = nfshunt_request(p, "DELETE", cat("/v1/rules/", r$id), "");
	when [p, r, req] ( local resp = ActiveHTTP::request(req) )
		{
		event NetControl::rule_timeout(r, nfshunt_flow_info(resp?$body ? resp$body : ""), p);
		}
	}

global nfshunt_plugin = Plugin(
	$name=nfshunt_name,
	$can_expire=T,
	$add_rule=nfshunt_add_rule,
	$remove_rule=nfshunt_remove_rule
	);

function create_nfshunt(config: NFShuntConfig) : PluginState
	{
	return PluginState($nfshunt_config=config, $plugin=nfshunt_plugin);
	}
