"""ckptwatch agent: `python agent.py [flags]`, the same daemon as `ckptwatch agent`.

A script, not an installed module (a wheel installs no top-level `agent`): both call
monitor.cli.main.agent_main, which answers --version and names a missing dependency in one
line before the daemon's imports could fail with a traceback.
"""
import os
import sys

if __name__ == "__main__":
    # Run from a checkout without installing: the repository root holds monitor/.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from monitor.cli.main import agent_main
    sys.exit(agent_main(sys.argv[1:]))
