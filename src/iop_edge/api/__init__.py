"""The OpenAI-compatible API served on the listener (contract: ``docs/openai-api.md``).

``app`` routes and answers; ``head_refusal``, ``overload`` and ``queue_room`` (with tenants:
whether admission too would refuse ``queue_full``) decide what is refused before a body is
read; ``failover`` retries before the first byte; ``tenant_charge`` prices a request for its
tenant; ``rejections`` and ``upstream_errors`` shape the error answers.
"""
