"""The Node's links to its Edges: one reconnecting client per Edge URL, one session per connection.

``clients`` holds a client per URL; ``client`` reconnects with backoff; ``session`` registers,
heartbeats and serves runs; ``websocket``, ``outbox`` and ``relays`` move its frames;
``fence`` keeps the highest leader epoch seen.
"""
