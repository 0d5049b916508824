"""Folders in storage by URI (actors/storage.py) against a real S3-compatible server (moto's server mode on
127.0.0.1): what is uploaded is fetched back byte for byte, once per node, and a URI that is unreachable, missing or
not a model fails at config time naming the field, without credentials in the message."""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

import pytest

from actors import storage
from actors.config import load_train_config
from app.agent import build_agent_app
from app.default_model import resolve_model


def _same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fetched = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != ".raygent-fetched")
    return files == fetched and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)


def test_a_model_folder_goes_to_storage_and_comes_back_once(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYGENT_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model"
    shutil.copytree(resolve_model("default:tiny"), source)
    (source / "sub").mkdir()
    (source / "sub" / "nested.json").write_text("{}")
    uri = s3_bucket.format(key="runs/a/checkpoints/iter_000001/model")
    storage.Storage(uri).upload(source, "")

    local = Path(resolve_model(uri))
    assert local.is_relative_to(tmp_path / "cache" / "storage") and _same_tree(source, local)
    # Fetched once: a second resolve reads the node's copy (the bucket's folder is gone by then)
    storage.Storage(uri).delete("")
    assert Path(resolve_model(uri)) == local
    assert not list(local.parent.glob(".*-*")), "a temporary download folder was left behind"


@pytest.mark.parametrize("key, field, reason", [
    ("runs/missing/model", "model", "no such folder in storage"),
    ("runs/b", "model", "the folder holds no config.json"),
    ("runs/b", "adapter", "the folder holds no adapter_config.json"),
])
def test_a_bad_storage_folder_fails_at_config_time_naming_the_field(s3_bucket, tmp_path, key, field, reason):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("not a model")
    storage.Storage(s3_bucket.format(key="runs/b")).upload(tmp_path / "b", "")
    with pytest.raises(ValueError) as e:
        load_train_config({"policy": {field: s3_bucket.format(key=key)}})
    message = str(e.value)
    assert f"args.policy.{field}" in message and reason in message, message
    assert "test:test@" not in message, "credentials in an error message"


def test_unreachable_storage_and_unknown_schemes_fail_at_config_time():
    """The agent app (what `serve run serve_configs/agent.yaml` builds) refuses them before any replica starts."""
    unreachable = "s3://KEY:SECRET@bucket/m?endpoint_override=127.0.0.1:1&scheme=http"
    with pytest.raises(ValueError) as e:
        build_agent_app({"policy": {"model": unreachable}})
    assert "args.policy.model: s3://bucket/m?" in str(e.value) and "storage not reachable" in str(e.value), e.value
    assert "SECRET" not in str(e.value), "credentials in an error message"
    with pytest.raises(ValueError, match=r"args.policy.model: .*not a storage URI pyarrow.fs can open"):
        build_agent_app({"model": "nosuchfs://bucket/model"})
    assert storage.shown("s3://KEY:SECRET@bucket/a/b?x=1") == "s3://bucket/a/b?x=1"
