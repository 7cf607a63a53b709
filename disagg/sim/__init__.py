"""`disagg sim`: a discrete-event simulator of a disaggregated cluster on a virtual clock.

It drives the project's own pure modules (engine scheduler, KV cache manager, block pool, the
connectors' scheduler halves, the router's policies) and replaces only what takes time (a model
step, a transfer, an inline setup, an HTTP hop) with a cost model. No torch, threads or asyncio.
"""
