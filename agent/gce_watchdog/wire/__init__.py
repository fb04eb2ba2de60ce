"""The wire format: the serial-line protocol and its event vocabulary, shared by agent and poller.

Pure: no clock, sockets, files or logging.
"""
