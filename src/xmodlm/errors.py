"""The one exception type a user can cause.

Anything a user can get wrong (a bad config value, a missing file, a corrupt
checkpoint) raises :class:`UserError` with a single line that says what was wrong
and what is allowed. The CLI prints that line to stderr and exits with status 2;
library callers can catch it. Broken invariants of our own code stay ``assert``s.
"""

from __future__ import annotations


class UserError(ValueError):
    """An error caused by user input; its message is one self-contained line."""
