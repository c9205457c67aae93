"""`baton bench`: a load generator for any OpenAI-compatible endpoint (Baton, vLLM, SGLang).

One job per module: `distributions` parses length specs, `workload` builds the prompts,
`arrivals` times the requests, `client` sends one streamed request and times its tokens,
`runner` drives one load, `metrics` turns results into percentiles and goodput, `report`
and `plot` present them, and `command` is the CLI glue.
"""
