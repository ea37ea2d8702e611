"""The ckptwatch agent: observation (ingest, fs/) and judgment (detect/, verify/).

Layout (docs/architecture.md has the data flow and the import boundaries):
  daemon.py  the Agent object and its core loop     ingest.py  the hook's Unix socket server
  config.py  flags and config files                 logformat.py  the agent's log lines
  detect/    pure: events -> writes -> collisions, findings
  fs/        filesystem observation and attribution (watchdog, fanotify, /proc)
  verify/    checkpoint verification (no torch)
  cli/       the `ckptwatch` command (nothing imports it)
"""
