"""When the controller hands a burst's freed memory back (nfshunt/trim.py)."""
from nfshunt.observe.trim import TRIM_AFTER, Trimmer, _malloc_trim


def test_trims_once_after_a_burst_has_settled():
    calls = []
    t = Trimmer(lambda pad: calls.append(pad) or 1)
    assert not t.tick(0, busy=False)  # nothing read yet
    assert not t.tick(TRIM_AFTER, busy=False)  # events still coming in this second
    assert not t.tick(TRIM_AFTER, busy=True)  # quiet, but installs wait for the switch
    assert t.tick(TRIM_AFTER, busy=False) and calls == [0]
    assert not t.tick(TRIM_AFTER, busy=False)  # nothing new since
    assert not t.tick(TRIM_AFTER + 5, busy=False) and not t.tick(TRIM_AFTER + 5, busy=False)  # too little
    assert calls == [0]


def test_the_library_function_is_found_on_glibc():
    assert _malloc_trim() is not None  # Debian: glibc
