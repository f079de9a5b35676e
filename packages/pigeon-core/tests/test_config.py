"""load_config: TOML file, then PIGEON_* environment, then command-line overrides."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from pigeon.bookie import BookieConfig
from pigeon.broker import BrokerConfig
from pigeon.core import load_config
from pigeon.core.errors import ConfigError


@dataclass
class NodeConfig:
    host: str = "127.0.0.1"
    port: int = 1000
    ratio: float = 0.5
    fsync: bool = True
    mode: Literal["fast", "safe"] = "safe"

    def validate(self) -> None:
        if self.port < 0:
            raise ConfigError(f"bad value for 'port': {self.port} is negative")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pigeon.toml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_is_given() -> None:
    assert load_config(NodeConfig, env={}) == NodeConfig()


def test_file_section(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [node]
        port = 2000
        ratio = 0.25
        fsync = false
        mode = "fast"

        [other]
        port = 9999
        unknown_key_of_another_node = 1
        """,
    )
    config = load_config(NodeConfig, path=path, section="node", env={})
    assert config == NodeConfig(port=2000, ratio=0.25, fsync=False, mode="fast")


def test_file_without_section_uses_top_level_and_skips_tables(tmp_path: Path) -> None:
    path = write(tmp_path, 'host = "0.0.0.0"\n[broker]\nport = 5\n')
    assert load_config(NodeConfig, path=str(path), env={}) == NodeConfig(host="0.0.0.0")


def test_missing_section_gives_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "[other]\nport = 5\n")
    assert load_config(NodeConfig, path=path, section="node", env={}) == NodeConfig()


def test_env_overrides_file_and_overrides_beat_env(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nport = 2000\nhost = "file"\nmode = "fast"\n')
    env = {"PIGEON_PORT": "3000", "PIGEON_HOST": "env"}
    config = load_config(NodeConfig, path=path, section="node", env=env)
    assert (config.port, config.host, config.mode) == (3000, "env", "fast")
    config = load_config(NodeConfig, path=path, section="node", env=env, overrides={"port": 4000})
    assert (config.port, config.host, config.mode) == (4000, "env", "fast")


def test_none_overrides_are_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "[node]\nport = 2000\n")
    config = load_config(
        NodeConfig,
        path=path,
        section="node",
        env={"PIGEON_HOST": "env"},
        overrides={"port": None, "host": None, "mode": None},
    )
    assert (config.port, config.host, config.mode) == (2000, "env", "safe")


def test_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIGEON_PORT", "4321")
    monkeypatch.setenv("PIGEON_UNRELATED_SETTING", "x")  # not a field: ignored
    assert load_config(NodeConfig).port == 4321


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        ("ON", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("Off", False),
    ],
)
def test_bool_from_env(text: str, expected: bool) -> None:
    assert load_config(NodeConfig, env={"PIGEON_FSYNC": text}).fsync is expected


def test_numbers_and_literal_from_env() -> None:
    config = load_config(
        NodeConfig, env={"PIGEON_PORT": "77", "PIGEON_RATIO": "1e-3", "PIGEON_MODE": "fast"}
    )
    assert config.port == 77 and isinstance(config.port, int)
    assert config.ratio == 0.001
    assert config.mode == "fast"


def test_int_from_file_is_accepted_for_a_float(tmp_path: Path) -> None:
    path = write(tmp_path, "[node]\nratio = 2\n")
    config = load_config(NodeConfig, path=path, section="node", env={})
    assert config.ratio == 2.0 and isinstance(config.ratio, float)


def test_overrides_are_converted() -> None:
    config = load_config(NodeConfig, env={}, overrides={"port": "8080", "fsync": "no"})
    assert (config.port, config.fsync) == (8080, False)


# ------------------------------------------------------------------ errors


def test_unknown_key_in_file_names_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[node]\nprot = 2000\n")
    with pytest.raises(ConfigError) as info:
        load_config(NodeConfig, path=path, section="node", env={})
    message = str(info.value)
    assert "'prot'" in message
    assert "pigeon.toml [node]" in message
    assert "port" in message  # the known keys are listed


def test_unknown_override_key() -> None:
    with pytest.raises(ConfigError, match=r"'colour'.*command line"):
        load_config(NodeConfig, env={}, overrides={"colour": "blue"})


def test_bad_int_from_env_names_key_and_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(NodeConfig, env={"PIGEON_PORT": "notanint"})
    message = str(info.value)
    assert "'port'" in message
    assert "PIGEON_PORT" in message
    assert "notanint" in message


