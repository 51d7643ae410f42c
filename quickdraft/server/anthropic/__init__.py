"""Anthropic's Messages API, translated onto the chat route: :mod:`.router`, :mod:`.protocol`,
:mod:`.translate`, :mod:`.streaming_events`."""
