"""monitor.agent.config: defaults, config files (TOML, YAML), precedence, every error at once."""
import grp
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, subprocess_env
from monitor.agent import config
from ckptwatch import paths
from monitor.agent.config import Config, ConfigError, load


def test_defaults():
    cfg = load([])
    assert cfg == Config()
    assert cfg.listen_address == paths.DEFAULT_METRICS_ADDRESS == ":19400"
    assert cfg.socket == paths.default_socket_path()
    assert cfg.socket_mode == 0o660
    assert cfg.socket_group is None
    assert cfg.collision_window == 60.0
    assert cfg.collision_settle == 1.0
    assert cfg.collision_max_paths == 10000
    assert cfg.log_level == "info"
    assert cfg.journal_path.endswith(".jsonl")
    assert cfg.watch_attribution == "auto"


def test_flags_are_parsed_and_typed(tmp_path):
    cfg = load(["--web.listen-address", "127.0.0.1:0", "--ingest.socket", str(tmp_path / "s"),
                "--ingest.socket-mode=0600", "--collision.window", "2.5",
                "--collision.max-paths", "7", "--journal.backups", "0", "--log.level", "DEBUG"])
    assert cfg.listen_address == "127.0.0.1:0"
    assert cfg.socket == str(tmp_path / "s")
    assert cfg.socket_mode == 0o600
    assert cfg.collision_window == 2.5
    assert cfg.collision_max_paths == 7
    assert cfg.journal_backups == 0
    assert cfg.log_level == "debug"


def test_zero_window_allowed_negative_rejected():
    assert load(["--collision.window", "0"]).collision_window == 0.0
    with pytest.raises(ConfigError, match="collision.window"):
        load(["--collision.window", "-0.5"])


def test_socket_group_by_name_and_gid():
    group = grp.getgrgid(os.getgid())
    assert load(["--ingest.socket-group", group.gr_name]).socket_group == group.gr_gid
    assert load(["--ingest.socket-group", str(group.gr_gid)]).socket_group == group.gr_gid


