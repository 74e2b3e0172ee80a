"""The step budget: stop the user's script cleanly after warm-up + N measured steps."""

from __future__ import annotations

__all__ = ["StepBudgetReached"]


class StepBudgetReached(BaseException):
    """Raised from the optimizer step hook when the budget is spent.

    A BaseException so that a script's `except Exception:` cannot swallow it; its
    `finally:` blocks still run. Every rank raises it after the same step, so the
    bootstrap can meet the other ranks at a barrier before tearing down.
    """

    def __init__(self, steps_done: int) -> None:
        super().__init__(f"step budget reached after {steps_done} steps")
        self.steps_done = steps_done
