"""A broker started from its configuration serves the admin API on web_service_port_tls."""

from __future__ import annotations

import functools
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio

from pigeon.bookie import BookieConfig
from pigeon.broker import BrokerConfig, run_standalone
from pigeon.core.errors import ConfigError
from pigeon.core.testing import SecurityFiles
from pigeon.core.testing.fuzz import ServerThread
from pigeon.core.testing.servers import free_ports


class ConfiguredStandalone(ServerThread):
    def __init__(self, data_dir: Path, config: BrokerConfig) -> None:
        super().__init__("tls-config-standalone")
        self.data_dir, self.config = data_dir, config

    async def serve(self, nursery: trio.Nursery) -> None:
        bookie = BookieConfig(port=0, fsync="never")
        await nursery.start(functools.partial(run_standalone, self.data_dir, self.config, bookie))


def test_web_service_port_tls_serves_https_and_http_port_minus_one_turns_http_off(
    tmp_path: Path,
) -> None:
    certs = SecurityFiles.create(tmp_path / "certs")
    tls_port, http_port = free_ports(2)
    config = BrokerConfig(
        port=0,
        http_port=-1,
        web_service_port_tls=tls_port,
        tls_certificate_file=str(certs.certificate_file),
        tls_key_file=str(certs.key_file),
    )
    server = ConfiguredStandalone(tmp_path / "data", config).start()
    try:
        url = f"https://localhost:{tls_port}/admin/v2/tenants"
        with urllib.request.urlopen(url, context=certs.client_tls_context(), timeout=10) as resp:
            assert resp.status == 200
        with pytest.raises(urllib.error.URLError):  # nothing on a plaintext port
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/", timeout=5)
    finally:
        server.stop()


def test_web_service_port_tls_without_a_certificate_is_a_config_error(tmp_path: Path) -> None:
    config = BrokerConfig(port=0, http_port=-1, web_service_port_tls=0)
    with pytest.raises(AssertionError) as failed:
        ConfiguredStandalone(tmp_path / "data", config).start()
    error = failed.value.__cause__
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, ConfigError)
    assert "tls_certificate_file" in str(error)
