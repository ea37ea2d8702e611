"""Pure judgment: hook and filesystem events -> writes -> collisions and findings.

No I/O, no threads, no clocks of its own (injected), no exporter imports.
"""
