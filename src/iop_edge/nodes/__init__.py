"""The node socket: node connections, their registration, heartbeats and runs.

``registry`` decides who may register and keeps one live link per node; ``link`` is one
registered connection (its reader, its writer, its runs); ``runs`` is one run's channel;
``connection`` is the Edge's end of one WebSocket; ``peer_watch`` the stream under it and its
place in the pending count; ``limits`` bounds what an unregistered peer may cost.
"""
