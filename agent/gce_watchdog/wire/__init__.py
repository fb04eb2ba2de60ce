"""The wire format: the serial-line protocol and its event vocabulary, shared by agent and poller.

One module per idea: ``line`` (the v3 line format: encode, sign, verify, parse), ``keys``
(announcements, rotations), ``legacy`` (v1/v2), ``console`` (one console line, any version),
``stream`` and ``lazy`` (the stream decoder), ``vocab`` (the event names); ``protocol``
re-exports the public names of all but ``vocab``. Pure: no clock, sockets, files or logging.
"""
