"""Shared pytest set-up: build the native ops once up front; worker pools live for the session."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402


def pytest_sessionstart(session):
    # The first native build takes 25-80 s on 2 cores: pay it here, once, before any forked
    # worker (whose per-test timeout it would eat) and before the workers are forked.
    from parts.csrc import native
    native.available()
    # torch optimizers import torch._dynamo on their first step (about 9 s): once, pre-fork.
    import torch._dynamo  # noqa: F401


def pytest_sessionfinish(session, exitstatus):
    harness.shutdown()
