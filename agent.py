"""ckptwatch agent: `python agent.py [flags]`, the same daemon as `ckptwatch agent`.

A script, not an installed module (a wheel installs no top-level `agent`): the daemon's entry
point is monitor.agent.daemon.main, which `ckptwatch agent` calls too.
"""
import os
import sys

if __name__ == "__main__":
    # Run from a checkout without installing: the repository root holds monitor/.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from monitor.agent.daemon import main
    sys.exit(main())
