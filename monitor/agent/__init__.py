"""The daemon: the Agent object and its loop, configuration, logging, job-scope reports."""
