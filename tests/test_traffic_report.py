"""A stopped transfer's receiver report (nfshunt_testbed.traffic.stopped_report): the stop's own
errors are not failures, any other is; iperf3 writes a second error under the same key."""
from nfshunt_testbed.traffic import stopped_report

INTERVALS = '"intervals": [{"sum": {"start": 0, "end": 0.2, "bytes": 2500000}}], "end": {"sum_received": {"bytes": 9}}'


def test_a_stop_s_own_error_is_a_report():
    report = stopped_report('{"start": {}, ' + INTERVALS + ', "error": "the client has terminated"}')
    assert report["end"] == {"sum_received": {"bytes": 9}}
    assert report["server_output_json"]["intervals"][0]["sum"]["bytes"] == 2500000


def test_the_late_tcp_info_read_after_the_stop_is_not_a_failure():
    # The same key twice, as iperf3 3.12 writes it: json.loads alone sees only the second.
    out = ('{"start": {}, ' + INTERVALS + ', "error": "the client has terminated", '
           '"error": "getsockopt - Bad file descriptor"}')
    assert "error" not in stopped_report(out)


def test_the_late_read_without_the_stop_or_any_other_error_fails():
    assert stopped_report('{' + INTERVALS + ', "error": "getsockopt - Bad file descriptor"}') == \
        {"error": "getsockopt - Bad file descriptor"}
    out = '{' + INTERVALS + ', "error": "the client has terminated", "error": "select failed: Bad file descriptor"}'
    assert stopped_report(out) == {"error": "select failed: Bad file descriptor"}
    assert stopped_report('{"error": "unable to receive parameters from client"}')["error"].startswith("unable")


def test_no_report_or_an_unreadable_one_fails():
    assert stopped_report("") == {"error": "no output"}
    assert stopped_report("{not json") == {"error": "unreadable iperf3 output"}
