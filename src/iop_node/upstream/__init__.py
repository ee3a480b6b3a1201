"""The Node's HTTP to its backends: a keep-alive pool, answers parsed by llhttp, one body poller.

``transport`` is the pool and its connections; ``response`` parses an answer; ``poller`` reads
every run's body from one task; ``http_upstream`` is what the adapters call.
"""
