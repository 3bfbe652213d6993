"""One admission check (interface.admission_error) for the scheduler and the engine client."""

from __future__ import annotations

from service.engine.interface import NotReady, QueueFull, admission_error


def test_admission_error_says_why_or_none() -> None:
    assert admission_error("ready", None, 3, 1, 4, 2) is None
    full = admission_error("ready", None, 3, 2, 4, 7)
    assert isinstance(full, QueueFull) and full.retry_after_s == 7
    assert str(full) == "3 prompts queued, limit 4"
    down = admission_error("failed", "boom", 0, 1, 4, 1)
    assert isinstance(down, NotReady) and str(down) == "engine is failed: boom"
    assert str(admission_error("loading", None, 0, 1, 4, 1)) == "engine is loading"
