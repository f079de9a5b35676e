"""The ``pigeon`` command: subcommands from plugins, ``pigeon plugins``, config errors."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click
import pluggy
import pytest
from click.testing import CliRunner

from pigeon.core import PluginManager
from pigeon.core._cli import make_cli

hookimpl = pluggy.HookimplMarker("pigeon")


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    # a developer's own PIGEON_* settings must not leak into these tests
    for name in list(os.environ):
        if name.startswith("PIGEON_"):
            monkeypatch.delenv(name)
    return CliRunner()


def test_help_lists_commands_from_every_package(runner: CliRunner) -> None:
    result = runner.invoke(make_cli(), ["--help"])
    assert result.exit_code == 0, result.output
    commands = result.output.split("Commands:")[1]
    listed = {line.split()[0] for line in commands.strip().splitlines() if line.strip()}
    assert {"standalone", "broker", "bookie", "produce", "consume", "perf", "plugins"} <= listed


def test_a_command_logs_in_key_value_lines_and_gives_the_root_logger_back(
    runner: CliRunner,
) -> None:
    class LoggingPlugin:
        @hookimpl
        def pigeon_cli_commands(self, group: click.Group) -> None:
            @group.command("say")
            def say() -> None:
                root = logging.getLogger()
                assert root.level == logging.WARNING
                assert len(root.handlers) == 1
                logging.getLogger("pigeon.test").warning("said")
                logging.getLogger("pigeon.test").info("not shown")

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    pm = PluginManager(load_entry_points=False, extra_plugins=(LoggingPlugin(),))
    result = runner.invoke(make_cli(pm), ["--log-level", "warning", "say"])
    assert result.exit_code == 0, result.output
    assert "level=WARNING logger=pigeon.test msg='said'" in result.output
    assert "not shown" not in result.output
    assert (root.handlers, root.level) == (handlers, level)


def test_disabled_plugin_commands_disappear(runner: CliRunner) -> None:
    result = runner.invoke(make_cli(PluginManager(disabled={"client"})), ["--help"])
    assert result.exit_code == 0
    assert "produce" not in result.output
    assert "broker" in result.output


def test_plugin_adds_a_command(runner: CliRunner) -> None:
    class HelloPlugin:
        @hookimpl
        def pigeon_cli_commands(self, group: click.Group) -> None:
            @group.command("hello")
            def hello() -> None:
                """Say hello."""
                click.echo("hello from a plugin")

    pm = PluginManager(load_entry_points=False, extra_plugins=(HelloPlugin(),))
    result = runner.invoke(make_cli(pm), ["hello"])
    assert result.exit_code == 0
    assert result.output == "hello from a plugin\n"


def test_plugins_command_lists_codecs_and_backends(runner: CliRunner) -> None:
    result = runner.invoke(make_cli(), ["plugins"])
    assert result.exit_code == 0, result.output
    lines = dict(line.split(": ", 1) for line in result.output.strip().splitlines())
    assert {"none", "gzip", "zstd", "lz4"} <= set(lines["codecs"].split(", "))
    assert "embedded" in lines["metadata stores"].split(", ")
    assert "quorum" in lines["replication policies"].split(", ")
    assert {"filesystem", "s3"} <= set(lines["offloaders"].split(", "))
    assert {"builtin", "broker", "bookie", "client", "zstd"} <= set(lines["plugins"].split(", "))


def test_plugins_command_honours_disabled_env(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIGEON_DISABLED_PLUGINS", "zstd")
    result = runner.invoke(make_cli(), ["plugins"])
    assert result.exit_code == 0, result.output
    lines = dict(line.split(": ", 1) for line in result.output.strip().splitlines())
    assert "zstd" not in lines["codecs"].split(", ")
    assert "zstd" not in lines["plugins"].split(", ")
    assert "lz4" in lines["codecs"].split(", ")


def _assert_clean_config_error(result: click.testing.Result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "ConfigError" in result.output
    for needle in needles:
        assert needle in result.output


def test_broker_bad_env_value_exits_2_naming_the_key(runner: CliRunner) -> None:
    result = runner.invoke(make_cli(), ["broker"], env={"PIGEON_PORT": "notanint"})
    _assert_clean_config_error(result, "'port'", "PIGEON_PORT", "notanint")


def test_bookie_bad_literal_exits_2(runner: CliRunner) -> None:
    result = runner.invoke(make_cli(), ["bookie"], env={"PIGEON_FSYNC": "sometimes"})
    _assert_clean_config_error(result, "'fsync'", "'always'")


def test_broker_unknown_key_in_config_file_exits_2(runner: CliRunner, tmp_path: Path) -> None:
    config = tmp_path / "pigeon.toml"
    config.write_text("[broker]\nprot = 6650\n")
    result = runner.invoke(make_cli(), ["broker", "--config", str(config)])
    _assert_clean_config_error(result, "'prot'", "pigeon.toml [broker]")


def test_broker_invalid_setting_combination_exits_2(runner: CliRunner, tmp_path: Path) -> None:
    config = tmp_path / "pigeon.toml"
    config.write_text("[broker]\nensemble_size = 1\nwrite_quorum = 2\n")
    result = runner.invoke(make_cli(), ["broker", "--config", str(config)])
    _assert_clean_config_error(result, "'write_quorum'")


def test_standalone_bad_env_value_exits_2(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(
        make_cli(),
        ["standalone", "--data-dir", str(tmp_path / "data")],
        env={"PIGEON_MAX_MESSAGE_SIZE": "big"},
    )
    _assert_clean_config_error(result, "'max_message_size'")


def test_missing_metadata_is_a_usage_error(runner: CliRunner) -> None:
    result = runner.invoke(make_cli(), ["broker"])
    assert result.exit_code == 2
    assert "--metadata" in result.output
    assert "Traceback" not in result.output


def test_bad_flag_type_is_a_usage_error(runner: CliRunner) -> None:
    result = runner.invoke(make_cli(), ["broker", "--port", "http"])
    assert result.exit_code == 2
    assert "--port" in result.output
