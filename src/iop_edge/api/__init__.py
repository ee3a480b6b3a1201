"""The OpenAI-compatible API served on the listener (contract: ``docs/openai-api.md``).

``app`` routes and answers; ``request_body`` reads what the Edge decides on; ``responder``,
``relay`` write the answer; ``failover`` retries before the first byte; ``tenant_charge`` prices
a request for its tenant; ``rejections``, ``run_failure``, ``upstream_errors`` and ``not_leader``
shape the error answers. What is refused before a body is read is :mod:`iop_edge.front_door`'s.
"""
