"""The tests phase's budget: a pytest plugin that starts no test it expects to end past a deadline.

    pytest -p gpu_check.budget --budget-deadline EPOCH_SECONDS ...

gpu_check.sh passes the tests phase's start plus its time limit, less the seconds pytest needs after
its last test (its summary and --durations). Before each test the plugin compares the time left with
the slowest test so far (the measured cost of the next, at worst): when it would not fit, the session
stops there, the terminal summary says "partial: N of M ran in the budget ...", and the exit status
is pytest's for the tests that ran (0 when all of them passed), not a timeout's. The phase's own
time limit stays behind it, for a single test that hangs.
"""

import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--budget-deadline", type=float, default=None,
                     help="seconds since the epoch after which no test should still be running (gpu_check.sh)")


def pytest_configure(config):
    deadline = config.getoption("budget_deadline")
    if deadline is not None:
        config.pluginmanager.register(Budget(deadline), "gpu_check_budget")


class Budget:
    """Counts the tests, measures each, and stops the session before one that would overrun."""

    def __init__(self, deadline, clock=time.time):
        self.deadline, self.clock = deadline, clock
        self.total = self.ran = 0
        self.slowest, self.stopped = 0.0, False

    def pytest_collection_finish(self, session):
        self.total = len(session.items)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        start = self.clock()
        yield
        self.ran += 1
        self.slowest = max(self.slowest, self.clock() - start)
        if nextitem is not None and self.clock() + self.slowest > self.deadline:
            self.stopped = True
            item.session.shouldstop = self.line()

    def line(self):
        return (f"partial: {self.ran} of {self.total} ran in the budget (the next would end past it: the "
                f"slowest so far took {self.slowest:.1f} s); {self.total - self.ran} not run")

    def pytest_terminal_summary(self, terminalreporter):
        if self.stopped:
            terminalreporter.write_line(self.line())

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        """A session stopped by the budget ends as the tests that ran say, not as interrupted."""
        if self.stopped and exitstatus == pytest.ExitCode.INTERRUPTED:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED if session.testsfailed else pytest.ExitCode.OK
