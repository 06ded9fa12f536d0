"""`met bench`: a load generator for OpenAI-compatible servers, sweep statistics, correctness
and speed gates against a `met serve` it starts itself, signed records, plots and floors.

Modules: ``loadgen`` (one streamed request, timed), ``prompts`` (prompts of a target token
length), ``stats`` (per-rung percentiles), ``sweep`` (the concurrency ladder), ``progress``,
``report`` (tables, JSON files, ``compare``), ``plot``, ``floors`` (TOML), ``records`` and
``signing`` (the `.benchmarks/` records and their Ed25519 signatures), ``server`` (a managed
`met serve` subprocess) and ``gates``.
"""
