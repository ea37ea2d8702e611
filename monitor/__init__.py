"""The ckptwatch agent, one folder per stage of the data flow (docs/architecture.md draws it
and lists the import contracts):

  ingest/   the hook's Unix socket: server, codec, the inbox to the loop, notices and acks back
  agent/    the daemon (Agent object and loop), config, logging, job-scope reports
  detect/   pure: events -> writes -> collisions, findings; the model types exporters share
  fs/       filesystem observation and attribution (watchdog, fanotify, /proc)
  verify/   checkpoint verification (no torch) and a sender's access rights
  lint/     static analysis of training code
  cli/      the `ckptwatch` command and the private-agent launcher (nothing imports it)
"""
