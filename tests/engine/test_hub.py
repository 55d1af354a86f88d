"""A hub model keeps its EOS ids and chat template: the download fetches every file the loader reads.

The hub is faked by a local folder served through huggingface_hub's own pattern filter, so the allow-patterns the
loader passes decide, as they would on the network, which files arrive.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture
def fake_hub(tiny_dir, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    remote = tmp_path / "remote"
    shutil.copytree(tiny_dir.hf_dir, remote)
    (remote / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    (remote / "chat_template.jinja").write_text(TEMPLATE)
    (remote / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle that must never be fetched")
    (remote / "README.md").write_text("not needed")
    fetched: list[str] = []

    def snapshot_download(repo_id: str, allow_patterns=None, ignore_patterns=None, **_):
        snap = tmp_path / "snapshots" / repo_id.replace("/", "--")
        snap.mkdir(parents=True, exist_ok=True)
        names = sorted(p.name for p in remote.iterdir())
        for name in filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            shutil.copy(remote / name, snap / name)
            fetched.append(name)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return fetched


def test_hub_download_fetches_generation_config_and_chat_template(fake_hub):
    from engine.loaders import load

    lm = load("someone/tiny-chat", device="cpu", dtype="float32", use_cache=False)
    assert {"generation_config.json", "chat_template.jinja", "config.json", "model.safetensors"} <= set(fake_hub)
    assert "pytorch_model.bin" not in fake_hub and "README.md" not in fake_hub
    assert 7 in lm.tokenizer.eos_ids  # only generation_config.json names token 7 as an end of generation
    assert lm.tokenizer.chat_template == TEMPLATE
    assert Path(lm.info.path).name == "someone--tiny-chat"
