"""OpenAI's API: chat and text completions, models (:mod:`.router`, :mod:`.protocol`,
:mod:`.streaming_events`), and the chat serving every dialect generates through
(:mod:`.prepare`, :mod:`.serving`)."""
