"""`llmgw bench`: a load generator for any OpenAI-compatible URL (a gateway or an engine).

Layout: a pure core — `distributions` (length specs such as ``uniform:64-512``), `workload`
(prompt text, conversations with growing history, arrival times), `stats` (percentiles,
throughput, TTFT/TPOT, errors by status), `sweep` (knee detection and the recommended
``scoring.target_waiting`` and endpoint ``weight``), `protocol` (request bodies, SSE decoding) and
`report` (results JSON, markdown) — and the I/O around it: `client` (aiohttp), `probe` (an
engine's ``/metrics`` during a sweep), `runner` (closed and open loops, the progress line),
`sweep_runner` (the levels of a sweep), `plot` (optional PNGs), `settings` (options checked) and
`main` (the command). `options` declares the command-line options and imports nothing heavy, so
the ``llmgw`` parser can be built without aiohttp. See docs/bench.md.
"""
