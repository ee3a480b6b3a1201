"""The Edge's HTTP/1.1 listener: sockets, one cycle per request, pacing and disconnects.

``server`` accepts connections and reads requests with :mod:`iop_http`; ``cycle`` owns one
request's state and framing; ``head_desk`` and ``pacing`` refuse or pause a request on its head;
``disconnects`` watches for a client that leaves; ``asgi`` holds the helpers the apps share.
"""