def test_toml_nested_and_flat_keys(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('"collision.settle" = 0.25\n'
                    '[web]\nlisten-address = "127.0.0.1:19999"\n'
                    '[ingest]\nsocket-mode = 0o640\n'
                    '[collision]\nwindow = 5\n')
    cfg = load(["--config.file", str(path)])
    assert cfg.listen_address == "127.0.0.1:19999"
    assert cfg.socket_mode == 0o640
    assert cfg.collision_window == 5.0
    assert cfg.collision_settle == 0.25


def test_yaml_nested_and_flat_keys(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("web:\n  listen-address: '127.0.0.1:19998'\n"
                    "journal.max-bytes: 1000\n"
                    "ingest:\n  socket-mode: '0600'\n"
                    "log:\n  level: warning\n")
    cfg = load(["--config.file", str(path)])
    assert cfg.listen_address == "127.0.0.1:19998"
    assert cfg.journal_max_bytes == 1000
    assert cfg.socket_mode == 0o600
    assert cfg.log_level == "warn"


@pytest.mark.parametrize("spelling", ["warn", "warning", "WARN", "Warning", " warn "])
def test_log_level_takes_the_usual_spellings(spelling):
    # go-kit/Prometheus say "warn", Python says "warning"; f503c65 refused "warn".
    assert load(["--log.level", spelling]).log_level == "warn"
    assert load([f"--log.level={spelling.strip().upper()}"]).log_level == "warn"


def test_log_level_error_lists_the_levels():
    with pytest.raises(ConfigError) as info:
        load(["--log.level", "loud"])
    (error,) = info.value.errors
    assert error.startswith("--log.level: expected one of debug, info, warn, error")


def test_precedence_defaults_file_flags(tmp_path):
    path = tmp_path / "agent.yml"
    path.write_text("collision:\n  window: 5\n  settle: 0.5\n")
    cfg = load(["--config.file", str(path), "--collision.window", "9"])
    assert cfg.collision_window == 9.0          # flag beats file
    assert cfg.collision_settle == 0.5          # file beats default
    assert cfg.collision_max_paths == 10000     # default stays


def test_every_error_reported_at_once(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[web]\nlisten-adress = ":1"\n'        # typo: unknown key
                    '[collision]\nwindow = "soon"\n'        # wrong type
                    'max-paths = 0\n')
    with pytest.raises(ConfigError) as info:
        load(["--config.file", str(path), "--bogus", "--collision.settle", "-1",
              "--web.listen-address", "nonsense", "--ingest.socket-mode", "0999",
              "--ingest.socket-group", "no-such-group-cw", "--log.level", "loud"])
    text = "\n".join(info.value.errors)
    expected = ["web.listen-adress", "--bogus", "collision.window", "collision.max-paths",
                "--collision.settle", "--web.listen-address", "--ingest.socket-mode",
                "no-such-group-cw", "--log.level"]
    for needle in expected:
        assert needle in text, f"{needle!r} missing from errors:\n{text}"
    assert len(info.value.errors) == len(expected)


def test_unparseable_and_unknown_config_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("web: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load(["--config.file", str(broken)])
    with pytest.raises(ConfigError, match="unknown extension"):
        (tmp_path / "agent.ini").write_text("x=1")
        load(["--config.file", str(tmp_path / "agent.ini")])
    with pytest.raises(ConfigError, match="cannot read"):
        load(["--config.file", str(tmp_path / "missing.toml")])


def test_help_lists_every_flag_with_default():
    text = config.build_parser().format_help()
    for opt in config.OPTIONS:
        assert f"--{opt.flag}" in text
    assert "--config.file" in text
    assert "(default: :19400)" in text
    assert "(default: 0660)" in text


def _agent(*args):
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "agent.py"), *args],
                          capture_output=True, text=True, timeout=60, env=subprocess_env())


def test_agent_exits_2_listing_every_error():
    proc = _agent("--bad", "--collision.window", "-3", "--web.listen-address", "x")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert any("--bad" in line for line in lines)
    assert any("--collision.window" in line for line in lines)
    assert any("--web.listen-address" in line for line in lines)
    assert "Traceback" not in proc.stderr


def test_agent_help_shows_flags():
    proc = _agent("--help")
    assert proc.returncode == 0
    for opt in config.OPTIONS:
        assert f"--{opt.flag}" in proc.stdout


def test_watch_attribution_choices():
    assert load(["--watch.attribution", "proc"]).watch_attribution == "proc"
    assert load(["--watch.attribution", "FANOTIFY"]).watch_attribution == "fanotify"
    with pytest.raises(ConfigError) as info:
        load(["--watch.attribution", "ebpf"])
    assert "--watch.attribution" in "\n".join(info.value.errors)


def test_metrics_label_limits_flags_reach_the_exporter():
    cfg = load(["--metrics.max-jobs", "7", "--metrics.max-ranks", "9",
                "--metrics.max-label-length", "40", "--metrics.job-idle-expiry", "0"])
    limits = cfg.label_limits()
    assert (limits.max_jobs, limits.max_ranks, limits.max_value_length,
            limits.job_idle_expiry) == (7, 9, 40, 0.0)
    default = Config().label_limits()
    assert default.max_jobs == 100 and default.job_idle_expiry == 86400.0


def test_metrics_label_limits_are_validated_together():
    with pytest.raises(ConfigError) as err:
        load(["--metrics.max-jobs", "0", "--metrics.max-ranks", "many",
              "--metrics.max-label-length", "8", "--metrics.job-idle-expiry", "-1"])
    text = "\n".join(err.value.errors)
    for flag in ("metrics.max-jobs", "metrics.max-ranks", "metrics.max-label-length",
                 "metrics.job-idle-expiry"):
        assert flag in text
