"""Shared pytest set-up: the worker pools of tests/harness.py live for the session."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    harness.shutdown()
