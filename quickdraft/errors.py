"""User-facing errors.

Every failure a user can cause (a wrong path, an unknown model, a corrupt file, a bad sampling
value, a prompt that does not fit) raises :class:`QuickdraftError` with a message that says what
went wrong and what to do. The CLI prints the message without a traceback and exits with 2.
"""

from __future__ import annotations


class QuickdraftError(Exception):
    """An error caused by input or environment, with a message meant for the user."""
