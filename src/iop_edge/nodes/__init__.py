"""The node socket: node connections, their registration, heartbeats and runs.

``connection`` is the Edge's end of one WebSocket; ``links`` registers nodes and multiplexes
their runs; ``limits`` bounds what an unregistered peer may cost.
"""
