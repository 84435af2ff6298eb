"""The settings of the milestone-2 backends: ``mpiio_hints`` and ``compressor`` (with a
per-file TOML rule), each from every source, and bad values as clear errors."""
from __future__ import annotations

import pytest

import chemio_py as cio
from chemio_py.runtime import config
from chemio_py.errors import ConfigError


def test_mpiio_hints_from_env_toml_and_configure(tmp_path, monkeypatch):
    assert cio.settings()["mpiio_hints"].value == {}
    monkeypatch.setenv("CHEMIO_MPIIO_HINTS", " cb_nodes=2, romio_cb_read = disable ,")
    s = cio.settings()["mpiio_hints"]
    assert s.value == {"cb_nodes": "2", "romio_cb_read": "disable"}
    assert s.source == "env:CHEMIO_MPIIO_HINTS"
    monkeypatch.delenv("CHEMIO_MPIIO_HINTS")
    toml = tmp_path / "chemio.toml"
    toml.write_text('[mpiio_hints]\nstriping_factor = 4\nromio_ds_read = "enable"\n')
    monkeypatch.setenv("CHEMIO_CONFIG", str(toml))
    assert config.get("mpiio_hints") == {"striping_factor": "4", "romio_ds_read": "enable"}
    cio.configure(mpiio_hints="cb_buffer_size=16777216")
    assert config.get_setting("mpiio_hints").source == "explicit"


@pytest.mark.parametrize("bad", ["cb_nodes", "a=b;rm -rf", "=x", {"k": 1.5}, 7])
def test_bad_mpiio_hints_are_refused(bad):
    with pytest.raises(ConfigError, match="mpiio_hints.*key=value"):
        cio.configure(mpiio_hints=bad)
    assert config.get("mpiio_hints") == {}


@pytest.mark.parametrize("text, want", [
    ("none", None), ("zstd", {"id": "zstd", "level": 3}), ("ZSTD:9", {"id": "zstd", "level": 9}),
    ("blosc", {"id": "blosc", "level": 5, "cname": "zstd", "shuffle": "shuffle"}),
    ("blosc:lz4:1:bitshuffle", {"id": "blosc", "level": 1, "cname": "lz4",
                                "shuffle": "bitshuffle"}),
    ({"id": "zstd", "level": -3}, {"id": "zstd", "level": -3}),
])
def test_compressor_values(text, want):
    cio.configure(compressor=text)
    assert config.get("compressor") == want


@pytest.mark.parametrize("bad, says", [
    ("gzip", "unknown compressor"), ("zstd:99", "level must be"), ("zstd:1:2", "expected"),
    ("blosc:snappy", "cname"), ("blosc:lz4:5:wobble", "shuffle"), ({"id": "zstd", "x": 1},
                                                                   "takes"),
    (3, "not a int"),
])
def test_bad_compressors_are_refused(bad, says):
    with pytest.raises(ConfigError, match=says):
        cio.configure(compressor=bad)
    assert config.get("compressor") is None


def test_compressor_per_file_rule(tmp_path, monkeypatch):
    toml = tmp_path / "chemio.toml"
    toml.write_text('compressor = "zstd:1"\n[files."t2*"]\ncompressor = "blosc:lz4"\n'
                    '[files."raw*"]\ncompressor = "none"\n')
    monkeypatch.setenv("CHEMIO_CONFIG", str(toml))
    assert config.setting_for("compressor", "t2.amps").value["cname"] == "lz4"
    assert config.setting_for("compressor", "raw.ints").value is None
    assert config.setting_for("compressor", "other").value == {"id": "zstd", "level": 1}
    assert config.setting_for("compressor", "t2.amps", "zstd").source == "argument"
    toml.write_text('[files."t2*"]\ncompressor = "lzma"\n')
    with pytest.raises(ConfigError, match="unknown compressor"):
        config.setting_for("compressor", "t2.amps")
