"""Filesystem observation: watch checkpoint directories, name the processes that write them."""