def test_bad_float_from_env() -> None:
    with pytest.raises(ConfigError, match=r"'ratio'.*PIGEON_RATIO.*number"):
        load_config(NodeConfig, env={"PIGEON_RATIO": "half"})


def test_bad_bool_from_env() -> None:
    with pytest.raises(ConfigError, match=r"'fsync'.*PIGEON_FSYNC.*boolean"):
        load_config(NodeConfig, env={"PIGEON_FSYNC": "maybe"})


def test_bad_literal_lists_the_choices(tmp_path: Path) -> None:
    path = write(tmp_path, '[node]\nmode = "reckless"\n')
    with pytest.raises(ConfigError) as info:
        load_config(NodeConfig, path=path, section="node", env={})
    message = str(info.value)
    assert "'mode'" in message and "'reckless'" in message
    assert "'fast'" in message and "'safe'" in message


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("port = true", "port"),
        ("port = 2000.5", "port"),  # not silently truncated to 2000
        ("ratio = true", "ratio"),
        ('ratio = "x"', "ratio"),
        ("host = 5", "host"),
        ("fsync = 1", "fsync"),
    ],
)
def test_wrong_toml_type_names_key(tmp_path: Path, line: str, key: str) -> None:
    path = write(tmp_path, f"[node]\n{line}\n")
    with pytest.raises(ConfigError, match=f"'{key}'.*pigeon.toml"):
        load_config(NodeConfig, path=path, section="node", env={})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist") as info:
        load_config(NodeConfig, path=tmp_path / "nope.toml", env={})
    assert "nope.toml" in str(info.value)


def test_invalid_toml(tmp_path: Path) -> None:
    path = write(tmp_path, "[node\nport = \n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(NodeConfig, path=path, env={})
    assert "pigeon.toml" in str(info.value)


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = write(tmp_path, "node = 5\n")
    with pytest.raises(ConfigError, match=r"\[node\]"):
        load_config(NodeConfig, path=path, section="node", env={})


def test_validate_runs_after_all_sources() -> None:
    with pytest.raises(ConfigError, match="'port'"):
        load_config(NodeConfig, env={}, overrides={"port": -1})


def test_not_a_dataclass() -> None:
    with pytest.raises(TypeError):
        load_config(dict, env={})


# ------------------------------------------------------------------ node configs


def test_broker_config_defaults_are_valid() -> None:
    config = load_config(BrokerConfig, env={})
    assert config.port == 6650


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"port": 70000}, "port"),
        ({"port": -1}, "port"),
        ({"max_message_size": 0}, "max_message_size"),
        ({"max_message_size": 1 << 20, "max_frame_size": (1 << 20) + 10}, "max_frame_size"),
        ({"segment_max_entries": 0}, "segment_max_entries"),
        ({"ensemble_size": 1, "write_quorum": 2, "ack_quorum": 1}, "write_quorum"),
        ({"ensemble_size": 3, "write_quorum": 2, "ack_quorum": 3}, "ack_quorum"),
        ({"ensemble_size": 1, "write_quorum": 1, "ack_quorum": 0}, "ack_quorum"),
        ({"log_level": "LOUD"}, "log_level"),
    ],
)
def test_broker_config_rejects_bad_values(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(BrokerConfig, env={}, overrides=overrides)


def test_broker_config_from_file_and_env(tmp_path: Path) -> None:
    path = write(tmp_path, "[broker]\nport = 7000\nensemble_size = 3\nwrite_quorum = 2\n")
    config = load_config(BrokerConfig, path=path, section="broker", env={"PIGEON_ACK_QUORUM": "2"})
    assert (config.port, config.ensemble_size, config.write_quorum, config.ack_quorum) == (
        7000,
        3,
        2,
        2,
    )


def test_bookie_config_defaults_are_valid() -> None:
    assert load_config(BookieConfig, env={}).fsync == "always"


@pytest.mark.parametrize(
    ("overrides", "env", "key"),
    [
        ({"port": 65536}, {}, "port"),
        ({"fsync_interval_ms": 0}, {}, "fsync_interval_ms"),
        ({}, {"PIGEON_FSYNC": "sometimes"}, "fsync"),
        ({}, {"PIGEON_FSYNC_INTERVAL_MS": "soon"}, "fsync_interval_ms"),
    ],
)
def test_bookie_config_rejects_bad_values(
    overrides: dict[str, object], env: dict[str, str], key: str
) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(BookieConfig, env=env, overrides=overrides)
