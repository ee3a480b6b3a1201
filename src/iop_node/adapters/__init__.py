"""Adapters: how the Node talks to each kind of backend, behind one interface (``interface``).

``openai_compat`` for any OpenAI-compatible server, ``ollama`` for Ollama's native API,
``mock`` for an in-process fake.
"""
