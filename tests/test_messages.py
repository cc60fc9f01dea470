"""How a failure message reads (mla_conformance/messages.py): the headline with the margin, the likely cause on its
own line, the details; and what the results keep of it as a test's reason (the plugin's session)."""

import math

from mla_conformance.messages import bound_line, failure, headline, over, split_cause, times, with_cause
from mla_conformance.pytest_plugin.session import message_lines


def test_times_reads_at_a_glance():
    assert times(3.4712) == "3.47x" and times(22_450.0) == "22,000x" and times(123.4) == "120x"
    assert times(math.inf) == "inf x" and times(8e35) == "8.0e+35x"
    assert over(0.2245, 1e-5) == "0.225 vs bound 1e-05, 22,000x over"


def test_failure_puts_the_cause_second_and_moves_an_inline_one_there():
    msg = failure("op [case] check: out differs at (b, s, h, d) = (0, 1, 2, 3): error 0.5 vs bound 0.1, 5x over",
                  "got 1, expected 0.5", bound_line('OP_TOLERANCES["float32"]'),
                  cause="; likely cause: top-left causal alignment")
    assert msg.splitlines() == [
        "op check: out differs at (b, s, h, d) = (0, 1, 2, 3): error 0.5 vs bound 0.1, 5x over",
        "  likely cause: top-left causal alignment",
        "  got 1, expected 0.5",
        '  bound: OP_TOLERANCES["float32"] (docs/tolerances.md)',
        "  case: case"], "the case where() put after the op's name gets the last line"
    inline = failure("row 0 is NaN; likely cause: a read of an unwritten slot", "3 values")
    assert inline.splitlines() == ["row 0 is NaN", "  likely cause: a read of an unwritten slot", "  3 values"]
    assert split_cause("where (t=3); likely cause: padding") == ("where (t=3)", "padding")


def test_with_cause_inserts_after_the_headline():
    assert with_cause("head\n  got 1", "; likely cause: x") == "head\n  likely cause: x\n  got 1"
    assert with_cause("head\n  likely cause: y\n  got 1", "x") == "head\n  likely cause: x; y\n  got 1"
    assert with_cause("head", "") == "head" and headline("head\n  more") == "head"


def test_a_reason_keeps_the_message_lines_not_pytests_explanation():
    msg = "head\n  likely cause: x\n  got 1\nassert False\n +  where False = f()"
    assert message_lines(msg) == "head\n  likely cause: x\n  got 1"
    assert message_lines("one line") == "one line"
    long = message_lines("head\n  likely cause: " + "x" * 5000 + "\n  case: B=4")
    assert long.endswith("\n  case: B=4") and len(long) < 700, "a long cause does not push the case off the reason"
