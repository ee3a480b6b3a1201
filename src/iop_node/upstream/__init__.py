"""The Node's HTTP to its backends, as httpcore cuts it: pool, HTTP/1.1, connection; one body poller.

``pool`` is the keep-alive pool (an ``httpx`` transport); ``http11`` writes a request with h11
and reads its answer (parsed by :class:`iop_http.AnswerParser`); ``connection`` is one
connection's socket (an :class:`iop_io.ByteStream`) and answer; ``poller`` reads every run's
body from one task; ``http_upstream`` is what the adapters call; ``abort`` holds a cancelled
run's request until its backend lets go.
"""
