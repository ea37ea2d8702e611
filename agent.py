"""ckptwatch agent: `python agent.py [flags]`, the same daemon as `ckptwatch agent`.

Thin on purpose: flags and config live in monitor.config, the core loop in monitor.daemon.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Parse flags (exit code 2 on invalid configuration, every error listed) and run."""
    from monitor import config

    try:
        cfg = config.load(argv)
    except config.ConfigError as exc:
        for line in exc.errors:
            print(f"ckptwatch agent: {line}", file=sys.stderr)
        print("ckptwatch agent: invalid configuration (see --help)", file=sys.stderr)
        return 2
    except SystemExit as exc:   # --help
        return exc.code if isinstance(exc.code, int) else 0

    from monitor import daemon
    return daemon.run(cfg)


if __name__ == "__main__":
    sys.exit(main())
