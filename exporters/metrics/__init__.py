"""Prometheus metrics: agent state -> metric families, served on /metrics and /healthz.

  state.py       MetricsState: the counters of events (writes, collisions, findings, rejected
                 inputs) with their bounded per-job series, updated as values are published
  collector.py   StateCollector (those series as families), build_registry()
  components.py  one collector per agent component (ingest, detector, job scope, filesystem
                 source, checks, journal, loop, HTTP server): reads it when scraped
  exporter.py    MetricsExporter: the exporters.fanout.Exporter that feeds MetricsState
  server.py      MetricsServer: HTTP(S) for the registry, /healthz and an index page
  listen.py      parse_listen_address(), for the server and the agent's flag validation

Metric names and labels are part of the stable contract (design.md, issue 2; deploy/ rules and
dashboards use them, tests/unit/test_metrics_exposition.py pins them). No label ever holds a file
path: paths are unbounded and would explode the series count; they live in the journal and
in `ckptwatch report` instead.

The training job's id is the label `training_job`, never `job`: Prometheus owns `job` (the
scrape job's name), and exporting it would need `honor_labels: true`, which the Prometheus
Operator may override. Label values that come from input (training_job, rank) are capped in
number and length (exporters.labels, issue 8), so no input can grow /metrics or the agent.
"""
