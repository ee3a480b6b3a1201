"""The Edge's front door: which completion requests are refused on their head, before a body is read.

``head_refusal`` is the one owner of that decision (overload shedding, a full queue, the API key,
tenants); ``overload`` holds the shedding decisions and the loop-lag sampler; ``queue_room`` tells
whether admission would queue a request now, per band and per tenant, counting those in transit.
"""
